//go:build linux

package sandbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/procfs"
	"github.com/deltabox/deltabox/internal/sandbox/initproto"
)

// A generation is one of our inits and the namespaces it is pid 1 of: a pid
// namespace with its own mount, net, uts and ipc namespaces (see
// ../shared/design/ARCHITECTURE.md, "Generations"). A sandbox's live
// processes always run in one generation. A fresh sandbox's first
// generation is a root: the daemon starts its init in a new user namespace
// U, the tree's. A checkpoint on the template path freezes the live
// processes in place as templates and moves the sandbox on into a child
// generation, nested under the old one and started by the old one's init
// (so in U, with no user namespace to join); a restore or fork makes a child
// generation of the checkpoint's generation and clones the templates into
// it. No live workload ever shares a pid namespace with a template or with
// another sandbox.
//
// A generation lives while something holds a reference: the sandbox whose
// live generation it is, the checkpoint whose templates it holds, and each
// child generation (killing a pid namespace's init kills everything nested in
// it). The last release kills its init.
type generation struct {
	hostPid int
	level   int         // depth of its pid namespace (the host's is 0)
	parent  *generation // nil for a root
	cmd     *exec.Cmd   // a root's init is the daemon's child
	pidfd   int         // a nested init is not: it is signalled through a pidfd
	c       *initproto.Conn
	log     *slog.Logger
	onFree  []func() // run after the init died (its root's mount, its cgroup)
	// configured marks an init that has its config and a root (the
	// runtime's stand-in, set up ahead, or a sandbox's): rootInit moves
	// it to another root with a reroot.
	configured bool

	mu      sync.Mutex // guards the fields below
	nspids  []int      // the init's pid in each pid namespace, host's first (see pidAt)
	nextID  uint64
	pending map[uint64]chan initproto.Message // request ID -> answer
	waiters map[int]chan int                  // pid (in this generation's namespace) -> wait status
	early   map[int]int                       // exits of our spawns that arrived before their waiter
	hello   chan int                          // the init's host pid, from its first message's credentials
	dead    bool
	deadCh  chan struct{}
	refs    int
	stdio   []*stdio // held ahead for clones (see prehold)
	socket  string   // persisted: where its init waits for the next daemon (see persist)
	started string   // persisted: its start time, which names it with its pid
}

// MaxPidNSLevel is the kernel's limit on pid namespace nesting
// (MAX_PID_NS_LEVEL): a generation's pid namespace can be at most this deep.
const MaxPidNSLevel = 32

func newGeneration(parent *generation, log *slog.Logger) *generation {
	g := &generation{
		parent: parent, pidfd: -1, log: log, refs: 1,
		pending: map[uint64]chan initproto.Message{}, waiters: map[int]chan int{}, early: map[int]int{},
		hello: make(chan int, 1), deadCh: make(chan struct{}),
	}
	if parent != nil {
		g.level = parent.level + 1
	}
	return g
}

// ownLevel is the depth of the calling process's pid namespace.
func ownLevel() (int, error) {
	ns, err := procfs.NSpids(os.Getpid())
	if err != nil {
		return 0, err
	}
	return len(ns) - 1, nil
}

// start runs the read loop; the generation owns c from here on.
func (g *generation) start(c *initproto.Conn) {
	g.c = c
	go g.readLoop()
}

// readLoop dispatches the init's messages: answers to requests and exits.
func (g *generation) readLoop() {
	defer g.c.Close()
	for {
		m, files, err := g.c.Recv()
		initproto.CloseFiles(files) // the init never sends files; drop any it forges
		if err != nil {
			g.markDead()
			return
		}
		g.mu.Lock()
		switch {
		case m.Op == initproto.OpHello:
			select {
			case g.hello <- m.PeerPid:
			default:
			}
		case m.Op == initproto.OpExited:
			if ch, ok := g.waiters[m.Pid]; ok {
				ch <- m.Status
				delete(g.waiters, m.Pid)
			} else if !m.Orphan && len(g.early) < 4096 {
				// Only our spawns' exits can precede their waiter; an
				// orphan's exit nobody waits for is dropped, so that a
				// later process with a reused pid never finds it.
				g.early[m.Pid] = m.Status
			}
		case m.ID != 0:
			if ch, ok := g.pending[m.ID]; ok {
				ch <- m
				delete(g.pending, m.ID)
			}
		}
		g.mu.Unlock()
	}
}

func (g *generation) markDead() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.dead {
		return
	}
	g.dead = true
	close(g.deadCh)
}

// alive reports whether the init still runs.
func (g *generation) alive() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return !g.dead
}

// request sends m and waits for the init's answer.
func (g *generation) request(ctx context.Context, m initproto.Message, files ...*os.File) (initproto.Message, error) {
	ch := make(chan initproto.Message, 1)
	g.mu.Lock()
	if g.dead {
		g.mu.Unlock()
		return initproto.Message{}, fmt.Errorf("init %d is not running: %w", g.hostPid, errdefs.ErrFailedPrecondition)
	}
	g.nextID++
	m.ID = g.nextID
	g.pending[m.ID] = ch
	g.mu.Unlock()
	if err := g.c.Send(m, files...); err != nil {
		g.mu.Lock()
		delete(g.pending, m.ID)
		g.mu.Unlock()
		return initproto.Message{}, fmt.Errorf("send to init: %w", err)
	}
	select {
	case r := <-ch:
		if r.Op == initproto.OpError {
			return r, errors.New(r.Err)
		}
		return r, nil
	case <-g.deadCh:
		return initproto.Message{}, fmt.Errorf("init %d exited: %w", g.hostPid, errdefs.ErrUnavailable)
	case <-ctx.Done():
		g.mu.Lock()
		delete(g.pending, m.ID)
		g.mu.Unlock()
		return initproto.Message{}, ctx.Err()
	}
}

// waitChan registers interest in the exit of pid (as this generation's init
// sees it: its child).
func (g *generation) waitChan(pid int) chan int {
	ch := make(chan int, 1)
	g.mu.Lock()
	defer g.mu.Unlock()
	if st, ok := g.early[pid]; ok {
		delete(g.early, pid)
		ch <- st
		return ch
	}
	g.waiters[pid] = ch
	return ch
}

// kill kills the init, and with it every process of its pid namespace and of
// the namespaces nested in it, and waits until it is gone.
func (g *generation) kill() {
	switch {
	case g.cmd != nil && g.cmd.Process != nil:
		_ = g.cmd.Process.Kill()
	case g.pidfd >= 0:
		_ = unix.PidfdSendSignal(g.pidfd, unix.SIGKILL, nil, 0)
	}
	if g.c != nil {
		_ = g.c.Shutdown() // the read loop ends (see initproto.Conn.Close)
	}
	select {
	case <-g.deadCh:
	case <-time.After(10 * time.Second):
		g.log.Warn("init did not die", "pid", g.hostPid)
	}
	if g.pidfd >= 0 {
		// The init is gone once its pidfd polls readable; the read loop's
		// end only says its socket closed.
		fds := []unix.PollFd{{Fd: int32(g.pidfd), Events: unix.POLLIN}}
		_, _ = unix.Poll(fds, 10_000)
	}
}

// tryHold takes one more reference, unless the last one is gone already
// (a generation whose count reached 0 is being torn down: it must not come
// back).
func (g *generation) tryHold() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.refs <= 0 || g.dead {
		return false
	}
	g.refs++
	return true
}

// release drops a reference; the last one kills the init, frees what the
// generation owned and releases its parent.
func (g *generation) release() {
	g.mu.Lock()
	g.refs--
	last := g.refs == 0
	g.mu.Unlock()
	if !last {
		return
	}
	g.kill()
	g.dropStdio()
	if g.pidfd >= 0 {
		unix.Close(g.pidfd)
		g.pidfd = -1
	}
	for i := len(g.onFree) - 1; i >= 0; i-- {
		g.onFree[i]()
	}
	if g.parent != nil {
		g.parent.release()
	}
}

// ErrTooDeep is returned (wrapped, with errdefs.ErrFailedPrecondition) when
// a new generation would nest pid namespaces deeper than the kernel allows.
var ErrTooDeep = errors.New("pid namespaces nest too deep")

// ErrTemplatesGone is returned (wrapped, with errdefs.ErrFailedPrecondition)
// when a checkpoint's templates cannot be cloned any more: one was killed,
// evicted, or resumed (a daemon that died while it was attached let it
// run). The checkpoint's other paths remain.
var ErrTemplatesGone = errors.New("the process templates are gone or were resumed")

// spawnGeneration has parent's init start the init of a child generation,
// puts it in cg and waits for its hello. The child holds a reference on
// parent; the caller owns the returned generation (one reference) and
// gives it its root (rootInit) before it runs anything.
func (r *Runtime) spawnGeneration(ctx context.Context, parent *generation, cg cgroupAdder, log *slog.Logger) (_ *generation, err error) {
	if parent.level+1 > MaxPidNSLevel {
		return nil, fmt.Errorf("a new generation would be %d pid namespaces deep, past the kernel's %d: %w (%w)",
			parent.level+1, MaxPidNSLevel, ErrTooDeep, errdefs.ErrFailedPrecondition)
	}
	// The child's reference on its parent, taken first: the parent cannot
	// be torn down while its child is being made.
	if !parent.tryHold() {
		return nil, fmt.Errorf("start a child generation: its parent is gone: %w", errdefs.ErrUnavailable)
	}
	defer func() {
		if err != nil {
			parent.release()
		}
	}()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("control socketpair: %w", err)
	}
	// Our end passes credentials: the kernel attaches the sender's pid, in
	// our pid namespace, to what the new init sends.
	if err := unix.SetsockoptInt(fds[0], unix.SOL_SOCKET, unix.SO_PASSCRED, 1); err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return nil, fmt.Errorf("control socket: %w", err)
	}
	ours := os.NewFile(uintptr(fds[0]), "control")
	theirs := os.NewFile(uintptr(fds[1]), "control-init")
	c, err := initproto.NewConn(ours)
	ours.Close()
	if err != nil {
		theirs.Close()
		return nil, err
	}
	g := newGeneration(parent, log)
	g.start(c)
	defer func() {
		if err != nil {
			g.kill()
			if g.pidfd >= 0 {
				unix.Close(g.pidfd)
			}
		}
	}()
	_, err = parent.request(ctx, initproto.Message{Op: initproto.OpGenerate}, theirs)
	theirs.Close()
	if err != nil {
		return nil, fmt.Errorf("start a child generation: %w", err)
	}
	select {
	case pid := <-g.hello:
		if pid <= 0 {
			return nil, fmt.Errorf("start a child generation: its hello carries no pid")
		}
		g.hostPid = pid
	case <-g.deadCh:
		return nil, fmt.Errorf("start a child generation: its init exited: %w", errdefs.ErrUnavailable)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if g.pidfd, err = unix.PidfdOpen(g.hostPid, 0); err != nil {
		return nil, fmt.Errorf("start a child generation: pidfd: %w", err)
	}
	if !g.alive() {
		// The pid could have been reused between its death and our pidfd.
		return nil, fmt.Errorf("start a child generation: its init exited: %w", errdefs.ErrUnavailable)
	}
	_ = os.WriteFile(fmt.Sprintf("/proc/%d/oom_score_adj", g.hostPid), []byte("-998"), 0)
	if err := cg.Add(g.hostPid); err != nil {
		return nil, err
	}
	return g, nil
}

// cgroupAdder is the part of a cgroup spawnGeneration needs.
type cgroupAdder interface{ Add(pid int) error }

// pidAt is the init's pid in the pid namespace at level (an ancestor's),
// read once: every clone into the generation needs it.
func (g *generation) pidAt(level int) (int, error) {
	g.mu.Lock()
	ns := g.nspids
	g.mu.Unlock()
	if ns == nil {
		var err error
		if ns, err = procfs.NSpids(g.hostPid); err != nil {
			return 0, err
		}
		g.mu.Lock()
		g.nspids = ns
		g.mu.Unlock()
	}
	if level >= len(ns) {
		return 0, fmt.Errorf("init %d has no pid at level %d (%v): %w", g.hostPid, level, ns, errdefs.ErrInternal)
	}
	return ns[level], nil
}
