//go:build linux

package layer_test

import (
	"context"
	"errors"
	"path/filepath"
	"testing"

	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/layer/btrfs"
	"github.com/deltabox/deltabox/internal/layer/copy"
	"github.com/deltabox/deltabox/internal/layer/internal/btrfsutil"
	"github.com/deltabox/deltabox/internal/layer/layertest"
	"github.com/deltabox/deltabox/internal/layer/overlay"
	"github.com/deltabox/deltabox/internal/testutil"
)

// The backends run in this one test binary rather than one per package: the
// leak checker looks at the whole machine's mounts and loop devices, which
// test binaries running side by side would confuse.

type backend struct {
	name  string
	gate  func(t testing.TB)
	open  func(root string) (layer.Store, error)
	crash int // rounds of the crash test
}

var backends = []backend{
	{"overlay", func(t testing.TB) { testutil.RequiresFilesystem(t, "overlay") }, func(root string) (layer.Store, error) {
		return overlay.New(root, overlay.WithMaxDepth(16))
	}, 4},
	{"btrfs", func(t testing.TB) { testutil.RequiresBtrfs(t); testutil.RequiresFilesystem(t, "overlay") }, func(root string) (layer.Store, error) {
		return btrfs.New(root, btrfs.WithImageSize(4<<30))
	}, 3},
	{"overlay-on-btrfs", func(t testing.TB) { testutil.RequiresBtrfs(t); testutil.RequiresFilesystem(t, "overlay") }, func(root string) (layer.Store, error) {
		// Layers as subvolumes: CommitLive works.
		img, err := btrfsutil.OpenImage(filepath.Join(root, "fs.img"), filepath.Join(root, "fs"), 4<<30)
		if err != nil {
			return nil, err
		}
		s, err := overlay.New(filepath.Join(root, "fs", "store"), overlay.WithMaxDepth(16))
		if err != nil {
			img.Close()
			return nil, err
		}
		if _, ok := s.(layer.LiveCommitter); !ok {
			s.Close()
			img.Close()
			return nil, errors.New("overlay store on btrfs is not a layer.LiveCommitter")
		}
		return onImage{s, img}, nil
	}, 2},
	{"copy", func(t testing.TB) { testutil.RequiresFilesystem(t, "overlay") }, func(root string) (layer.Store, error) {
		return copy.New(root)
	}, 3},
}

// onImage is a store on a btrfs image the test mounted.
type onImage struct {
	layer.Store
	img *btrfsutil.Image
}

func (s onImage) Close() error { return errors.Join(s.Store.Close(), s.img.Close()) }

func (s onImage) CommitLive(ctx context.Context, active string, opts ...layer.Opt) (layer.Info, error) {
	return s.Store.(layer.LiveCommitter).CommitLive(ctx, active, opts...)
}

func (s onImage) Check(ctx context.Context) error {
	return s.Store.(layertest.Checker).Check(ctx)
}

func (b backend) newStore(t *testing.T, root string) layer.Store {
	s, err := b.open(root)
	if err != nil {
		t.Fatalf("open %s store: %v", b.name, err)
	}
	return s
}

func TestConformance(t *testing.T) {
	testutil.CheckLeaks(t)
	testutil.RequiresRoot(t)
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			b.gate(t)
			layertest.Run(t, b.newStore)
		})
	}
}

func TestCrash(t *testing.T) {
	if !layertest.IsCrashChild() {
		testutil.CheckLeaks(t)
	}
	testutil.RequiresRoot(t)
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			b.gate(t)
			layertest.RunCrash(t, b.newStore, b.crash)
		})
	}
}
