//go:build linux

// Package probe picks and opens a layer store backend by name, for the
// daemon's --storage flag.
package probe

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/layer/btrfs"
	"github.com/deltabox/deltabox/internal/layer/copy"
	"github.com/deltabox/deltabox/internal/layer/internal/btrfsutil"
	"github.com/deltabox/deltabox/internal/layer/overlay"
)

// The backend kinds.
const (
	Btrfs   = "btrfs"
	Overlay = "overlay"
	Copy    = "copy"
)

// Kinds lists the backends, preferred first.
func Kinds() []string { return []string{Btrfs, Overlay, Copy} }

// DefaultKind returns the backend to use for a store in root: btrfs when root
// is on btrfs or the kernel has btrfs and mkfs.btrfs is installed (the store
// then makes an image file), else overlay when the kernel has it, else copy.
func DefaultKind(root string) string {
	if btrfsutil.IsBtrfs(root) {
		return Btrfs
	}
	if hasFS("btrfs") {
		if _, err := exec.LookPath("mkfs.btrfs"); err == nil {
			return Btrfs
		}
	}
	if hasFS("overlay") {
		return Overlay
	}
	return Copy
}

func hasFS(name string) bool {
	b, err := os.ReadFile("/proc/filesystems")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 0 && f[len(f)-1] == name {
			return true
		}
	}
	return false
}

// Open opens the store of kind ("" for DefaultKind) in root/<kind>.
func Open(ctx context.Context, kind, root string) (layer.Store, error) {
	if kind == "" {
		kind = DefaultKind(root)
	}
	dir := filepath.Join(root, kind)
	switch kind {
	case Btrfs:
		return btrfs.New(dir)
	case Overlay:
		return overlay.New(dir)
	case Copy:
		return copy.New(dir)
	}
	return nil, fmt.Errorf("open layer store: unknown kind %q (want one of %q): %w", kind, Kinds(), errdefs.ErrInvalidArgument)
}
