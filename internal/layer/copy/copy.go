//go:build linux

// Package copy is the portable reference layer store: Commit and Branch copy
// the layer's upper directory, with FICLONE reflinks where the filesystem
// allows and a full copy otherwise. It is slow by design and is the
// "copytree" baseline of the benchmarks.
package copy

import (
	"os"
	"path/filepath"

	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/layer/internal/core"
)

type store struct{ *core.Store }

var _ layer.Store = (*store)(nil)

// New opens the copy layer store in root.
func New(root string) (layer.Store, error) {
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, err
	}
	s, err := core.Open(root, filepath.Join(root, "layers"), core.Backend{
		Flat: true,
		Make: func(dir string) error {
			if err := os.Mkdir(dir, 0o755); err != nil {
				return err
			}
			return mkParts(dir, "upper", "work")
		},
		Snapshot: func(src, dst string, readonly bool) error {
			if err := os.Mkdir(dst, 0o755); err != nil {
				return err
			}
			if err := core.CopyTree(filepath.Join(src, "upper"), filepath.Join(dst, "upper")); err != nil {
				return err
			}
			if readonly {
				return nil
			}
			return mkParts(dst, "work")
		},
		Destroy: os.RemoveAll,
	})
	if err != nil {
		return nil, err
	}
	return &store{s}, nil
}

func mkParts(dir string, parts ...string) error {
	for _, p := range parts {
		if err := os.Mkdir(filepath.Join(dir, p), 0o755); err != nil {
			return err
		}
	}
	return nil
}
