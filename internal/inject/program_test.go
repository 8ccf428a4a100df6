//go:build linux

package inject_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/internal/inject"
)

// echo is a python that prints "ready", then each line it reads, prefixed.
const echo = `import sys
print("ready")
for l in sys.stdin:
    print("got " + l.strip())
`

// code returns the bytes of every executable mapping of pid, by address.
func code(t *testing.T, pid int) map[string][]byte {
	t.Helper()
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		t.Fatal(err)
	}
	mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	out := map[string][]byte{}
	for _, line := range strings.Split(string(maps), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || f[1][2] != 'x' || (len(f) >= 6 && f[5] == "[vsyscall]") {
			continue
		}
		lo, hi, _ := strings.Cut(f[0], "-")
		a, _ := strconv.ParseUint(lo, 16, 64)
		b, _ := strconv.ParseUint(hi, 16, 64)
		buf := make([]byte, b-a)
		if _, err := mem.ReadAt(buf, int64(a)); err != nil {
			t.Fatalf("read %s of %d: %v", f[0], pid, err)
		}
		out[f[0]] = buf
	}
	return out
}

// run runs pg in p, in a batch of its own.
func run(p *inject.Proc, pg *inject.Program, scratch uintptr) (res inject.RunResult, err error) {
	err = p.Batch(func(b *inject.Batch) error {
		res, err = b.Run(p, pg, scratch)
		return err
	})
	return res, err
}

func sameCode(t *testing.T, who string, got, want map[string][]byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: %d executable mappings, want %d", who, len(got), len(want))
	}
	for k, w := range want {
		if !bytes.Equal(got[k], w) {
			t.Errorf("%s: the code of mapping %s changed", who, k)
		}
	}
}

// TestProgram runs system calls in a tracee in one resume: arguments from
// constants, strings and earlier results; a failing Try goes on; a failing
// Call ends the program and says which; a Clone's child runs a program of
// its own. The tracee's code is left as it was, in it and in the child, and
// it goes on reading its input afterwards.
func TestProgram(t *testing.T) {
	tr := setup(t)
	tg := python(t, echo)
	blockedIn(t, tg.pid, unix.SYS_READ)
	before := code(t, tg.pid)
	p := seize(t, tr, tg.pid)
	scratch, err := p.Scratch()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(path, []byte("data"), 0o600); err != nil {
		t.Fatal(err)
	}

	atFDCWD := unix.AT_FDCWD
	var pg inject.Program
	open := pg.Call("open", unix.SYS_OPENAT, inject.Value(uintptr(atFDCWD)), pg.String(path), inject.Value(unix.O_RDONLY|unix.O_CLOEXEC))
	pg.Call("dup3", unix.SYS_DUP3, inject.Result(open), inject.Value(100), inject.Value(0))
	pg.Try("close", unix.SYS_CLOSE, inject.Result(open))
	bad := pg.Try("close a closed fd", unix.SYS_CLOSE, inject.Value(9999))
	pg.Call("lseek", unix.SYS_LSEEK, inject.Value(100), inject.Value(2), inject.Value(0))
	pid := pg.Call("getpid", unix.SYS_GETPID)
	res, err := run(p, &pg, scratch)
	if err != nil {
		t.Fatalf("Run() = %v", err)
	}
	if len(res.Results) != 6 || int(res.Results[pid]) != tg.pid || int64(res.Results[bad]) != -int64(unix.EBADF) || res.Child != nil {
		t.Fatalf("Run() = %+v, want 6 results, getpid %d, EBADF for the bad close, no child", res, tg.pid)
	}
	if got, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/100", tg.pid)); err != nil || got != path {
		t.Errorf("fd 100 = %q, %v, want %q", got, err, path)
	}
	if info, err := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/100", tg.pid)); err != nil || !strings.HasPrefix(string(info), "pos:\t2\n") {
		t.Errorf("fdinfo of fd 100 = %q, %v, want pos 2", info, err)
	}

	// A failing call ends the program: what ran before it is reported.
	var fail inject.Program
	fail.Call("getpid", unix.SYS_GETPID)
	fail.Call("close a closed fd", unix.SYS_CLOSE, inject.Value(9999))
	fail.Call("never", unix.SYS_DUP3, inject.Value(100), inject.Value(101), inject.Value(0))
	res, err = run(p, &fail, scratch)
	var perr *inject.ProgramError
	if !errors.As(err, &perr) || perr.What != "close a closed fd" || !errors.Is(err, unix.EBADF) || len(res.Results) != 1 {
		t.Fatalf("Run() of a failing program = %+v, %v, want a ProgramError of the close (EBADF) after one result", res, err)
	}
	if _, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/101", tg.pid)); err == nil {
		t.Errorf("the call after the failing one ran")
	}

	// A clone, then a program in the clone.
	off, err := p.TIDOffset()
	if err != nil {
		t.Fatal(err)
	}
	var fork inject.Program
	fork.Clone("clone", cloneFlags, p.FSBase()+off)
	var child inject.Program
	cpid := child.Call("getpid", unix.SYS_GETPID)
	child.Call("close fd 100", unix.SYS_CLOSE, inject.Value(100))
	var cres inject.RunResult
	err = p.Batch(func(b *inject.Batch) error {
		res, err = b.Run(p, &fork, scratch)
		if err != nil {
			return err
		}
		cres, err = b.Run(res.Child, &child, scratch)
		return err
	})
	if err != nil || res.Child == nil {
		t.Fatalf("Run() of a clone = %+v, %v", res, err)
	}
	c := res.Child
	adopt(t, c.Pid())
	if int(res.Results[0]) != c.Pid() || int(cres.Results[cpid]) != c.Pid() {
		t.Errorf("clone returned %d, the child's getpid %d, want %d", res.Results[0], cres.Results[cpid], c.Pid())
	}
	if _, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/100", tg.pid)); err != nil {
		t.Errorf("the child's close closed the parent's fd: %v", err)
	}
	sameCode(t, "the clone", code(t, c.Pid()), before)
	if err := c.Kill(); err != nil {
		t.Fatalf("Kill() of the clone = %v", err)
	}
	sameCode(t, "the tracee", code(t, tg.pid), before)
	detach(t, p, false)
	tg.write(t, "hello\n")
	if l := tg.line(t); l != "got hello" {
		t.Fatalf("after the programs, python printed %q, want %q", l, "got hello")
	}
}

// TestProgramKeepsIgnoredSIGTRAP runs a program in a process that ignores
// SIGTRAP (bash's "trap ” TRAP"): a breakpoint's forced SIGTRAP would reset
// that to the default action, so the calls run one injection each, and the
// process still ignores it afterwards.
func TestProgramKeepsIgnoredSIGTRAP(t *testing.T) {
	tr := setup(t)
	tg := python(t, "import signal\nsignal.signal(signal.SIGTRAP, signal.SIG_IGN)\n"+echo)
	blockedIn(t, tg.pid, unix.SYS_READ)
	ignored := func() bool {
		t.Helper()
		v := statusField(t, tg.pid, "SigIgn")
		mask, err := strconv.ParseUint(v, 16, 64)
		if err != nil {
			t.Fatalf("SigIgn %q: %v", v, err)
		}
		return mask&(1<<(unix.SIGTRAP-1)) != 0
	}
	if !ignored() {
		t.Fatal("python does not ignore SIGTRAP")
	}
	p := seize(t, tr, tg.pid)
	scratch, err := p.Scratch()
	if err != nil {
		t.Fatal(err)
	}
	var pg inject.Program
	pid := pg.Call("getpid", unix.SYS_GETPID)
	pg.Try("close a closed fd", unix.SYS_CLOSE, inject.Value(9999))
	res, err := run(p, &pg, scratch)
	if err != nil || len(res.Results) != 2 || int(res.Results[pid]) != tg.pid || int64(res.Results[1]) != -int64(unix.EBADF) {
		t.Fatalf("Run() = %+v, %v, want getpid %d and EBADF", res, err, tg.pid)
	}
	detach(t, p, false)
	if !ignored() {
		t.Error("after the program, SIGTRAP is no longer ignored")
	}
	tg.write(t, "hello\n")
	if l := tg.line(t); l != "got hello" {
		t.Fatalf("after the program, python printed %q", l)
	}
}
