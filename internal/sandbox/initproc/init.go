//go:build linux

// Package initproc is a sandbox's init: pid 1 of each of its generations,
// run by cmd/deltabox-init (or a re-execution of any binary that starts
// sandboxes, see IsInit). It talks to the daemon (package sandbox) over
// package initproto. It links as little as it can: every checkpoint
// generation, restore and fork boots one, and a Go binary's boot cost grows
// with the packages it initialises.
package initproc

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/internal/sandbox/initproto"
	"github.com/deltabox/deltabox/internal/sandbox/seccomp/filter"
)

// envInit marks a re-execution of the DeltaBox binary as a sandbox's init.
const envInit = "_DELTABOX_INIT"

// Env is the whole environment an init starts with: the mark, and one P
// for the Go scheduler. The init waits on its socket and on children; one
// P is all it uses, and each P is set up at boot (with GOMAXPROCS unset,
// the runtime also reads the cgroup's CPU limit through mountinfo): 11%
// less CPU per boot on this 2-CPU machine, more on larger ones.
func Env() []string { return []string{envInit + "=1", "GOMAXPROCS=1"} }

// IsInit reports whether this process was started as a sandbox's init. Every
// binary that starts sandboxes (the daemon, and test binaries, which re-exec
// themselves) calls it first thing in main or TestMain:
//
//	if initproc.IsInit() { initproc.Run() }
func IsInit() bool { return os.Getenv(envInit) == "1" }

// Run runs the sandbox's init and never returns. The init is pid 1 of the
// sandbox's pid namespace: it sets up the root filesystem (pivot_root into
// it, /proc, /dev, /sys, masked paths), brings up loopback, then starts
// processes at the daemon's request, each under the seccomp filter the
// daemon sent, and reports their exits, reaping every orphan. When the
// daemon's end of the control socket closes, it exits, and the kernel kills
// the whole sandbox.
func Run() {
	err := runInit()
	if errors.Is(err, initproto.ErrClosed) {
		os.Exit(0) // the daemon let go of the sandbox: the normal end
	}
	fmt.Fprintf(os.Stderr, "deltabox init: %v\n", err)
	os.Exit(1)
}

type initState struct {
	cmu      sync.Mutex // guards c, which a reconnect replaces
	c        *initproto.Conn
	listener int      // persist: where the next daemon connects; -1 when the init dies with its daemon
	home     *os.File // the sandbox cgroup's v1 "tasks" file: spawning threads return there
	// filter is the workload's seccomp filter. The init itself is not
	// filtered (it replaces its root on restore); each process it starts is
	// forked from a throwaway thread that loaded the filter.
	filter filter.Filter

	mu       sync.Mutex // guards children; held across fork and register so the reaper cannot miss an exit
	children map[int]bool

	held map[int]*os.File // files kept for a template's clone (hold); used by the main loop only
}

func runInit() error {
	tr := newSteps()
	os.Unsetenv(envInit)
	// Nothing the daemon's process inherited may reach the workload: every
	// fd but stdio and the control socket closes on exec.
	if err := unix.CloseRange(4, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		return fmt.Errorf("mark inherited fds close-on-exec: %w", err)
	}
	ctl := os.NewFile(3, "control")
	c, err := initproto.NewConn(ctl)
	if err != nil {
		return err
	}
	ctl.Close()
	st := &initState{c: c, listener: -1, children: map[int]bool{}, held: map[int]*os.File{}}
	// Unasked: a nested init's daemon learns our host pid from this
	// message's credentials.
	if err := c.Send(initproto.Message{Op: initproto.OpHello}); err != nil {
		return err
	}

	m, files, err := c.Recv()
	if err != nil {
		return fmt.Errorf("receive config: %w", err)
	}
	if m.Op != initproto.OpConfig || m.Config == nil {
		initproto.CloseFiles(files)
		return fmt.Errorf("first message is %q, want %q", m.Op, initproto.OpConfig)
	}
	// The config carries the detached root mount and, on cgroup v1, the
	// sandbox cgroup's tasks file.
	if len(files) == 0 {
		return fmt.Errorf("config without the root mount")
	}
	tree := files[0]
	if len(files) > 1 {
		st.home = files[1]
		initproto.CloseFiles(files[2:])
	}
	tr.step("boot")
	err = setupRoot(m.Config, tree)
	tree.Close()
	tr.step("root")
	if err != nil {
		_ = c.Send(initproto.Message{Op: initproto.OpError, ID: m.ID, Err: err.Error()})
		return err
	}
	st.filter = m.Config.Seccomp
	// SIGCHLD is delivered to the reaper; every other signal the kernel
	// sends to a pid 1 from inside its namespace is ignored unless handled.
	sigs := make(chan os.Signal, 16)
	signal.Notify(sigs, unix.SIGCHLD)
	go st.reap(sigs)
	tr.step("reaper")
	if err := c.Send(initproto.Message{Op: initproto.OpReady, ID: m.ID, Trace: tr.String()}); err != nil {
		return err
	}
	for {
		m, files, err := c.Recv()
		if err != nil && st.listener >= 0 {
			// A generation that holds templates outlives its daemon: it
			// waits for the next one.
			c.Close()
			if c, err = st.accept(); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			// The daemon is gone: take the sandbox down with us.
			if errors.Is(err, initproto.ErrClosed) {
				return err
			}
			return fmt.Errorf("control connection: %w", err)
		}
		switch m.Op {
		case initproto.OpSpawn:
			if m.Spawn != nil && m.Spawn.Cgroup && !m.Spawn.V2 && st.home == nil {
				initproto.CloseFiles(files)
				_ = c.Send(initproto.Message{Op: initproto.OpError, ID: m.ID, Err: "spawn: no home cgroup to return to"})
				continue
			}
			go st.spawn(m, files)
		case initproto.OpReroot:
			if len(files) < 1 || len(files) > 2 {
				initproto.CloseFiles(files)
				_ = c.Send(initproto.Message{Op: initproto.OpError, ID: m.ID, Err: "reroot: want the root and at most the cgroup's tasks file"})
				continue
			}
			err := reroot(files[0])
			files[0].Close()
			if err == nil && m.Config != nil && m.Config.Hostname != "" {
				err = unix.Sethostname([]byte(m.Config.Hostname))
			}
			if len(files) == 2 {
				// A generation set up ahead, on a stand-in root, learns its
				// sandbox's cgroup only now; nothing has been spawned yet.
				if err == nil && st.home == nil {
					st.home = files[1]
				} else {
					files[1].Close()
				}
			}
			if err != nil {
				_ = c.Send(initproto.Message{Op: initproto.OpError, ID: m.ID, Err: err.Error()})
				continue
			}
			_ = c.Send(initproto.Message{Op: initproto.OpReady, ID: m.ID})
		case initproto.OpGenerate:
			if len(files) != 1 {
				initproto.CloseFiles(files)
				_ = c.Send(initproto.Message{Op: initproto.OpError, ID: m.ID, Err: "generate: want one file"})
				continue
			}
			go st.generate(m, files[0])
		case initproto.OpPersist:
			if len(files) != 1 || st.listener >= 0 {
				initproto.CloseFiles(files)
				_ = c.Send(initproto.Message{Op: initproto.OpError, ID: m.ID, Err: "persist: want one listening socket, once"})
				continue
			}
			fd, err := unix.Dup(int(files[0].Fd()))
			files[0].Close()
			if err != nil {
				_ = c.Send(initproto.Message{Op: initproto.OpError, ID: m.ID, Err: err.Error()})
				continue
			}
			unix.CloseOnExec(fd)
			st.listener = fd
			_ = c.Send(initproto.Message{Op: initproto.OpReady, ID: m.ID})
		case initproto.OpHold:
			fds := make([]int, len(files))
			for i, f := range files {
				fds[i] = int(f.Fd())
				st.held[fds[i]] = f
			}
			_ = c.Send(initproto.Message{Op: initproto.OpReady, ID: m.ID, Fds: fds})
		case initproto.OpRelease:
			initproto.CloseFiles(files)
			for _, fd := range m.Fds {
				if f, ok := st.held[fd]; ok {
					f.Close()
					delete(st.held, fd)
				}
			}
		case initproto.OpSignal:
			initproto.CloseFiles(files)
			if m.Pid > 1 {
				_ = unix.Kill(m.Pid, unix.Signal(m.Signal))
			}
		default:
			initproto.CloseFiles(files)
			_ = c.Send(initproto.Message{Op: initproto.OpError, ID: m.ID, Err: "unknown op " + m.Op})
		}
	}
}

// spawn starts a process. A process that must start in its own cgroup (so
// that a timeout can kill its whole tree) is forked from a thread that was
// moved into that cgroup first: a v1 cgroup "tasks" file moves one thread,
// and a child starts in its parent thread's cgroups. This keeps exec cheap
// (no shim binary to exec inside the sandbox, whose libc may differ) and
// race-free (the command cannot fork before it is in its cgroup). On v2,
// clone3's CLONE_INTO_CGROUP does the same.
func (st *initState) spawn(m initproto.Message, files []*os.File) {
	defer initproto.CloseFiles(files)
	req := m.Spawn
	fail := func(err error) { _ = st.send(initproto.Message{Op: initproto.OpError, ID: m.ID, Err: err.Error()}) }
	if req == nil || len(req.Argv) == 0 {
		fail(errors.New("spawn: no command"))
		return
	}
	want := 3
	if req.Cgroup {
		want = 4
	}
	if len(files) != want {
		fail(fmt.Errorf("spawn: got %d files, want %d", len(files), want))
		return
	}
	path := req.Argv[0]
	if filepath.Base(path) == path {
		p, err := lookPath(path, req.Env)
		if err != nil {
			fail(err)
			return
		}
		path = p
	}
	attr := &syscall.ProcAttr{
		Dir:   req.Cwd,
		Env:   req.Env,
		Files: []uintptr{files[0].Fd(), files[1].Fd(), files[2].Fd()},
		Sys: &syscall.SysProcAttr{
			Setsid:     true,
			Cloneflags: unix.CLONE_NEWCGROUP,
		},
	}
	if req.Cgroup && req.V2 {
		attr.Sys.UseCgroupFD = true
		attr.Sys.CgroupFD = int(files[3].Fd())
	}

	// Runs on its own goroutine (see runInit). The thread it locks is
	// filtered by seccomp before the fork, and never unlocked: the runtime
	// destroys it when the goroutine returns, so no other goroutine ever
	// runs filtered or in the exec cgroup.
	runtime.LockOSThread()
	if st.filter != nil {
		if err := st.filter.Thread(); err != nil {
			fail(fmt.Errorf("spawn: %w", err))
			return
		}
	}
	moved := false
	if req.Cgroup && !req.V2 {
		if _, err := unix.Write(int(files[3].Fd()), []byte("0")); err != nil {
			fail(fmt.Errorf("spawn: join exec cgroup: %w", err))
			return
		}
		moved = true
	}
	st.mu.Lock()
	pid, err := syscall.ForkExec(path, req.Argv, attr)
	if err == nil {
		st.children[pid] = true
	}
	st.mu.Unlock()
	if moved {
		// Leave the exec cgroup at once, although the thread dies with this
		// goroutine: while it is there, v1's cgroup.procs lists the init's
		// pid in the exec's cgroup, where a timeout's kill would find it.
		if _, err := unix.Write(int(st.home.Fd()), []byte("0")); err != nil {
			fail(fmt.Errorf("spawn: leave exec cgroup: %w", err))
			return
		}
	}
	if err != nil {
		if errors.Is(err, unix.ENOENT) && req.Cwd != "" {
			if _, serr := os.Stat(req.Cwd); serr != nil {
				fail(fmt.Errorf("spawn: working directory %q: %w", req.Cwd, serr))
				return
			}
		}
		fail(fmt.Errorf("spawn %q: %w", req.Argv[0], err))
		return
	}
	_ = st.send(initproto.Message{Op: initproto.OpSpawned, ID: m.ID, Pid: pid})
}

// send sends m on the current control connection.
func (st *initState) send(m initproto.Message) error {
	st.cmu.Lock()
	c := st.c
	st.cmu.Unlock()
	return c.Send(m)
}

// accept waits for the next daemon on the listener and makes its connection
// the control connection. What the init reported meanwhile (exits) is lost:
// the new daemon re-adopts templates, whose state does not depend on it.
func (st *initState) accept() (*initproto.Conn, error) {
	for {
		fd, _, err := unix.Accept4(st.listener, unix.SOCK_CLOEXEC)
		if errors.Is(err, unix.EINTR) || errors.Is(err, unix.ECONNABORTED) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("accept a daemon: %w", err)
		}
		f := os.NewFile(uintptr(fd), "control")
		c, err := initproto.NewConn(f)
		f.Close()
		if err != nil {
			return nil, err
		}
		if err := c.Send(initproto.Message{Op: initproto.OpHello}); err != nil {
			c.Close()
			continue
		}
		st.cmu.Lock()
		st.c = c
		st.cmu.Unlock()
		return c, nil
	}
}

// generate starts the init of a child generation: the same binary, in new
// pid, mount, net, uts and ipc namespaces nested under ours (and so owned by
// our user namespace, the tree's). Our pid namespace is the one the new pid
// namespace nests under: it must be the caller's active one, which is why
// the parent generation's init, not the daemon, starts it. The new init
// talks to the daemon over ctl and waits for its config, as a root init does.
func (st *initState) generate(m initproto.Message, ctl *os.File) {
	defer ctl.Close()
	null, err := os.Open(os.DevNull)
	if err != nil {
		_ = st.send(initproto.Message{Op: initproto.OpError, ID: m.ID, Err: fmt.Sprintf("generate: %v", err)})
		return
	}
	defer null.Close()
	attr := &syscall.ProcAttr{
		Env:   Env(),
		Files: []uintptr{null.Fd(), os.Stderr.Fd(), os.Stderr.Fd(), ctl.Fd()},
		Sys: &syscall.SysProcAttr{
			Setsid: true,
			Cloneflags: unix.CLONE_NEWPID | unix.CLONE_NEWNS | unix.CLONE_NEWNET |
				unix.CLONE_NEWUTS | unix.CLONE_NEWIPC,
		},
	}
	pid, err := syscall.ForkExec("/proc/self/exe", []string{"deltabox-init"}, attr)
	if err != nil {
		_ = st.send(initproto.Message{Op: initproto.OpError, ID: m.ID, Err: fmt.Sprintf("generate: %v", err)})
		return
	}
	_ = st.send(initproto.Message{Op: initproto.OpSpawned, ID: m.ID, Pid: pid})
}

// reap reaps every child on SIGCHLD and reports the exits of the processes
// the daemon started.
func (st *initState) reap(sigs <-chan os.Signal) {
	for range sigs {
		for {
			var ws unix.WaitStatus
			st.mu.Lock()
			pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
			if pid <= 0 || err != nil {
				st.mu.Unlock()
				break
			}
			ours := st.children[pid]
			delete(st.children, pid)
			st.mu.Unlock()
			// Orphans include the clones of templates, which are our
			// children by clone(CLONE_PARENT): the daemon waits for them.
			_ = st.send(initproto.Message{Op: initproto.OpExited, Pid: pid, Status: int(ws), Orphan: !ours})
		}
	}
}

// lookPath resolves a command name with the PATH of env, inside the sandbox.
func lookPath(name string, env []string) (string, error) {
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	for _, kv := range env {
		if len(kv) > 5 && kv[:5] == "PATH=" {
			path = kv[5:]
		}
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%q: executable file not found in $PATH: %w", name, unix.ENOENT)
}

// steps times the init's boot, for the daemon's debug log (the ready
// message's Trace).
type steps struct {
	last time.Time
	done []string
}

func newSteps() *steps { return &steps{last: time.Now()} }

func (s *steps) step(name string) {
	now := time.Now()
	s.done = append(s.done, fmt.Sprintf("%s=%.2fms", name, float64(now.Sub(s.last).Microseconds())/1000))
	s.last = now
}

func (s *steps) String() string { return strings.Join(s.done, " ") }
