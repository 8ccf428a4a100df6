//go:build linux

// Package filter loads a compiled seccomp filter. It is apart from package
// seccomp, which compiles the policy, so that a sandbox's init (package
// initproc) loads the filter the daemon compiled without linking the
// compiler, whose package initialisation alone cost every init's boot about
// a tenth of its CPU.
package filter

import (
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
)

// Filter is a compiled classic BPF seccomp program.
type Filter []unix.SockFilter

// Process sets no_new_privs and installs f on every thread of the calling
// process (TSYNC); children forked afterwards inherit both. It fails if a
// thread cannot be synchronized (one already has a diverging filter).
func (f Filter) Process() error {
	// no_new_privs is per thread until TSYNC copies it with the filter:
	// both calls must come from the same thread.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return f.load(unix.SECCOMP_FILTER_FLAG_TSYNC)
}

// Thread sets no_new_privs and installs f on the calling OS thread only;
// processes that thread forks afterwards inherit both, the rest of the
// process does not. The caller must have locked the goroutine to its thread
// (runtime.LockOSThread) and must never unlock it: the thread is then
// destroyed with the goroutine, so no other goroutine runs filtered. This is
// how a sandbox's init filters the workload it starts while staying free to
// change its own mounts.
func (f Filter) Thread() error { return f.load(0) }

func (f Filter) load(flags uintptr) error {
	if len(f) == 0 {
		return fmt.Errorf("seccomp: empty filter: %w", errdefs.ErrInvalidArgument)
	}
	prog := unix.SockFprog{Len: uint16(len(f)), Filter: &f[0]}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("seccomp: set no_new_privs: %w: %w", err, errdefs.ErrUnavailable)
	}
	r, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, flags, uintptr(unsafe.Pointer(&prog)))
	runtime.KeepAlive(f)
	if errno != 0 {
		return fmt.Errorf("seccomp: install filter: %w: %w", errno, errdefs.ErrUnavailable)
	}
	if r != 0 {
		return fmt.Errorf("seccomp: install filter: thread %d cannot be synchronized: %w", r, errdefs.ErrFailedPrecondition)
	}
	return nil
}
