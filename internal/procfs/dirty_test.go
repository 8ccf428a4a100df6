//go:build linux

package procfs_test

import (
	"bufio"
	"io"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/deltabox/deltabox/internal/procfs"
	"github.com/deltabox/deltabox/internal/testutil"
)

// TestTouched has a python process write some pages of a fresh anonymous
// mapping and finds exactly those, merged by the gap and cut at the cap.
func TestTouched(t *testing.T) {
	testutil.RequiresRoot(t)
	testutil.RequiresBinary(t, "python3")
	testutil.CheckLeaks(t)
	cmd, _, lines := python(t, `import mmap, sys, ctypes
m = mmap.mmap(-1, 64 << 12, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in (3, 4, 5, 40, 42): m[i << 12] = 1
print(ctypes.addressof(ctypes.c_char.from_buffer(m)), flush=True)
sys.stdin.readline()`)
	lines.Scan()
	base, err := strconv.ParseUint(strings.TrimSpace(lines.Text()), 10, 64)
	if err != nil {
		t.Fatalf("python said %q", lines.Text())
	}
	pages := func(gap uintptr, max int64) []procfs.Range {
		got, err := procfs.Touched(cmd.Process.Pid, gap, max)
		if err != nil {
			t.Fatal(err)
		}
		var in []procfs.Range
		for _, r := range got {
			if r.Start >= uintptr(base) && r.End <= uintptr(base)+64<<12 {
				in = append(in, procfs.Range{Start: (r.Start - uintptr(base)) >> 12, End: (r.End - uintptr(base)) >> 12})
			}
		}
		return in
	}
	eq := func(a, b []procfs.Range) bool {
		if len(a) != len(b) {
			return false
		}
		for i := range a {
			if a[i] != b[i] {
				return false
			}
		}
		return true
	}
	if got, want := pages(0, 1<<40), []procfs.Range{{3, 6}, {40, 41}, {42, 43}}; !eq(got, want) {
		t.Errorf("touched pages (page numbers) %v, want %v", got, want)
	}
	if got, want := pages(2<<12, 1<<40), []procfs.Range{{3, 6}, {40, 43}}; !eq(got, want) {
		t.Errorf("with a two-page gap %v, want %v", got, want)
	}
	// The cap: ranges stop once they cover it.
	capped, err := procfs.Touched(cmd.Process.Pid, 0, 3<<12)
	if err != nil {
		t.Fatal(err)
	}
	var total uintptr
	for _, r := range capped {
		total += r.End - r.Start
	}
	if total != 3<<12 {
		t.Errorf("capped at three pages: %v cover %d bytes", capped, total)
	}
	// Exclusive: none of them is shared with another process.
	ex, err := procfs.Exclusive(cmd.Process.Pid)
	if err != nil || len(ex) == 0 {
		t.Errorf("Exclusive = %v, %v: want python's own pages", ex, err)
	}
}

func TestExiting(t *testing.T) {
	cmd := exec.Command("sleep", "1000")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	if procfs.Exiting(pid) {
		t.Errorf("Exiting(a sleeping process) = true")
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	if !procfs.Exiting(pid) {
		t.Errorf("Exiting(a reaped process) = false")
	}
}

// TestPrivateMemory has a python process write 32 MiB of its own and
// finds at least that; forked, the pages it shares with its child are no
// longer its own.
func TestPrivateMemory(t *testing.T) {
	testutil.RequiresBinary(t, "python3")
	testutil.CheckLeaks(t)
	cmd, in, lines := python(t, `import os, sys
b = bytearray(32 << 20)
for i in range(0, len(b), 4096): b[i] = 1
print("ready", flush=True)
sys.stdin.readline()
pid = os.fork()
if pid == 0:
    sys.stdin.readline(); os._exit(0)
print("forked", flush=True)
os.waitpid(pid, 0)`)
	if !lines.Scan() || lines.Text() != "ready" {
		t.Fatalf("python said %q", lines.Text())
	}
	alone, err := procfs.PrivateMemory(cmd.Process.Pid)
	if err != nil || alone < 32<<20 {
		t.Fatalf("PrivateMemory = %d, %v; want at least 32 MiB", alone, err)
	}
	if _, err := in.Write([]byte("\n")); err != nil {
		t.Fatal(err)
	}
	if !lines.Scan() || lines.Text() != "forked" {
		t.Fatalf("python said %q", lines.Text())
	}
	shared, err := procfs.PrivateMemory(cmd.Process.Pid)
	if err != nil || shared > alone-32<<20 {
		t.Errorf("PrivateMemory after a fork = %d, %v; want 32 MiB less than %d", shared, err, alone)
	}
	if n, err := procfs.Dirty(); err != nil || n < 0 {
		t.Errorf("Dirty() = %d, %v", n, err)
	}
}

// python starts python3 running script, with a pipe on its stdin and its
// stdout read by line; the test's end closes its stdin and waits for it.
func python(t *testing.T, script string) (*exec.Cmd, io.WriteCloser, *bufio.Scanner) {
	t.Helper()
	cmd := exec.Command("python3", "-u", "-c", script)
	in, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); _ = cmd.Wait() })
	return cmd, in, bufio.NewScanner(out)
}
