//go:build linux

package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/procfs"
	"github.com/deltabox/deltabox/internal/sandbox/cgroup"
	"github.com/deltabox/deltabox/internal/sandbox/initproto"
)

// Templates outlive the daemon. A generation that holds templates, and each
// of its ancestors (they hold templates too: a generation gets children only
// from a checkpoint or from its templates), is persisted: its init gets a
// listening socket in the run directory and from then on survives the loss of
// its control connection, waiting for the next daemon. The checkpoint stores
// a TemplatesRecord; after a restart, AdoptTemplates connects to the
// generations again and checks that every template is still the process it
// was (pid and start time) and still stopped.

// GenRecord names one persisted generation.
type GenRecord struct {
	Pid    int    `json:"pid"`
	Start  string `json:"start"` // /proc/pid/stat start time: the pid is not reused
	Level  int    `json:"level"`
	Socket string `json:"socket"`
}

// TemplateRecord is one template as stored.
type TemplateRecord struct {
	Pid    int         `json:"pid"`
	Start  string      `json:"start"`
	Kind   SessionKind `json:"kind"`
	Origin int         `json:"origin"` // index in Chain of the generation whose init is its parent
	Cwd    string      `json:"cwd"`
	FDs    []fdRef     `json:"fds"`
	TIDOff uint64      `json:"tid_off"`
	PC     uint64      `json:"pc"`
	SP     uint64      `json:"sp"`
}

// TemplatesRecord is what re-adopting a checkpoint's templates takes.
type TemplatesRecord struct {
	Chain  []GenRecord      `json:"chain"` // the holder first, its root last
	Procs  []TemplateRecord `json:"procs"`
	Cgroup string           `json:"cgroup"`
}

// persist makes g and its ancestors outlive the daemon (see above).
func (r *Runtime) persist(ctx context.Context, g *generation) error {
	for ; g != nil; g = g.parent {
		g.mu.Lock()
		done := g.socket != ""
		g.mu.Unlock()
		if done {
			continue
		}
		start := procfs.StartTime(g.hostPid)
		path := filepath.Join(r.runDir, "gen-"+strconv.Itoa(g.hostPid)+"-"+start+".sock")
		_ = os.Remove(path)
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("persist generation: %w", err)
		}
		lis := os.NewFile(uintptr(fd), "listener")
		err = unix.Bind(fd, &unix.SockaddrUnix{Name: path})
		if err == nil {
			err = unix.Listen(fd, 4)
		}
		if err == nil {
			_, err = g.request(ctx, initproto.Message{Op: initproto.OpPersist}, lis)
		}
		lis.Close()
		if err != nil {
			_ = os.Remove(path)
			return fmt.Errorf("persist generation %d: %w", g.hostPid, err)
		}
		g.mu.Lock()
		g.socket, g.started = path, start
		g.onFree = append(g.onFree, func() { _ = os.Remove(path) })
		g.mu.Unlock()
	}
	return nil
}

// Record returns what AdoptTemplates needs to take the templates back after a
// daemon restart.
func (ts *Templates) Record() TemplatesRecord {
	rec := TemplatesRecord{Cgroup: filepath.Base(ts.cg.Name())}
	index := map[*generation]int{}
	for g := ts.g; g != nil; g = g.parent {
		g.mu.Lock()
		index[g] = len(rec.Chain)
		rec.Chain = append(rec.Chain, GenRecord{Pid: g.hostPid, Start: g.started, Level: g.level, Socket: g.socket})
		g.mu.Unlock()
	}
	for _, t := range ts.procs {
		rec.Procs = append(rec.Procs, TemplateRecord{
			Pid: t.pid, Start: t.start, Kind: t.kind, Origin: index[t.origin], Cwd: t.cwd, FDs: t.fds,
			TIDOff: uint64(t.tidOff), PC: uint64(t.pc), SP: uint64(t.sp),
		})
	}
	return rec
}

// Disconnect lets the daemon go without killing the templates: the
// connections to their (persisted) generations close, and the inits wait
// for the next daemon. The Templates must not be used afterwards.
func (ts *Templates) Disconnect() {
	ts.mu.Lock()
	ts.released = true
	ts.mu.Unlock()
	ts.users.Wait()
	ts.bg.Wait()
	ts.mu.Lock()
	spares := ts.spares // not persisted: a next daemon makes its own
	ts.spares = nil
	ts.mu.Unlock()
	for _, g := range spares {
		g.release()
	}
	for g := ts.g; g != nil; g = g.parent {
		if g.c != nil {
			_ = g.c.Shutdown()
		}
	}
}

// AdoptTemplates takes a previous daemon's templates back from their record.
// It fails, taking nothing, when a generation or a template is gone, was
// replaced (a reused pid) or was resumed.
func (r *Runtime) AdoptTemplates(ctx context.Context, rec TemplatesRecord) (_ *Templates, err error) {
	if len(rec.Chain) == 0 || len(rec.Procs) == 0 {
		return nil, fmt.Errorf("adopt templates: empty record: %w", errdefs.ErrInvalidArgument)
	}
	for _, p := range rec.Procs {
		if procfs.StartTime(p.Pid) != p.Start || procfs.State(p.Pid) != "T" {
			return nil, fmt.Errorf("adopt templates: template %d is gone or was resumed: %w", p.Pid, errdefs.ErrNotFound)
		}
		if p.Origin < 0 || p.Origin >= len(rec.Chain) {
			return nil, fmt.Errorf("adopt templates: bad origin %d: %w", p.Origin, errdefs.ErrInvalidArgument)
		}
	}
	// The chain, root first; each generation holds a reference on its
	// parent, and we hold one on the holder.
	gens := make([]*generation, len(rec.Chain))
	var parent *generation
	for i := len(rec.Chain) - 1; i >= 0; i-- {
		g, err := r.adoptGeneration(ctx, rec.Chain[i], parent)
		if err != nil {
			if parent != nil {
				parent.release()
			}
			return nil, err
		}
		gens[i], parent = g, g
	}
	defer func() {
		if err != nil {
			gens[0].release()
		}
	}()
	cg, err := cgroup.Load(rec.Cgroup, cgroup.WithParent(r.cgParent))
	if err != nil {
		return nil, fmt.Errorf("adopt templates: %w", err)
	}
	ts := &Templates{g: gens[0], cg: cg, tracer: r.tracerThread(), rt: r, quit: make(chan struct{})}
	for _, p := range rec.Procs {
		ts.procs = append(ts.procs, &template{
			pid: p.Pid, start: p.Start, kind: p.Kind, origin: gens[p.Origin], cwd: p.Cwd, fds: p.FDs,
			tidOff: uintptr(p.TIDOff), pc: uintptr(p.PC), sp: uintptr(p.SP),
		})
	}
	return ts, nil
}

// adoptGeneration connects to a persisted generation (or takes one more
// reference on it, when another record adopted it already). It consumes the
// caller's reference on parent: the new generation keeps it.
func (r *Runtime) adoptGeneration(ctx context.Context, rec GenRecord, parent *generation) (*generation, error) {
	key := strconv.Itoa(rec.Pid) + "-" + rec.Start
	r.adoptMu.Lock()
	defer r.adoptMu.Unlock()
	if g, ok := r.adopted[key]; ok && g.tryHold() {
		if parent != nil {
			parent.release() // g holds its parent already
		}
		return g, nil
	}
	if procfs.StartTime(rec.Pid) != rec.Start {
		return nil, fmt.Errorf("adopt generation %d: it is gone: %w", rec.Pid, errdefs.ErrNotFound)
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	if err := unix.Connect(fd, &unix.SockaddrUnix{Name: rec.Socket}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("adopt generation %d: connect: %w", rec.Pid, err)
	}
	f := os.NewFile(uintptr(fd), "control")
	c, err := initproto.NewConn(f)
	f.Close()
	if err != nil {
		return nil, err
	}
	g := newGeneration(parent, r.log)
	g.hostPid, g.level, g.socket, g.started = rec.Pid, rec.Level, rec.Socket, rec.Start
	g.start(c)
	fail := func(err error) (*generation, error) {
		g.refs = 0
		_ = c.Shutdown()
		if g.pidfd >= 0 {
			unix.Close(g.pidfd)
		}
		return nil, err
	}
	select {
	case <-g.hello:
	case <-g.deadCh:
		return fail(fmt.Errorf("adopt generation %d: it hung up: %w", rec.Pid, errdefs.ErrUnavailable))
	case <-time.After(5 * time.Second):
		return fail(fmt.Errorf("adopt generation %d: no hello: %w", rec.Pid, errdefs.ErrUnavailable))
	case <-ctx.Done():
		return fail(ctx.Err())
	}
	if g.pidfd, err = unix.PidfdOpen(rec.Pid, 0); err != nil || procfs.StartTime(rec.Pid) != rec.Start {
		return fail(fmt.Errorf("adopt generation %d: pidfd: %v: %w", rec.Pid, err, errdefs.ErrUnavailable))
	}
	path := rec.Socket
	g.onFree = append(g.onFree, func() { _ = os.Remove(path) })
	g.onFree = append(g.onFree, func() {
		r.adoptMu.Lock()
		delete(r.adopted, key)
		r.adoptMu.Unlock()
	})
	if r.adopted == nil {
		r.adopted = map[string]*generation{}
	}
	r.adopted[key] = g
	return g, nil
}

// KillOrphanGenerations kills the persisted generations of a previous daemon
// that no template was adopted from (their checkpoints are gone), and
// removes their sockets. It returns what it killed, for the log.
func (r *Runtime) KillOrphanGenerations() []string {
	socks, _ := filepath.Glob(filepath.Join(r.runDir, "gen-*.sock"))
	var killed []string
	r.adoptMu.Lock()
	defer r.adoptMu.Unlock()
	for _, sock := range socks {
		name := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(sock), "gen-"), ".sock")
		if _, ok := r.adopted[name]; ok {
			continue
		}
		pidS, start, _ := strings.Cut(name, "-")
		if pid, err := strconv.Atoi(pidS); err == nil && procfs.StartTime(pid) == start {
			// SIGKILL to a pid namespace's init takes everything nested.
			if err := unix.Kill(pid, unix.SIGKILL); err == nil || !errors.Is(err, unix.ESRCH) {
				killed = append(killed, name)
			}
		}
		_ = os.Remove(sock)
	}
	return killed
}

// DropTemplates kills what is left of templates that could not be adopted
// (each still the process it was).
func (r *Runtime) DropTemplates(ctx context.Context, rec TemplatesRecord) {
	for _, p := range rec.Procs {
		if procfs.StartTime(p.Pid) == p.Start {
			_ = unix.Kill(p.Pid, unix.SIGKILL)
		}
	}
	// Their cgroup goes with the orphans' (RemoveOrphanTemplateCgroups):
	// it may hold the init of a generation that other templates, adopted
	// later, nest in.
}

// Templates' cgroups are marked in the run directory while they exist
// (the cgroup parent may be shared with other daemons): a daemon that died
// in a checkpoint, before the checkpoint was recorded, leaves a cgroup no
// record names, which the next one finds by its mark.

// cgroupMark is the mark of the templates' cgroup name.
func (r *Runtime) cgroupMark(name string) string {
	return filepath.Join(r.runDir, name+".cgroup")
}

// templatesCgroup makes a templates' cgroup, marked.
func (r *Runtime) templatesCgroup(ctx context.Context, name string) (cgroup.Cgroup, error) {
	if err := os.WriteFile(r.cgroupMark(name), nil, 0o600); err != nil {
		return nil, err
	}
	cg, err := cgroup.New(ctx, name, cgroup.Limits{}, cgroup.WithParent(r.cgParent))
	if err != nil {
		_ = os.Remove(r.cgroupMark(name))
	}
	return cg, err
}

// deleteTemplatesCgroup deletes a templates' cgroup and its mark.
func (r *Runtime) deleteTemplatesCgroup(ctx context.Context, cg cgroup.Cgroup) {
	if err := cg.Delete(ctx); err == nil {
		_ = os.Remove(r.cgroupMark(filepath.Base(cg.Name())))
	}
}

// RemoveOrphanTemplateCgroups removes the marked templates' cgroups of a
// previous daemon that no adopted templates hold (keep names those that
// do), and returns their names.
func (r *Runtime) RemoveOrphanTemplateCgroups(ctx context.Context, keep map[string]bool) []string {
	marks, _ := filepath.Glob(filepath.Join(r.runDir, "*.cgroup"))
	r.adoptMu.Lock()
	adopted := map[int]*generation{}
	for _, g := range r.adopted {
		adopted[g.hostPid] = g
	}
	r.adoptMu.Unlock()
	var removed []string
	for _, mark := range marks {
		name := strings.TrimSuffix(filepath.Base(mark), ".cgroup")
		if keep[name] {
			continue
		}
		cg, err := cgroup.Load(name, cgroup.WithParent(r.cgParent))
		if errors.Is(err, errdefs.ErrNotFound) {
			_ = os.Remove(mark)
			continue
		}
		if err != nil {
			r.log.Warn("remove an orphan templates' cgroup", "cgroup", name, "err", err)
			continue
		}
		// It also holds the init of its templates' generation: one that
		// adopted templates nest in lives on, and the cgroup goes with it.
		pids, _ := cg.Procs()
		var holder *generation
		for _, p := range pids {
			if g := adopted[p]; g != nil {
				holder = g
			}
		}
		if holder != nil {
			holder.mu.Lock()
			holder.onFree = append(holder.onFree, func() {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				r.deleteTemplatesCgroup(ctx, cg)
			})
			holder.mu.Unlock()
			continue
		}
		if err := cg.Delete(ctx); err != nil {
			r.log.Warn("remove an orphan templates' cgroup", "cgroup", name, "err", err)
			continue
		}
		_ = os.Remove(mark)
		removed = append(removed, name)
	}
	return removed
}
