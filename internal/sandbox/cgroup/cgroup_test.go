//go:build linux

package cgroup

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/testutil"
)

// requiresHost gates a test on root and on this machine's cgroups being v1 or
// hybrid (the v2 logic is tested against a fake cgroupfs in v2_test.go).
func requiresV1(t *testing.T) {
	t.Helper()
	testutil.RequiresRoot(t)
	m, err := DetectMode("")
	if err != nil {
		testutil.Skip(t, "no cgroups: "+err.Error())
	}
	if m != ModeV1 && m != ModeHybrid {
		t.Skipf("cgroup mode is %v; the v1 tests need v1 or hybrid", m)
	}
}

// testMarker is in the name of every cgroup this test binary creates, so
// that checkLeaks can tell them from other packages' running alongside.
func testMarker() string { return "t" + strconv.Itoa(os.Getpid()) + "-" }

func uniqueName(t *testing.T) string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	n := strings.NewReplacer("/", "-", " ", "-").Replace(t.Name())
	return testMarker() + n + "-" + hex.EncodeToString(b)
}

// checkLeaks fails t if, when it ends, a cgroup this test binary created or a
// descendant process is left. It is testutil.CheckLeaks scoped to what this
// process owns: that one compares machine-wide mounts, loop devices and
// cgroups, so with `go test -p 2` it reports the layer tests' mounts (and
// they ours). This package creates no mounts or loop devices.
func checkLeaks(t *testing.T) {
	t.Helper()
	before := testutil.Take()
	t.Cleanup(func() {
		var after testutil.Snapshot
		for deadline := time.Now().Add(5 * time.Second); ; {
			after = testutil.Take()
			if len(newOnes(before.Children, after.Children, "")) == 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if d := newOnes(before.Cgroups, after.Cgroups, "/"+testMarker()); len(d) > 0 {
			t.Errorf("leaked cgroups: %s", strings.Join(d, ", "))
		}
		if d := newOnes(before.Children, after.Children, ""); len(d) > 0 {
			t.Errorf("leaked processes: %s", strings.Join(d, ", "))
		}
	})
}

func newOnes(before, after []string, marker string) []string {
	var out []string
	for _, a := range after {
		if !slices.Contains(before, a) && strings.Contains(a, marker) {
			out = append(out, a)
		}
	}
	return out
}

// newTestCgroup creates a cgroup that is deleted when t ends.
func newTestCgroup(t *testing.T, lim Limits) Cgroup {
	t.Helper()
	cg, err := New(context.Background(), uniqueName(t), lim)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := cg.Delete(ctx); err != nil {
			t.Errorf("cleanup: Delete: %v", err)
		}
	})
	return cg
}

// gated is a process started with a stdin pipe: a `read x` in its script
// holds it until the test has put it into a cgroup, so that everything it
// forks is born inside.
type gated struct {
	cmd  *exec.Cmd
	gate io.WriteCloser
	done chan error
}

func startGated(t *testing.T, script string, extra ...*os.File) *gated {
	t.Helper()
	cmd := exec.Command("/bin/sh", "-c", "read x; "+script)
	cmd.ExtraFiles = extra
	gate, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	g := &gated{cmd: cmd, gate: gate, done: make(chan error, 1)}
	go func() { g.done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-g.done
	})
	return g
}

func (g *gated) open(t *testing.T) {
	t.Helper()
	if _, err := g.gate.Write([]byte("go\n")); err != nil {
		t.Fatal(err)
	}
}

func (g *gated) wait(t *testing.T, d time.Duration) error {
	t.Helper()
	select {
	case err := <-g.done:
		g.done <- err
		return err
	case <-time.After(d):
		t.Fatalf("process %d did not exit within %v", g.cmd.Process.Pid, d)
		return nil
	}
}

func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func v1Dir(ctrl, name string) string { return filepath.Join(DefaultRoot, ctrl, name) }

func readTrim(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	return f[0] != "Z" && f[0] != "X"
}

// cpuTicks is utime+stime of pid.
func cpuTicks(t *testing.T, pid int) int {
	t.Helper()
	s := readTrim(t, "/proc/"+strconv.Itoa(pid)+"/stat")
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	u, _ := strconv.Atoi(f[11])
	k, _ := strconv.Atoi(f[12])
	return u + k
}

func TestDetectMode(t *testing.T) {
	m, err := DetectMode("")
	if err != nil {
		testutil.Skip(t, "no cgroups: "+err.Error())
	}
	if m == ModeUnknown {
		t.Fatalf("DetectMode() = %v", m)
	}
	var st syscall.Statfs_t
	if syscall.Statfs("/sys/fs/cgroup/unified", &st) == nil && st.Type == 0x63677270 && m != ModeHybrid {
		t.Errorf("DetectMode() = %v with a cgroup2 mount at /sys/fs/cgroup/unified, want hybrid", m)
	}
	t.Logf("cgroup mode: %v", m)
}

func TestLimitsValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		lim  Limits
		ok   bool
	}{
		{"zero", Limits{}, true},
		{"all", Limits{MemoryBytes: 64 << 20, Pids: 10, CPUs: 0.5}, true},
		{"negative memory", Limits{MemoryBytes: -1}, false},
		{"tiny memory", Limits{MemoryBytes: 4096}, false},
		{"negative pids", Limits{Pids: -1}, false},
		{"negative cpus", Limits{CPUs: -1}, false},
		{"tiny cpus", Limits{CPUs: 0.001}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.lim.Validate()
			if (err == nil) != tc.ok || (err != nil && !errors.Is(err, errdefs.ErrInvalidArgument)) {
				t.Errorf("Validate(%+v) = %v, want ok=%v", tc.lim, err, tc.ok)
			}
		})
	}
}

func TestNewRejects(t *testing.T) {
	requiresV1(t)
	checkLeaks(t)
	ctx := ctxT(t)
	for _, name := range []string{"", ".", "..", "a/b", "a\nb"} {
		if _, err := New(ctx, name, Limits{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("New(%q) = %v, want ErrInvalidArgument", name, err)
		}
	}
	if _, err := New(ctx, "x", Limits{}, WithParent("other")); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("New(WithParent(other)) = %v, want ErrInvalidArgument", err)
	}
	cg := newTestCgroup(t, Limits{})
	name := strings.TrimPrefix(cg.Name(), "/"+DefaultParent+"/")
	if _, err := New(ctx, name, Limits{}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("New(existing %q) = %v, want ErrAlreadyExists", name, err)
	}
	if _, err := os.Stat(v1Dir("freezer", cg.Name())); err != nil {
		t.Errorf("a failed New of an existing name removed it: %v", err)
	}
}

func TestLimitsV1(t *testing.T) {
	requiresV1(t)
	checkLeaks(t)
	cg := newTestCgroup(t, Limits{MemoryBytes: 64 << 20, Pids: 100, CPUs: 0.5})
	n := cg.Name()
	for _, tc := range []struct{ file, want string }{
		{v1Dir("memory", n) + "/memory.limit_in_bytes", strconv.Itoa(64 << 20)},
		{v1Dir("pids", n) + "/pids.max", "100"},
		{v1Dir("cpu", n) + "/cpu.cfs_period_us", "100000"},
		{v1Dir("cpu", n) + "/cpu.cfs_quota_us", "50000"},
	} {
		if got := readTrim(t, tc.file); got != tc.want {
			t.Errorf("%s = %q, want %q", tc.file, got, tc.want)
		}
	}
	if memsw := v1Dir("memory", n) + "/memory.memsw.limit_in_bytes"; exists(memsw) {
		if got := readTrim(t, memsw); got != strconv.Itoa(64<<20) {
			t.Errorf("%s = %q, want %d (no swap)", memsw, got, 64<<20)
		}
	}
	if !exists(v1Dir("freezer", n)) {
		t.Errorf("no freezer cgroup %s", v1Dir("freezer", n))
	}
}

func TestAddProcs(t *testing.T) {
	requiresV1(t)
	checkLeaks(t)
	cg := newTestCgroup(t, Limits{MemoryBytes: 256 << 20, Pids: 64, CPUs: 1})
	p := startGated(t, "exec sleep 100")
	pid := p.cmd.Process.Pid
	if err := cg.Add(pid); err != nil {
		t.Fatalf("Add(%d): %v", pid, err)
	}
	pids, err := cg.Procs()
	if err != nil || !slices.Contains(pids, pid) {
		t.Fatalf("Procs() = %v, %v, want it to contain %d", pids, err, pid)
	}
	own := readTrim(t, fmt.Sprintf("/proc/%d/cgroup", pid))
	for _, ctrl := range []string{"memory", "pids", "cpu", "freezer"} {
		if !strings.Contains(own, ":"+ctrl+":"+cg.Name()+"\n") && !strings.HasSuffix(own, ":"+ctrl+":"+cg.Name()) {
			t.Errorf("/proc/%d/cgroup lacks %s:%s:\n%s", pid, ctrl, cg.Name(), own)
		}
	}
	// (v1 does not move a process's memory charge with it, so usage may
	// read 0 here: TestOOMKill checks memory.)
	st, err := cg.Stats()
	if err != nil || st.PidsCurrent != 1 {
		t.Errorf("Stats() = %+v, %v, want 1 pid", st, err)
	}
	if err := cg.Add(1 << 30); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Add(no such pid) = %v, want ErrNotFound", err)
	}
}

func TestFreezeThaw(t *testing.T) {
	requiresV1(t)
	checkLeaks(t)
	ctx := ctxT(t)
	cg := newTestCgroup(t, Limits{})
	p := startGated(t, "while :; do :; done")
	pid := p.cmd.Process.Pid
	if err := cg.Add(pid); err != nil {
		t.Fatal(err)
	}
	p.open(t)
	start := cpuTicks(t, pid)
	waitFor(t, "the busy loop to use CPU", 10*time.Second, func() bool { return cpuTicks(t, pid) > start+2 })

	if err := cg.Freeze(ctx); err != nil {
		t.Fatalf("Freeze: %v", err)
	}
	if s := readTrim(t, v1Dir("freezer", cg.Name())+"/freezer.state"); s != "FROZEN" {
		t.Errorf("freezer.state = %q after Freeze, want FROZEN", s)
	}
	frozen := cpuTicks(t, pid)
	time.Sleep(300 * time.Millisecond)
	if got := cpuTicks(t, pid); got != frozen {
		t.Errorf("frozen process used CPU: ticks %d -> %d", frozen, got)
	}
	if err := cg.Thaw(ctx); err != nil {
		t.Fatalf("Thaw: %v", err)
	}
	waitFor(t, "the thawed loop to use CPU", 10*time.Second, func() bool { return cpuTicks(t, pid) > frozen+2 })
}

// TestKillTree kills, in an exec's child cgroup, a tree that includes a
// process that left the session (setsid) and one that double-forked, while
// the sandbox's own process survives.
func TestKillTree(t *testing.T) {
	requiresV1(t)
	checkLeaks(t)
	ctx := ctxT(t)
	cg := newTestCgroup(t, Limits{Pids: 100})
	keeper := startGated(t, "exec sleep 100")
	if err := cg.Add(keeper.cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	ex, err := cg.Child("exec-1")
	if err != nil {
		t.Fatalf("Child: %v", err)
	}
	if _, err := cg.Child("exec-1"); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("Child(existing) = %v, want ErrAlreadyExists", err)
	}
	p := startGated(t, "setsid sleep 1000 & (sleep 1001 &) ; sleep 1002 & wait")
	if err := ex.Add(p.cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	p.open(t)
	var pids []int
	// sh, the setsid sleeper, the double-forked one (its subshell exits) and
	// the plain background one.
	waitFor(t, "4 processes in the child", 10*time.Second, func() bool {
		pids, _ = ex.Procs()
		return len(pids) == 4
	})
	all, _ := cg.Procs()
	// Only the child's processes that are still there after the parent's
	// listing count: the double fork's subshell may have exited meanwhile.
	still, _ := ex.Procs()
	for _, pid := range pids {
		if slices.Contains(still, pid) && !slices.Contains(all, pid) {
			t.Errorf("parent Procs() = %v lacks child's %d", all, pid)
		}
	}
	if err := ex.Kill(ctx); err != nil {
		t.Fatalf("Kill: %v", err)
	}
	if got, err := ex.Procs(); err != nil || len(got) != 0 {
		t.Errorf("Procs() after Kill = %v, %v, want none", got, err)
	}
	for _, pid := range pids {
		waitFor(t, fmt.Sprintf("pid %d to die", pid), 5*time.Second, func() bool { return !alive(pid) })
	}
	if err := p.wait(t, 5*time.Second); err == nil {
		t.Errorf("killed shell exited cleanly")
	}
	if !alive(keeper.cmd.Process.Pid) {
		t.Errorf("Kill of the child killed the sandbox's own process")
	}
	if err := ex.Delete(ctx); err != nil {
		t.Fatalf("child Delete: %v", err)
	}
	if exists(v1Dir("freezer", ex.Name())) {
		t.Errorf("child Delete left %s", v1Dir("freezer", ex.Name()))
	}
	if err := ex.Delete(ctx); err != nil {
		t.Errorf("second Delete: %v", err)
	}
}

func TestDeleteRemovesAll(t *testing.T) {
	requiresV1(t)
	checkLeaks(t)
	ctx := ctxT(t)
	cg, err := New(ctx, uniqueName(t), Limits{MemoryBytes: 64 << 20, Pids: 10, CPUs: 1})
	if err != nil {
		t.Fatal(err)
	}
	ex, err := cg.Child("exec")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ex.Child("nested"); err != nil {
		t.Fatal(err)
	}
	p := startGated(t, "sleep 100 & wait")
	if err := ex.Add(p.cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	p.open(t)
	if err := cg.Delete(ctx); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	left, _ := filepath.Glob(filepath.Join(DefaultRoot, "*", strings.TrimPrefix(cg.Name(), "/")))
	if len(left) > 0 {
		t.Errorf("Delete left %v", left)
	}
	p.wait(t, 5*time.Second)
}

// TestDeleteThawsAChildFrozenByItself deletes a cgroup whose child a kill
// left frozen (a daemon that died between the freeze and the thaw of the
// child): its tasks must die all the same.
func TestDeleteThawsAChildFrozenByItself(t *testing.T) {
	requiresV1(t)
	checkLeaks(t)
	ctx := ctxT(t)
	cg, err := New(ctx, uniqueName(t), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	ex, err := cg.Child("session")
	if err != nil {
		t.Fatal(err)
	}
	p := startGated(t, "sleep 100")
	if err := ex.Add(p.cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	p.open(t)
	if err := ex.Freeze(ctx); err != nil {
		t.Fatal(err)
	}
	_ = p.cmd.Process.Kill() // pending while frozen
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := cg.Delete(dctx); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	p.wait(t, 5*time.Second)
}

func TestOOMKill(t *testing.T) {
	requiresV1(t)
	checkLeaks(t)
	cg := newTestCgroup(t, Limits{MemoryBytes: 64 << 20})
	// tail keeps the last "line" in memory, and /dev/zero has no newline.
	p := startGated(t, "head -c 1G /dev/zero | tail; echo survived")
	if err := cg.Add(p.cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	p.open(t)
	p.wait(t, 60*time.Second)
	st, err := cg.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.OOMKills < 1 {
		t.Errorf("Stats().OOMKills = %d after a 1 GiB hog in 64 MiB, want >= 1", st.OOMKills)
	}
	if st.MemoryUsage > 64<<20 {
		t.Errorf("Stats().MemoryUsage = %d above the 64 MiB limit", st.MemoryUsage)
	}
}

func TestPidsLimit(t *testing.T) {
	requiresV1(t)
	checkLeaks(t)
	ctx := ctxT(t)
	const max = 20
	cg := newTestCgroup(t, Limits{Pids: max})
	// A bounded fork bomb: 200 sleepers, each fork failing past the limit.
	p := startGated(t, "i=0; while [ $i -lt 200 ]; do sleep 60 & i=$((i+1)); done 2>/dev/null; sleep 60")
	if err := cg.Add(p.cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	p.open(t)
	events := v1Dir("pids", cg.Name()) + "/pids.events"
	waitFor(t, "pids.events to count refused forks", 20*time.Second, func() bool {
		n, _ := readKeyUint(events, "max")
		return n > 0
	})
	st, err := cg.Stats()
	if err != nil || st.PidsCurrent > max {
		t.Errorf("Stats() = %+v, %v, want at most %d pids", st, err, max)
	}
	if err := cg.Kill(ctx); err != nil {
		t.Fatalf("Kill: %v", err)
	}
}

// TestJoinFromUserNamespace is what the runtime relies on: a process whose
// uid is an unprivileged host uid (uid 0 of a new user namespace, mapped to
// host 100000) joins a cgroup by writing "0" to a cgroup.procs (or tasks) fd
// that host root opened and passed to it. The kernel checks the credentials
// of the open, not of the write.
func TestJoinFromUserNamespace(t *testing.T) {
	requiresV1(t)
	checkLeaks(t)
	cg := newTestCgroup(t, Limits{Pids: 50})
	ex, err := cg.Child("exec-userns")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		target Cgroup
		file   string
	}{{"sandbox-procs", cg, "cgroup.procs"}, {"child-procs", ex, "cgroup.procs"}, {"child-tasks", ex, "tasks"}} {
		target := tc.target
		t.Run(tc.name, func(t *testing.T) {
			open := target.ProcsFile
			if tc.file == "tasks" {
				open = target.TasksFile
			}
			f, err := open()
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			// Control: opening the same file by path from inside is refused.
			byPath := filepath.Join(v1Dir("freezer", target.Name()), tc.file)
			cmd := exec.Command("/bin/sh", "-c", "(echo 0 >"+byPath+") 2>/dev/null && echo OPENED-BY-PATH; echo 0 >&3 && id -u && cat /proc/self/uid_map /proc/self/cgroup")
			cmd.ExtraFiles = []*os.File{f}
			cmd.SysProcAttr = &syscall.SysProcAttr{
				Cloneflags:  syscall.CLONE_NEWUSER,
				UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 100000, Size: 65536}},
				GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: 100000, Size: 65536}},
				// Become uid 0 of the namespace, i.e. host uid 100000: without
				// it the child keeps host uid 0 (shown as 65534 inside).
				Credential: &syscall.Credential{Uid: 0, Gid: 0, NoSetGroups: true},
			}
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("join from a user namespace: %v\n%s", err, out)
			}
			if !strings.Contains(string(out), "freezer:"+target.Name()+"\n") {
				t.Fatalf("the process did not join freezer:%s:\n%s", target.Name(), out)
			}
			if strings.Contains(string(out), "OPENED-BY-PATH") {
				t.Errorf("uid 100000 could open %s by path: the test proves nothing", byPath)
			}
			if lines := strings.Fields(string(out)); len(lines) < 4 || lines[0] != "0" || lines[1] != "0" || lines[2] != "100000" {
				t.Errorf("the process was not uid 0 of a namespace mapped to host uid 100000:\n%s", out)
			}
			t.Logf("%s", out)
		})
	}
}

// TestLoadRemove is recovery's path: a daemon that restarts finds an orphan
// sandbox cgroup by name, with processes in it, and removes it.
func TestLoadRemove(t *testing.T) {
	requiresV1(t)
	checkLeaks(t)
	ctx := ctxT(t)
	name := uniqueName(t)
	if _, err := Load(name); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Load(missing) = %v, want ErrNotFound", err)
	}
	cg, err := New(ctx, name, Limits{Pids: 10})
	if err != nil {
		t.Fatal(err)
	}
	ex, err := cg.Child("exec")
	if err != nil {
		t.Fatal(err)
	}
	p := startGated(t, "sleep 100 & wait")
	if err := ex.Add(p.cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	p.open(t)
	waitFor(t, "2 processes", 10*time.Second, func() bool { pids, _ := cg.Procs(); return len(pids) == 2 })

	loaded, err := Load(name)
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	if loaded.Name() != cg.Name() {
		t.Errorf("Load(%q).Name() = %q, want %q", name, loaded.Name(), cg.Name())
	}
	if pids, _ := loaded.Procs(); len(pids) != 2 {
		t.Errorf("Load(%q).Procs() = %v, want the 2 processes", name, pids)
	}
	if err := Remove(ctx, name); err != nil {
		t.Fatalf("Remove: %v", err)
	}
	p.wait(t, 5*time.Second)
	if left, _ := filepath.Glob(filepath.Join(DefaultRoot, "*", DefaultParent, name)); len(left) > 0 {
		t.Errorf("Remove left %v", left)
	}
	if err := Remove(ctx, name); err != nil {
		t.Errorf("Remove(missing) = %v, want nil", err)
	}
}

// Regression: Procs of a sandbox cgroup failed with "no such device" when a
// child cgroup was removed while it walked the tree (a timed-out command's
// cleanup racing the sandbox's delete).
func TestProcsWhileChildrenComeAndGo(t *testing.T) {
	testutil.RequiresRoot(t)
	testutil.CheckLeaks(t)
	ctx := context.Background()
	cg, err := New(ctx, "procs-race", Limits{}, WithParent(testutil.CgroupParent()))
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Delete(ctx)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			ch, err := cg.Child("c" + strconv.Itoa(i))
			if err != nil {
				t.Error(err)
				return
			}
			_ = ch.Delete(ctx)
		}
	}()
	for i := 0; i < 2000; i++ {
		if _, err := cg.Procs(); err != nil {
			t.Fatalf("Procs while children come and go: %v", err)
		}
	}
	close(stop)
	<-done
}
