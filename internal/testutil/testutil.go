//go:build linux

// Package testutil holds the gates and checks every DeltaBox test shares:
// root and kernel-feature gates that skip only when a feature is truly absent
// (and fail instead when DELTABOX_REQUIRE_ALL is set), and a leak checker that
// fails a test which leaves a mount, loop device, cgroup or process behind.
package testutil

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deltabox/deltabox/internal/procfs"
	"golang.org/x/sys/unix"
)

// RequireAllEnv, when set to 1, turns every skip of a gate into a failure: CI
// sets it so that privileged tests run rather than skip.
const RequireAllEnv = "DELTABOX_REQUIRE_ALL"

// Skip skips t with reason, or fails it when RequireAllEnv is set.
func Skip(t testing.TB, reason string) {
	t.Helper()
	if os.Getenv(RequireAllEnv) == "1" {
		t.Fatalf("%s is set but this test cannot run: %s", RequireAllEnv, reason)
	}
	t.Skip(reason)
}

// RequiresRoot gates a test on running as root.
func RequiresRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		Skip(t, "requires root")
	}
}

// RequiresBinary gates a test on a program being on PATH.
func RequiresBinary(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		Skip(t, "requires "+name+" on PATH")
	}
	return p
}

// RequiresFilesystem gates a test on the kernel supporting a filesystem type
// (as listed in /proc/filesystems).
func RequiresFilesystem(t testing.TB, fstype string) {
	t.Helper()
	b, err := os.ReadFile("/proc/filesystems")
	if err != nil {
		Skip(t, "cannot read /proc/filesystems: "+err.Error())
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 0 && f[len(f)-1] == fstype {
			return
		}
	}
	// btrfs and others may be modules loaded on first mount: try modprobe.
	if exec.Command("modprobe", fstype).Run() == nil {
		return
	}
	Skip(t, "kernel lacks filesystem "+fstype)
}

// RequiresBtrfs gates a test on btrfs being usable (kernel support and
// mkfs.btrfs).
func RequiresBtrfs(t testing.TB) {
	t.Helper()
	RequiresRoot(t)
	RequiresFilesystem(t, "btrfs")
	RequiresBinary(t, "mkfs.btrfs")
}

// Snapshot is what of the machine's state a test must leave as it found it.
type Snapshot struct {
	Mounts   []string // mount points
	Loops    []string // loop devices with their backing file
	Cgroups  []string // cgroup directories below this test process's cgroup parent
	Children []string // live descendants of this process (pid:comm)
}

// Take records the current state.
func Take() Snapshot {
	return Snapshot{
		Mounts:   mountPoints(),
		Loops:    loopDevices(),
		Cgroups:  deltaboxCgroups(CgroupParent()),
		Children: descendants(os.Getpid()),
	}
}

// CgroupParent is the cgroup parent directory this test process gives every
// sandbox it creates: its own, so that the leak check of one test binary
// never sees the cgroups of another running at the same time.
func CgroupParent() string { return CgroupPrefix + "-test-" + strconv.Itoa(os.Getpid()) }

// RemoveCgroupParent removes this process's cgroup parent directories (empty
// by then, or the leak check has failed); TestMain calls it after m.Run.
func RemoveCgroupParent() {
	dirs, _ := filepath.Glob("/sys/fs/cgroup/*/" + CgroupParent())
	unified, _ := filepath.Glob("/sys/fs/cgroup/" + CgroupParent())
	for _, d := range append(dirs, unified...) {
		_ = os.Remove(d)
	}
}

// CheckLeaks records the state now and, when t ends, fails t if something
// appeared that is still there: a mount or a loop device below the test's
// temporary directories (or below a path given to WatchPath), a cgroup below
// CgroupParent, or a descendant process. Mounts are attributed by place so
// that tests of other packages running at the same time on the machine never
// count. Register it first in a test so that its cleanup runs last.
// Processes get a grace period to be reaped.
func CheckLeaks(t testing.TB) {
	t.Helper()
	before := Take()
	// t.TempDir's parent is unique to this test: every temp dir it makes is
	// below it.
	watched := []string{filepath.Dir(t.TempDir())}
	t.Cleanup(func() {
		under := func(list []string) []string {
			var out []string
			for _, m := range list {
				for _, w := range watched {
					if strings.HasPrefix(m, w+"/") || m == w || strings.Contains(m, ":"+w+"/") {
						out = append(out, m)
						break
					}
				}
			}
			return out
		}
		// The kernel finishes some releases after the call that asks for
		// them returns (a loop device detaches when the last reference to
		// its filesystem goes, which namespace teardown drops late; a killed
		// process is reaped): give them a grace period. It costs nothing
		// when nothing leaks.
		var after Snapshot
		deadline := time.Now().Add(20 * time.Second)
		for {
			after = Take()
			clean := len(diff(before.Children, after.Children)) == 0 &&
				len(diff(before.Mounts, under(after.Mounts))) == 0 &&
				len(diff(before.Loops, under(after.Loops))) == 0 &&
				len(diff(before.Cgroups, after.Cgroups)) == 0
			if clean || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		report := func(what string, b, a []string) {
			if d := diff(b, a); len(d) > 0 {
				t.Errorf("leaked %s: %s", what, strings.Join(d, ", "))
			}
		}
		report("mounts", before.Mounts, under(after.Mounts))
		report("loop devices", before.Loops, under(after.Loops))
		report("cgroups", before.Cgroups, after.Cgroups)
		report("processes", before.Children, after.Children)
	})
}

func diff(before, after []string) []string {
	var out []string
	for _, a := range after {
		if !slices.Contains(before, a) {
			out = append(out, a)
		}
	}
	return out
}

func mountPoints() []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 64<<10), 1<<20)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) > 4 {
			out = append(out, fields[4])
		}
	}
	return out
}

func loopDevices() []string {
	var out []string
	matches, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, m := range matches {
		b, err := os.ReadFile(m)
		if err != nil {
			continue
		}
		out = append(out, filepath.Base(filepath.Dir(filepath.Dir(m)))+":"+strings.TrimSpace(string(b)))
	}
	return out
}

// CgroupPrefix is the name prefix of every cgroup parent DeltaBox creates,
// in any hierarchy.
const CgroupPrefix = "deltabox"

// deltaboxCgroups lists the cgroups below parent in every hierarchy (the
// parent itself excluded).
func deltaboxCgroups(parent string) []string {
	var out []string
	roots, _ := filepath.Glob("/sys/fs/cgroup/*/" + parent)
	unified, _ := filepath.Glob("/sys/fs/cgroup/" + parent)
	roots = append(roots, unified...)
	for _, r := range roots {
		_ = filepath.WalkDir(r, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() && p != r {
				out = append(out, p)
			}
			return nil
		})
	}
	return out
}

// descendants lists the live (non-zombie) descendants of pid as "pid:comm".
func descendants(pid int) []string {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	children := map[int][]int{}
	comm := map[int]string{}
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 || i+2 >= len(s) {
			continue
		}
		f := strings.Fields(s[i+2:])
		if len(f) < 2 || f[0] == "Z" || f[0] == "X" {
			continue
		}
		pp, _ := strconv.Atoi(f[1])
		children[pp] = append(children[pp], p)
		comm[p] = s[strings.IndexByte(s, '(')+1 : i]
	}
	var out []string
	var walk func(int)
	walk = func(p int) {
		for _, c := range children[p] {
			out = append(out, strconv.Itoa(c)+":"+comm[c])
			walk(c)
		}
	}
	walk(pid)
	return out
}

// KernelAtLeast reports whether the running kernel is at least major.minor.
func KernelAtLeast(major, minor int) bool {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return false
	}
	rel := unix.ByteSliceToString(u.Release[:])
	parts := strings.SplitN(rel, ".", 3)
	if len(parts) < 2 {
		return false
	}
	ma, _ := strconv.Atoi(parts[0])
	mi, _ := strconv.Atoi(strings.TrimFunc(parts[1], func(r rune) bool { return r < '0' || r > '9' }))
	return ma > major || (ma == major && mi >= minor)
}

// CgroupProcs lists the processes of the cgroup name under this test
// process's cgroup parent (its freezer hierarchy on v1, the unified one on
// v2).
func CgroupProcs(name string) ([]int, error) {
	paths := []string{
		filepath.Join("/sys/fs/cgroup/freezer", CgroupParent(), name, "cgroup.procs"),
		filepath.Join("/sys/fs/cgroup", CgroupParent(), name, "cgroup.procs"),
	}
	var lastErr error
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			lastErr = err
			continue
		}
		var out []int
		for _, f := range strings.Fields(string(b)) {
			if n, err := strconv.Atoi(f); err == nil {
				out = append(out, n)
			}
		}
		return out, nil
	}
	return nil, lastErr
}

// ProcState is the state letter of a process ("S", "T", …), "" if it is
// gone.
func ProcState(pid int) string { return procfs.State(pid) }
