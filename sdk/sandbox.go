package deltabox

import (
	"context"
	"fmt"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/deltabox/deltabox/api/deltabox/v1"
)

// State is the state of a sandbox.
type State string

const (
	StateUnknown  State = "unknown"
	StateCreating State = "creating"
	StateRunning  State = "running"
	StateStopped  State = "stopped" // its processes are gone
	StateDeleted  State = "deleted"
)

var states = map[v1.SandboxState]State{
	v1.SandboxState_SANDBOX_STATE_CREATING: StateCreating,
	v1.SandboxState_SANDBOX_STATE_RUNNING:  StateRunning,
	v1.SandboxState_SANDBOX_STATE_STOPPED:  StateStopped,
	v1.SandboxState_SANDBOX_STATE_DELETED:  StateDeleted,
}

// Limits are a sandbox's cgroup limits; zero means the daemon's default.
type Limits struct {
	MemoryBytes int64   `json:"memory_bytes"`
	Pids        int64   `json:"pids"`
	CPUs        float64 `json:"cpus"` // 1.5 = one and a half cores
}

// CreateOptions is what a sandbox is created with.
type CreateOptions struct {
	Image   string            // image name; "" means "host"
	Env     []string          // K=V, added to every command's environment
	Workdir string            // default cwd; "" means /work
	Labels  map[string]string // free-form, for you
	Limits  Limits
}

// SandboxInfo describes a sandbox at the time of a call.
type SandboxInfo struct {
	ID      string            `json:"id"`
	Image   string            `json:"image"`
	State   State             `json:"state"`
	Created time.Time         `json:"created"`
	Env     []string          `json:"env,omitempty"`
	Workdir string            `json:"workdir"`
	Labels  map[string]string `json:"labels,omitempty"`
	Limits  Limits            `json:"limits"`
	InitPid int               `json:"init_pid,omitempty"` // host pid of its init
	Head    string            `json:"head,omitempty"`     // checkpoint last taken or restored
}

func sandboxInfo(m *v1.Sandbox) SandboxInfo {
	st, ok := states[m.GetState()]
	if !ok {
		st = StateUnknown
	}
	info := SandboxInfo{
		ID: m.GetId(), Image: m.GetImage(), State: st, Env: m.GetEnv(), Workdir: m.GetWorkdir(),
		Labels: m.GetLabels(), InitPid: int(m.GetInitPid()), Head: m.GetHead(),
		Limits: Limits{
			MemoryBytes: m.GetLimits().GetMemoryBytes(),
			Pids:        m.GetLimits().GetPids(),
			CPUs:        m.GetLimits().GetCpus(),
		},
	}
	if m.Created != nil {
		info.Created = m.Created.AsTime()
	}
	return info
}

// Sandbox is a handle on one sandbox. It holds only the id (and the info of
// the call that made it); every method is a call to the daemon.
type Sandbox struct {
	c    *Client
	id   string
	info SandboxInfo
}

// ID is the sandbox's id.
func (s *Sandbox) ID() string { return s.id }

// Info is the sandbox as it was when this handle was made or last refreshed;
// for a handle from Client.Sandbox, only its ID is set.
func (s *Sandbox) Info() SandboxInfo { return s.info }

// Refresh fetches the sandbox's current info.
func (s *Sandbox) Refresh(ctx context.Context) (SandboxInfo, error) {
	res, err := s.c.rpc.GetSandbox(ctx, connect.NewRequest(&v1.GetSandboxRequest{Id: s.id}))
	if err != nil {
		return SandboxInfo{}, s.c.err(err)
	}
	s.info = sandboxInfo(res.Msg.Sandbox)
	return s.info, nil
}

// Create creates and starts a sandbox.
func (c *Client) Create(ctx context.Context, opts CreateOptions) (*Sandbox, error) {
	res, err := c.rpc.CreateSandbox(ctx, connect.NewRequest(&v1.CreateSandboxRequest{
		Image:   opts.Image,
		Env:     opts.Env,
		Workdir: opts.Workdir,
		Labels:  opts.Labels,
		Limits: &v1.Limits{
			MemoryBytes: opts.Limits.MemoryBytes,
			Pids:        opts.Limits.Pids,
			Cpus:        opts.Limits.CPUs,
		},
	}))
	if err != nil {
		return nil, c.err(err)
	}
	info := sandboxInfo(res.Msg.Sandbox)
	if info.ID == "" {
		return nil, fmt.Errorf("create sandbox: daemon returned no id")
	}
	return &Sandbox{c: c, id: info.ID, info: info}, nil
}

// Get returns a handle on an existing sandbox (errdefs.ErrNotFound if there
// is none).
func (c *Client) Get(ctx context.Context, id string) (*Sandbox, error) {
	sb := c.Sandbox(id)
	if _, err := sb.Refresh(ctx); err != nil {
		return nil, err
	}
	return sb, nil
}

// Sandbox returns a handle on the sandbox id without asking the daemon; the
// first call on it fails if there is no such sandbox.
func (c *Client) Sandbox(id string) *Sandbox {
	return &Sandbox{c: c, id: id, info: SandboxInfo{ID: id}}
}

// List lists the sandboxes.
func (c *Client) List(ctx context.Context) ([]SandboxInfo, error) {
	res, err := c.rpc.ListSandboxes(ctx, connect.NewRequest(&v1.ListSandboxesRequest{}))
	if err != nil {
		return nil, c.err(err)
	}
	out := make([]SandboxInfo, len(res.Msg.Sandboxes))
	for i, m := range res.Msg.Sandboxes {
		out[i] = sandboxInfo(m)
	}
	return out, nil
}

// DeleteOptions tune Delete.
type DeleteOptions struct {
	// Force kills running commands; without it, Delete fails with
	// errdefs.ErrFailedPrecondition while one runs.
	Force bool
}

// Delete stops and removes the sandbox.
func (s *Sandbox) Delete(ctx context.Context, opts DeleteOptions) error {
	_, err := s.c.rpc.DeleteSandbox(ctx, connect.NewRequest(&v1.DeleteSandboxRequest{Id: s.id, Force: opts.Force}))
	return s.c.err(err)
}
