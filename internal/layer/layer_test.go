//go:build linux

package layer_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
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
	has   layertest.Features
}

var backends = []backend{
	{"overlay", func(t testing.TB) { testutil.RequiresFilesystem(t, "overlay") }, func(root string) (layer.Store, error) {
		return overlay.New(root, overlay.WithMaxDepth(16))
	}, 4, layertest.Features{}},
	{"btrfs", func(t testing.TB) { testutil.RequiresBtrfs(t); testutil.RequiresFilesystem(t, "overlay") }, func(root string) (layer.Store, error) {
		return btrfs.New(root, btrfs.WithImageSize(4<<30))
	}, 3, layertest.Features{LiveCommit: true, Prepare: true}},
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
	}, 2, layertest.Features{LiveCommit: true}},
	{"copy", func(t testing.TB) { testutil.RequiresFilesystem(t, "overlay") }, func(root string) (layer.Store, error) {
		return copy.New(root)
	}, 3, layertest.Features{}},
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
			layertest.Run(t, b.newStore, b.has)
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

// TestImageReopenWhileHeldElsewhere pins the bug behind TestCrash's
// "upper missing" flake under CI: another process unshared its mount
// namespace while a store's btrfs image was mounted, so the filesystem
// outlived the store's unmount, and the next OpenImage attached the image to
// a second loop device: a second filesystem from the stale image, where the
// fsynced records were back (fsync log) but not the subvolumes and
// directories made since the last transaction. Reopening must see them.
func TestImageReopenWhileHeldElsewhere(t *testing.T) {
	testutil.CheckLeaks(t)
	testutil.RequiresRoot(t)
	testutil.RequiresBtrfs(t)
	dir := t.TempDir()
	file, mnt := filepath.Join(dir, "fs.img"), filepath.Join(dir, "fs")
	img, err := btrfsutil.OpenImage(file, mnt, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = img.Close() }() // a no-op once closed
	// What a store does: a layer subvolume with its upper/, then its record
	// (a file) fsynced.
	layerDir := filepath.Join(mnt, "layer")
	if err := btrfsutil.CreateSubvolume(layerDir); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(layerDir, "upper"), 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(mnt, "records"))
	if err == nil {
		_, err = f.WriteString("layer\n")
		err = errors.Join(err, f.Sync(), f.Close())
	}
	if err != nil {
		t.Fatal(err)
	}
	// A process holding a copy of the mount namespace (Unshareflags makes
	// its mounts private, so the unmount below does not propagate to it).
	holder := exec.Command("sleep", "60")
	holder.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	release := func() {
		_ = holder.Process.Kill()
		_ = holder.Wait()
	}
	defer release()
	// What img.Close does, without its wait for the loop device (which
	// stays attached while the holder lives).
	if err := syscall.Unmount(mnt, 0); err != nil {
		t.Fatal(err)
	}
	img, err = btrfsutil.OpenImage(file, mnt, 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.ReadFile(filepath.Join(mnt, "records")); err != nil {
		t.Errorf("record after reopen: %v", err)
	}
	if fi, err := os.Stat(filepath.Join(layerDir, "upper")); err != nil || !fi.IsDir() {
		t.Errorf("layer upper after reopen: %v, want the directory made before the unmount", err)
	}
	release() // first, so that the filesystem ends with the unmount
	if err := img.Close(); err != nil {
		t.Error(err)
	}
}
