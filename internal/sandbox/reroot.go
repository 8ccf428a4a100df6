//go:build linux

package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"syscall"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/sandbox/cgroup"
	"github.com/deltabox/deltabox/internal/sandbox/initproto"
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
	s.interruptPreps(true) // made for the root and generation this replaces
	s.mu.Lock()
	if s.destroyed || !s.g.alive() {
		s.mu.Unlock()
		return fmt.Errorf("reroot sandbox %q: %w", s.id, errdefs.ErrFailedPrecondition)
	}
	s.rerooting = true
	s.epoch++ // clones made ahead meanwhile are for the old root
	ah := s.ahead
	s.ahead, s.stepping = nil, true
	sessions := s.sess
	s.sess = map[SessionKind]*session{}
	children := s.children
	s.children = map[string]cgroup.Cgroup{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.rerooting = false
		s.mu.Unlock()
	}()

	if ah != nil {
		s.discardAhead(ah)
	}
	tr := newTrace(ctx)
	defer tr.done(s.log, "reroot")
	// 1. Kill every process but the init, race-free: idle sessions cannot
	//    fork, anything else is frozen first and the kills land at the
	//    thaw. They need not be dead before the pivot (what they still
	//    write goes to the old root, which is dropped); their cgroups are
	//    removed in the background.
	if !killIdleSessions(s, sessions, children) {
		if err := s.killAllButInit(ctx); err != nil {
			return fmt.Errorf("reroot sandbox %q: %w", s.id, err)
		}
	}
	// After the kill: a session whose stdin closes first may exit by
	// itself, which would make it look busy to killIdleSessions.
	for _, ss := range sessions {
		ss.closePipes()
	}
	go func() {
		for _, cg := range children {
			_ = cg.Delete(context.Background())
		}
	}()
	tr.step("kill")

	// 2. The new root on the host.
	target, err := s.mountRoot(view)
	if err != nil {
		return fmt.Errorf("reroot sandbox %q: %w", s.id, err)
	}
	tr.step("overlay")
	tree, err := cloneMount(target)
	if err != nil {
		_ = layer.Unmount(target)
		os.Remove(target)
		return fmt.Errorf("reroot sandbox %q: %w", s.id, err)
	}
	defer tree.Close()

	// 3. The init pivots into it.
	if _, err := s.request(ctx, initproto.Message{Op: initproto.OpReroot}, tree); err != nil {
		_ = layer.Unmount(target)
		os.Remove(target)
		return fmt.Errorf("reroot sandbox %q: %w", s.id, err)
	}
	tr.step("pivot")
	s.mu.Lock()
	old := s.rootfs
	s.rootfs, s.view = target, view
	s.mu.Unlock()
	// Detaching the old overlay syncs its upper (tens of ms on a loaded
	// disk): off the critical path. File operations that still hold it
	// finish on it.
	s.detachRoot(old)
	return nil
}

// killIdleSessions kills the sandbox's processes without a freeze when they
// are only idle sessions: no command runs (children holds only the
// sessions' cgroups), no session call is in flight (each session's lock is
// free), and each session is one process, blocked reading its next snippet,
// which cannot fork. It reports false, having done nothing, otherwise.
func killIdleSessions(s *Sandbox, sessions map[SessionKind]*session, children map[string]cgroup.Cgroup) bool {
	if len(children) != len(sessions) {
		return false
	}
	var pids []int
	for _, ss := range sessions {
		if !ss.mu.TryLock() {
			return false
		}
		defer ss.mu.Unlock()
		if children["session-"+ss.kind.String()] != ss.p.cg {
			return false
		}
		p, err := ss.p.cg.Procs()
		if err != nil || len(p) != 1 {
			return false
		}
		pids = append(pids, p[0])
	}
	all, err := s.cg.Procs()
	if err != nil || len(all) != len(pids)+len(s.initPids()) {
		return false
	}
	for _, p := range pids {
		_ = syscall.Kill(p, syscall.SIGKILL)
	}
	return true
}

// killAllButInit sends SIGKILL to every process of the sandbox but its init,
// with the sandbox frozen so that none can fork in between. The processes
// die when it is thawed, on return.
func (s *Sandbox) killAllButInit(ctx context.Context) error {
	inits := s.initPids()
	if err := s.cg.Freeze(ctx); err != nil {
		_ = s.cg.Thaw(context.Background())
		return err
	}
	pids, err := s.cg.Procs()
	if err == nil {
		for _, p := range slices.DeleteFunc(pids, func(p int) bool { return inits[p] }) {
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
	}
	return errors.Join(err, s.cg.Thaw(context.Background()))
}
