//go:build linux

package core

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/deltabox/deltabox/internal/layer"
)

// flatCopies is a flat backend whose snapshots are plain copies: enough to
// drive the store's bookkeeping without btrfs.
func flatCopies() Backend {
	mk := func(dir string) error {
		for _, p := range []string{"upper", "work"} {
			if err := os.MkdirAll(filepath.Join(dir, p), 0o755); err != nil {
				return err
			}
		}
		return nil
	}
	return Backend{
		Flat: true,
		Make: mk,
		Snapshot: func(src, dst string, readonly bool) error {
			return exec.Command("cp", "-a", src, dst).Run()
		},
		Destroy: os.RemoveAll,
	}
}

// TestCommitFlatKeepsRecordsItCouldNotWrite fails the record write of a
// prepared commit (its writers are on the copy by then): the records are in
// effect all the same, and reach the disk with the next save.
func TestCommitFlatKeepsRecordsItCouldNotWrite(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	s, err := Open(root, filepath.Join(root, "data"), flatCopies())
	if err != nil {
		t.Fatal(err)
	}
	a, err := s.Branch(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	p, err := s.PrepareFlat(ctx, a.ID)
	if err != nil {
		t.Fatal(err)
	}
	// A database that refuses every write, for this commit only.
	db := s.db
	closed, err := bolt.Open(filepath.Join(root, "closed.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	s.db = closed
	captured := false
	c, err := s.CommitFlat(ctx, p, layer.WithCaptured(func() { captured = true }))
	s.db = db
	if err == nil || !captured {
		t.Fatalf("CommitFlat with a failing write: %v (captured %v), want an error after the capture", err, captured)
	}
	if v, err := s.Mounts(ctx, a.ID); err != nil || v.Upper != p.View.Upper {
		t.Fatalf("the active layer's view after the failed write: %+v, %v: want the copy's", v, err)
	}
	if in, err := s.Stat(ctx, a.ID); err != nil || in.Parent != c.ID {
		t.Fatalf("the active layer after the failed write: %+v, %v: want a child of %s", in, err, c.ID)
	}
	// The next save writes them: a store opened again finds them.
	if _, err := s.Branch(ctx, ""); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s, err = Open(root, filepath.Join(root, "data"), flatCopies())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if v, err := s.Mounts(ctx, a.ID); err != nil || v.Upper != p.View.Upper {
		t.Errorf("the active layer's view once reopened: %+v, %v: want the copy's", v, err)
	}
	if _, err := os.Stat(p.View.Upper); err != nil {
		t.Errorf("the copy is gone once reopened: %v", err)
	}
	if err := s.Check(ctx); err != nil {
		t.Error(err)
	}
}
