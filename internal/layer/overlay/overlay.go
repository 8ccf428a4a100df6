//go:build linux

// Package overlay is the layer store built on overlay stacking: Commit is the
// layer switch (the active upper becomes a committed lower as it is and a
// fresh upper goes on top), Branch is a fresh upper over the committed chain.
// Past a configurable depth, a background worker compacts a chain into one
// directory without blocking commits. When the store sits on btrfs, every
// layer directory is its own subvolume, so that a live upper can also be
// snapshotted read-only (layer.LiveCommitter).
package overlay

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/layer/internal/btrfsutil"
	"github.com/deltabox/deltabox/internal/layer/internal/core"
)

// DefaultMaxDepth is the chain depth past which layers are compacted.
const DefaultMaxDepth = 64

type config struct{ maxDepth int }

// Opt sets an option of New.
type Opt func(*config) error

// WithMaxDepth sets the chain depth past which the store compacts a chain in
// the background (0 turns background compaction off; Mounts still compacts a
// chain too deep for the kernel).
func WithMaxDepth(n int) Opt {
	return func(c *config) error {
		if n < 0 || n > core.HardDepth {
			return fmt.Errorf("max depth %d out of range", n)
		}
		c.maxDepth = n
		return nil
	}
}

type store struct{ *core.Store }

// liveStore is the store on btrfs, where layers are subvolumes.
type liveStore struct{ store }

var (
	_ layer.Store         = (*store)(nil)
	_ layer.Compactor     = (*store)(nil)
	_ layer.LiveCommitter = (*liveStore)(nil)
)

// New opens the overlay layer store in root.
func New(root string, opts ...Opt) (layer.Store, error) {
	cfg := config{maxDepth: DefaultMaxDepth}
	for _, o := range opts {
		if err := o(&cfg); err != nil {
			return nil, err
		}
	}
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, fmt.Errorf("open overlay layer store %q: %w", root, err)
	}
	onBtrfs := btrfsutil.IsBtrfs(root)
	b := core.Backend{
		MaxDepth: cfg.maxDepth,
		Make: func(dir string) error {
			var err error
			if onBtrfs {
				err = btrfsutil.CreateSubvolume(dir)
			} else {
				err = os.Mkdir(dir, 0o755)
			}
			if err != nil {
				return err
			}
			for _, p := range []string{"upper", "work"} {
				if err := os.Mkdir(filepath.Join(dir, p), 0o755); err != nil {
					return err
				}
			}
			return nil
		},
		Snapshot: func(src, dst string, readonly bool) error {
			if !onBtrfs {
				return fmt.Errorf("snapshot %q: store not on btrfs", src)
			}
			return btrfsutil.Snapshot(src, dst, readonly)
		},
		Destroy: func(dir string) error {
			if onBtrfs && btrfsutil.IsSubvolume(dir) {
				return btrfsutil.DestroySubvolume(dir)
			}
			return os.RemoveAll(dir)
		},
	}
	s, err := core.Open(root, filepath.Join(root, "layers"), b)
	if err != nil {
		return nil, err
	}
	if onBtrfs {
		return &liveStore{store{s}}, nil
	}
	return &store{s}, nil
}

// CommitLive implements layer.LiveCommitter: a read-only snapshot of the
// active layer's subvolume while it stays mounted.
func (s *liveStore) CommitLive(ctx context.Context, active string, opts ...layer.Opt) (layer.Info, error) {
	return s.Store.LiveCommit(ctx, active, opts...)
}

// Compact implements layer.Compactor: it merges the chain of committed
// layer id into one directory (what the background worker does past the
// maximum depth).
func (s *store) Compact(ctx context.Context, id string) error {
	return s.Store.CompactChain(ctx, id)
}
