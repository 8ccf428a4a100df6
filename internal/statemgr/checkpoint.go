//go:build linux

package statemgr

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/procfs"
	"github.com/deltabox/deltabox/internal/sandbox"
)

var bucketCheckpoints = []byte("checkpoints")

var _ daemon.Checkpointer = (*Manager)(nil)

// ckRecord is a checkpoint as stored in bbolt. It never changes after it is
// acknowledged, except for its Parent when an ancestor is deleted.
type ckRecord struct {
	ID        string                `json:"id"`
	Parent    string                `json:"parent,omitempty"`
	Sandbox   string                `json:"sandbox"`
	Name      string                `json:"name,omitempty"`
	Labels    map[string]string     `json:"labels,omitempty"`
	Created   time.Time             `json:"created"`
	PauseMs   float64               `json:"pause_ms"`
	Layer     string                `json:"layer"`  // committed layer
	IDSlot    int                   `json:"idslot"` // the tree's id range
	Config    sandbox.Config        `json:"config"` // the source's, for forks
	Shell     string                `json:"shell,omitempty"`
	HasShell  bool                  `json:"has_shell,omitempty"`
	Processes []daemon.ProcessState `json:"processes,omitempty"`
	// Templates: the sessions' processes were kept as frozen templates (the
	// fast path); they live in the daemon's memory only.
	Templates bool `json:"templates,omitempty"`
	// Tpl is how a restarted daemon re-adopts the templates; Retired the
	// layer they see as their root (the sandbox's before the checkpoint),
	// removed with them.
	Tpl     *sandbox.TemplatesRecord `json:"tpl,omitempty"`
	Retired string                   `json:"retired,omitempty"`
}

var ckIDRe = regexp.MustCompile(`^ck-[0-9a-f]{8}$`)

func checkCkID(id string) error {
	if !ckIDRe.MatchString(id) {
		return fmt.Errorf("checkpoint id %q is malformed (want ck-xxxxxxxx): %w", id, errdefs.ErrInvalidArgument)
	}
	return nil
}

// opLock serialises the operations that replace a sandbox's processes or
// layer (checkpoint, restore, delete) per sandbox.
func (m *Manager) opLock(id string) func() {
	m.mu.Lock()
	l, ok := m.ops[id]
	if !ok {
		l = &sync.Mutex{}
		m.ops[id] = l
	}
	m.mu.Unlock()
	l.Lock()
	return l.Unlock
}

// commitLive commits a live sandbox's active layer without disturbing its
// mount: the checkpoint's slow path (processes stay where they are).
// captured is called at the instant of capture (see layer.WithCaptured).
func (m *Manager) commitLive(ctx context.Context, active string, labels map[string]string, captured func()) (layer.Info, error) {
	if lc, ok := m.layers.(layer.LiveCommitter); ok {
		return lc.CommitLive(ctx, active, layer.WithLabels(labels), layer.WithCaptured(captured))
	}
	return layer.Info{}, fmt.Errorf("storage %q cannot commit a live sandbox's layer (use btrfs, or overlay on btrfs): %w", m.storage, errdefs.ErrFailedPrecondition)
}

func (m *Manager) Checkpoint(ctx context.Context, id string, opts daemon.CheckpointOptions) (_ daemon.Checkpoint, err error) {
	if err := checkID(id); err != nil {
		return daemon.Checkpoint{}, err
	}
	if len(opts.Name) > 128 {
		return daemon.Checkpoint{}, fmt.Errorf("checkpoint name longer than 128 bytes: %w", errdefs.ErrInvalidArgument)
	}
	for k := range opts.Labels {
		if !labelRe.MatchString(k) {
			return daemon.Checkpoint{}, fmt.Errorf("checkpoint label key %q: %w", k, errdefs.ErrInvalidArgument)
		}
	}
	unlock := m.opLock(id)
	defer unlock()
	r, err := m.get(id)
	if err != nil {
		return daemon.Checkpoint{}, err
	}
	m.mu.Lock()
	sb := m.live[id]
	m.mu.Unlock()
	if sb == nil || !sb.Alive() {
		return daemon.Checkpoint{}, fmt.Errorf("checkpoint sandbox %q: it is stopped: %w", id, errdefs.ErrFailedPrecondition)
	}

	// Session state is data, read from the idle session before the freeze.
	shell, hasShell, err := sb.ShellState(ctx)
	if err != nil {
		return daemon.Checkpoint{}, fmt.Errorf("checkpoint sandbox %q: %w", id, err)
	}
	procs, err := sb.Processes()
	if err != nil {
		return daemon.Checkpoint{}, fmt.Errorf("checkpoint sandbox %q: %w", id, err)
	}

	ck := &ckRecord{
		ID: newID("ck-"), Parent: r.Head, Sandbox: id, Name: opts.Name, Labels: opts.Labels,
		IDSlot: r.IDSlot, Config: r.Config, Shell: shell, HasShell: hasShell,
		Processes: describeProcesses(procs, hasShell),
	}
	m.layersMu.RLock()
	defer m.layersMu.RUnlock()
	// Flush the layer's dirty data while the sandbox still runs: a btrfs
	// snapshot flushes what is dirty, and inside the freeze that would make
	// the pause grow with what the workload wrote since its last
	// checkpoint. Now only what it writes in the next instant is left. A
	// checkpoint that switches to a copy made ahead snapshots nothing.
	if !sb.CopiedAhead() {
		m.preflush(ctx, r.Layer)
	}

	// The fast path: the sessions become templates, the sandbox moves on
	// into a new generation.
	if _, ok := m.layers.(layer.LiveCommitter); ok && len(procs) > 0 {
		done, why, err := m.checkpointTemplates(ctx, sb, r, ck)
		if err != nil {
			return daemon.Checkpoint{}, fmt.Errorf("checkpoint sandbox %q: %w", id, err)
		}
		if done {
			return m.ckInfo(ck, []string{id}), nil
		}
		for i := range ck.Processes {
			ck.Processes[i].Reason = strings.TrimSpace(ck.Processes[i].Reason + " (" + why + ")")
		}
	}

	// The coupled capture: nothing runs between the freeze and the thaw, so
	// the filesystem is the one the processes see at this instant.
	began := time.Now()
	if err := sb.Freeze(ctx); err != nil {
		_ = sb.Thaw(context.Background())
		return daemon.Checkpoint{}, fmt.Errorf("checkpoint sandbox %q: freeze: %w", id, err)
	}
	frozen := time.Now()
	var committedAt time.Time
	var terr error
	thawed := false
	thaw := func() { // at the instant of capture, or after a failure
		if !thawed {
			thawed = true
			committedAt = time.Now()
			terr = sb.Thaw(context.Background())
			ck.PauseMs = msSince(began)
		}
	}
	committed, cerr := m.commitLive(ctx, r.Layer, map[string]string{"checkpoint": ck.ID}, thaw)
	thaw()
	m.log.Debug("checkpoint pause", "sandbox", id, "freeze_ms", ms(frozen.Sub(began)),
		"commit_ms", ms(committedAt.Sub(frozen)), "pause_ms", ck.PauseMs)
	if cerr != nil || terr != nil {
		if cerr == nil {
			_ = m.layers.Remove(context.Background(), committed.ID)
		}
		return daemon.Checkpoint{}, fmt.Errorf("checkpoint sandbox %q: %w", id, errors.Join(cerr, terr))
	}
	ck.Layer = committed.ID
	ck.Created = time.Now().UTC()
	defer func() {
		if err != nil {
			_ = m.layers.Remove(context.Background(), committed.ID)
		}
	}()
	// Acknowledge: the node and the new head in one fsynced transaction.
	r.Head = ck.ID
	if err := m.ack(ck, r); err != nil {
		return daemon.Checkpoint{}, fmt.Errorf("checkpoint sandbox %q: store: %w", id, err)
	}
	m.makeSpare(id, ck.ID, ck.Layer)
	return m.ckInfo(ck, []string{id}), nil
}

// ack stores a checkpoint and its sandbox's record (the new head) in one
// fsynced transaction: the acknowledgement of a checkpoint.
func (m *Manager) ack(ck *ckRecord, r *record) error {
	return m.db.Update(func(tx *bolt.Tx) error {
		if err := putJSON(tx.Bucket(bucketCheckpoints), ck.ID, ck); err != nil {
			return err
		}
		return putJSON(tx.Bucket(bucketSandboxes), r.ID, r)
	})
}

// checkpointTemplates tries the fast path (see sandbox.CheckpointTemplates):
// the sessions become templates, the filesystem a snapshot of the writable
// layer, which the sandbox keeps (its new generation runs on the same root).
// It reports false, with the reason and nothing changed, when the sandbox is
// not eligible.
func (m *Manager) checkpointTemplates(ctx context.Context, sb *sandbox.Sandbox, r *record, ck *ckRecord) (bool, string, error) {
	var committed layer.Info
	switched := false // the sandbox went on in a copy of its layer
	ts, err := sb.CheckpointTemplates(ctx, "tpl-"+ck.ID, func(ctx context.Context, copied *layer.Prepared, captured func()) error {
		if committed.ID != "" { // taken again: the first is void
			_ = m.layers.Remove(context.Background(), committed.ID)
			committed = layer.Info{}
		}
		labels := map[string]string{"checkpoint": ck.ID}
		var err error
		if copied == nil {
			committed, err = m.commitLive(ctx, r.Layer, labels, captured)
			return err
		}
		committed, err = m.layers.(layer.Preparer).CommitPrepared(ctx, *copied, layer.WithLabels(labels), layer.WithCaptured(captured))
		switched = err == nil
		return err
	})
	if err != nil {
		if committed.ID != "" {
			_ = m.layers.Remove(context.Background(), committed.ID)
		}
		var ie *sandbox.IneligibleError
		if errors.As(err, &ie) {
			return false, ie.Error(), nil
		}
		return false, "", err
	}
	ck.Layer, ck.Templates, ck.PauseMs = committed.ID, true, ms(ts.Pause)
	rec := ts.Record()
	// The templates' mounts are the sandbox's writable layer's: it stays
	// while they live, even once the sandbox moved on to another. When the
	// sandbox went on in a copy, that layer's content is the committed
	// layer's, which the checkpoint keeps.
	ck.Tpl = &rec
	if !switched {
		ck.Retired = r.Layer
	}
	ck.Processes = templateProcesses(ts)
	ck.Created = time.Now().UTC()
	r.Head = ck.ID
	if err := m.ack(ck, r); err != nil {
		ts.Release()
		_ = m.layers.Remove(context.Background(), committed.ID)
		return false, "", fmt.Errorf("store: %w", err)
	}
	m.keepTemplates(ck.ID, ts, ck.Retired)
	m.makeSpare(r.ID, ck.ID, ck.Layer)
	return true, "", nil
}

// preflushMin is the dirty page cache below which a checkpoint does not
// preflush: what little the snapshot then writes back in the pause costs
// less than the transaction commit a preflush costs the call (2-5 ms).
const preflushMin = 2 << 20

// preflush writes back the dirty data of a layer's filesystem (best effort)
// when there is some.
func (m *Manager) preflush(ctx context.Context, active string) {
	if dirty, err := procfs.Dirty(); err == nil && dirty < preflushMin {
		return
	}
	view, err := m.layers.Mounts(ctx, active)
	if err != nil || view.Upper == "" {
		return
	}
	fd, err := unix.Open(view.Upper, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return
	}
	defer unix.Close(fd)
	_ = unix.Syncfs(fd)
}

func describeProcesses(procs []sandbox.Process, hasShell bool) []daemon.ProcessState {
	var out []daemon.ProcessState
	seen := map[sandbox.SessionKind]bool{}
	for _, p := range procs {
		switch p.Session {
		case sandbox.SessionShell:
			if seen[p.Session] {
				continue
			}
			seen[p.Session] = true
			ps := daemon.ProcessState{Name: "shell session", Path: daemon.PathReplay}
			if !hasShell {
				ps.Path, ps.Reason = daemon.PathNone, "shell state could not be read"
			}
			out = append(out, ps)
		case sandbox.SessionPython:
			if seen[p.Session] {
				continue
			}
			seen[p.Session] = true
			out = append(out, daemon.ProcessState{Name: "python session", Path: daemon.PathNone,
				Reason: "python state is not capturable as data; a fresh session starts on restore"})
		default:
			out = append(out, daemon.ProcessState{Name: p.Cmdline, Path: daemon.PathNone,
				Reason: "process memory is not captured on this path; it is stopped on restore"})
		}
	}
	return out
}

func (m *Manager) Restore(ctx context.Context, id, ckID string) (_ daemon.RestoreResult, err error) {
	if err := checkID(id); err != nil {
		return daemon.RestoreResult{}, err
	}
	if err := checkCkID(ckID); err != nil {
		return daemon.RestoreResult{}, err
	}
	unlock := m.opLock(id)
	handedOff := false // the record's write holds the lock (see below)
	defer func() {
		if !handedOff {
			unlock()
		}
	}()
	r, err := m.get(id)
	if err != nil {
		return daemon.RestoreResult{}, err
	}
	ck, err := m.getCk(ckID)
	if err != nil {
		return daemon.RestoreResult{}, err
	}
	if ck.IDSlot != r.IDSlot {
		return daemon.RestoreResult{}, fmt.Errorf("restore sandbox %q to %q: the checkpoint belongs to another tree (fork it instead): %w", id, ckID, errdefs.ErrFailedPrecondition)
	}
	began := time.Now()
	m.layersMu.RLock()
	defer func() {
		if !handedOff {
			m.layersMu.RUnlock()
		}
	}()
	var active layer.Info
	var prep *sandbox.PreparedRoot
	if l, p, ok := m.takeSpare(id, ckID); ok {
		active.ID, prep = l, p
	} else if active, err = m.layers.Branch(ctx, ck.Layer, layer.WithLabels(map[string]string{"sandbox": id})); err != nil {
		return daemon.RestoreResult{}, fmt.Errorf("restore sandbox %q to %q: %w", id, ckID, err)
	}
	oldLayer, oldHead := r.Layer, r.Head
	r.Layer, r.Head = active.ID, ck.ID
	m.mu.Lock()
	sb := m.live[id]
	m.mu.Unlock()
	branched := time.Now()
	ts, why := m.templatesOf(ck)
	live := sb != nil && sb.Alive()
	defer prep.Release() // a no-op once RestoreTemplates took it
	if ts == nil || !live {
		prep.Release() // it holds the layer's mount
		ts = nil
	}
	var cloned []sandbox.SessionKind
	if live {
		// In place: on the fast path a new generation of the templates'
		// clones; otherwise the same init, namespaces and cgroup on a new
		// root.
		// The record is written (and fsynced) while the sandbox switches:
		// a crash in between finds it on the new layer, which holds the
		// checkpoint's files, as if the restore had finished.
		stored := make(chan error, 1)
		next := *r
		go func() { stored <- m.put(&next) }()
		view, err := m.layers.Mounts(ctx, active.ID)
		switch {
		case err != nil:
		case ts != nil:
			cloned, err = sb.RestoreTemplates(ctx, view, ts, prep)
		default:
			err = sb.Reroot(ctx, view)
		}
		rerooted := time.Now()
		m.log.Debug("restore", "sandbox", id, "templates", ts != nil, "branch_ms", ms(branched.Sub(began)), "reroot_ms", ms(rerooted.Sub(branched)))
		if err == nil && ts != nil {
			// The sandbox runs the checkpoint's processes: that is the
			// restore. Its record reaches the disk right after, in the
			// background like a checkpoint's durability; until then the
			// sandbox's next operation waits (the op lock stays held), so
			// nothing is ever ordered after an unwritten restore. A
			// daemon crash in between brings the sandbox back on its old
			// layer, whole.
			res := daemon.RestoreResult{RestoreMs: msSince(began)}
			for _, k := range ts.Kinds() {
				ps := daemon.ProcessState{Name: k.String() + " session", Path: daemon.PathTemplate}
				if !slices.Contains(cloned, k) {
					ps.Path, ps.Reason = daemon.PathNone, "its clone failed; a fresh session starts"
					if k == sandbox.SessionShell && ck.HasShell {
						// The shell's state is data too: replayed into the
						// fresh session before its next call.
						if rerr := sb.ReplayShellState(ctx, ck.Shell); rerr == nil {
							ps.Path, ps.Reason = daemon.PathReplay, "its clone failed; its state is replayed"
						}
					}
				}
				res.Processes = append(res.Processes, ps)
			}
			if len(cloned) < len(ts.Kinds()) && !ts.Alive() {
				// Killed or resumed: never used again.
				m.dropTemplates(ckID, "its process templates were found gone or resumed")
			}
			m.makeSpare(id, ckID, ck.Layer)
			// The layers' read lock goes with it: gc must not see the
			// new layer unreferenced before the record names it.
			handedOff = true
			m.bg.Add(1)
			go func() {
				defer m.bg.Done()
				defer unlock()
				defer m.layersMu.RUnlock()
				err := <-stored
				for try := 0; err != nil && try < 5; try++ {
					time.Sleep(time.Duration(try+1) * 100 * time.Millisecond)
					err = m.put(&next)
				}
				if err != nil {
					m.log.Error("restore: the sandbox's record could not be written: a daemon restart would bring it back to its old layer", "sandbox", id, "layer", oldLayer, "err", err)
					return
				}
				m.removeLater(sb, oldLayer)
			}()
			return res, nil
		}
		perr := <-stored
		if err == nil {
			err = perr
		}
		if err != nil {
			_ = m.layers.Remove(context.Background(), active.ID)
			r.Layer, r.Head = oldLayer, oldHead
			if perr == nil {
				_ = m.put(r) // the record follows the sandbox back
			}
			if !sb.Alive() {
				m.restart(r)
			}
			return daemon.RestoreResult{}, fmt.Errorf("restore sandbox %q to %q: %w", id, ckID, err)
		}
	} else {
		// Stopped: start it on the new layer.
		m.mu.Lock()
		delete(m.live, id)
		m.mu.Unlock()
		if sb != nil {
			_ = sb.Destroy(ctx)
		}
		sb, err = m.startRecord(ctx, r)
		if err != nil {
			r.Layer, r.Head = oldLayer, oldHead
			m.restart(r)
			_ = m.layers.Remove(context.Background(), active.ID)
			return daemon.RestoreResult{}, fmt.Errorf("restore sandbox %q to %q: %w", id, ckID, err)
		}
	}
	res := daemon.RestoreResult{Processes: restoredProcesses(ck, why)}
	replayAt := time.Now()
	if ck.HasShell {
		if err := sb.ReplayShellState(ctx, ck.Shell); err != nil {
			res.Processes[0].Path, res.Processes[0].Reason = daemon.PathNone, err.Error()
		}
	}
	res.RestoreMs = msSince(began)
	m.makeSpare(id, ckID, ck.Layer) // for the next rollback to the same place
	m.log.Debug("restore done", "sandbox", id, "replay_ms", ms(time.Since(replayAt)), "total_ms", res.RestoreMs)
	m.removeLater(sb, oldLayer)
	return res, nil
}

// removeLater removes a sandbox's replaced layer once its overlay is
// detached, off the critical path.
func (m *Manager) removeLater(sb *sandbox.Sandbox, oldLayer string) {
	m.bg.Add(1)
	go func() {
		defer m.bg.Done()
		sb.Settle()
		if m.layerPinned(oldLayer) {
			return // templates' root: removed with the last of them
		}
		if err := m.layers.Remove(context.Background(), oldLayer); err != nil && !errdefs.IsNotFound(err) {
			m.log.Warn("restore: old layer kept for GC", "layer", oldLayer, "err", err)
		}
	}()
}

func (m *Manager) dropInflight(id string) {
	m.mu.Lock()
	delete(m.inflight, id)
	m.mu.Unlock()
}

// restart puts a sandbox whose restore failed back on its own layer rather
// than leave it dead.
func (m *Manager) restart(r *record) {
	m.mu.Lock()
	old := m.live[r.ID]
	delete(m.live, r.ID)
	m.mu.Unlock()
	if old != nil {
		_ = old.Destroy(context.Background())
	}
	if _, err := m.startRecord(context.Background(), r); err != nil {
		m.log.Warn("restore failed and the sandbox could not be restarted", "sandbox", r.ID, "err", err)
	}
}

// restoredProcesses says how each process of a checkpoint comes back off
// the template path (why: the reason its templates are unusable, if it had
// any); the shell session, when captured, comes first.
func restoredProcesses(ck *ckRecord, why string) []daemon.ProcessState {
	var out []daemon.ProcessState
	if ck.HasShell {
		out = append(out, daemon.ProcessState{Name: "shell session", Path: daemon.PathReplay, Reason: why})
	}
	for _, p := range ck.Processes {
		if p.Name == "shell session" {
			continue
		}
		if p.Path == daemon.PathTemplate {
			p.Path, p.Reason = daemon.PathNone, why
		}
		out = append(out, p)
	}
	return out
}

func (m *Manager) Fork(ctx context.Context, ckID string, n int) (_ daemon.ForkResult, err error) {
	if err := checkCkID(ckID); err != nil {
		return daemon.ForkResult{}, err
	}
	if n < 1 || n > 256 {
		return daemon.ForkResult{}, fmt.Errorf("fork %q: n = %d, want 1 to 256: %w", ckID, n, errdefs.ErrInvalidArgument)
	}
	ck, err := m.getCk(ckID)
	if err != nil {
		return daemon.ForkResult{}, err
	}
	began := time.Now()
	ts, _ := m.templatesOf(ck)
	ids := make([]string, n)
	// Every fork or none: a failure removes the ones made.
	defer func() {
		if err != nil {
			for _, id := range ids {
				if id != "" {
					_ = m.DeleteSandbox(context.Background(), id, true)
				}
			}
		}
	}()
	// The ids records hold, read once: freshID marks each id it hands out
	// in flight, so the forks cannot collide with each other either.
	_, taken, err := m.usedIDs()
	if err != nil {
		return daemon.ForkResult{}, err
	}
	if ts != nil {
		// No spare generation is booted while the forks take them (it
		// would take CPU from the forks); afterwards n are made, so that
		// the next fan-out from here (a policy's next batch of rollouts
		// from the same state) finds its generations ready.
		defer ts.FanOut(n)()
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(8)
	for i := range ids {
		g.Go(func() error {
			m.layersMu.RLock()
			defer m.layersMu.RUnlock()
			// As in a create, the record is written once, when the fork
			// runs.
			r := &record{Config: ck.Config, State: sandbox.StateRunning, Created: time.Now().UTC(), IDSlot: ck.IDSlot, Head: ck.ID}
			m.mu.Lock()
			r.ID = m.freshID(taken)
			m.mu.Unlock()
			active, err := m.layers.Branch(gctx, ck.Layer, layer.WithLabels(map[string]string{"sandbox": r.ID}))
			if err != nil {
				m.dropInflight(r.ID)
				return err
			}
			r.Layer = active.ID
			tpl := ts
			sb, err := m.startWith(gctx, r, nil, tpl)
			if err != nil && errors.Is(err, sandbox.ErrTemplatesGone) {
				// One was killed or resumed since (a daemon that died while
				// it was attached): never used again; the fork takes the
				// checkpoint's other path.
				m.dropTemplates(ck.ID, "its process templates were found gone or resumed: "+err.Error())
				tpl = nil
				sb, err = m.startWith(gctx, r, nil, nil)
			}
			if err != nil {
				m.dropInflight(r.ID)
				_ = m.layers.Remove(context.Background(), active.ID)
				return err
			}
			ids[i] = r.ID
			if ck.HasShell && tpl == nil {
				return sb.ReplayShellState(gctx, ck.Shell)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return daemon.ForkResult{}, fmt.Errorf("fork %q: %w", ckID, err)
	}
	return daemon.ForkResult{IDs: ids, ForkMs: msSince(began)}, nil
}

func (m *Manager) GetCheckpoint(ctx context.Context, id string) (daemon.Checkpoint, error) {
	if err := checkCkID(id); err != nil {
		return daemon.Checkpoint{}, err
	}
	ck, err := m.getCk(id)
	if err != nil {
		return daemon.Checkpoint{}, err
	}
	return m.ckInfo(ck, m.headsOf(id)), nil
}

func (m *Manager) ListCheckpoints(ctx context.Context) ([]daemon.Checkpoint, error) {
	cks, err := m.checkpoints()
	if err != nil {
		return nil, err
	}
	heads := m.heads()
	out := make([]daemon.Checkpoint, 0, len(cks))
	for _, ck := range cks {
		out = append(out, m.ckInfo(ck, heads[ck.ID]))
	}
	return out, nil
}

func (m *Manager) Tree(ctx context.Context, id string) (daemon.Tree, error) {
	slot := -1
	switch {
	case id == "":
	case strings.HasPrefix(id, "sb-"):
		if err := checkID(id); err != nil {
			return daemon.Tree{}, err
		}
		r, err := m.get(id)
		if err != nil {
			return daemon.Tree{}, err
		}
		slot = r.IDSlot
	default:
		if err := checkCkID(id); err != nil {
			return daemon.Tree{}, err
		}
		ck, err := m.getCk(id)
		if err != nil {
			return daemon.Tree{}, err
		}
		slot = ck.IDSlot
	}
	cks, err := m.checkpoints()
	if err != nil {
		return daemon.Tree{}, err
	}
	heads := m.heads()
	var t daemon.Tree
	for _, ck := range cks {
		if slot < 0 || ck.IDSlot == slot {
			t.Checkpoints = append(t.Checkpoints, m.ckInfo(ck, heads[ck.ID]))
		}
	}
	recs, err := m.records()
	if err != nil {
		return daemon.Tree{}, err
	}
	m.mu.Lock()
	for _, r := range recs {
		if slot < 0 || r.IDSlot == slot {
			t.Sandboxes = append(t.Sandboxes, m.info(r, m.live[r.ID]))
		}
	}
	m.mu.Unlock()
	sort.Slice(t.Sandboxes, func(i, j int) bool { return t.Sandboxes[i].Created.Before(t.Sandboxes[j].Created) })
	return t, nil
}

func (m *Manager) DeleteCheckpoint(ctx context.Context, id string, recursive bool) error {
	if err := checkCkID(id); err != nil {
		return err
	}
	cks, err := m.checkpoints()
	if err != nil {
		return err
	}
	byID := map[string]*ckRecord{}
	children := map[string][]string{}
	for _, ck := range cks {
		byID[ck.ID] = ck
		children[ck.Parent] = append(children[ck.Parent], ck.ID)
	}
	target, ok := byID[id]
	if !ok {
		return fmt.Errorf("checkpoint %q: %w", id, errdefs.ErrNotFound)
	}
	if len(children[id]) > 0 && !recursive {
		return fmt.Errorf("delete checkpoint %q: it has %d children (use recursive): %w", id, len(children[id]), errdefs.ErrFailedPrecondition)
	}
	doomed := map[string]bool{}
	var walk func(string)
	walk = func(c string) {
		doomed[c] = true
		for _, ch := range children[c] {
			walk(ch)
		}
	}
	walk(id)
	err = m.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketCheckpoints)
		for c := range doomed {
			if err := b.Delete([]byte(c)); err != nil {
				return err
			}
		}
		// Sandboxes whose head is gone take the nearest surviving ancestor.
		sbs := tx.Bucket(bucketSandboxes)
		return sbs.ForEach(func(k, v []byte) error {
			var r record
			if err := json.Unmarshal(v, &r); err != nil || !doomed[r.Head] {
				return err
			}
			r.Head = target.Parent
			return putJSON(sbs, r.ID, &r)
		})
	})
	if err != nil {
		return fmt.Errorf("delete checkpoint %q: %w", id, err)
	}
	for c := range doomed {
		m.dropTemplates(c, "")
		m.mu.Lock()
		delete(m.tplGone, c)
		m.mu.Unlock()
	}
	m.bg.Wait() // a spare of one of them may be in the making
	m.dropSpares(ctx, func(_ string, sp spare) bool { return doomed[sp.checkpoint] })
	m.gc(ctx)
	return nil
}

func (m *Manager) Diff(ctx context.Context, a, b string) ([]layer.Change, error) {
	la, err := m.layerOf(a)
	if err != nil {
		return nil, err
	}
	lb, err := m.layerOf(b)
	if err != nil {
		return nil, err
	}
	return m.layers.Diff(ctx, la, lb)
}

// layerOf resolves a checkpoint id to its committed layer and a sandbox id to
// its active layer.
func (m *Manager) layerOf(id string) (string, error) {
	if strings.HasPrefix(id, "sb-") {
		if err := checkID(id); err != nil {
			return "", err
		}
		r, err := m.get(id)
		if err != nil {
			return "", err
		}
		return r.Layer, nil
	}
	if err := checkCkID(id); err != nil {
		return "", err
	}
	ck, err := m.getCk(id)
	if err != nil {
		return "", err
	}
	return ck.Layer, nil
}

// gc removes the layers no sandbox or checkpoint references, children first.
// A layer that still has children is kept for a later pass.
func (m *Manager) gc(ctx context.Context) []string {
	m.layersMu.Lock()
	defer m.layersMu.Unlock()
	refs := map[string]bool{}
	recs, _ := m.records()
	for _, r := range recs {
		refs[r.Layer] = true
	}
	cks, _ := m.checkpoints()
	for _, ck := range cks {
		refs[ck.Layer] = true
	}
	for _, l := range append(m.spareLayers(), m.retiredLayers()...) {
		refs[l] = true
	}
	var removed []string
	for progress := true; progress; {
		progress = false
		var all []layer.Info
		_ = m.layers.Walk(ctx, func(in layer.Info) error { all = append(all, in); return nil })
		for _, in := range all {
			if refs[in.ID] {
				continue
			}
			if err := m.layers.Remove(ctx, in.ID); err == nil {
				removed = append(removed, in.ID)
				progress = true
			} else {
				m.log.Debug("gc: layer kept", "layer", in.ID, "err", err)
			}
		}
	}
	return removed
}

// Fsck checks the checkpoint tree against the layer store: every
// checkpoint's layer exists and is committed, every sandbox's active layer
// exists and is active, parents and heads exist, and no layer is unreferenced.
// Tests run it after every test.
func (m *Manager) Fsck(ctx context.Context) error {
	m.bg.Wait()
	m.layersMu.Lock()
	defer m.layersMu.Unlock()
	var errs []error
	recs, err := m.records()
	if err != nil {
		return err
	}
	cks, err := m.checkpoints()
	if err != nil {
		return err
	}
	ckByID := map[string]*ckRecord{}
	refs := map[string]bool{}
	for _, ck := range cks {
		ckByID[ck.ID] = ck
		refs[ck.Layer] = true
	}
	for _, ck := range cks {
		if in, err := m.layers.Stat(ctx, ck.Layer); err != nil || in.Kind != layer.KindCommitted {
			errs = append(errs, fmt.Errorf("checkpoint %s: layer %s: %v (kind %v)", ck.ID, ck.Layer, err, in.Kind))
		}
		if ck.Parent != "" && ckByID[ck.Parent] == nil {
			errs = append(errs, fmt.Errorf("checkpoint %s: parent %s missing", ck.ID, ck.Parent))
		}
	}
	for _, l := range append(m.spareLayers(), m.retiredLayers()...) {
		refs[l] = true
	}
	for _, r := range recs {
		refs[r.Layer] = true
		if in, err := m.layers.Stat(ctx, r.Layer); err != nil || in.Kind != layer.KindActive {
			errs = append(errs, fmt.Errorf("sandbox %s: layer %s: %v (kind %v)", r.ID, r.Layer, err, in.Kind))
		}
		if r.Head != "" && ckByID[r.Head] == nil {
			errs = append(errs, fmt.Errorf("sandbox %s: head %s missing", r.ID, r.Head))
		}
	}
	// A layer that is the parent of a referenced one stays until its last
	// child goes (the store refuses to remove it earlier).
	var all []layer.Info
	_ = m.layers.Walk(ctx, func(in layer.Info) error { all = append(all, in); return nil })
	parent := map[string]string{}
	for _, in := range all {
		parent[in.ID] = in.Parent
	}
	for id := range refs {
		for p := parent[id]; p != "" && !refs[p]; p = parent[p] {
			refs[p] = true
		}
	}
	for _, in := range all {
		if !refs[in.ID] {
			errs = append(errs, fmt.Errorf("layer %s (%v, parent %q, labels %v) is referenced by no sandbox or checkpoint", in.ID, in.Kind, in.Parent, in.Labels))
		}
	}
	return errors.Join(errs...)
}

func (m *Manager) ckInfo(ck *ckRecord, heads []string) daemon.Checkpoint {
	return daemon.Checkpoint{
		ID: ck.ID, Parent: ck.Parent, Sandbox: ck.Sandbox, Name: ck.Name, Labels: ck.Labels,
		Created: ck.Created, PauseMs: ck.PauseMs, Processes: m.ckProcesses(ck), Heads: heads,
	}
}

func (m *Manager) heads() map[string][]string {
	out := map[string][]string{}
	recs, _ := m.records()
	for _, r := range recs {
		if r.Head != "" {
			out[r.Head] = append(out[r.Head], r.ID)
		}
	}
	return out
}

func (m *Manager) headsOf(ck string) []string { return m.heads()[ck] }

func (m *Manager) getCk(id string) (*ckRecord, error) {
	var ck *ckRecord
	err := m.db.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketCheckpoints).Get([]byte(id))
		if v == nil {
			return fmt.Errorf("checkpoint %q: %w", id, errdefs.ErrNotFound)
		}
		ck = &ckRecord{}
		return json.Unmarshal(v, ck)
	})
	return ck, err
}

// checkpoints lists every checkpoint, oldest first (so parents come before
// their children).
func (m *Manager) checkpoints() ([]*ckRecord, error) {
	var out []*ckRecord
	err := m.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketCheckpoints).ForEach(func(_, v []byte) error {
			ck := &ckRecord{}
			if err := json.Unmarshal(v, ck); err != nil {
				return err
			}
			out = append(out, ck)
			return nil
		})
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out, err
}

func putJSON(b *bolt.Bucket, key string, v any) error {
	buf, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return b.Put([]byte(key), buf)
}

func newID(prefix string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

func msSince(t time.Time) float64 { return ms(time.Since(t)) }

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
