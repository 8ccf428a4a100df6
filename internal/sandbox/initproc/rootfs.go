//go:build linux

package initproc

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/internal/sandbox/initproto"
)

// rootMountpoint is where the init attaches its root before pivot_root: it
// exists on every host and every user may traverse it.
const rootMountpoint = "/tmp"

// Masked and read-only paths, as in runc's default spec.
var (
	maskedPaths = []string{
		"/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
		"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
		"/sys/firmware", "/sys/devices/virtual/powercap",
	}
	readonlyPaths = []string{
		"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
	}
	// Device nodes bound from the host: a user namespace cannot mknod them.
	hostDevices = []string{"null", "zero", "full", "random", "urandom", "tty"}
)

// setupRoot runs in the init (pid 1 of new pid, mount, net, uts, ipc
// namespaces owned by the sandbox's user namespace) and makes cfg.Rootfs the
// root: the proven sequence of ../shared/design/branch-namespaces.md. tree is
// a detached clone of the root's mount, made by the daemon; it is attached
// over rootMountpoint, a directory every user can reach in the copy of the
// host's mount table, which the pivot_root drops right after.
func setupRoot(cfg *initproto.Config, tree *os.File) error {
	// Nothing we mount may propagate back to the host.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make / private: %w", err)
	}
	const root = rootMountpoint
	if err := unix.MoveMount(int(tree.Fd()), "", unix.AT_FDCWD, root, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach root: %w", err)
	}
	// Mounts copied from the host's namespace are locked together; a bind of
	// the root onto itself is a mount of ours that pivot_root accepts.
	if err := unix.Mount(root, root, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind root: %w", err)
	}
	// proc must be mounted while a full proc is still visible (the kernel's
	// mount_too_revealing check), that is, before pivot_root.
	if err := mkdirMount("proc", filepath.Join(root, "proc"), "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return err
	}
	if err := mkdirMount("sysfs", filepath.Join(root, "sys"), "sysfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return err
	}
	if err := setupDev(filepath.Join(root, "dev")); err != nil {
		return err
	}
	if err := maskPaths(root); err != nil {
		return err
	}
	if cfg.Hostname != "" {
		if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
			return fmt.Errorf("set hostname: %w", err)
		}
	}
	if err := loopbackUp(); err != nil {
		return err
	}
	if err := pivotRoot(root); err != nil {
		return err
	}
	return nil
}

func mkdirMount(src, target, fstype string, flags uintptr, data string) error {
	if err := os.MkdirAll(target, 0o755); err != nil {
		return fmt.Errorf("mkdir %q: %w", target, err)
	}
	if err := unix.Mount(src, target, fstype, flags, data); err != nil {
		return fmt.Errorf("mount %s on %q: %w", fstype, target, err)
	}
	return nil
}

func setupDev(dev string) error {
	if err := mkdirMount("tmpfs", dev, "tmpfs", unix.MS_NOSUID|unix.MS_STRICTATIME, "mode=755,size=65536k"); err != nil {
		return err
	}
	for _, d := range hostDevices {
		target := filepath.Join(dev, d)
		f, err := os.OpenFile(target, os.O_CREATE|os.O_WRONLY, 0o666)
		if err != nil {
			return fmt.Errorf("create %q: %w", target, err)
		}
		f.Close()
		if err := unix.Mount("/dev/"+d, target, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind /dev/%s: %w", d, err)
		}
	}
	if err := mkdirMount("devpts", filepath.Join(dev, "pts"), "devpts", unix.MS_NOSUID|unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"); err != nil {
		return err
	}
	if err := mkdirMount("shm", filepath.Join(dev, "shm"), "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=1777,size=65536k"); err != nil {
		return err
	}
	links := [][2]string{
		{"pts/ptmx", "ptmx"}, {"/proc/self/fd", "fd"},
		{"/proc/self/fd/0", "stdin"}, {"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"},
	}
	for _, l := range links {
		if err := os.Symlink(l[0], filepath.Join(dev, l[1])); err != nil {
			return fmt.Errorf("symlink /dev/%s: %w", l[1], err)
		}
	}
	return nil
}

func maskPaths(root string) error {
	for _, p := range maskedPaths {
		target := filepath.Join(root, p)
		fi, err := os.Stat(target)
		if err != nil {
			continue // absent on this kernel
		}
		if fi.IsDir() {
			err = unix.Mount("tmpfs", target, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=0")
		} else {
			err = unix.Mount(filepath.Join(root, "dev/null"), target, "", unix.MS_BIND, "")
		}
		if err != nil {
			return fmt.Errorf("mask %s: %w", p, err)
		}
	}
	for _, p := range readonlyPaths {
		target := filepath.Join(root, p)
		if _, err := os.Stat(target); err != nil {
			continue
		}
		if err := unix.Mount(target, target, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s: %w", p, err)
		}
		// A read-only remount in a user namespace must keep the locked
		// flags of proc (nosuid, nodev, noexec).
		flags := uintptr(unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY | unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC)
		if err := unix.Mount(target, target, "", flags, ""); err != nil {
			return fmt.Errorf("make %s read-only: %w", p, err)
		}
	}
	return nil
}

func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("loopback: socket: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("loopback: get flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("loopback: up: %w", err)
	}
	return nil
}

// reroot runs in the init, whose only remaining process it is: it attaches
// tree (a detached clone of the new root's mount) on a directory of the
// current root, moves /proc, /sys and /dev into it and pivots into it. The
// old root is detached.
func reroot(tree *os.File) error {
	// Any directory of the old root will do as the attachment point; the
	// whole old root is dropped below.
	at := "/tmp"
	if fi, err := os.Stat(at); err != nil || !fi.IsDir() {
		at = "/.deltabox-reroot"
		if err := os.MkdirAll(at, 0o700); err != nil {
			return fmt.Errorf("reroot: %w", err)
		}
	}
	if err := unix.MoveMount(int(tree.Fd()), "", unix.AT_FDCWD, at, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("reroot: attach new root: %w", err)
	}
	for _, m := range []string{"proc", "sys", "dev"} {
		target := filepath.Join(at, m)
		if err := os.MkdirAll(target, 0o755); err != nil {
			return fmt.Errorf("reroot: %w", err)
		}
		if err := unix.Mount("/"+m, target, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("reroot: move /%s: %w", m, err)
		}
	}
	return pivotRoot(at)
}

func pivotRoot(root string) error {
	if err := unix.Chdir(root); err != nil {
		return fmt.Errorf("chdir root: %w", err)
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	// The old root is now stacked under the new one at "/": detach it.
	if err := unix.Mount("", ".", "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make old root slave: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach old root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return errors.Join(fmt.Errorf("chdir /"), err)
	}
	return nil
}
