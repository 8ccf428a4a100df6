//go:build linux

// Package btrfs is the layer store on btrfs subvolumes: an active layer is a
// writable subvolume holding upper/ and work/, Commit is a read-only snapshot
// of it (the committed layer holds the whole delta, so a chain is one layer
// deep and the active mount stays live), Branch is a writable snapshot. All
// through the btrfs ioctls. When the state directory is not on btrfs, the
// store keeps its layers in a sparse btrfs image file it loop-mounts.
package btrfs

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/layer/internal/btrfsutil"
	"github.com/deltabox/deltabox/internal/layer/internal/core"
)

// DefaultImageSize is the apparent size of the sparse image file made when
// the state directory is not on btrfs.
const DefaultImageSize = 64 << 30

type config struct{ imageSize int64 }

// Opt sets an option of New.
type Opt func(*config) error

// WithImageSize sets the size of the sparse image (when one is needed).
func WithImageSize(n int64) Opt {
	return func(c *config) error { c.imageSize = n; return nil }
}

type store struct{ *core.Store }

var (
	_ layer.Store         = (*store)(nil)
	_ layer.LiveCommitter = (*store)(nil)
	_ layer.Preparer      = (*store)(nil)
)

// New opens the btrfs layer store in root.
func New(root string, opts ...Opt) (layer.Store, error) {
	cfg := config{imageSize: DefaultImageSize}
	for _, o := range opts {
		if err := o(&cfg); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, fmt.Errorf("open btrfs layer store %q: %w", root, err)
	}
	data := filepath.Join(root, "layers")
	var img *btrfsutil.Image
	if !btrfsutil.IsBtrfs(root) {
		var err error
		img, err = btrfsutil.OpenImage(filepath.Join(root, "btrfs.img"), filepath.Join(root, "mnt"), cfg.imageSize)
		if err != nil {
			return nil, fmt.Errorf("open btrfs layer store %q: %w", root, err)
		}
		data = filepath.Join(root, "mnt", "layers")
	}
	b := core.Backend{
		Flat:     true,
		Make:     makeLayer,
		Snapshot: snapshot,
		Destroy:  destroy,
	}
	if img != nil {
		b.Close = img.Close
	}
	s, err := core.Open(root, data, b)
	if err != nil {
		if img != nil {
			_ = img.Close()
		}
		return nil, err
	}
	return &store{s}, nil
}

// CommitLive implements layer.LiveCommitter. Commit is already live here;
// CommitLive differs in leaving the active layer's parent as it is.
func (s *store) CommitLive(ctx context.Context, active string, opts ...layer.Opt) (layer.Info, error) {
	return s.Store.LiveCommit(ctx, active, opts...)
}

// PrepareCommit, CommitPrepared and DiscardPrepared implement
// layer.Preparer: the copy is a writable snapshot, the commit a switch.
func (s *store) PrepareCommit(ctx context.Context, active string) (layer.Prepared, error) {
	return s.Store.PrepareFlat(ctx, active)
}

func (s *store) CommitPrepared(ctx context.Context, p layer.Prepared, opts ...layer.Opt) (layer.Info, error) {
	return s.Store.CommitFlat(ctx, p, opts...)
}

func (s *store) DiscardPrepared(ctx context.Context, p layer.Prepared) error {
	return s.Store.DiscardFlat(ctx, p)
}

func makeLayer(dir string) error {
	if err := btrfsutil.CreateSubvolume(dir); err != nil {
		return err
	}
	return mkParts(dir, "upper", "work")
}

func mkParts(dir string, parts ...string) error {
	for _, p := range parts {
		if err := os.Mkdir(filepath.Join(dir, p), 0o755); err != nil {
			return err
		}
	}
	return nil
}

func snapshot(src, dst string, readonly bool) error {
	if err := btrfsutil.Snapshot(src, dst, readonly); err != nil {
		return err
	}
	if readonly {
		return nil
	}
	// A fresh work directory: the source's may hold overlay's leftovers.
	if err := os.RemoveAll(filepath.Join(dst, "work")); err != nil {
		return err
	}
	return mkParts(dst, "work")
}

func destroy(dir string) error {
	if btrfsutil.IsSubvolume(dir) {
		return btrfsutil.DestroySubvolume(dir)
	}
	return os.RemoveAll(dir)
}
