//go:build linux

package probe

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/testutil"
)

func TestDefaultKind(t *testing.T) {
	if k := DefaultKind(t.TempDir()); !slices.Contains(Kinds(), k) {
		t.Errorf("DefaultKind = %q, want one of %q", k, Kinds())
	}
}

func TestOpen(t *testing.T) {
	testutil.CheckLeaks(t)
	ctx := context.Background()
	if _, err := Open(ctx, "zfs", t.TempDir()); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf(`Open("zfs") = %v, want %v`, err, errdefs.ErrInvalidArgument)
	}
	s, err := Open(ctx, Copy, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	in, err := s.Branch(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Remove(ctx, in.ID); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
}
