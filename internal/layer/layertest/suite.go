//go:build linux

// Package layertest is the conformance suite every layer.Store backend
// passes: isolation of commits and branches, deep chains, file types and
// attributes, whiteouts and opaque directories, removal rules, exact Diff, a
// model-based property test and a crash test. Run it from a backend's tests:
//
//	func TestConformance(t *testing.T) {
//		testutil.CheckLeaks(t)
//		layertest.Run(t, func(t *testing.T, root string) layer.Store { ... }, layertest.Features{...})
//	}
//
// Every check gets a fresh root, runs in parallel with the others, dumps its
// directory on failure, and ends with an invariant check (fsck) of the store.
package layertest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/layer/internal/core"
	"golang.org/x/sys/unix"
)

// NewStore opens a store of the backend under test in root (an empty
// directory that belongs to the check). The suite closes it.
type NewStore func(t *testing.T, root string) layer.Store

// Checker is implemented by stores that can check their own invariants
// beyond what the interface shows (e.g. no layer directory without a record).
type Checker interface {
	Check(ctx context.Context) error
}

// Features are the optional interfaces a backend implements: the suite
// checks those it has, and that it has no others (a store that lost one
// must fail, not skip).
type Features struct {
	LiveCommit bool // layer.LiveCommitter
	Prepare    bool // layer.Preparer
}

// Run runs every check of the suite against the backend newStore opens,
// which has the optional interfaces has.
func Run(t *testing.T, newStore NewStore, has Features) {
	optional := func(name string, want bool, fn func(*testing.T, layer.Store, string)) func(*testing.T, layer.Store, string) {
		return func(t *testing.T, s layer.Store, root string) {
			var got bool
			switch name {
			case "LiveCommitter":
				_, got = s.(layer.LiveCommitter)
			case "Preparer":
				_, got = s.(layer.Preparer)
			}
			if got != want {
				t.Fatalf("store is a layer.%s: %v, want %v", name, got, want)
			}
			if got {
				fn(t, s, root)
			}
		}
	}
	checks := []struct {
		name string
		fn   func(t *testing.T, s layer.Store, root string)
	}{
		{"CommitIsolation", testCommitIsolation},
		{"BranchIsolation", testBranchIsolation},
		{"ConcurrentBranches", testConcurrentBranches},
		{"DeepChain", testDeepChain},
		{"FileTypes", testFileTypes},
		{"RenameDelete", testRenameDelete},
		{"RemoveRules", testRemoveRules},
		{"InfoWalkUsage", testInfoWalkUsage},
		{"CommitLive", optional("LiveCommitter", has.LiveCommit, testCommitLive)},
		{"CommitPrepared", optional("Preparer", has.Prepare, testCommitPrepared)},
		{"Model", func(t *testing.T, s layer.Store, root string) {
			RunModel(t, s, root, ModelSeed(t), modelSteps(t, 3000))
		}},
	}
	for _, c := range checks {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			root := t.TempDir()
			s := Open(t, newStore, root)
			c.fn(t, s, root)
		})
	}
}

// Open opens a store with newStore and registers, in this order of running:
// a dump of root if t failed, the invariant check, and Close.
func Open(t *testing.T, newStore NewStore, root string) layer.Store {
	t.Helper()
	s := newStore(t, root)
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("close store: %v", err)
		}
	})
	t.Cleanup(func() {
		if err := Fsck(context.Background(), s); err != nil {
			t.Errorf("fsck: %v", err)
		}
	})
	dumpOnFailure(t, root)
	return s
}

// Fsck checks the invariants of a store's layer tree: every parent exists
// and is committed, kinds are known, no cycles, every view's directories
// exist (an active layer has an upper and a work directory, a committed one
// none), and the store's own Check when it has one.
func Fsck(ctx context.Context, s layer.Store) error {
	byID := map[string]layer.Info{}
	if err := s.Walk(ctx, func(in layer.Info) error { byID[in.ID] = in; return nil }); err != nil {
		return err
	}
	var errs []error
	for id, in := range byID {
		if in.Kind != layer.KindActive && in.Kind != layer.KindCommitted {
			errs = append(errs, fmt.Errorf("layer %q: kind %v", id, in.Kind))
		}
		if in.Parent != "" {
			if p, ok := byID[in.Parent]; !ok {
				errs = append(errs, fmt.Errorf("layer %q: parent %q missing", id, in.Parent))
			} else if p.Kind != layer.KindCommitted {
				errs = append(errs, fmt.Errorf("layer %q: parent %q is %v", id, in.Parent, p.Kind))
			}
		}
		seen := map[string]bool{}
		for p := id; p != ""; p = byID[p].Parent {
			if seen[p] {
				errs = append(errs, fmt.Errorf("layer %q: parent cycle", id))
				break
			}
			seen[p] = true
		}
		v, err := s.Mounts(ctx, id)
		if err != nil {
			errs = append(errs, fmt.Errorf("layer %q: mounts: %w", id, err))
			continue
		}
		if (in.Kind == layer.KindActive) != (v.Upper != "" && v.Work != "") {
			errs = append(errs, fmt.Errorf("layer %q (%v): view %+v", id, in.Kind, v))
		}
		for _, d := range append(slices.Clip(v.Lowers), v.Upper, v.Work) {
			if d == "" {
				continue
			}
			if fi, err := os.Stat(d); err != nil || !fi.IsDir() {
				errs = append(errs, fmt.Errorf("layer %q: %q: not a directory (%v)", id, d, err))
			}
		}
	}
	if c, ok := s.(Checker); ok {
		errs = append(errs, c.Check(ctx))
	}
	return errors.Join(errs...)
}

// Mount mounts the view of layer id at a new directory and unmounts it when
// t ends. Committed layers mount read-only.
func Mount(t testing.TB, s layer.Store, id string) string {
	t.Helper()
	v, err := s.Mounts(context.Background(), id)
	if err != nil {
		t.Fatalf("Mounts(%q): %v", id, err)
	}
	// Below t's temporary directory, where the leak checker looks.
	target := t.TempDir()
	if err := layer.MountOverlay(v, nil, target); err != nil {
		os.Remove(target)
		t.Fatalf("mount %q: %v", id, err)
	}
	t.Cleanup(func() { unmount(t, target) })
	return target
}

func unmount(t testing.TB, target string) {
	if _, err := os.Stat(target); err != nil {
		return
	}
	if err := layer.Unmount(target); err != nil && !errors.Is(err, unix.EINVAL) {
		t.Errorf("unmount: %v", err)
	}
	os.Remove(target)
}

// commit commits active and returns the committed layer, the next active
// layer and where next is mounted (mnt, remounted if the layer switched).
func commit(t testing.TB, s layer.Store, active, mnt string, opts ...layer.Opt) (c, n layer.Info, nmnt string) {
	t.Helper()
	c, n, err := s.Commit(context.Background(), active, opts...)
	if err != nil {
		t.Fatalf("Commit(%q): %v", active, err)
	}
	if c.Kind != layer.KindCommitted || n.Kind != layer.KindActive || n.Parent != c.ID {
		t.Fatalf("Commit(%q) = %+v, %+v: want committed and active child", active, c, n)
	}
	if n.ID == active || mnt == "" {
		return c, n, mnt
	}
	unmount(t, mnt)
	return c, n, Mount(t, s, n.ID)
}

func branch(t testing.TB, s layer.Store, parent string, opts ...layer.Opt) layer.Info {
	t.Helper()
	in, err := s.Branch(context.Background(), parent, opts...)
	if err != nil {
		t.Fatalf("Branch(%q): %v", parent, err)
	}
	if in.Kind != layer.KindActive || in.Parent != parent {
		t.Fatalf("Branch(%q) = %+v", parent, in)
	}
	return in
}

func write(t testing.TB, p, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func wantContent(t testing.TB, p, want string) {
	t.Helper()
	b, err := os.ReadFile(p)
	if want == "" {
		if !errors.Is(err, os.ErrNotExist) {
			t.Errorf("read %q = %q, %v: want it absent", p, b, err)
		}
		return
	}
	if err != nil || string(b) != want {
		t.Errorf("read %q = %q, %v: want %q", p, b, err, want)
	}
}

func wantDiff(t testing.TB, s layer.Store, a, b string, want []layer.Change) {
	t.Helper()
	got, err := s.Diff(context.Background(), a, b)
	if err != nil {
		t.Fatalf("Diff(%q, %q): %v", a, b, err)
	}
	sort.Slice(want, func(i, j int) bool { return want[i].Path < want[j].Path })
	if len(got) == 0 && len(want) == 0 {
		return
	}
	if !slices.Equal(got, want) {
		t.Errorf("Diff(%q, %q) =\n  %v\nwant\n  %v", a, b, got, want)
	}
}

func testCommitIsolation(t *testing.T, s layer.Store, root string) {
	a := branch(t, s, "")
	m := Mount(t, s, a.ID)
	write(t, m+"/f", "v1")
	write(t, m+"/d/g", "g1")
	c, n, m := commit(t, s, a.ID, m)
	if c.Parent != "" {
		t.Errorf("first commit's parent = %q, want none", c.Parent)
	}
	wantContent(t, m+"/f", "v1")
	write(t, m+"/f", "v2")
	write(t, m+"/h", "h2")
	if err := os.Remove(m + "/d/g"); err != nil {
		t.Fatal(err)
	}
	cm := Mount(t, s, c.ID)
	wantContent(t, cm+"/f", "v1")
	wantContent(t, cm+"/d/g", "g1")
	wantContent(t, cm+"/h", "")
	if err := os.WriteFile(cm+"/x", nil, 0o644); err == nil {
		t.Errorf("write to committed layer %q's mount succeeded", c.ID)
	}
	wantDiff(t, s, c.ID, n.ID, []layer.Change{{Path: "/d/g", Kind: layer.ChangeDelete}, {Path: "/f", Kind: layer.ChangeModify}, {Path: "/h", Kind: layer.ChangeAdd}})
	wantDiff(t, s, "", c.ID, []layer.Change{{Path: "/d", Kind: layer.ChangeAdd}, {Path: "/d/g", Kind: layer.ChangeAdd}, {Path: "/f", Kind: layer.ChangeAdd}})
	wantDiff(t, s, c.ID, c.ID, nil)
	// A second commit leaves the first alone.
	c2, _, m := commit(t, s, n.ID, m)
	write(t, m+"/f", "v3")
	cm2 := Mount(t, s, c2.ID)
	wantContent(t, cm2+"/f", "v2")
	wantContent(t, cm+"/f", "v1")
	if c2.Parent != c.ID {
		t.Errorf("second commit's parent = %q, want %q", c2.Parent, c.ID)
	}
}

func testBranchIsolation(t *testing.T, s layer.Store, root string) {
	a := branch(t, s, "")
	m := Mount(t, s, a.ID)
	write(t, m+"/shared", "base")
	c, _, _ := commit(t, s, a.ID, m)
	b1, b2 := branch(t, s, c.ID), branch(t, s, c.ID)
	m1, m2 := Mount(t, s, b1.ID), Mount(t, s, b2.ID)
	wantContent(t, m1+"/shared", "base")
	write(t, m1+"/shared", "one")
	write(t, m1+"/only1", "1")
	write(t, m2+"/only2", "2")
	if err := os.Remove(m2 + "/shared"); err != nil {
		t.Fatal(err)
	}
	wantContent(t, m1+"/shared", "one")
	wantContent(t, m1+"/only2", "")
	wantContent(t, m2+"/shared", "")
	wantContent(t, m2+"/only1", "")
	cm := Mount(t, s, c.ID)
	wantContent(t, cm+"/shared", "base")
	wantContent(t, cm+"/only1", "")
	wantDiff(t, s, b1.ID, b2.ID, []layer.Change{{Path: "/only1", Kind: layer.ChangeDelete}, {Path: "/only2", Kind: layer.ChangeAdd}, {Path: "/shared", Kind: layer.ChangeDelete}})
	// Branches of the branches stay apart too.
	c1, _, _ := commit(t, s, b1.ID, m1)
	g := branch(t, s, c1.ID)
	gm := Mount(t, s, g.ID)
	wantContent(t, gm+"/shared", "one")
	wantContent(t, gm+"/only2", "")
}

func testConcurrentBranches(t *testing.T, s layer.Store, root string) {
	ctx := context.Background()
	a := branch(t, s, "")
	m := Mount(t, s, a.ID)
	write(t, m+"/base", "base")
	c, next, _ := commit(t, s, a.ID, m)
	const n = 12
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = func() error {
				b, err := s.Branch(ctx, c.ID)
				if err != nil {
					return err
				}
				v, err := s.Mounts(ctx, b.ID)
				if err != nil {
					return err
				}
				// Writing into an unmounted upper is what a mount would do
				// for a new file.
				if err := os.WriteFile(filepath.Join(v.Upper, fmt.Sprint("own", i)), []byte(fmt.Sprint(i)), 0o644); err != nil {
					return err
				}
				bc, next, err := s.Commit(ctx, b.ID)
				if err != nil {
					return err
				}
				diff, err := s.Diff(ctx, c.ID, bc.ID)
				if err != nil {
					return err
				}
				want := []layer.Change{{Path: fmt.Sprint("/own", i), Kind: layer.ChangeAdd}}
				if !slices.Equal(diff, want) {
					return fmt.Errorf("branch %d: Diff = %v, want %v", i, diff, want)
				}
				if err := s.Remove(ctx, next.ID); err != nil {
					return err
				}
				return s.Remove(ctx, bc.ID)
			}()
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("branch %d: %v", i, err)
		}
	}
	if err := s.Walk(ctx, func(in layer.Info) error {
		if in.ID != next.ID && in.Parent == c.ID {
			return fmt.Errorf("layer %q left", in.ID)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
}

func testDeepChain(t *testing.T, s layer.Store, root string) {
	ctx := context.Background()
	const depth = 520
	a := branch(t, s, "")
	ids := []string{}
	for i := 0; i < depth; i++ {
		v, err := s.Mounts(ctx, a.ID)
		if err != nil {
			t.Fatal(err)
		}
		if i%50 == 0 || i == depth-1 { // few files: the copy backend copies them all at every commit
			if err := os.WriteFile(filepath.Join(v.Upper, fmt.Sprint("f", i)), []byte(fmt.Sprint(i)), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(v.Upper, "n"), []byte(fmt.Sprint(i)), 0o644); err != nil {
			t.Fatal(err)
		}
		c, n, err := s.Commit(ctx, a.ID)
		if err != nil {
			t.Fatalf("commit %d: %v", i, err)
		}
		if i > 0 && c.Parent != ids[len(ids)-1] {
			t.Fatalf("commit %d: parent %q, want %q", i, c.Parent, ids[len(ids)-1])
		}
		ids = append(ids, c.ID)
		a = n
	}
	check := func(id string, upto int) {
		m := Mount(t, s, id)
		defer unmount(t, m)
		wantContent(t, m+"/n", fmt.Sprint(upto))
		for i := 0; i <= upto; i += 50 {
			wantContent(t, m+fmt.Sprintf("/f%d", i), fmt.Sprint(i))
		}
		if upto == depth-1 {
			wantContent(t, m+fmt.Sprintf("/f%d", upto), fmt.Sprint(upto))
		}
		wantContent(t, m+fmt.Sprintf("/f%d", upto/50*50+50), "")
	}
	check(ids[depth-1], depth-1)
	check(a.ID, depth-1)
	check(ids[120], 120)
	b := branch(t, s, ids[depth-1])
	check(b.ID, depth-1)
	if c, ok := s.(layer.Compactor); ok {
		if err := c.Compact(ctx, ids[depth-1]); err != nil {
			t.Fatalf("Compact: %v", err)
		}
		v, err := s.Mounts(ctx, b.ID)
		if err != nil || len(v.Lowers) != 1 {
			t.Errorf("after Compact, Mounts(%q) = %d lowers, %v: want 1", b.ID, len(v.Lowers), err)
		}
		check(b.ID, depth-1)
		check(ids[depth-1], depth-1)
	}
	wantDiff(t, s, ids[depth-2], ids[depth-1], []layer.Change{{Path: fmt.Sprint("/f", depth-1), Kind: layer.ChangeAdd}, {Path: "/n", Kind: layer.ChangeModify}})
	// Unwind: leaves first.
	for _, id := range []string{b.ID, a.ID} {
		if err := s.Remove(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	for i := depth - 1; i >= depth/2; i-- {
		if err := s.Remove(ctx, ids[i]); err != nil {
			t.Fatalf("remove %d: %v", i, err)
		}
	}
	check(ids[depth/2-1], depth/2-1)
}

func testFileTypes(t *testing.T, s layer.Store, root string) {
	a := branch(t, s, "")
	m := Mount(t, s, a.ID)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	write(t, m+"/file", "content")
	must(os.Mkdir(m+"/dir", 0o755))
	write(t, m+"/dir/inner", "inner")
	must(os.Symlink("dir/inner", m+"/link"))
	must(os.Symlink("/nowhere", m+"/dangling"))
	must(os.Link(m+"/file", m+"/hard"))
	must(unix.Mkfifo(m+"/fifo", 0o640))
	must(unix.Mknod(m+"/null", unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	for name, mode := range map[string]uint32{"suid": 0o4755, "sgid": 0o2711, "sticky": 0o1777, "none": 0} {
		write(t, m+"/"+name, name)
		must(unix.Chmod(m+"/"+name, mode))
	}
	must(os.Mkdir(m+"/sgiddir", 0o755))
	must(unix.Chmod(m+"/sgiddir", 0o2775))
	must(os.Lchown(m+"/file", 1234, 5678))
	must(unix.Chmod(m+"/file", 0o4755)) // after chown, which clears setuid
	must(os.Lchown(m+"/link", 42, 43))
	must(os.Lchown(m+"/dir", 7, 8))
	must(unix.Lsetxattr(m+"/file", "user.k", []byte("v"), 0))
	must(unix.Lsetxattr(m+"/dir", "user.d", []byte("dir value"), 0))
	mt := time.Date(2001, 2, 3, 4, 5, 6, 7000, time.UTC)
	must(os.Chtimes(m+"/dir/inner", mt, mt))
	// Sparse: 256 MiB apparent, two 4 KiB extents.
	f, err := os.Create(m + "/sparse")
	must(err)
	_, err = f.WriteAt(bytes.Repeat([]byte{1}, 4096), 0)
	must(err)
	_, err = f.WriteAt(bytes.Repeat([]byte{2}, 4096), 256<<20-4096)
	must(err)
	must(f.Close())
	big := make([]byte, 8<<20)
	for i := range big {
		big[i] = byte(i * 7)
	}
	must(os.WriteFile(m+"/large", big, 0o600))
	must(os.Chtimes(m+"/sgiddir", mt, mt))
	want, err := ReadTree(m)
	must(err)

	c, n, m := commit(t, s, a.ID, m)
	b := branch(t, s, c.ID)
	for _, id := range []string{c.ID, n.ID, b.ID} {
		mm := m
		if id != n.ID {
			mm = Mount(t, s, id)
		}
		got, err := ReadTree(mm)
		must(err)
		compareTrees(t, id, got, want)
		if got["/file"].Ino != got["/hard"].Ino {
			t.Errorf("layer %q: hardlink broken: /file ino %d, /hard ino %d", id, got["/file"].Ino, got["/hard"].Ino)
		}
		var st unix.Stat_t
		if err := unix.Lstat(mm+"/sgiddir", &st); err != nil || st.Mtim.Nano() != mt.UnixNano() {
			t.Errorf("layer %q: directory mtime %v, %v: want %v", id, time.Unix(0, st.Mtim.Nano()).UTC(), err, mt)
		}
		if blk := got["/sparse"].Blocks; blk > 1024 {
			t.Errorf("layer %q: sparse file takes %d blocks", id, blk)
		}
	}
	wantDiff(t, s, c.ID, b.ID, nil)
}

func compareTrees(t testing.TB, id string, got, want map[string]Entry) {
	t.Helper()
	var bad []string
	for p, w := range want {
		g, ok := got[p]
		g.Ino, w.Ino, g.Blocks, w.Blocks = 0, 0, 0, 0
		if !ok {
			bad = append(bad, fmt.Sprintf("%s: missing, want %+v", p, w))
		} else if g != w {
			bad = append(bad, fmt.Sprintf("%s: %+v, want %+v", p, g, w))
		}
	}
	for p, g := range got {
		if _, ok := want[p]; !ok {
			bad = append(bad, fmt.Sprintf("%s: unexpected %+v", p, g))
		}
	}
	sort.Strings(bad)
	if len(bad) > 0 {
		t.Errorf("layer %q differs:\n  %s", id, strings.Join(bad, "\n  "))
	}
}

// renameAll is rename(2), falling back to copy and delete when the overlay
// refuses to rename a directory of a lower layer (EXDEV with
// redirect_dir=off), as mv does.
func renameAll(src, dst string) error {
	err := os.Rename(src, dst)
	if !errors.Is(err, unix.EXDEV) {
		return err
	}
	if err := core.CopyTree(src, dst); err != nil {
		return err
	}
	return os.RemoveAll(src)
}

func testRenameDelete(t *testing.T, s layer.Store, root string) {
	a := branch(t, s, "")
	m := Mount(t, s, a.ID)
	for _, p := range []string{"/d/a", "/d/b", "/d/sub/c", "/e/x", "/e/y/z", "/keep", "/f"} {
		write(t, m+p, p)
	}
	c1, n1, m := commit(t, s, a.ID, m)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.RemoveAll(m + "/d"))  // whiteouts
	must(os.Mkdir(m+"/d", 0o755)) // an opaque directory
	write(t, m+"/d/new", "new")
	must(renameAll(m+"/e", m+"/e2"))
	must(os.Rename(m+"/f", m+"/g"))
	write(t, m+"/keep", "changed")
	c2, n2, m := commit(t, s, n1.ID, m)
	want := map[string]string{"/d/new": "new", "/e2/x": "/e/x", "/e2/y/z": "/e/y/z", "/keep": "changed", "/g": "/f"}
	for _, id := range []string{c2.ID, n2.ID} {
		mm := m
		if id == c2.ID {
			mm = Mount(t, s, id)
		}
		got, err := ReadTree(mm)
		must(err)
		var files []string
		for p, e := range got {
			if e.Type != "dir" {
				files = append(files, p)
				b, _ := os.ReadFile(mm + p)
				if want[p] != string(b) {
					t.Errorf("layer %q: %s = %q, want %q", id, p, b, want[p])
				}
			}
		}
		if len(files) != len(want) {
			t.Errorf("layer %q: files %q, want %v", id, files, want)
		}
	}
	changes := []layer.Change{
		{Path: "/d/a", Kind: layer.ChangeDelete}, {Path: "/d/b", Kind: layer.ChangeDelete}, {Path: "/d/sub", Kind: layer.ChangeDelete},
		{Path: "/d/sub/c", Kind: layer.ChangeDelete}, {Path: "/d/new", Kind: layer.ChangeAdd},
		{Path: "/e", Kind: layer.ChangeDelete}, {Path: "/e/x", Kind: layer.ChangeDelete}, {Path: "/e/y", Kind: layer.ChangeDelete}, {Path: "/e/y/z", Kind: layer.ChangeDelete},
		{Path: "/e2", Kind: layer.ChangeAdd}, {Path: "/e2/x", Kind: layer.ChangeAdd}, {Path: "/e2/y", Kind: layer.ChangeAdd}, {Path: "/e2/y/z", Kind: layer.ChangeAdd},
		{Path: "/f", Kind: layer.ChangeDelete}, {Path: "/g", Kind: layer.ChangeAdd}, {Path: "/keep", Kind: layer.ChangeModify},
	}
	wantDiff(t, s, c1.ID, c2.ID, slices.Clone(changes))
	wantDiff(t, s, c1.ID, n2.ID, slices.Clone(changes))
	var rev []layer.Change
	for _, c := range changes {
		switch c.Kind {
		case layer.ChangeAdd:
			c.Kind = layer.ChangeDelete
		case layer.ChangeDelete:
			c.Kind = layer.ChangeAdd
		}
		rev = append(rev, c)
	}
	wantDiff(t, s, c2.ID, c1.ID, rev)
	// Deleting everything, then recreating a directory of the same name.
	must(os.RemoveAll(m + "/e2"))
	must(os.Mkdir(m+"/e2", 0o700))
	c3, _, _ := commit(t, s, n2.ID, m)
	wantDiff(t, s, c2.ID, c3.ID, []layer.Change{
		{Path: "/e2", Kind: layer.ChangeModify}, {Path: "/e2/x", Kind: layer.ChangeDelete}, {Path: "/e2/y", Kind: layer.ChangeDelete}, {Path: "/e2/y/z", Kind: layer.ChangeDelete},
	})
}

func testRemoveRules(t *testing.T, s layer.Store, root string) {
	ctx := context.Background()
	a := branch(t, s, "")
	c, n, _ := commit(t, s, a.ID, "")
	b := branch(t, s, c.ID)
	isClass := func(what string, err, class error) {
		t.Helper()
		if !errors.Is(err, class) {
			t.Errorf("%s = %v, want %v", what, err, class)
		}
	}
	isClass("Remove(parent with children)", s.Remove(ctx, c.ID), errdefs.ErrFailedPrecondition)
	_, _, err := s.Commit(ctx, c.ID)
	isClass("Commit(committed)", err, errdefs.ErrFailedPrecondition)
	_, err = s.Branch(ctx, b.ID)
	isClass("Branch(active)", err, errdefs.ErrFailedPrecondition)
	_, err = s.Stat(ctx, "no-such-layer")
	isClass("Stat(unknown)", err, errdefs.ErrNotFound)
	_, err = s.Branch(ctx, "no-such-layer")
	isClass("Branch(unknown)", err, errdefs.ErrNotFound)
	for _, bad := range []string{"", "../x", "a/b", "A B"} {
		_, err = s.Stat(ctx, bad)
		isClass(fmt.Sprintf("Stat(%q)", bad), err, errdefs.ErrInvalidArgument)
	}
	_, err = s.Mounts(ctx, "no-such-layer")
	isClass("Mounts(unknown)", err, errdefs.ErrNotFound)
	isClass("Remove(unknown)", s.Remove(ctx, "no-such-layer"), errdefs.ErrNotFound)
	for _, id := range []string{b.ID, n.ID} {
		if err := s.Remove(ctx, id); err != nil {
			t.Fatalf("Remove(%q): %v", id, err)
		}
	}
	if err := s.Remove(ctx, c.ID); err != nil {
		t.Fatalf("Remove(%q) after its children: %v", c.ID, err)
	}
	_, err = s.Stat(ctx, c.ID)
	isClass("Stat(removed)", err, errdefs.ErrNotFound)
}

func testInfoWalkUsage(t *testing.T, s layer.Store, root string) {
	ctx := context.Background()
	a := branch(t, s, "", layer.WithLabels(map[string]string{"sandbox": "s1"}))
	v, err := s.Mounts(ctx, a.ID)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(v.Upper+"/mb", make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	c, n, _ := commit(t, s, a.ID, "", layer.WithLabels(map[string]string{"checkpoint": "c1"}))
	if got, err := s.Stat(ctx, c.ID); err != nil || got.Labels["checkpoint"] != "c1" || got.Parent != "" || got.Kind != layer.KindCommitted {
		t.Errorf("Stat(%q) = %+v, %v", c.ID, got, err)
	}
	if got, err := s.Stat(ctx, n.ID); err != nil || got.Labels["sandbox"] != "s1" || got.Parent != c.ID {
		t.Errorf("Stat(%q) = %+v, %v", n.ID, got, err)
	}
	var ids []string
	if err := s.Walk(ctx, func(in layer.Info) error { ids = append(ids, in.ID); return nil }); err != nil {
		t.Fatal(err)
	}
	slices.Sort(ids)
	want := []string{c.ID, n.ID}
	slices.Sort(want)
	if !slices.Equal(ids, want) {
		t.Errorf("Walk = %q, want %q", ids, want)
	}
	u, err := s.Usage(ctx, c.ID)
	if err != nil || u.Size < 1<<20 || u.Inodes < 1 {
		t.Errorf("Usage(%q) = %+v, %v: want at least 1 MiB in 1 inode", c.ID, u, err)
	}
	v, err = s.Mounts(ctx, n.ID)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(v.Upper+"/small", []byte("12345"), 0o644); err != nil {
		t.Fatal(err)
	}
	u, err = s.Usage(ctx, n.ID)
	if err != nil || u.Size != 5 || u.Inodes != 1 {
		t.Errorf("Usage(%q) = %+v, %v: want 5 bytes in 1 inode", n.ID, u, err)
	}
}

func testCommitLive(t *testing.T, s layer.Store, root string) {
	lc := s.(layer.LiveCommitter)
	a := branch(t, s, "")
	m := Mount(t, s, a.ID)
	write(t, m+"/f", "before")
	f, err := os.OpenFile(m+"/open", os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString("one"); err != nil {
		t.Fatal(err)
	}
	// The capture hook runs once, inside the commit: a write it makes
	// (as a thawed writer would) does not reach the committed layer.
	calls := 0
	c, err := lc.CommitLive(context.Background(), a.ID, layer.WithCaptured(func() {
		calls++
		write(t, m+"/in-hook", "x")
	}))
	if err != nil {
		t.Fatal(err)
	}
	if calls != 1 {
		t.Errorf("WithCaptured hook called %d times, want 1", calls)
	}
	if _, err := f.WriteString("two"); err != nil {
		t.Fatal(err)
	}
	write(t, m+"/f", "after")
	cm := Mount(t, s, c.ID)
	wantContent(t, cm+"/f", "before")
	wantContent(t, cm+"/open", "one")
	wantContent(t, m+"/open", "onetwo")
	wantContent(t, m+"/f", "after")
	if _, err := os.Lstat(cm + "/in-hook"); err == nil {
		t.Errorf("a write made in the capture hook reached the committed layer")
	}
}

func testCommitPrepared(t *testing.T, s layer.Store, root string) {
	pr := s.(layer.Preparer)
	ctx := context.Background()
	a := branch(t, s, "")
	m := Mount(t, s, a.ID)
	write(t, m+"/f", "before")
	write(t, m+"/gone", "x")
	p, err := pr.PrepareCommit(ctx, a.ID)
	if err != nil {
		t.Fatal(err)
	}
	pm := t.TempDir()
	if err := layer.MountOverlay(p.View, nil, pm); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unmount(t, pm) })
	wantContent(t, pm+"/f", "before")
	calls := 0
	c, err := pr.CommitPrepared(ctx, p, layer.WithLabels(map[string]string{"k": "v"}), layer.WithCaptured(func() { calls++ }))
	if err != nil {
		t.Fatal(err)
	}
	if calls != 1 {
		t.Errorf("WithCaptured hook called %d times, want 1", calls)
	}
	if c.Kind != layer.KindCommitted || c.Parent != "" || c.Labels["k"] != "v" {
		t.Errorf("CommitPrepared = %+v: want a committed layer on the image, labelled", c)
	}
	if in, err := s.Stat(ctx, a.ID); err != nil || in.Kind != layer.KindActive || in.Parent != c.ID {
		t.Errorf("Stat(active) = %+v, %v: want active, child of %q", in, err, c.ID)
	}
	if v, err := s.Mounts(ctx, a.ID); err != nil || v.Upper != p.View.Upper {
		t.Errorf("Mounts(active) = %+v, %v: want the copy's view %+v", v, err, p.View)
	}
	// The writers go on in the copy; the committed layer keeps the
	// content of the instant.
	write(t, pm+"/f", "after")
	write(t, pm+"/new", "n")
	if err := os.Remove(pm + "/gone"); err != nil {
		t.Fatal(err)
	}
	cm := Mount(t, s, c.ID)
	wantContent(t, cm+"/f", "before")
	wantContent(t, cm+"/gone", "x")
	wantContent(t, cm+"/new", "")
	wantDiff(t, s, c.ID, a.ID, []layer.Change{{Path: "/f", Kind: layer.ChangeModify}, {Path: "/gone", Kind: layer.ChangeDelete}, {Path: "/new", Kind: layer.ChangeAdd}})
	// A copy serves one commit.
	if _, err := pr.CommitPrepared(ctx, p); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("CommitPrepared twice: %v, want ErrFailedPrecondition", err)
	}
	if err := pr.DiscardPrepared(ctx, p); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("DiscardPrepared of a committed copy: %v, want ErrFailedPrecondition", err)
	}
	// One never committed is discarded, and then gone.
	p2, err := pr.PrepareCommit(ctx, a.ID)
	if err != nil {
		t.Fatal(err)
	}
	if err := pr.DiscardPrepared(ctx, p2); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p2.View.Upper); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("discarded copy still there: %v", err)
	}
	if _, err := pr.CommitPrepared(ctx, p2); !errdefs.IsNotFound(err) {
		t.Errorf("CommitPrepared of a discarded copy: %v, want ErrNotFound", err)
	}
	for _, bad := range []layer.Prepared{{Active: a.ID, Dir: "../x"}, {Active: a.ID, Dir: a.ID}, {Active: "", Dir: p2.Dir}} {
		if _, err := pr.CommitPrepared(ctx, bad); !errdefs.IsInvalidArgument(err) {
			t.Errorf("CommitPrepared(%+v): %v, want ErrInvalidArgument", bad, err)
		}
	}
	if _, err := pr.PrepareCommit(ctx, c.ID); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("PrepareCommit of a committed layer: %v, want ErrFailedPrecondition", err)
	}
}
