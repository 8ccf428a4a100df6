//go:build linux

// Package btrfsutil holds the btrfs ioctls (subvolume create, snapshot,
// destroy) and the loop-mounted image the layer stores use when their state
// directory is not on btrfs. Nothing here shells out except Format (mkfs.btrfs,
// run once when a store is created).
package btrfsutil

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Ioctl numbers from linux/btrfs.h: _IOW(0x94, nr, 4096-byte args).
const (
	iocSubvolCreate  = 0x5000940E // BTRFS_IOC_SUBVOL_CREATE, btrfs_ioctl_vol_args
	iocSnapDestroy   = 0x5000940F // BTRFS_IOC_SNAP_DESTROY, btrfs_ioctl_vol_args
	iocSnapCreateV2  = 0x50009417 // BTRFS_IOC_SNAP_CREATE_V2, btrfs_ioctl_vol_args_v2
	subvolRdonly     = 1 << 1     // BTRFS_SUBVOL_RDONLY
	volNameMax       = 4087
	volNameMaxV2     = 4039
	firstFreeObjecID = 256 // BTRFS_FIRST_FREE_OBJECTID: the inode of a subvolume's root
)

// volArgs is struct btrfs_ioctl_vol_args.
type volArgs struct {
	fd   int64
	name [volNameMax + 1]byte
}

// volArgsV2 is struct btrfs_ioctl_vol_args_v2.
type volArgsV2 struct {
	fd      int64
	transid uint64
	flags   uint64
	unused  [4]uint64
	name    [volNameMaxV2 + 1]byte
}

func ioctl(fd int, req uintptr, arg unsafe.Pointer) error {
	_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg))
	if e != 0 {
		return e
	}
	return nil
}

func openDir(p string) (int, error) {
	return unix.Open(p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
}

// IsBtrfs reports whether p is on a btrfs filesystem.
func IsBtrfs(p string) bool {
	var st unix.Statfs_t
	return unix.Statfs(p, &st) == nil && st.Type == unix.BTRFS_SUPER_MAGIC
}

// IsSubvolume reports whether p is the root of a btrfs subvolume.
func IsSubvolume(p string) bool {
	var st unix.Stat_t
	return IsBtrfs(p) && unix.Lstat(p, &st) == nil && st.Ino == firstFreeObjecID
}

// CreateSubvolume creates an empty subvolume at p.
func CreateSubvolume(p string) error {
	dir, name := filepath.Split(filepath.Clean(p))
	fd, err := openDir(dir)
	if err != nil {
		return fmt.Errorf("create subvolume %q: %w", p, err)
	}
	defer unix.Close(fd)
	var a volArgs
	if len(name) > volNameMax {
		return fmt.Errorf("create subvolume %q: name too long", p)
	}
	copy(a.name[:], name)
	if err := ioctl(fd, iocSubvolCreate, unsafe.Pointer(&a)); err != nil {
		return fmt.Errorf("create subvolume %q: %w", p, err)
	}
	return nil
}

// Snapshot creates dst, a snapshot of the subvolume src, read-only when
// readonly is set. The snapshot is atomic: it holds src's content at one
// instant even while src is being written.
func Snapshot(src, dst string, readonly bool) error {
	sfd, err := openDir(src)
	if err != nil {
		return fmt.Errorf("snapshot %q: %w", src, err)
	}
	defer unix.Close(sfd)
	dir, name := filepath.Split(filepath.Clean(dst))
	dfd, err := openDir(dir)
	if err != nil {
		return fmt.Errorf("snapshot %q to %q: %w", src, dst, err)
	}
	defer unix.Close(dfd)
	var a volArgsV2
	if len(name) > volNameMaxV2 {
		return fmt.Errorf("snapshot %q to %q: name too long", src, dst)
	}
	a.fd = int64(sfd)
	if readonly {
		a.flags = subvolRdonly
	}
	copy(a.name[:], name)
	if err := ioctl(dfd, iocSnapCreateV2, unsafe.Pointer(&a)); err != nil {
		return fmt.Errorf("snapshot %q to %q: %w", src, dst, err)
	}
	return nil
}

// DestroySubvolume deletes the subvolume p with all its content (read-only or
// not). A missing p is not an error.
func DestroySubvolume(p string) error {
	dir, name := filepath.Split(filepath.Clean(p))
	fd, err := openDir(dir)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("destroy subvolume %q: %w", p, err)
	}
	defer unix.Close(fd)
	var a volArgs
	copy(a.name[:], name)
	if err := ioctl(fd, iocSnapDestroy, unsafe.Pointer(&a)); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("destroy subvolume %q: %w", p, err)
	}
	return nil
}

// Image is a sparse file holding a btrfs filesystem, mounted through a loop
// device that detaches itself when the filesystem is unmounted.
type Image struct {
	File  string // the image file
	Mount string // where it is mounted
}

// OpenImage mounts the btrfs image file at mnt, creating and formatting it
// (sparse, size bytes) when it does not exist. An image already mounted at
// mnt (left by a process that crashed) is reused, and so is a filesystem on
// the image that is still alive though no longer mounted here (see
// mountAttached).
func OpenImage(file, mnt string, size int64) (*Image, error) {
	img := &Image{File: file, Mount: mnt}
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		return nil, fmt.Errorf("open btrfs image %q: %w", file, err)
	}
	if mounted(mnt) {
		return img, nil
	}
	if _, err := os.Stat(file); errors.Is(err, os.ErrNotExist) {
		if err := format(file, size); err != nil {
			return nil, err
		}
	} else if ok, err := mountAttached(file, mnt); err != nil {
		return nil, err
	} else if ok {
		return img, nil
	}
	if err := attachAndMount(file, mnt); err != nil {
		return nil, err
	}
	return img, nil
}

func mounted(mnt string) bool {
	var st, pst unix.Stat_t
	if unix.Stat(mnt, &st) != nil || unix.Stat(filepath.Dir(mnt), &pst) != nil {
		return false
	}
	return st.Dev != pst.Dev && IsBtrfs(mnt)
}

func format(file string, size int64) error {
	tmp := file + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_RDWR, 0o600)
	if err != nil {
		return fmt.Errorf("create btrfs image %q: %w", file, err)
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return fmt.Errorf("create btrfs image %q: %w", file, err)
	}
	f.Close()
	if out, err := exec.Command("mkfs.btrfs", "-q", "-f", tmp).CombinedOutput(); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("mkfs.btrfs %q: %w: %s", file, err, out)
	}
	if err := os.Rename(tmp, file); err != nil {
		return fmt.Errorf("create btrfs image %q: %w", file, err)
	}
	return nil
}

// mountAttached mounts at mnt the loop device that still backs file, if
// one does, and reports whether it did.
//
// Unmounting the image does not end its filesystem when another mount
// namespace holds a copy of the mount (any process that unshared its mount
// namespace while the image was mounted: a sandbox, a concurrent test): the
// filesystem lives on with its latest state in memory, its autoclear loop
// device stays attached, and the image file holds only its last transaction
// plus the fsync log. Attaching the file to a second loop device would mount
// a second, independent filesystem from that stale state (btrfs gives the
// clone a temporary fsid and replays the log): the layer records bolt
// fsynced come back, the subvolumes and directories made since the last
// transaction do not, and the first filesystem later overwrites the image
// when it ends. Mounting the same device joins the live filesystem instead.
func mountAttached(file, mnt string) (bool, error) {
	var st unix.Stat_t
	if err := unix.Stat(file, &st); err != nil {
		return false, fmt.Errorf("open btrfs image %q: %w", file, err)
	}
	m, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var errs []error
	for _, p := range m {
		dev := "/dev/" + filepath.Base(filepath.Dir(filepath.Dir(p)))
		// The open descriptor keeps the device from detaching (and being
		// reused for another file) between the check and the mount.
		fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			continue // detached meanwhile
		}
		info, err := unix.IoctlLoopGetStatus64(fd)
		if err != nil || info.Device != st.Dev || info.Inode != st.Ino {
			unix.Close(fd)
			continue
		}
		err = unix.Mount(dev, mnt, "btrfs", 0, "")
		unix.Close(fd)
		if err != nil {
			// Another device on the same file may be the live one.
			errs = append(errs, fmt.Errorf("mount btrfs image %q (still attached to %s) at %q: %w", file, dev, mnt, err))
			continue
		}
		return true, nil
	}
	// Attached but mountable nowhere: a fresh attachment would mount a
	// stale copy, so this is an error, not a fallback.
	return false, errors.Join(errs...)
}

// attachAndMount attaches file to a free loop device with autoclear and
// mounts it; the device goes away with the mount.
func attachAndMount(file, mnt string) error {
	f, err := os.OpenFile(file, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("open btrfs image %q: %w", file, err)
	}
	defer f.Close()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("attach btrfs image %q: %w", file, err)
	}
	defer ctl.Close()
	for attempt := 0; ; attempt++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return fmt.Errorf("attach btrfs image %q: get free loop device: %w", file, err)
		}
		dev := fmt.Sprintf("/dev/loop%d", n)
		lfd, err := unix.Open(dev, unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			if attempt < 20 {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			return fmt.Errorf("attach btrfs image %q: %w", file, err)
		}
		cfg := unix.LoopConfig{Fd: uint32(f.Fd())}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
		copy(cfg.Info.File_name[:], file)
		err = unix.IoctlLoopConfigure(lfd, &cfg)
		if err == unix.EBUSY && attempt < 50 {
			unix.Close(lfd)
			continue // another process took it between GET_FREE and configure
		}
		if err != nil {
			unix.Close(lfd)
			return fmt.Errorf("attach btrfs image %q to %s: %w", file, dev, err)
		}
		err = unix.Mount(dev, mnt, "btrfs", 0, "")
		unix.Close(lfd) // autoclear: the mount now holds the device
		if err != nil {
			return fmt.Errorf("mount btrfs image %q (%s) at %q: %w", file, dev, mnt, err)
		}
		return nil
	}
}

// Close unmounts the image; its loop device detaches itself.
func (img *Image) Close() error {
	var err error
	for i := 0; i < 100; i++ {
		if err = unix.Unmount(img.Mount, 0); err != unix.EBUSY {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil && err != unix.EINVAL {
		return fmt.Errorf("unmount btrfs image %q: %w", img.Mount, err)
	}
	// The loop device detaches itself on its last close, which may trail the
	// unmount a little: wait so that callers (and leak checks) see it gone.
	abs, _ := filepath.Abs(img.File)
	for i := 0; i < 200 && attached(abs); i++ {
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

func attached(file string) bool {
	m, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	for _, p := range m {
		b, err := os.ReadFile(p)
		if err == nil && strings.TrimSpace(string(b)) == file {
			return true
		}
	}
	return false
}
