//go:build linux

package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/sandbox/cgroup"
)

// Reroot replaces the sandbox's root filesystem with the view of another
// active layer, in place: every process but the init is killed, the new
// overlay is mounted over the same idmapped image lowers, and the init
// pivots into it, carrying /proc, /sys and /dev across. The namespaces, the
// cgroup and so the network identity stay; nothing is booted. This is the
// restore of the checkpoint's slow path (processes are not captured): tens
// of milliseconds cheaper than a new init.
//
// On failure before the pivot the sandbox keeps its old root (with its
// processes gone); a failure in the pivot itself leaves it dead.
func (s *Sandbox) Reroot(ctx context.Context, view layer.View) error {
	s.mu.Lock()
	if s.dead {
		s.mu.Unlock()
		return fmt.Errorf("reroot sandbox %q: %w", s.id, errdefs.ErrFailedPrecondition)
	}
	s.rerooting = true
	sessions := s.sess
	s.sess = map[SessionKind]*session{}
	children := s.children
	s.children = map[string]cgroup.Cgroup{}
	s.gen++
	target := filepath.Join(s.dir, "rootfs."+strconv.Itoa(s.gen))
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.rerooting = false
		s.mu.Unlock()
	}()

	// 1. Kill every process but the init. Sessions and commands each live
	//    in a child cgroup; orphans the init adopted stay in theirs.
	for _, ss := range sessions {
		ss.closePipes()
	}
	for _, cg := range children {
		if err := cg.Delete(ctx); err != nil {
			return fmt.Errorf("reroot sandbox %q: %w", s.id, err)
		}
	}
	if err := s.killStrays(ctx); err != nil {
		return fmt.Errorf("reroot sandbox %q: %w", s.id, err)
	}

	// 2. The new root on the host.
	if view.Upper != "" {
		for _, d := range []string{view.Upper, view.Work} {
			if err := os.Chown(d, int(s.ids.HostBase), int(s.ids.HostBase)); err != nil {
				return fmt.Errorf("reroot sandbox %q: chown layer: %w", s.id, err)
			}
		}
	}
	if err := os.Mkdir(target, 0o755); err != nil {
		return fmt.Errorf("reroot sandbox %q: %w", s.id, err)
	}
	if err := layer.MountOverlay(view, s.lowers, target); err != nil {
		os.Remove(target)
		return fmt.Errorf("reroot sandbox %q: %w", s.id, err)
	}
	tree, err := cloneMount(target)
	if err != nil {
		_ = layer.Unmount(target)
		os.Remove(target)
		return fmt.Errorf("reroot sandbox %q: %w", s.id, err)
	}
	defer tree.Close()

	// 3. The init pivots into it.
	if _, err := s.request(ctx, message{Op: opReroot}, tree); err != nil {
		_ = layer.Unmount(target)
		os.Remove(target)
		return fmt.Errorf("reroot sandbox %q: %w", s.id, err)
	}
	s.mu.Lock()
	old := s.rootfs
	s.rootfs = target
	s.mu.Unlock()
	// File operations that still hold the old root finish on it.
	if err := unix.Unmount(old, unix.MNT_DETACH); err != nil {
		s.log.Warn("reroot: detach old root", "err", err)
	}
	_ = os.Remove(old)
	return nil
}

// killStrays kills the processes of the sandbox's own cgroup other than the
// init (there are none unless something escaped its child cgroup) and waits
// until they are gone.
func (s *Sandbox) killStrays(ctx context.Context) error {
	initPid := s.InitPid()
	deadline := time.Now().Add(10 * time.Second)
	for {
		pids, err := s.cg.Procs()
		if err != nil {
			return err
		}
		pids = slices.DeleteFunc(pids, func(p int) bool { return p == initPid })
		if len(pids) == 0 {
			return nil
		}
		for _, p := range pids {
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
		if time.Now().After(deadline) {
			return errors.New("processes survive SIGKILL")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
}
