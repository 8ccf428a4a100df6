//go:build linux

package cgroup

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/deltabox/deltabox/errdefs"
)

// This machine has no v2 controllers, so the v2 logic runs against a fake
// cgroupfs: a plain directory tree whose mkdir populates the interface
// files, whose rmdir refuses populated or non-leaf cgroups like the kernel,
// and a "kernel" goroutine that answers cgroup.freeze and cgroup.kill.

func withOps(ops fsOps) Opt { return func(c *config) error { c.ops = ops; return nil } }

var fakeFiles = map[string]string{
	"cgroup.procs":           "",
	"cgroup.events":          "populated 0\nfrozen 0\n",
	"cgroup.freeze":          "0",
	"cgroup.kill":            "",
	"cgroup.controllers":     "cpu memory pids",
	"cgroup.subtree_control": "",
	"memory.max":             "max",
	"memory.swap.max":        "max",
	"memory.current":         "0",
	"memory.events":          "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n",
	"pids.max":               "max",
	"pids.current":           "0",
	"cpu.max":                "max 100000",
}

type fakeFS struct {
	root string
	stop chan struct{}
	wg   sync.WaitGroup
}

func newFakeFS(t *testing.T, controllers string) *fakeFS {
	return newFakeFSKernel(t, controllers, true)
}

func newFakeFSKernel(t *testing.T, controllers string, kernel bool) *fakeFS {
	f := &fakeFS{root: t.TempDir(), stop: make(chan struct{})}
	if err := f.populate(f.root); err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(f.root, "cgroup.controllers"), controllers)
	if kernel {
		f.wg.Add(1)
		go f.kernel()
	}
	t.Cleanup(func() { close(f.stop); f.wg.Wait() })
	return f
}

func (f *fakeFS) populate(dir string) error {
	for name, content := range fakeFiles {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func (f *fakeFS) ops() fsOps {
	return fsOps{
		mkdir: func(p string) error {
			if err := os.Mkdir(p, 0o755); err != nil {
				return err
			}
			return f.populate(p)
		},
		rmdir: func(p string) error {
			ents, err := os.ReadDir(p)
			if err != nil {
				return err
			}
			for _, e := range ents {
				if e.IsDir() {
					return &fs.PathError{Op: "rmdir", Path: p, Err: syscall.ENOTEMPTY}
				}
			}
			if b, _ := os.ReadFile(filepath.Join(p, "cgroup.procs")); len(strings.TrimSpace(string(b))) > 0 {
				return &fs.PathError{Op: "rmdir", Path: p, Err: syscall.EBUSY}
			}
			return os.RemoveAll(p)
		},
	}
}

// kernel plays the kernel's part: cgroup.freeze → cgroup.events frozen (also
// inherited from frozen ancestors), cgroup.kill → empty cgroup.procs below.
func (f *fakeFS) kernel() {
	defer f.wg.Done()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-f.stop:
			return
		case <-tick.C:
		}
		var killed []string
		_ = filepath.WalkDir(f.root, func(p string, d fs.DirEntry, err error) error {
			if err != nil || !d.IsDir() {
				return nil
			}
			if b, _ := os.ReadFile(filepath.Join(p, "cgroup.kill")); strings.TrimSpace(string(b)) == "1" {
				killed = append(killed, p)
				_ = overwrite(filepath.Join(p, "cgroup.kill"), "")
			}
			for _, k := range killed {
				if p == k || strings.HasPrefix(p, k+"/") {
					_ = overwrite(filepath.Join(p, "cgroup.procs"), "")
				}
			}
			frozen := "0"
			for q := p; strings.HasPrefix(q, f.root); q = filepath.Dir(q) {
				if b, _ := os.ReadFile(filepath.Join(q, "cgroup.freeze")); strings.TrimSpace(string(b)) == "1" {
					frozen = "1"
				}
			}
			_ = overwrite(filepath.Join(p, "cgroup.events"), "populated 0\nfrozen "+frozen+"\n")
			return nil
		})
	}
}

// overwrite writes an existing file only: the fake kernel must not recreate
// the files of a cgroup being removed.
func overwrite(p, s string) error {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(s)
	f.Close()
	return err
}

func write(t *testing.T, p, s string) {
	t.Helper()
	if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

func newFakeV2(t *testing.T, f *fakeFS, name string, lim Limits) (Cgroup, error) {
	return New(context.Background(), name, lim, WithRoot(f.root), WithMode(ModeUnified), withOps(f.ops()))
}

func TestV2Fake(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	f := newFakeFS(t, "cpuset cpu io memory hugetlb pids")
	cg, err := newFakeV2(t, f, "sb", Limits{MemoryBytes: 64 << 20, Pids: 100, CPUs: 1.5})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	dir := filepath.Join(f.root, "deltabox", "sb")
	if cg.Name() != "/deltabox/sb" {
		t.Errorf("Name() = %q", cg.Name())
	}
	for _, tc := range []struct{ file, want string }{
		{filepath.Join(f.root, "cgroup.subtree_control"), "+cpu +memory +pids"},
		{filepath.Join(f.root, "deltabox", "cgroup.subtree_control"), "+cpu +memory +pids"},
		{filepath.Join(dir, "memory.max"), "67108864"},
		{filepath.Join(dir, "memory.swap.max"), "0"},
		{filepath.Join(dir, "pids.max"), "100"},
		{filepath.Join(dir, "cpu.max"), "150000 100000"},
	} {
		if got, _ := readString(tc.file); got != tc.want {
			t.Errorf("%s = %q, want %q", tc.file, got, tc.want)
		}
	}
	if _, err := newFakeV2(t, f, "sb", Limits{}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("New(existing) = %v, want ErrAlreadyExists", err)
	}

	// Add and Procs, with a child.
	if err := cg.Add(123); err != nil {
		t.Fatalf("Add: %v", err)
	}
	ex, err := cg.Child("exec")
	if err != nil {
		t.Fatalf("Child: %v", err)
	}
	if ex.Name() != "/deltabox/sb/exec" {
		t.Errorf("child Name() = %q", ex.Name())
	}
	if got, _ := readString(filepath.Join(dir, "exec", "cgroup.subtree_control")); got != "" {
		t.Errorf("child enables controllers %q: the sandbox could no longer hold processes", got)
	}
	if err := ex.Add(456); err != nil {
		t.Fatal(err)
	}
	if pids, err := cg.Procs(); err != nil || !slices.Equal(pids, []int{123, 456}) {
		t.Errorf("Procs() = %v, %v, want [123 456]", pids, err)
	}
	pf, err := ex.ProcsFile()
	if err != nil {
		t.Fatal(err)
	}
	pf.Close()
	if ex.Version() != 2 {
		t.Errorf("Version() = %d, want 2", ex.Version())
	}
	// TasksFile on v2 is the directory, for CLONE_INTO_CGROUP.
	df, err := ex.TasksFile()
	if err != nil {
		t.Fatal(err)
	}
	if st, err := df.Stat(); err != nil || !st.IsDir() || df.Name() != filepath.Join(dir, "exec") {
		t.Errorf("TasksFile() = %s (%v), want the directory %s", df.Name(), err, filepath.Join(dir, "exec"))
	}
	df.Close()

	// Freeze waits for the kernel to report frozen; Thaw for thawed.
	if err := cg.Freeze(ctx); err != nil {
		t.Fatalf("Freeze: %v", err)
	}
	waitFor(t, "the child to read frozen", 5*time.Second, func() bool {
		v, _ := readKey(filepath.Join(dir, "exec", "cgroup.events"), "frozen")
		return v == "1"
	})
	if err := cg.Thaw(ctx); err != nil {
		t.Fatalf("Thaw: %v", err)
	}

	// Stats.
	write(t, filepath.Join(dir, "memory.current"), "4096\n")
	write(t, filepath.Join(dir, "pids.current"), "2\n")
	write(t, filepath.Join(dir, "memory.events"), "low 0\nhigh 0\nmax 7\noom 3\noom_kill 2\n")
	if st, err := cg.Stats(); err != nil || st != (Stats{MemoryUsage: 4096, PidsCurrent: 2, OOMKills: 2}) {
		t.Errorf("Stats() = %+v, %v", st, err)
	}

	// Kill of the child leaves the sandbox's own process.
	if err := ex.Kill(ctx); err != nil {
		t.Fatalf("child Kill: %v", err)
	}
	if pids, _ := cg.Procs(); !slices.Equal(pids, []int{123}) {
		t.Errorf("Procs() after child Kill = %v, want [123]", pids)
	}

	// Delete kills and removes leaf first, then the empty parent.
	if err := cg.Delete(ctx); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if _, err := os.Stat(filepath.Join(f.root, "deltabox")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Delete left the parent: %v", err)
	}
	if err := cg.Delete(ctx); err != nil {
		t.Errorf("second Delete: %v", err)
	}
}

func TestV2FakeFreezeTimeoutThaws(t *testing.T) {
	t.Parallel()
	f := newFakeFSKernel(t, "cpu memory pids", false) // no kernel: never reports frozen
	cg, err := newFakeV2(t, f, "sb", Limits{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := cg.Freeze(ctx); !errors.Is(err, errdefs.ErrDeadlineExceeded) {
		t.Errorf("Freeze(never frozen) = %v, want ErrDeadlineExceeded", err)
	}
	if v, _ := readString(filepath.Join(f.root, "deltabox", "sb", "cgroup.freeze")); v != "0" {
		t.Errorf("cgroup.freeze = %q after a failed Freeze, want 0 (never left frozen)", v)
	}
}

func TestV2FakeMissingController(t *testing.T) {
	t.Parallel()
	f := newFakeFS(t, "cpu pids")
	if _, err := newFakeV2(t, f, "sb", Limits{MemoryBytes: 64 << 20}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("New(memory limit, no memory controller) = %v, want ErrUnavailable", err)
	}
	if _, err := os.Stat(filepath.Join(f.root, "deltabox", "sb")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a failed New left its cgroup: %v", err)
	}
	// Without a memory limit it works, and Stats reads absent files as 0.
	cg, err := newFakeV2(t, f, "sb", Limits{Pids: 5})
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := readString(filepath.Join(f.root, "cgroup.subtree_control")); got != "+cpu +pids" {
		t.Errorf("root subtree_control = %q, want +cpu +pids", got)
	}
	// Recovery: Load by name, Remove, Remove again.
	opts := []Opt{WithRoot(f.root), WithMode(ModeUnified), withOps(f.ops())}
	if loaded, err := Load("sb", opts...); err != nil || loaded.Name() != cg.Name() {
		t.Errorf("Load(sb) = %v, %v", loaded, err)
	}
	if err := Remove(context.Background(), "sb", opts...); err != nil {
		t.Fatal(err)
	}
	if _, err := Load("sb", opts...); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Load(removed) = %v, want ErrNotFound", err)
	}
	if err := Remove(context.Background(), "sb", opts...); err != nil {
		t.Errorf("Remove(missing) = %v", err)
	}
}

func TestV2FakeKillFallback(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	f := newFakeFS(t, "cpu memory pids")
	cg, err := newFakeV2(t, f, "sb", Limits{})
	if err != nil {
		t.Fatal(err)
	}
	// Without cgroup.kill (Linux < 5.14), Kill freezes, SIGKILLs and thaws.
	// The pid is one that does not exist; the fake kernel "reaps" it once
	// thawed, as the real one would once it has died.
	dir := filepath.Join(f.root, "deltabox", "sb")
	if err := os.Remove(filepath.Join(dir, "cgroup.kill")); err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(dir, "cgroup.procs"), "1073741824\n")
	done := make(chan error, 1)
	go func() { done <- cg.Kill(ctx) }()
	// Wait for the freeze-kill-thaw round, then play the reaper.
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if v, _ := readString(filepath.Join(dir, "cgroup.freeze")); v == "0" {
			if ev, _ := readKey(filepath.Join(dir, "cgroup.events"), "frozen"); ev == "0" {
				break
			}
		}
		time.Sleep(time.Millisecond)
	}
	write(t, filepath.Join(dir, "cgroup.procs"), "")
	if err := <-done; err != nil {
		t.Fatalf("Kill: %v", err)
	}
	if err := cg.Delete(ctx); err != nil {
		t.Fatal(err)
	}
}
