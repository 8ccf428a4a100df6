//go:build linux

package inject_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/inject"
	"github.com/deltabox/deltabox/internal/testutil"
)

// cloneFlags are the flags callers fork templates with.
const cloneFlags = unix.CLONE_PARENT | unix.CLONE_CHILD_SETTID | uintptr(unix.SIGCHLD)

// guard bounds every wait for a process to reach a state or print a line.
// It only turns a hang into a failure; nothing is timed.
const guard = 30 * time.Second

// setup gates a test and returns a Tracer closed at its end, after every
// process the test started is gone.
func setup(t *testing.T) *inject.Tracer {
	t.Helper()
	testutil.RequiresRoot(t)
	testutil.RequiresBinary(t, "python3")
	testutil.RequiresBinary(t, "sleep")
	testutil.CheckLeaks(t)
	tr := inject.NewTracer()
	t.Cleanup(func() {
		if err := tr.Close(); err != nil && !t.Failed() {
			t.Errorf("Close() = %v, want nil", err)
		}
	})
	return tr
}

// target is a process the test started, with a pipe on its stdin and its
// stdout and stderr read line by line. Clones of it share both pipes.
type target struct {
	cmd   *exec.Cmd
	pid   int
	stdin *os.File
	lines chan string
}

func start(t *testing.T, name string, args ...string) *target {
	t.Helper()
	inR, inW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(name, args...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, outW
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	inR.Close()
	outW.Close()
	tg := &target{cmd: cmd, pid: cmd.Process.Pid, stdin: inW, lines: make(chan string, 256)}
	go func() {
		defer outR.Close()
		s := bufio.NewScanner(outR)
		for s.Scan() {
			tg.lines <- s.Text()
		}
		close(tg.lines)
	}()
	t.Cleanup(func() {
		inW.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return tg
}

// python starts python3 running script, and waits until it prints ready.
func python(t *testing.T, script string, args ...string) *target {
	t.Helper()
	tg := start(t, "python3", append([]string{"-u", "-c", script}, args...)...)
	if l := tg.line(t); l != "ready" {
		t.Fatalf("python printed %q, want ready", l)
	}
	return tg
}

// line returns the next line the target (or a clone of it) printed.
func (tg *target) line(t *testing.T) string {
	t.Helper()
	select {
	case l, ok := <-tg.lines:
		if !ok {
			t.Fatalf("output of %d ended", tg.pid)
		}
		return l
	case <-time.After(guard):
		t.Fatalf("no output from %d", tg.pid)
	}
	return ""
}

func (tg *target) write(t *testing.T, s string) {
	t.Helper()
	if _, err := tg.stdin.WriteString(s); err != nil {
		t.Fatal(err)
	}
}

// exitStatus waits for the target and returns its exit status.
func (tg *target) exitStatus(t *testing.T) int {
	t.Helper()
	err := tg.cmd.Wait()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("wait for %d: %v", tg.pid, err)
	}
	return tg.cmd.ProcessState.ExitCode()
}

// adopt makes sure a clone (a child of the test, by CLONE_PARENT) is
// killed and reaped when the test ends. The process handle holds a pidfd,
// so neither can hit a reused pid.
func adopt(t *testing.T, pid int) *os.Process {
	t.Helper()
	p, err := os.FindProcess(pid)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = p.Kill()
		_, _ = p.Wait()
	})
	return p
}

// exitCode waits for an adopted clone. Call it only once the clone is
// detached: a wait from any thread sees the stops of an attached one.
func exitCode(t *testing.T, p *os.Process) int {
	t.Helper()
	st, err := p.Wait()
	if err != nil {
		t.Fatalf("wait for %d: %v", p.Pid, err)
	}
	return st.ExitCode()
}

// eventually polls cond until it holds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(guard); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("%s: not reached", what)
		}
	}
}

// blockedIn waits until pid sleeps in one of the system calls nrs.
func blockedIn(t *testing.T, pid int, nrs ...int) {
	t.Helper()
	eventually(t, fmt.Sprintf("process %d blocked in system call %v", pid, nrs), func() bool {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/syscall", pid))
		f := strings.Fields(string(b))
		if err != nil || len(f) == 0 {
			return false
		}
		nr, err := strconv.Atoi(f[0])
		return err == nil && slices.Contains(nrs, nr)
	})
}

// asleep waits until a coreutils sleep sleeps: in clock_nanosleep, or in
// restart_syscall once a stop interrupted it.
func asleep(t *testing.T, pid int) {
	t.Helper()
	blockedIn(t, pid, unix.SYS_CLOCK_NANOSLEEP, unix.SYS_RESTART_SYSCALL)
}

func procState(t *testing.T, pid int) byte {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	i := bytes.LastIndexByte(b, ')')
	return b[i+2]
}

func statusField(t *testing.T, pid int, name string) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, name+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no %s in /proc/%d/status", name, pid)
	return ""
}

func tracerPid(t *testing.T, pid int) int {
	t.Helper()
	n, err := strconv.Atoi(statusField(t, pid, "TracerPid"))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func seize(t *testing.T, tr *inject.Tracer, pid int) *inject.Proc {
	t.Helper()
	p, err := tr.Seize(context.Background(), pid, guard)
	if err != nil {
		t.Fatalf("Seize(%d) = %v", pid, err)
	}
	return p
}

// clone forks p the way templates are forked.
func clone(t *testing.T, p *inject.Proc, flags uintptr) (*inject.Proc, *os.Process) {
	t.Helper()
	off, err := p.TIDOffset()
	if err != nil {
		t.Fatalf("TIDOffset() = %v", err)
	}
	c, err := p.Clone(flags, p.FSBase()+off)
	if err != nil {
		t.Fatalf("Clone() = %v", err)
	}
	return c, adopt(t, c.Pid())
}

func detach(t *testing.T, p *inject.Proc, stopped bool) {
	t.Helper()
	if err := p.Detach(stopped); err != nil {
		t.Fatalf("Detach(%v) of %d = %v", stopped, p.Pid(), err)
	}
}

func TestSyscallGetpid(t *testing.T) {
	tr := setup(t)
	tg := start(t, "sleep", "1000")
	asleep(t, tg.pid)
	p := seize(t, tr, tg.pid)
	got, err := p.Syscall(unix.SYS_GETPID)
	if err != nil || int(got) != tg.pid {
		t.Fatalf("Syscall(getpid) = %d, %v, want %d", got, err, tg.pid)
	}
	detach(t, p, false)
	if s := procState(t, tg.pid); s == 'T' || s == 't' {
		t.Errorf("state after Detach(false) = %c, want running or sleeping", s)
	}
	if n := tracerPid(t, tg.pid); n != 0 {
		t.Errorf("TracerPid after Detach = %d, want 0", n)
	}
	// Back in its sleep, and it dies of a signal like any process.
	asleep(t, tg.pid)
	if err := tg.cmd.Process.Signal(unix.SIGTERM); err != nil {
		t.Fatal(err)
	}
	err = tg.cmd.Wait()
	if ws, ok := tg.cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != unix.SIGTERM {
		t.Errorf("sleep ended with %v, want killed by SIGTERM", err)
	}
}

// TestRestart forks processes blocked in each kind of interrupted system
// call, and checks that the original and the clone both carry on with it.
// Without the restart fix each of them sees the kernel's internal error
// code (or EINTR) and fails.
func TestRestart(t *testing.T) {
	for _, tc := range []struct {
		name string
		argv []string
		nr   int // the system call it blocks in
		code int // -rax at the stop
		// drive makes the two processes finish and checks what they
		// printed.
		drive func(t *testing.T, tg *target)
	}{{
		name: "read",
		argv: []string{"python3", "-u", "-c", `
import os
print("ready", flush=True)
d = os.read(0, 100)
os.write(1, b"got " + d.strip() + b"\n")
`},
		nr:   unix.SYS_READ,
		code: 512, // ERESTARTSYS
		drive: func(t *testing.T, tg *target) {
			var got []string
			for _, in := range []string{"a", "b"} {
				tg.write(t, in+"\n") // one line at a time: each read takes one
				got = append(got, tg.line(t))
			}
			slices.Sort(got)
			if want := []string{"got a", "got b"}; !slices.Equal(got, want) {
				t.Errorf("printed %q, want %q", got, want)
			}
		},
	}, {
		name: "python sleep",
		argv: []string{"python3", "-u", "-c", `
import os, time
print("ready", flush=True)
time.sleep(2)
os.write(1, b"slept\n")
`},
		nr:   unix.SYS_CLOCK_NANOSLEEP,
		code: 514, // ERESTARTNOHAND
		drive: func(t *testing.T, tg *target) {
			for range 2 {
				if l := tg.line(t); l != "slept" {
					t.Errorf("printed %q, want slept", l)
				}
			}
		},
	}, {
		name:  "coreutils sleep",
		argv:  []string{"sleep", "2"},
		nr:    unix.SYS_CLOCK_NANOSLEEP,
		code:  516, // ERESTART_RESTARTBLOCK: restart_syscall
		drive: func(t *testing.T, tg *target) {},
	}, {
		// ctypes, because Python's own epoll retries EINTR and would
		// hide the bug.
		name: "epoll_wait",
		argv: []string{"python3", "-u", "-c", `
import ctypes, os, select, sys
libc = ctypes.CDLL(None, use_errno=True)
ep = select.epoll()
ep.register(0, select.EPOLLIN)
events = ctypes.create_string_buffer(64)
print("ready", flush=True)
n = libc.epoll_wait(ep.fileno(), events, 4, -1)
if n < 0:
    os.write(1, b"error %d\n" % ctypes.get_errno())
    sys.exit(3)
os.write(1, b"woke %d\n" % n)
`},
		nr:   unix.SYS_EPOLL_WAIT,
		code: int(unix.EINTR),
		drive: func(t *testing.T, tg *target) {
			// Nobody reads the input: it wakes one, then the other.
			tg.write(t, "x\n")
			for range 2 {
				if l := tg.line(t); l != "woke 1" {
					t.Errorf("printed %q, want woke 1", l)
				}
			}
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			tr := setup(t)
			var tg *target
			if tc.argv[0] == "python3" {
				tg = python(t, tc.argv[3])
			} else {
				tg = start(t, tc.argv[0], tc.argv[1:]...)
			}
			blockedIn(t, tg.pid, tc.nr)
			p := seize(t, tr, tg.pid)
			stop := p.StopRegs()
			if got := -int64(stop.Return()); got != int64(tc.code) || stop.SyscallNr() != int64(tc.nr) {
				t.Fatalf("stopped in system call %d returning %d, want %d returning %d", stop.SyscallNr(), got, tc.nr, tc.code)
			}
			if r := p.Regs(); int64(r.Return()) < 0 || r.PC() != stop.PC()-2 {
				t.Errorf("resume registers return %#x at %#x, want the restart at %#x", r.Return(), r.PC(), stop.PC()-2)
			}
			c, cp := clone(t, p, cloneFlags)
			detach(t, c, false)
			detach(t, p, false)
			tc.drive(t, tg)
			if code := tg.exitStatus(t); code != 0 {
				t.Errorf("original exited with %d, want 0", code)
			}
			if code := exitCode(t, cp); code != 0 {
				t.Errorf("clone exited with %d, want 0", code)
			}
		})
	}
}

// TestCloneTID checks the thread id glibc caches in a clone's TCB (it
// encodes it in the clock id of pthread_getcpuclockid) against the clone's
// pid, with and without CLONE_CHILD_SETTID.
func TestCloneTID(t *testing.T) {
	const script = `
import os, threading, time
print("ready", flush=True)
os.read(0, 100)
clock = time.pthread_getcpuclockid(threading.get_ident())
os.write(1, b"%d %d %d\n" % (os.getpid(), threading.get_native_id(), ~(clock >> 3)))
`
	for _, tc := range []struct {
		name  string
		flags uintptr
		stale bool // the clone's cached tid is the original's pid
	}{
		{"settid", cloneFlags, false},
		{"without settid the tid is stale", unix.CLONE_PARENT | uintptr(unix.SIGCHLD), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := setup(t)
			tg := python(t, script)
			blockedIn(t, tg.pid, unix.SYS_READ)
			p := seize(t, tr, tg.pid)
			off, err := p.TIDOffset()
			if err != nil {
				t.Fatalf("TIDOffset() = %v", err)
			}
			b := make([]byte, 4)
			if err := p.ReadMem(p.FSBase()+off, b); err != nil {
				t.Fatal(err)
			}
			if got := int(int32(uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24)); got != tg.pid {
				t.Fatalf("int32 at fs_base+%#x = %d, want pid %d", off, got, tg.pid)
			}
			c, cp := clone(t, p, tc.flags)
			detach(t, c, false)
			detach(t, p, false)

			byPid := map[int][3]int{}
			for range 2 {
				tg.write(t, "x\n")
				var pid, native, tcb int
				l := tg.line(t)
				if _, err := fmt.Sscan(l, &pid, &native, &tcb); err != nil {
					t.Fatalf("printed %q: %v", l, err)
				}
				byPid[pid] = [3]int{pid, native, tcb}
			}
			want := map[int][3]int{tg.pid: {tg.pid, tg.pid, tg.pid}, c.Pid(): {c.Pid(), c.Pid(), c.Pid()}}
			if tc.stale {
				want[c.Pid()] = [3]int{c.Pid(), c.Pid(), tg.pid}
			}
			for pid, w := range want {
				if byPid[pid] != w {
					t.Errorf("process %d printed pid, native id, TCB tid %v, want %v", pid, byPid[pid], w)
				}
			}
			if code := tg.exitStatus(t); code != 0 {
				t.Errorf("original exited with %d, want 0", code)
			}
			if code := exitCode(t, cp); code != 0 {
				t.Errorf("clone exited with %d, want 0", code)
			}
		})
	}
}

// TestTemplate freezes a process as a template, adopts it again, forks it
// and freezes it again; the clone runs, and the template, continued in the
// end, carries on with its read.
func TestTemplate(t *testing.T) {
	tr := setup(t)
	tg := python(t, `
import os
print("ready", flush=True)
while True:
    d = os.read(0, 100)
    if not d:
        break
    os.write(1, b"got %d %s\n" % (os.getpid(), d.strip()))
`)
	blockedIn(t, tg.pid, unix.SYS_READ)
	isStopped := func() bool { return procState(t, tg.pid) == 'T' }
	detach(t, seize(t, tr, tg.pid), true)
	eventually(t, "template stopped", isStopped)

	p := seize(t, tr, tg.pid)
	c, cp := clone(t, p, cloneFlags)
	detach(t, p, true)
	eventually(t, "template stopped again", isStopped)
	detach(t, c, false)
	if s := procState(t, c.Pid()); s == 'T' || s == 't' {
		t.Errorf("clone state = %c, want running or sleeping", s)
	}
	tg.write(t, "hello\n") // the template is stopped: the clone reads it
	if l, want := tg.line(t), fmt.Sprintf("got %d hello", c.Pid()); l != want {
		t.Errorf("printed %q, want %q", l, want)
	}
	for range 3 {
		detach(t, seize(t, tr, tg.pid), true)
	}
	eventually(t, "template still stopped", isStopped)
	if n := tracerPid(t, tg.pid); n != 0 {
		t.Errorf("template TracerPid = %d, want 0", n)
	}

	tg.stdin.Close() // the clone reads EOF
	if code := exitCode(t, cp); code != 0 {
		t.Errorf("clone exited with %d, want 0", code)
	}
	if err := tg.cmd.Process.Signal(unix.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if code := tg.exitStatus(t); code != 0 {
		t.Errorf("continued template exited with %d, want 0", code)
	}
}

// TestSignalsRequeued sends a signal while the process is attached: it is
// swallowed, then delivered after Detach; to a template, after SIGCONT.
func TestSignalsRequeued(t *testing.T) {
	const script = `
import os, signal
signal.signal(signal.SIGUSR1, lambda s, f: print("usr1", flush=True))
print("ready", flush=True)
while True:
    d = os.read(0, 100)
    if not d:
        break
    print("got", d.decode().strip(), flush=True)
`
	for _, stopped := range []bool{false, true} {
		t.Run(fmt.Sprintf("stopped=%v", stopped), func(t *testing.T) {
			tr := setup(t)
			tg := python(t, script)
			blockedIn(t, tg.pid, unix.SYS_READ)
			p := seize(t, tr, tg.pid)
			if _, err := p.Syscall(unix.SYS_GETPID); err != nil {
				t.Fatal(err)
			}
			if err := unix.Kill(tg.pid, unix.SIGUSR1); err != nil {
				t.Fatal(err)
			}
			if _, err := p.Syscall(unix.SYS_GETPID); err != nil {
				t.Fatal(err)
			}
			if got := p.Pending(); !slices.Equal(got, []unix.Signal{unix.SIGUSR1}) {
				t.Fatalf("Pending() = %v, want [SIGUSR1]", got)
			}
			detach(t, p, stopped)
			if stopped {
				eventually(t, "template stopped", func() bool { return procState(t, tg.pid) == 'T' })
				mask, err := strconv.ParseUint(statusField(t, tg.pid, "SigPnd"), 16, 64)
				if err != nil || mask&(1<<(unix.SIGUSR1-1)) == 0 {
					t.Fatalf("SigPnd of the stopped template = %#x, %v; want SIGUSR1 pending", mask, err)
				}
				if err := unix.Kill(tg.pid, unix.SIGCONT); err != nil {
					t.Fatal(err)
				}
			}
			if l := tg.line(t); l != "usr1" {
				t.Errorf("printed %q, want usr1", l)
			}
			tg.write(t, "a\n") // the interrupted read carries on
			if l := tg.line(t); l != "got a" {
				t.Errorf("printed %q, want got a", l)
			}
			tg.stdin.Close()
			if code := tg.exitStatus(t); code != 0 {
				t.Errorf("exited with %d, want 0", code)
			}
		})
	}
}

// TestSeizeTimeout seizes a vfork parent, which never stops: its child
// (posix_spawn's) blocks opening a FIFO before it can exec.
func TestSeizeTimeout(t *testing.T) {
	const script = `
import os, sys
print("ready", flush=True)
pid = os.posix_spawn("/bin/true", ["true"], dict(os.environ),
    file_actions=[(os.POSIX_SPAWN_OPEN, 3, sys.argv[1], os.O_RDONLY, 0)])
_, status = os.waitpid(pid, 0)
print("spawned", status, flush=True)
os.read(0, 1)
`
	// vforkParent starts the script and waits until its child blocks.
	vforkParent := func(t *testing.T) (*target, string) {
		fifo := filepath.Join(t.TempDir(), "fifo")
		if err := unix.Mkfifo(fifo, 0o600); err != nil {
			t.Fatal(err)
		}
		tg := python(t, script, fifo)
		var child int
		eventually(t, "posix_spawn child", func() bool {
			b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", tg.pid, tg.pid))
			f := strings.Fields(string(b))
			if len(f) == 0 {
				return false
			}
			child, _ = strconv.Atoi(f[0])
			return true
		})
		blockedIn(t, child, unix.SYS_OPENAT)
		return tg, fifo
	}
	timesOut := func(t *testing.T, tr *inject.Tracer, pid int) {
		t.Helper()
		_, err := tr.Seize(context.Background(), pid, 100*time.Millisecond)
		if !errors.Is(err, inject.ErrTimeout) || !errors.Is(err, errdefs.ErrUnavailable) {
			t.Fatalf("Seize(vfork parent) = %v, want ErrTimeout", err)
		}
	}
	// finish lets the child exec, and checks that the parent goes on and
	// can be seized now.
	finish := func(t *testing.T, tr *inject.Tracer, tg *target, fifo string) {
		t.Helper()
		if n := tracerPid(t, tg.pid); n != 0 {
			t.Errorf("TracerPid = %d, want 0", n)
		}
		if s := procState(t, tg.pid); s == 'T' || s == 't' {
			t.Errorf("state = %c, want not stopped", s)
		}
		f, err := os.OpenFile(fifo, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
		if l := tg.line(t); l != "spawned 0" {
			t.Errorf("printed %q, want spawned 0", l)
		}
		blockedIn(t, tg.pid, unix.SYS_READ)
		detach(t, seize(t, tr, tg.pid), false)
		tg.stdin.Close()
		if code := tg.exitStatus(t); code != 0 {
			t.Errorf("exited with %d, want 0", code)
		}
	}

	t.Run("alone", func(t *testing.T) {
		tr := setup(t)
		tg, fifo := vforkParent(t)
		timesOut(t, tr, tg.pid)
		finish(t, tr, tg, fifo)
	})
	// Another process attached through the same thread keeps the stuck
	// one attached until it is detached.
	t.Run("beside an attached process", func(t *testing.T) {
		tr := setup(t)
		other := start(t, "sleep", "1000")
		asleep(t, other.pid)
		op := seize(t, tr, other.pid)
		tg, fifo := vforkParent(t)
		timesOut(t, tr, tg.pid)
		if got, err := op.Syscall(unix.SYS_GETPID); err != nil || int(got) != other.pid {
			t.Errorf("Syscall(getpid) after a timed-out Seize = %d, %v, want %d", got, err, other.pid)
		}
		detach(t, op, false)
		finish(t, tr, tg, fifo)
	})
}

// TestScratch writes a path to scratch memory and opens it by an injected
// openat.
func TestScratch(t *testing.T) {
	tr := setup(t)
	tg := start(t, "sleep", "1000")
	asleep(t, tg.pid)
	p := seize(t, tr, tg.pid)
	at, err := p.Scratch()
	if err != nil {
		t.Fatalf("Scratch() = %v", err)
	}
	if sp := p.Regs().SP(); at%4096 != 0 || at+4096 > sp-128 {
		t.Errorf("Scratch() = %#x, want page-aligned 4 KiB below the red zone of %#x", at, sp)
	}
	path := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(path, []byte("data"), 0o600); err != nil {
		t.Fatal(err)
	}
	in := append([]byte(path), 0)
	if err := p.WriteMem(at, in); err != nil {
		t.Fatalf("WriteMem() = %v", err)
	}
	out := make([]byte, len(in))
	if err := p.ReadMem(at, out); err != nil || !bytes.Equal(out, in) {
		t.Fatalf("ReadMem() = %q, %v, want %q", out, err, in)
	}

	atFDCWD := unix.AT_FDCWD
	fd, err := p.Syscall(unix.SYS_OPENAT, uintptr(atFDCWD), at, unix.O_RDONLY|unix.O_CLOEXEC)
	if err != nil {
		t.Fatalf("Syscall(openat) = %v", err)
	}
	link := fmt.Sprintf("/proc/%d/fd/%d", tg.pid, fd)
	if got, err := os.Readlink(link); err != nil || got != path {
		t.Errorf("readlink %s = %q, %v, want %q", link, got, err, path)
	}
	if _, err := p.Syscall(unix.SYS_CLOSE, fd); err != nil {
		t.Fatalf("Syscall(close) = %v", err)
	}
	if _, err := p.Syscall(unix.SYS_CLOSE, fd); !errors.Is(err, unix.EBADF) {
		t.Errorf("Syscall(close) of a closed fd = %v, want EBADF", err)
	}
	detach(t, p, false)
	asleep(t, tg.pid)
}

// TestKill kills a clone and its original while attached: both are gone
// (reaped: both are children of the test), none is left a traced zombie.
func TestKill(t *testing.T) {
	tr := setup(t)
	tg := start(t, "sleep", "1000")
	asleep(t, tg.pid)
	p := seize(t, tr, tg.pid)
	c, _ := clone(t, p, cloneFlags)
	for _, q := range []*inject.Proc{c, p} {
		if err := q.Kill(); err != nil {
			t.Fatalf("Kill() of %d = %v", q.Pid(), err)
		}
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", q.Pid())); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("process %d after Kill: stat = %v, want gone", q.Pid(), err)
		}
		if _, err := q.Syscall(unix.SYS_GETPID); !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("Syscall after Kill = %v, want ErrFailedPrecondition", err)
		}
	}
}

// TestClose: Close ends the thread, which lets go of a process left
// attached, and every later call fails.
func TestClose(t *testing.T) {
	testutil.RequiresRoot(t)
	testutil.CheckLeaks(t)
	tr := inject.NewTracer()
	tg := start(t, "sleep", "1000")
	asleep(t, tg.pid)
	p := seize(t, tr, tg.pid)
	if err := tr.Close(); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("Close() with a process attached = %v, want ErrFailedPrecondition", err)
	}
	if n := tracerPid(t, tg.pid); n != 0 {
		t.Errorf("TracerPid after Close = %d, want 0", n)
	}
	asleep(t, tg.pid)
	if err := p.Detach(false); !errors.Is(err, inject.ErrClosed) {
		t.Errorf("Detach() after Close = %v, want ErrClosed", err)
	}
	if _, err := tr.Seize(context.Background(), tg.pid, guard); !errors.Is(err, inject.ErrClosed) {
		t.Errorf("Seize() after Close = %v, want ErrClosed", err)
	}
	if err := tr.Close(); err != nil {
		t.Errorf("second Close() = %v, want nil", err)
	}
}
