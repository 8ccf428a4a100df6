//go:build linux

package core

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/deltabox/deltabox/internal/testutil"
	"golang.org/x/sys/unix"
)

// layers builds three overlay layer directories (top first) with whiteouts,
// an opaque directory and a directory over a file.
func layers(t *testing.T) []string {
	t.Helper()
	root := t.TempDir()
	mk := func(layer, p, content string) {
		full := filepath.Join(root, layer, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		switch content {
		case "<dir>":
			if err := os.MkdirAll(full, 0o755); err != nil {
				t.Fatal(err)
			}
		case "<whiteout>":
			if err := unix.Mknod(full, unix.S_IFCHR, 0); err != nil {
				t.Fatal(err)
			}
		case "<opaque>":
			if err := os.MkdirAll(full, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := unix.Lsetxattr(full, OpaqueXattr, []byte("y"), 0); err != nil {
				t.Fatal(err)
			}
		default:
			if err := os.WriteFile(full, []byte(content), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	mk("l1", "keep", "k")
	mk("l1", "gone", "g")
	mk("l1", "d/a", "a")
	mk("l1", "d/b", "b")
	mk("l1", "o/x", "x")
	mk("l1", "f", "file then dir")
	mk("l2", "gone", "<whiteout>")
	mk("l2", "d/a", "<whiteout>")
	mk("l2", "d/c", "c")
	mk("l2", "o", "<opaque>")
	mk("l2", "o/y", "y")
	mk("l2", "image-file", "<whiteout>")
	mk("l3", "f", "<dir>")
	mk("l3", "f/inner", "i")
	mk("l3", "d/b", "b3")
	return []string{filepath.Join(root, "l3"), filepath.Join(root, "l2"), filepath.Join(root, "l1")}
}

func TestFlattenKeepsContent(t *testing.T) {
	testutil.RequiresRoot(t)
	ls := layers(t)
	flat := filepath.Join(t.TempDir(), "flat")
	if err := Flatten(ls, flat); err != nil {
		t.Fatal(err)
	}
	a, err := Merge(ls)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Merge([]string{flat})
	if err != nil {
		t.Fatal(err)
	}
	if d, err := DiffTrees(a, b); err != nil || len(d) != 0 {
		t.Errorf("DiffTrees(layers, flattened) = %v, %v; want none", d, err)
	}
	// The whiteout of an image file survives flattening.
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(flat, "image-file"), &st); err != nil || !IsWhiteout(&st) {
		t.Errorf("flattened image-file: %v, whiteout %v", err, IsWhiteout(&st))
	}
}

func TestDiffTrees(t *testing.T) {
	testutil.RequiresRoot(t)
	ls := layers(t)
	empty, err := Merge(nil)
	if err != nil {
		t.Fatal(err)
	}
	base, err := Merge(ls[2:])
	if err != nil {
		t.Fatal(err)
	}
	top, err := Merge(ls)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DiffTrees(base, top)
	if err != nil {
		t.Fatal(err)
	}
	want := []Change{
		{"/d/a", 'D'}, {"/d/b", 'M'}, {"/d/c", 'A'},
		{"/f", 'M'}, {"/f/inner", 'A'},
		{"/gone", 'D'}, {"/image-file", 'D'},
		{"/o/x", 'D'}, {"/o/y", 'A'},
	}
	if !slices.Equal(got, want) {
		t.Errorf("DiffTrees(l1, l3:l2:l1) =\n  %v\nwant\n  %v", got, want)
	}
	got, err = DiffTrees(empty, base)
	if err != nil {
		t.Fatal(err)
	}
	want = nil
	for _, p := range []string{"/d", "/d/a", "/d/b", "/f", "/gone", "/keep", "/o", "/o/x"} {
		want = append(want, Change{Path: p, Kind: 'A'})
	}
	if !slices.Equal(got, want) {
		t.Errorf("DiffTrees(empty, l1) = %v, want %v", got, want)
	}
}
