package deltabox

import (
	"context"
	"fmt"
	"maps"
	"math"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/deltabox/deltabox/api/deltabox/v1"
)

// ProcessPath is how a process's state is kept at a checkpoint, or how it
// came back at a restore.
type ProcessPath string

const (
	PathUnknown  ProcessPath = "unknown"
	PathTemplate ProcessPath = "template" // a frozen fork template: memory exact
	PathCRIU     ProcessPath = "criu"     // a CRIU image
	PathReplay   ProcessPath = "replay"   // session state kept as data and replayed
	PathNone     ProcessPath = "none"     // not captured: started fresh, or stopped
)

var processPaths = map[v1.ProcessPath]ProcessPath{
	v1.ProcessPath_PROCESS_PATH_TEMPLATE: PathTemplate,
	v1.ProcessPath_PROCESS_PATH_CRIU:     PathCRIU,
	v1.ProcessPath_PROCESS_PATH_REPLAY:   PathReplay,
	v1.ProcessPath_PROCESS_PATH_NONE:     PathNone,
}

// ProcessState is one process of a checkpoint or a restore.
type ProcessState struct {
	Name   string      `json:"name"` // "shell session", "python session", or the command line
	Path   ProcessPath `json:"path"`
	Reason string      `json:"reason,omitempty"` // why it was not captured
}

func processStates(ms []*v1.ProcessState) []ProcessState {
	if len(ms) == 0 {
		return nil
	}
	out := make([]ProcessState, len(ms))
	for i, m := range ms {
		p, ok := processPaths[m.GetPath()]
		if !ok {
			p = PathUnknown
		}
		out[i] = ProcessState{Name: m.GetName(), Path: p, Reason: m.GetReason()}
	}
	return out
}

// Checkpoint describes one node of a checkpoint tree.
type Checkpoint struct {
	ID        string            `json:"id"`
	Parent    string            `json:"parent,omitempty"` // "" for a root
	SandboxID string            `json:"sandbox"`          // the sandbox it was taken of
	Name      string            `json:"name,omitempty"`
	Labels    map[string]string `json:"labels,omitempty"`
	Created   time.Time         `json:"created"`
	Pause     time.Duration     `json:"pause"` // how long the sandbox was frozen
	// Processes says what of each process was captured.
	Processes []ProcessState `json:"processes,omitempty"`
	// Heads lists the sandboxes whose head it is.
	Heads []string `json:"heads,omitempty"`
}

func checkpoint(m *v1.Checkpoint) Checkpoint {
	ck := Checkpoint{
		ID: m.GetId(), Parent: m.GetParent(), SandboxID: m.GetSandboxId(), Name: m.GetName(),
		Labels: m.GetLabels(), Pause: m.GetPause().AsDuration(),
		Processes: processStates(m.GetProcesses()), Heads: m.GetHeads(),
	}
	if m.Created != nil {
		ck.Created = m.Created.AsTime()
	}
	return ck
}

func checkpoints(ms []*v1.Checkpoint) []Checkpoint {
	out := make([]Checkpoint, len(ms))
	for i, m := range ms {
		out[i] = checkpoint(m)
	}
	return out
}

type checkpointOptions struct {
	name   string
	labels map[string]string
}

// CheckpointOption names or labels a checkpoint.
type CheckpointOption func(*checkpointOptions)

// WithCheckpointName names the checkpoint (at most 128 bytes, no control
// characters).
func WithCheckpointName(name string) CheckpointOption {
	return func(o *checkpointOptions) { o.name = name }
}

// WithCheckpointLabel adds a label; repeat it for more.
func WithCheckpointLabel(key, value string) CheckpointOption {
	return func(o *checkpointOptions) {
		if o.labels == nil {
			o.labels = map[string]string{}
		}
		o.labels[key] = value
	}
}

// WithCheckpointLabels adds labels.
func WithCheckpointLabels(labels map[string]string) CheckpointOption {
	return func(o *checkpointOptions) {
		if o.labels == nil {
			o.labels = map[string]string{}
		}
		maps.Copy(o.labels, labels)
	}
}

// Checkpoint takes a checkpoint of the sandbox, which becomes its head. The
// sandbox is frozen meanwhile (Checkpoint.Pause), so the filesystem and the
// processes are captured at the same instant.
func (s *Sandbox) Checkpoint(ctx context.Context, opts ...CheckpointOption) (Checkpoint, error) {
	var o checkpointOptions
	for _, opt := range opts {
		opt(&o)
	}
	res, err := s.c.rpc.CreateCheckpoint(ctx, connect.NewRequest(&v1.CreateCheckpointRequest{
		SandboxId: s.id, Name: o.name, Labels: o.labels,
	}))
	if err != nil {
		return Checkpoint{}, s.c.err(err)
	}
	ck := checkpoint(res.Msg.Checkpoint)
	if ck.ID == "" {
		return Checkpoint{}, fmt.Errorf("checkpoint sandbox %q: daemon returned no id", s.id)
	}
	return ck, nil
}

// RestoreResult is what a restore did.
type RestoreResult struct {
	Duration time.Duration `json:"duration"`
	// Processes says, per process, which path brought it back (PathNone: it
	// was not, see Reason).
	Processes []ProcessState `json:"processes,omitempty"`
}

// Restore rolls the sandbox back, in place, to checkpoint ckID of its tree:
// afterwards its files and processes are those of the checkpoint, it keeps
// its id, and ckID is its head. Commands running in it are killed. A
// checkpoint of another tree fails with errdefs.ErrFailedPrecondition: fork
// it instead.
func (s *Sandbox) Restore(ctx context.Context, ckID string) (RestoreResult, error) {
	res, err := s.c.rpc.Restore(ctx, connect.NewRequest(&v1.RestoreRequest{SandboxId: s.id, CheckpointId: ckID}))
	if err != nil {
		return RestoreResult{}, s.c.err(err)
	}
	return RestoreResult{Duration: res.Msg.GetDuration().AsDuration(), Processes: processStates(res.Msg.Processes)}, nil
}

// MaxFork is the most sandboxes one Fork makes.
const MaxFork = 256

// ForkResult lists the new sandboxes.
type ForkResult struct {
	Sandboxes []*Sandbox
	Duration  time.Duration
}

// IDs are the new sandboxes' ids.
func (r ForkResult) IDs() []string {
	ids := make([]string, len(r.Sandboxes))
	for i, sb := range r.Sandboxes {
		ids[i] = sb.ID()
	}
	return ids
}

// Fork creates n (1 to MaxFork) new sandboxes, each exactly as at checkpoint
// ckID and isolated from the others and from the source; ckID is their head.
// It makes all of them or none.
func (c *Client) Fork(ctx context.Context, ckID string, n int) (ForkResult, error) {
	// Out-of-range counts reach the daemon as such (never wrapped into
	// range), which refuses them.
	n32 := int32(min(max(n, math.MinInt32), math.MaxInt32))
	res, err := c.rpc.Fork(ctx, connect.NewRequest(&v1.ForkRequest{CheckpointId: ckID, N: n32}))
	if err != nil {
		return ForkResult{}, c.err(err)
	}
	out := ForkResult{Duration: res.Msg.GetDuration().AsDuration()}
	for _, id := range res.Msg.SandboxIds {
		out.Sandboxes = append(out.Sandboxes, c.Sandbox(id))
	}
	return out, nil
}

// Tree is a forest of checkpoints with the sandboxes that live in it.
type Tree struct {
	Checkpoints []Checkpoint  `json:"checkpoints"` // parents before children
	Sandboxes   []SandboxInfo `json:"sandboxes"`   // SandboxInfo.Head places each in the tree
}

// Tree returns the checkpoint tree that holds the sandbox or checkpoint id;
// "" returns every tree.
func (c *Client) Tree(ctx context.Context, id string) (Tree, error) {
	res, err := c.rpc.GetTree(ctx, connect.NewRequest(&v1.GetTreeRequest{Id: id}))
	if err != nil {
		return Tree{}, c.err(err)
	}
	t := Tree{Checkpoints: checkpoints(res.Msg.Checkpoints), Sandboxes: make([]SandboxInfo, len(res.Msg.Sandboxes))}
	for i, m := range res.Msg.Sandboxes {
		t.Sandboxes[i] = sandboxInfo(m)
	}
	return t, nil
}

// GetCheckpoint describes one checkpoint (errdefs.ErrNotFound if there is
// none).
func (c *Client) GetCheckpoint(ctx context.Context, id string) (Checkpoint, error) {
	res, err := c.rpc.GetCheckpoint(ctx, connect.NewRequest(&v1.GetCheckpointRequest{Id: id}))
	if err != nil {
		return Checkpoint{}, c.err(err)
	}
	return checkpoint(res.Msg.Checkpoint), nil
}

// ListCheckpoints lists every checkpoint, parents before children.
func (c *Client) ListCheckpoints(ctx context.Context) ([]Checkpoint, error) {
	res, err := c.rpc.ListCheckpoints(ctx, connect.NewRequest(&v1.ListCheckpointsRequest{}))
	if err != nil {
		return nil, c.err(err)
	}
	return checkpoints(res.Msg.Checkpoints), nil
}

// DeleteCheckpoint removes a checkpoint; with recursive, its descendants
// too. Without, one that has children fails with
// errdefs.ErrFailedPrecondition. Sandboxes whose head it was take its parent
// as their head; the sandboxes themselves are not touched.
func (c *Client) DeleteCheckpoint(ctx context.Context, id string, recursive bool) error {
	_, err := c.rpc.DeleteCheckpoint(ctx, connect.NewRequest(&v1.DeleteCheckpointRequest{Id: id, Recursive: recursive}))
	return c.err(err)
}

// ChangeKind is what happened to a path between two states.
type ChangeKind string

const (
	ChangeUnknown  ChangeKind = "unknown"
	ChangeAdded    ChangeKind = "added"
	ChangeModified ChangeKind = "modified"
	ChangeRemoved  ChangeKind = "removed"
)

var changeKinds = map[v1.ChangeKind]ChangeKind{
	v1.ChangeKind_CHANGE_KIND_ADDED:    ChangeAdded,
	v1.ChangeKind_CHANGE_KIND_MODIFIED: ChangeModified,
	v1.ChangeKind_CHANGE_KIND_REMOVED:  ChangeRemoved,
}

// Change is one path that differs.
type Change struct {
	Path string     `json:"path"` // absolute inside the sandbox
	Kind ChangeKind `json:"change"`
}

// Diff lists the files added, modified and removed from a to b, sorted by
// path. Each of a and b is a checkpoint id or a sandbox id (its live
// filesystem).
func (c *Client) Diff(ctx context.Context, a, b string) ([]Change, error) {
	res, err := c.rpc.Diff(ctx, connect.NewRequest(&v1.DiffRequest{From: a, To: b}))
	if err != nil {
		return nil, c.err(err)
	}
	out := make([]Change, len(res.Msg.Changes))
	for i, m := range res.Msg.Changes {
		k, ok := changeKinds[m.GetKind()]
		if !ok {
			k = ChangeUnknown
		}
		out[i] = Change{Path: m.GetPath(), Kind: k}
	}
	return out, nil
}
