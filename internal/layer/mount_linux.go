//go:build linux

package layer

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// MountOverlay mounts view at target (an existing directory): an overlay whose
// layers are, top first, view.Upper (when set), view.Lowers, then imageLowers
// (the caller's image, top first).
//
// It uses the new mount API (fsopen, fsconfig "lowerdir+" one layer at a time,
// fsmount, move_mount), so the depth of a stack is not limited by the 4 KiB
// page of a mount(2) option string; the kernel still caps an overlay at 500
// lower layers (stores compact long chains well below that). The mount is
// read-only when view.Upper is empty. Options are fixed: redirect_dir=off,
// metacopy=off, index=off, xino=off, so that every layer stays a plain,
// self-contained directory tree the stores can snapshot, copy and diff
// (no redirects or metacopy-only inodes that point into other layers). With
// redirect_dir=off, renaming a directory that lives in a lower layer fails
// with EXDEV (tools such as mv fall back to copying).
//
// The caller must be privileged in the target's mount namespace.
func MountOverlay(view View, imageLowers []string, target string) error {
	lowers := append(append([]string(nil), view.Lowers...), imageLowers...)
	if view.Upper == "" && len(lowers) == 0 {
		return fmt.Errorf("mount overlay at %q: no layers", target)
	}
	if (view.Upper == "" && len(lowers) == 1) || len(lowers) == 0 {
		// An overlay needs a lower layer, and two when it has no upper; an
		// empty one changes nothing. Every mount shares it.
		empty := filepath.Join(os.TempDir(), "deltabox-overlay-empty")
		if err := os.MkdirAll(empty, 0o555); err != nil {
			return fmt.Errorf("mount overlay at %q: %w", target, err)
		}
		lowers = append(lowers, empty)
	}
	fd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("mount overlay at %q: fsopen: %w", target, err)
	}
	defer unix.Close(fd)
	set := func(k, v string) error {
		if err := unix.FsconfigSetString(fd, k, v); err != nil {
			return fmt.Errorf("mount overlay at %q: fsconfig %s=%q: %w", target, k, v, err)
		}
		return nil
	}
	for _, l := range lowers {
		if err := set("lowerdir+", l); err != nil {
			return err
		}
	}
	if view.Upper != "" {
		if err := set("upperdir", view.Upper); err != nil {
			return err
		}
		if err := set("workdir", view.Work); err != nil {
			return err
		}
	}
	for _, kv := range [][2]string{{"redirect_dir", "off"}, {"metacopy", "off"}, {"index", "off"}, {"xino", "off"}} {
		if err := set(kv[0], kv[1]); err != nil {
			return err
		}
	}
	if err := unix.FsconfigCreate(fd); err != nil {
		return fmt.Errorf("mount overlay at %q: fsconfig create (%d lowers): %w", target, len(lowers), err)
	}
	var attr int
	if view.Upper == "" {
		attr = unix.MOUNT_ATTR_RDONLY
	}
	mfd, err := unix.Fsmount(fd, unix.FSMOUNT_CLOEXEC, attr)
	if err != nil {
		return fmt.Errorf("mount overlay at %q: fsmount: %w", target, err)
	}
	defer unix.Close(mfd)
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("mount overlay at %q: move_mount: %w", target, err)
	}
	return nil
}

// Unmount unmounts what MountOverlay mounted at target. It retries a busy
// mount briefly, then detaches it lazily.
func Unmount(target string) error {
	for i := 0; i < 50; i++ {
		err := unix.Unmount(target, 0)
		switch err {
		case nil:
			return nil
		case unix.EINVAL, unix.ENOENT:
			return fmt.Errorf("unmount %q: %w", target, err)
		case unix.EBUSY:
			time.Sleep(10 * time.Millisecond)
			continue
		default:
			return fmt.Errorf("unmount %q: %w", target, err)
		}
	}
	if err := unix.Unmount(target, unix.MNT_DETACH); err != nil {
		return fmt.Errorf("unmount %q: %w", target, err)
	}
	return nil
}
