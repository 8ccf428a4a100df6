//go:build linux

package safefs

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
)

const paxXattr = "SCHILY.xattr."

// keepXattr says which extended attributes cross the boundary in either
// direction: user.* always; security.capability only for the identity map (an
// image being built), since file capabilities of a shifted sandbox would need
// their root id rewritten. trusted.* (overlay's own metadata: opaque,
// redirect, metacopy) never, or an upload could steer the overlay.
func (m IDMap) keepXattr(name string) bool {
	return strings.HasPrefix(name, "user.") || (m.identity() && name == "security.capability")
}

func (l Limits) withDefaults() Limits {
	if l.MaxBytes <= 0 {
		l.MaxBytes = DefaultMaxBytes
	}
	if l.MaxEntries <= 0 {
		l.MaxEntries = DefaultMaxEntries
	}
	return l
}

// cleanEntryName checks a tar entry name (or hardlink target): relative, no
// ".." component at all, bounded in length. "./a//b/" becomes "a/b"; the
// archive's own top "./" becomes ".".
func cleanEntryName(name string) (string, error) {
	if name == "" {
		return "", fmt.Errorf("empty name: %w", errdefs.ErrInvalidArgument)
	}
	if len(name) > maxPathLen {
		return "", fmt.Errorf("name longer than %d bytes: %w", maxPathLen, errdefs.ErrInvalidArgument)
	}
	if strings.IndexByte(name, 0) >= 0 {
		return "", fmt.Errorf("name has a nul byte: %w", errdefs.ErrInvalidArgument)
	}
	if strings.HasPrefix(name, "/") {
		return "", fmt.Errorf("absolute name: %w", errdefs.ErrInvalidArgument)
	}
	var out []string
	for _, c := range strings.Split(name, "/") {
		switch c {
		case "", ".":
		case "..":
			return "", fmt.Errorf("name has a \"..\" component: %w", errdefs.ErrInvalidArgument)
		default:
			if len(c) > maxNameLen {
				return "", fmt.Errorf("name component longer than %d bytes: %w", maxNameLen, errdefs.ErrInvalidArgument)
			}
			out = append(out, c)
		}
	}
	if len(out) == 0 {
		return ".", nil
	}
	return strings.Join(out, "/"), nil
}

// extractor is the state of one TarIn.
type extractor struct {
	m       IDMap
	rs      resolver // rooted at dst
	lim     Limits
	bytes   int64
	entries int64
	// linkable holds the non-directory entries extracted so far: the only
	// names a hardlink entry may point at.
	linkable map[string]bool
	// dirs are the directories whose mtime is set at the end, once their
	// children no longer change it.
	dirs []dirTime
}

type dirTime struct {
	name  string
	mtime time.Time
}

func (r *rootImpl) tarIn(ctx context.Context, dst string, rd io.Reader, lim Limits) error {
	defer r.hold()()
	rel, err := cleanPath(dst)
	if err != nil {
		return fmt.Errorf("extract tar: %w", err)
	}
	root := r.m.rootID()
	dfd, err := r.res().mkdirAll(rel, 0o755, root, root)
	if err != nil {
		return wrapErrno("extract tar into", dst, err)
	}
	defer unix.Close(dfd)
	// Into the sandbox's root, resolve as the sandbox would (absolute
	// symlinks of an image start at its root). Into a directory below it,
	// refuse any entry whose resolution would leave dst.
	rs := resolver{fd: dfd, resolve: beneath}
	if rel == "." {
		rs.resolve = inRoot
	}
	x := &extractor{m: r.m, rs: rs, lim: lim.withDefaults(), linkable: map[string]bool{}}
	tr := tar.NewReader(rd)
	for {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("extract tar into %q: %w", dst, err)
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			if errdefs.Classify(err) == errdefs.ClassUnknown {
				err = fmt.Errorf("%w: %w", errdefs.ErrInvalidArgument, err)
			}
			return fmt.Errorf("extract tar into %q: read: %w", dst, err)
		}
		if err := x.entry(ctx, hdr, tr); err != nil {
			return fmt.Errorf("extract tar into %q: entry %q: %w", dst, truncate(hdr.Name), classed(err))
		}
	}
	for _, d := range slices.Backward(x.dirs) {
		if err := x.setTimes(d.name, d.mtime); err != nil && !errors.Is(err, unix.ENOENT) {
			return wrapErrno("extract tar into "+fmt.Sprintf("%q", dst)+": set mtime of", d.name, err)
		}
	}
	return nil
}

func truncate(s string) string {
	if len(s) > 128 {
		return s[:128] + "..."
	}
	return s
}

func (x *extractor) entry(ctx context.Context, hdr *tar.Header, r io.Reader) error {
	switch hdr.Typeflag {
	case tar.TypeXGlobalHeader:
		return nil
	case tar.TypeChar, tar.TypeBlock:
		return fmt.Errorf("device nodes are not allowed: %w", errdefs.ErrInvalidArgument)
	case tar.TypeGNUSparse:
		// The reader expands holes; Size is the logical size, which is
		// what the extracted (non-sparse) file takes.
		hdr.Typeflag = tar.TypeReg
	case tar.TypeReg, tar.TypeDir, tar.TypeSymlink, tar.TypeLink, tar.TypeFifo:
	default:
		return fmt.Errorf("unsupported entry type %q: %w", hdr.Typeflag, errdefs.ErrInvalidArgument)
	}
	x.entries++
	if x.entries > x.lim.MaxEntries {
		return fmt.Errorf("more than %d entries: %w", x.lim.MaxEntries, errdefs.ErrResourceExhausted)
	}
	name, err := cleanEntryName(hdr.Name)
	if err != nil {
		return err
	}
	if hdr.Size < 0 {
		return fmt.Errorf("negative size: %w", errdefs.ErrInvalidArgument)
	}
	if hdr.Typeflag == tar.TypeReg {
		if hdr.Size > x.lim.MaxBytes-x.bytes {
			return fmt.Errorf("%d bytes would exceed the limit of %d: %w", hdr.Size, x.lim.MaxBytes, errdefs.ErrResourceExhausted)
		}
		x.bytes += hdr.Size
	}
	if hdr.Uid < 0 || hdr.Gid < 0 || hdr.Uid > 1<<32-1 || hdr.Gid > 1<<32-1 {
		return fmt.Errorf("bad owner %d:%d: %w", hdr.Uid, hdr.Gid, errdefs.ErrInvalidArgument)
	}
	uid, err := x.m.toHost(uint32(hdr.Uid))
	if err != nil {
		return err
	}
	gid, err := x.m.toHost(uint32(hdr.Gid))
	if err != nil {
		return err
	}
	mode := uint32(hdr.Mode) & 0o7777
	root := x.m.rootID()

	if name == "." {
		if hdr.Typeflag != tar.TypeDir {
			return fmt.Errorf("the top entry is not a directory: %w", errdefs.ErrInvalidArgument)
		}
		fd, err := unix.Openat(x.rs.fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if err := x.setOwnerMode(fd, uid, gid, mode, hdr); err != nil {
			return err
		}
		x.dirs = append(x.dirs, dirTime{name, hdr.ModTime})
		return nil
	}

	dir, base := split(name)
	pfd, err := x.rs.mkdirAll(dir, 0o755, root, root)
	if err != nil {
		return err
	}
	defer unix.Close(pfd)

	switch hdr.Typeflag {
	case tar.TypeDir:
		var st unix.Stat_t
		err := unix.Fstatat(pfd, base, &st, unix.AT_SYMLINK_NOFOLLOW)
		if err == nil && st.Mode&unix.S_IFMT != unix.S_IFDIR {
			if err := unix.Unlinkat(pfd, base, 0); err != nil {
				return err
			}
			err = unix.ENOENT
		}
		if err == unix.ENOENT {
			err = unix.Mkdirat(pfd, base, 0o700)
		}
		if err != nil {
			return err
		}
		fd, err := unix.Openat(pfd, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		if err := x.setOwnerMode(fd, uid, gid, mode, hdr); err != nil {
			return err
		}
		delete(x.linkable, name)
		x.dirs = append(x.dirs, dirTime{name, hdr.ModTime})
		return nil

	case tar.TypeReg:
		if err := makeRoom(pfd, base); err != nil {
			return err
		}
		fd, err := unix.Openat(pfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), base)
		defer f.Close()
		if _, err := io.CopyN(f, ctxReader{ctx, r}, hdr.Size); err != nil {
			if err == io.EOF || err == io.ErrUnexpectedEOF {
				return fmt.Errorf("truncated content: %w", errdefs.ErrInvalidArgument)
			}
			return classed(err) // a full disk is resource exhausted
		}
		if err := x.setOwnerMode(fd, uid, gid, mode, hdr); err != nil {
			return err
		}
		if err := unix.UtimesNanoAt(pfd, base, times(hdr.ModTime), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}

	case tar.TypeSymlink:
		if hdr.Linkname == "" || len(hdr.Linkname) > maxPathLen || strings.IndexByte(hdr.Linkname, 0) >= 0 {
			return fmt.Errorf("bad symlink target: %w", errdefs.ErrInvalidArgument)
		}
		if err := makeRoom(pfd, base); err != nil {
			return err
		}
		// The target is only data: whatever it says, it is later resolved
		// within the root (openat2 RESOLVE_IN_ROOT here, the sandbox's
		// mount namespace there).
		if err := unix.Symlinkat(hdr.Linkname, pfd, base); err != nil {
			return err
		}
		if err := unix.Fchownat(pfd, base, uid, gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		if err := unix.UtimesNanoAt(pfd, base, times(hdr.ModTime), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}

	case tar.TypeLink:
		target, err := cleanEntryName(hdr.Linkname)
		if err != nil {
			return fmt.Errorf("hardlink target: %w", err)
		}
		if !x.linkable[target] || target == name {
			return fmt.Errorf("hardlink to %q, which is not an earlier entry of this archive: %w", truncate(hdr.Linkname), errdefs.ErrInvalidArgument)
		}
		tdir, tbase := split(target)
		tfd, err := x.rs.openDir(tdir)
		if err != nil {
			return err
		}
		defer unix.Close(tfd)
		if err := makeRoom(pfd, base); err != nil {
			return err
		}
		// No AT_SYMLINK_FOLLOW: a symlink target is linked itself.
		if err := unix.Linkat(tfd, tbase, pfd, base, 0); err != nil {
			return err
		}

	case tar.TypeFifo:
		if err := makeRoom(pfd, base); err != nil {
			return err
		}
		if err := unix.Mknodat(pfd, base, unix.S_IFIFO|0o600, 0); err != nil {
			return err
		}
		if err := unix.Fchownat(pfd, base, uid, gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		// fchmodat2 with AT_SYMLINK_NOFOLLOW: if the fifo was swapped for a
		// symlink meanwhile, this fails instead of following it.
		if err := unix.Fchmodat(pfd, base, mode, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		if err := unix.UtimesNanoAt(pfd, base, times(hdr.ModTime), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	}
	x.linkable[name] = true
	return nil
}

// setOwnerMode sets owner, then mode (a chown clears setuid bits), then the
// allowed xattrs, on an fd of the new file or directory.
func (x *extractor) setOwnerMode(fd, uid, gid int, mode uint32, hdr *tar.Header) error {
	if err := unix.Fchown(fd, uid, gid); err != nil {
		return err
	}
	if err := unix.Fchmod(fd, mode); err != nil {
		return err
	}
	for k, v := range hdr.PAXRecords {
		name, ok := strings.CutPrefix(k, paxXattr)
		if !ok || !x.m.keepXattr(name) {
			continue
		}
		if err := unix.Fsetxattr(fd, name, []byte(v), 0); err != nil {
			return fmt.Errorf("set xattr %q: %w", name, err)
		}
	}
	return nil
}

func (x *extractor) setTimes(name string, mtime time.Time) error {
	if name == "." {
		return unix.UtimesNanoAt(x.rs.fd, ".", times(mtime), 0)
	}
	dir, base := split(name)
	pfd, err := x.rs.openDir(dir)
	if err != nil {
		return err
	}
	defer unix.Close(pfd)
	return unix.UtimesNanoAt(pfd, base, times(mtime), unix.AT_SYMLINK_NOFOLLOW)
}

func times(t time.Time) []unix.Timespec {
	ts := unix.NsecToTimespec(t.UnixNano())
	return []unix.Timespec{ts, ts}
}

// makeRoom makes room for a new non-directory entry: it removes what is at name
// (never following a symlink), including an empty directory, as tar does.
func makeRoom(dirfd int, name string) error {
	err := removeOne(dirfd, name)
	if err == unix.ENOENT {
		return nil
	}
	return err
}

// TarOut

type archiver struct {
	m      IDMap
	tw     *tar.Writer
	inodes map[[2]uint64]string // hardlinked files already written
}

func (r *rootImpl) tarOut(ctx context.Context, p string, w io.Writer) error {
	defer r.hold()()
	rel, err := cleanPath(p)
	if err != nil {
		return fmt.Errorf("archive: %w", err)
	}
	dir, base := split(rel)
	name := base
	if rel == "." {
		dir, base, name = ".", ".", "."
	}
	dfd, err := r.res().openDir(dir)
	if err != nil {
		return wrapErrno("archive", p, err)
	}
	defer unix.Close(dfd)
	a := &archiver{m: r.m, tw: tar.NewWriter(w), inodes: map[[2]uint64]string{}}
	if err := a.walk(ctx, dfd, base, name, 0); err != nil {
		return wrapErrno("archive", p, err)
	}
	if err := a.tw.Close(); err != nil {
		return fmt.Errorf("archive %q: %w", p, err)
	}
	return nil
}

// walk writes name (in dirfd) as aname and, for a directory, everything below
// it. It descends through fds opened with O_NOFOLLOW: a symlink is written as
// a symlink and never followed.
func (a *archiver) walk(ctx context.Context, dirfd int, name, aname string, depth int) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if depth > maxPathLen/2 {
		return unix.ELOOP
	}
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if depth > 0 && err == unix.ENOENT { // removed while we archive
			return nil
		}
		return err
	}
	hdr := &tar.Header{
		Name:    aname,
		Mode:    int64(st.Mode & 0o7777),
		Uid:     int(a.m.fromHost(st.Uid)),
		Gid:     int(a.m.fromHost(st.Gid)),
		ModTime: time.Unix(st.Mtim.Unix()),
		Format:  tar.FormatPAX,
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), aname)
		defer f.Close()
		hdr.Typeflag = tar.TypeDir
		hdr.Name = strings.TrimSuffix(aname, "/") + "/"
		if err := a.xattrs(fd, hdr); err != nil {
			return err
		}
		if err := a.tw.WriteHeader(hdr); err != nil {
			return err
		}
		names, err := f.Readdirnames(-1)
		if err != nil {
			return err
		}
		slices.Sort(names)
		for _, n := range names {
			if err := a.walk(ctx, fd, n, path.Join(aname, n), depth+1); err != nil {
				return err
			}
		}
		return nil

	case unix.S_IFREG:
		key := [2]uint64{st.Dev, st.Ino}
		if st.Nlink > 1 {
			if first, ok := a.inodes[key]; ok {
				hdr.Typeflag = tar.TypeLink
				hdr.Linkname = first
				return a.tw.WriteHeader(hdr)
			}
			a.inodes[key] = aname
		}
		pfd, err := unix.Openat(dirfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		f, err := reopen(pfd)
		unix.Close(pfd)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := unix.Fstat(int(f.Fd()), &st); err != nil {
			return err
		}
		hdr.Typeflag = tar.TypeReg
		hdr.Size = st.Size
		if err := a.xattrs(int(f.Fd()), hdr); err != nil {
			return err
		}
		if err := a.tw.WriteHeader(hdr); err != nil {
			return err
		}
		n, err := io.CopyN(a.tw, ctxReader{ctx, f}, hdr.Size)
		if err == io.EOF { // shrank meanwhile: pad to keep the archive valid
			_, err = io.CopyN(a.tw, zeros{}, hdr.Size-n)
		}
		return err

	case unix.S_IFLNK:
		t, err := readlinkat(dirfd, name)
		if err != nil {
			return err
		}
		hdr.Typeflag = tar.TypeSymlink
		hdr.Linkname = t
		return a.tw.WriteHeader(hdr)

	case unix.S_IFIFO:
		hdr.Typeflag = tar.TypeFifo
		return a.tw.WriteHeader(hdr)
	}
	// Sockets and device nodes (such as overlay whiteouts) cannot be
	// uploaded back, so they are left out.
	return nil
}

func (a *archiver) xattrs(fd int, hdr *tar.Header) error {
	sz, err := unix.Flistxattr(fd, nil)
	if err != nil || sz == 0 {
		return nil // no xattr support is no xattrs
	}
	buf := make([]byte, sz)
	sz, err = unix.Flistxattr(fd, buf)
	if err != nil {
		return nil
	}
	for _, name := range bytes.Split(buf[:sz], []byte{0}) {
		n := string(name)
		if n == "" || !a.m.keepXattr(n) {
			continue
		}
		vsz, err := unix.Fgetxattr(fd, n, nil)
		if err != nil {
			continue
		}
		val := make([]byte, vsz)
		vsz, err = unix.Fgetxattr(fd, n, val)
		if err != nil {
			continue
		}
		if hdr.PAXRecords == nil {
			hdr.PAXRecords = map[string]string{}
		}
		hdr.PAXRecords[paxXattr+n] = string(val[:vsz])
	}
	return nil
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}
