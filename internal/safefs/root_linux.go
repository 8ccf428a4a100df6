//go:build linux

package safefs

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
)

const (
	// inRoot resolves like a chroot at the dirfd: ".." stops at it and
	// absolute symlinks start from it. Magic links (/proc/self/fd/N, which a
	// sandbox could plant to point anywhere) are refused outright.
	inRoot = unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS
	// beneath refuses (EXDEV) any resolution that would leave the dirfd.
	beneath = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS

	// overflowID is what ids outside the map show as, like the kernel's
	// /proc/sys/kernel/overflowuid.
	overflowID = 65534

	maxPathLen = unix.PathMax - 1
	maxNameLen = 255

	// openat2 fails with EAGAIN when a rename races with a RESOLVE_IN_ROOT
	// walk through ".."; we retry this many times before giving up.
	maxRetries = 128
)

// rootImpl holds the O_PATH dirfd everything is resolved from. fd, dir and m
// are set once by open.
type rootImpl struct {
	fd  int
	dir string
	m   IDMap

	// mu is held for reading by every operation and for writing by close,
	// so that the fd is never closed (and its number reused by an
	// unrelated file) while an operation resolves paths from it.
	mu sync.RWMutex
	// closed is set by close; operations after it fail with EBADF.
	closed bool
}

func open(dir string, m IDMap) (*Root, error) {
	if m.Size != 0 && uint64(m.HostBase)+uint64(m.Size) > 1<<32 {
		return nil, fmt.Errorf("open root %q: id map %d+%d overflows: %w", dir, m.HostBase, m.Size, errdefs.ErrInvalidArgument)
	}
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, wrapErrno("open root", dir, err)
	}
	return &Root{impl: rootImpl{fd: fd, dir: dir, m: m}}, nil
}

func (r *rootImpl) close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	return unix.Close(r.fd)
}

// hold keeps the root open until the returned func is called.
func (r *rootImpl) hold() func() {
	r.mu.RLock()
	return r.mu.RUnlock
}

// ids

func (m IDMap) identity() bool { return m.Size == 0 }

// toHost maps a sandbox id to a host id.
func (m IDMap) toHost(id uint32) (int, error) {
	if m.identity() {
		return int(id), nil
	}
	if id >= m.Size {
		return 0, fmt.Errorf("id %d outside the sandbox's %d ids: %w", id, m.Size, errdefs.ErrInvalidArgument)
	}
	return int(m.HostBase + id), nil
}

// fromHost maps a host id to what the sandbox sees.
func (m IDMap) fromHost(id uint32) uint32 {
	if m.identity() {
		return id
	}
	if id < m.HostBase || id-m.HostBase >= m.Size {
		return overflowID
	}
	return id - m.HostBase
}

// rootID is the host id of the sandbox's root.
func (m IDMap) rootID() int { return int(m.HostBase) }

// paths

// cleanPath turns a path inside the root (absolute or relative to the root)
// into a clean relative one ("." for the root). A ".." that would climb above
// the root is refused rather than clamped: the caller meant something else.
func cleanPath(p string) (string, error) {
	if strings.IndexByte(p, 0) >= 0 {
		return "", fmt.Errorf("path %q has a nul byte: %w", p, errdefs.ErrInvalidArgument)
	}
	if len(p) > maxPathLen {
		return "", fmt.Errorf("path %q...: longer than %d bytes: %w", p[:64], maxPathLen, errdefs.ErrInvalidArgument)
	}
	var out []string
	for _, c := range strings.Split(p, "/") {
		switch c {
		case "", ".":
		case "..":
			if len(out) == 0 {
				return "", fmt.Errorf("path %q escapes the root: %w", p, errdefs.ErrInvalidArgument)
			}
			out = out[:len(out)-1]
		default:
			if len(c) > maxNameLen {
				return "", fmt.Errorf("path %q: component longer than %d bytes: %w", p, maxNameLen, errdefs.ErrInvalidArgument)
			}
			out = append(out, c)
		}
	}
	if len(out) == 0 {
		return ".", nil
	}
	return strings.Join(out, "/"), nil
}

// split returns the directory and base name of a clean relative path.
func split(rel string) (string, string) {
	d, b := path.Split(rel)
	if d == "" {
		d = "."
	}
	return strings.TrimSuffix(d, "/"), b
}

// resolver opens paths relative to a dirfd, never leaving it.
type resolver struct {
	fd      int
	resolve uint64
}

// res resolves from the root. The caller holds r.hold().
func (r *rootImpl) res() resolver {
	if r.closed {
		return resolver{fd: -1, resolve: inRoot} // EBADF
	}
	return resolver{fd: r.fd, resolve: inRoot}
}

// open opens rel (a clean relative path) with openat2, following symlinks
// within the resolver's root, including a final one unless flags has
// O_NOFOLLOW.
func (rs resolver) open(rel string, flags int, mode uint32) (int, error) {
	how := &unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC), Mode: uint64(mode), Resolve: rs.resolve}
	for range maxRetries {
		fd, err := unix.Openat2(rs.fd, rel, how)
		if err == unix.EAGAIN || err == unix.EINTR {
			continue
		}
		return fd, err
	}
	return -1, fmt.Errorf("openat2 kept racing with renames: %w", errdefs.ErrUnavailable)
}

// openDir opens the directory rel as an O_PATH fd.
func (rs resolver) openDir(rel string) (int, error) {
	return rs.open(rel, unix.O_PATH|unix.O_DIRECTORY, 0)
}

// mkdirAll creates rel and its missing parents (mode perm, owned by uid:gid)
// and returns an O_PATH fd of it. Each component is created with mkdirat on
// the fd of its resolved parent, so a symlink planted in a component is
// followed only within the resolver's root and a name is never created
// anywhere else.
func (rs resolver) mkdirAll(rel string, perm uint32, uid, gid int) (int, error) {
	if fd, err := rs.openDir(rel); err == nil || err != unix.ENOENT {
		return fd, err
	}
	comps := strings.Split(rel, "/")
	parent, err := unix.Dup(rs.fd)
	if err != nil {
		return -1, err
	}
	unix.CloseOnExec(parent)
	for i := range comps {
		fd, err := rs.openDir(strings.Join(comps[:i+1], "/"))
		if err == unix.ENOENT {
			if err := mkdirOwned(parent, comps[i], perm, uid, gid); err != nil && err != unix.EEXIST {
				unix.Close(parent)
				return -1, err
			}
			fd, err = rs.openDir(strings.Join(comps[:i+1], "/"))
		}
		unix.Close(parent)
		if err != nil {
			return -1, err
		}
		parent = fd
	}
	return parent, nil
}

// mkdirOwned creates name in dirfd with exactly perm (umask ignored) and
// owner uid:gid, working on an fd of the new directory so that a swap for a
// symlink in between cannot redirect the chown or chmod.
func mkdirOwned(dirfd int, name string, perm uint32, uid, gid int) error {
	if err := unix.Mkdirat(dirfd, name, 0o700); err != nil {
		return err
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Fchown(fd, uid, gid); err != nil {
		return err
	}
	return unix.Fchmod(fd, perm)
}

// reopen turns an O_PATH fd of a regular file into a readable one without a
// second path walk (through the fd's magic link in our own /proc), so that
// the file checked is the file read and no device or fifo is ever opened.
func reopen(pathfd int) (*os.File, error) {
	var st unix.Stat_t
	if err := unix.Fstat(pathfd, &st); err != nil {
		return nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, errNotRegular(st.Mode)
	}
	fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(pathfd), unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, err
	}
	var st2 unix.Stat_t
	if err := unix.Fstat(fd, &st2); err != nil || st2.Ino != st.Ino || st2.Dev != st.Dev {
		unix.Close(fd)
		return nil, fmt.Errorf("file changed while opening: %w", errdefs.ErrUnavailable)
	}
	return os.NewFile(uintptr(fd), ""), nil
}

type notRegularError struct{ mode uint32 }

func errNotRegular(mode uint32) error { return notRegularError{mode} }

func (e notRegularError) Error() string {
	if e.mode&unix.S_IFMT == unix.S_IFDIR {
		return "is a directory"
	}
	return "not a regular file"
}

func (e notRegularError) Unwrap() error { return errdefs.ErrFailedPrecondition }

// wrapErrno adds an error class to err and the operation and path as context.
func wrapErrno(op, p string, err error) error {
	return fmt.Errorf("%s %q: %w", op, p, classed(err))
}

// classed adds the error class an errno belongs to, unless err has one.
func classed(err error) error {
	if errdefs.Classify(err) != errdefs.ClassUnknown {
		return err
	}
	var class error
	switch {
	case errors.Is(err, unix.ENOENT):
		class = errdefs.ErrNotFound
	case errors.Is(err, unix.EXDEV), errors.Is(err, unix.ELOOP), errors.Is(err, unix.ENAMETOOLONG), errors.Is(err, unix.EINVAL):
		class = errdefs.ErrInvalidArgument
	case errors.Is(err, unix.EEXIST):
		class = errdefs.ErrAlreadyExists
	case errors.Is(err, unix.ENOTDIR), errors.Is(err, unix.EISDIR), errors.Is(err, unix.EBADF), errors.Is(err, unix.ENOTEMPTY), errors.Is(err, unix.EBUSY):
		class = errdefs.ErrFailedPrecondition
	case errors.Is(err, unix.ENOSPC), errors.Is(err, unix.EDQUOT), errors.Is(err, unix.EMFILE), errors.Is(err, unix.ENFILE):
		class = errdefs.ErrResourceExhausted
	case errors.Is(err, unix.EACCES), errors.Is(err, unix.EPERM), errors.Is(err, unix.EROFS):
		class = errdefs.ErrPermissionDenied
	}
	if class == nil {
		return err
	}
	if errors.Is(err, unix.EXDEV) {
		return fmt.Errorf("%w: resolution would leave the directory: %w", class, err)
	}
	return fmt.Errorf("%w: %w", class, err)
}

// modes

// toUnixMode also honours raw 07000 bits (as in 0o4755), which no fs.Mode
// flag uses, so that callers may pass either spelling.
func toUnixMode(m fs.FileMode) uint32 {
	u := uint32(m.Perm()) | uint32(m)&0o7000
	if m&fs.ModeSetuid != 0 {
		u |= unix.S_ISUID
	}
	if m&fs.ModeSetgid != 0 {
		u |= unix.S_ISGID
	}
	if m&fs.ModeSticky != 0 {
		u |= unix.S_ISVTX
	}
	return u
}

func fromUnixMode(u uint32) fs.FileMode {
	m := fs.FileMode(u & 0o777)
	if u&unix.S_ISUID != 0 {
		m |= fs.ModeSetuid
	}
	if u&unix.S_ISGID != 0 {
		m |= fs.ModeSetgid
	}
	if u&unix.S_ISVTX != 0 {
		m |= fs.ModeSticky
	}
	switch u & unix.S_IFMT {
	case unix.S_IFDIR:
		m |= fs.ModeDir
	case unix.S_IFLNK:
		m |= fs.ModeSymlink
	case unix.S_IFIFO:
		m |= fs.ModeNamedPipe
	case unix.S_IFSOCK:
		m |= fs.ModeSocket
	case unix.S_IFCHR:
		m |= fs.ModeDevice | fs.ModeCharDevice
	case unix.S_IFBLK:
		m |= fs.ModeDevice
	}
	return m
}

func (r *rootImpl) info(dirfd int, name, abs string, st *unix.Stat_t) (FileInfo, error) {
	fi := FileInfo{
		Name:    path.Base(abs),
		Path:    abs,
		Size:    st.Size,
		Mode:    fromUnixMode(st.Mode),
		ModTime: time.Unix(st.Mtim.Unix()),
		UID:     r.m.fromHost(st.Uid),
		GID:     r.m.fromHost(st.Gid),
	}
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		t, err := readlinkat(dirfd, name)
		if err != nil {
			return FileInfo{}, err
		}
		fi.LinkTarget = t
	}
	return fi, nil
}

func readlinkat(dirfd int, name string) (string, error) {
	for size := 256; ; size *= 2 {
		buf := make([]byte, size)
		n, err := unix.Readlinkat(dirfd, name, buf)
		if err != nil {
			return "", err
		}
		if n < size {
			return string(buf[:n]), nil
		}
		if size > unix.PathMax {
			return "", unix.ENAMETOOLONG
		}
	}
}

func absPath(rel string) string {
	if rel == "." {
		return "/"
	}
	return "/" + rel
}

// operations

func (r *rootImpl) stat(ctx context.Context, p string) (FileInfo, error) {
	defer r.hold()()
	rel, err := cleanPath(p)
	if err != nil {
		return FileInfo{}, fmt.Errorf("stat: %w", err)
	}
	dir, base := split(rel)
	dfd, err := r.res().openDir(dir)
	if err != nil {
		return FileInfo{}, wrapErrno("stat", p, err)
	}
	defer unix.Close(dfd)
	if rel == "." {
		base = "."
	}
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return FileInfo{}, wrapErrno("stat", p, err)
	}
	fi, err := r.info(dfd, base, absPath(rel), &st)
	if err != nil {
		return FileInfo{}, wrapErrno("stat", p, err)
	}
	return fi, nil
}

func (r *rootImpl) listDir(ctx context.Context, p string) ([]FileInfo, error) {
	defer r.hold()()
	rel, err := cleanPath(p)
	if err != nil {
		return nil, fmt.Errorf("list directory: %w", err)
	}
	fd, err := r.res().open(rel, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil, wrapErrno("list directory", p, err)
	}
	f := os.NewFile(uintptr(fd), p)
	defer f.Close()
	names, err := f.Readdirnames(-1)
	if err != nil {
		return nil, wrapErrno("list directory", p, err)
	}
	slices.Sort(names)
	out := make([]FileInfo, 0, len(names))
	for _, n := range names {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		var st unix.Stat_t
		if err := unix.Fstatat(fd, n, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if err == unix.ENOENT { // removed meanwhile
				continue
			}
			return nil, wrapErrno("list directory", p, err)
		}
		fi, err := r.info(fd, n, path.Join(absPath(rel), n), &st)
		if err != nil {
			return nil, wrapErrno("list directory", p, err)
		}
		out = append(out, fi)
	}
	return out, nil
}

func (r *rootImpl) mkdir(ctx context.Context, p string, perm fs.FileMode, parents bool) error {
	defer r.hold()()
	rel, err := cleanPath(p)
	if err != nil {
		return fmt.Errorf("mkdir: %w", err)
	}
	uid := r.m.rootID()
	if rel == "." {
		if parents {
			return nil
		}
		return fmt.Errorf("mkdir %q: %w", p, errdefs.ErrAlreadyExists)
	}
	if parents {
		fd, err := r.res().mkdirAll(rel, toUnixMode(perm), uid, uid)
		if err != nil {
			return wrapErrno("mkdir", p, err)
		}
		unix.Close(fd)
		return nil
	}
	dir, base := split(rel)
	dfd, err := r.res().openDir(dir)
	if err != nil {
		return wrapErrno("mkdir", p, err)
	}
	defer unix.Close(dfd)
	if err := mkdirOwned(dfd, base, toUnixMode(perm), uid, uid); err != nil {
		return wrapErrno("mkdir", p, err)
	}
	return nil
}

func (r *rootImpl) remove(ctx context.Context, p string, recursive bool) error {
	defer r.hold()()
	rel, err := cleanPath(p)
	if err != nil {
		return fmt.Errorf("remove: %w", err)
	}
	if rel == "." {
		return fmt.Errorf("remove %q: refusing to remove the root: %w", p, errdefs.ErrInvalidArgument)
	}
	dir, base := split(rel)
	dfd, err := r.res().openDir(dir)
	if err != nil {
		return wrapErrno("remove", p, err)
	}
	defer unix.Close(dfd)
	if recursive {
		err = removeAll(ctx, dfd, base, 0)
	} else {
		err = removeOne(dfd, base)
	}
	if err != nil {
		return wrapErrno("remove", p, err)
	}
	return nil
}

// removeOne removes a non-directory or an empty directory.
func removeOne(dirfd int, name string) error {
	err := unix.Unlinkat(dirfd, name, 0)
	if err == unix.EISDIR {
		err = unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR)
	}
	return err
}

// removeAll removes name in dirfd and, for a directory, everything below it,
// descending through fds opened with O_NOFOLLOW so it never leaves the tree.
func removeAll(ctx context.Context, dirfd int, name string, depth int) error {
	if depth > maxPathLen/2 {
		return unix.ELOOP
	}
	err := removeOne(dirfd, name)
	if err == nil || err == unix.ENOENT {
		return nil
	}
	if err != unix.ENOTEMPTY && err != unix.EEXIST {
		return err
	}
	for range 8 { // the sandbox may keep adding entries; bounded retries
		if err := ctx.Err(); err != nil {
			return err
		}
		fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), name)
		names, err := f.Readdirnames(-1)
		if err == nil {
			for _, n := range names {
				if err = removeAll(ctx, fd, n, depth+1); err != nil {
					break
				}
			}
		}
		f.Close()
		if err != nil {
			return err
		}
		err = unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR)
		if err != unix.ENOTEMPTY && err != unix.EEXIST {
			return err
		}
	}
	return unix.ENOTEMPTY
}

func (r *rootImpl) readFile(ctx context.Context, p string, w io.Writer, max int64) (int64, error) {
	defer r.hold()()
	rel, err := cleanPath(p)
	if err != nil {
		return 0, fmt.Errorf("read file: %w", err)
	}
	pfd, err := r.res().open(rel, unix.O_PATH, 0)
	if err != nil {
		return 0, wrapErrno("read file", p, err)
	}
	f, err := reopen(pfd)
	unix.Close(pfd)
	if err != nil {
		return 0, wrapErrno("read file", p, err)
	}
	defer f.Close()
	src := io.Reader(ctxReader{ctx, f})
	if max <= 0 {
		n, err := io.Copy(w, src)
		if err != nil {
			return n, fmt.Errorf("read file %q: %w", p, err)
		}
		return n, nil
	}
	n, err := io.CopyN(w, src, max)
	if err == io.EOF {
		return n, nil
	}
	if err != nil {
		return n, fmt.Errorf("read file %q: %w", p, err)
	}
	var one [1]byte
	if k, _ := io.ReadFull(f, one[:]); k > 0 {
		return n, fmt.Errorf("read file %q: larger than %d bytes: %w", p, max, errdefs.ErrResourceExhausted)
	}
	return n, nil
}

func (r *rootImpl) writeFile(ctx context.Context, p string, rd io.Reader, perm fs.FileMode, max int64) (err error) {
	defer r.hold()()
	rel, err := cleanPath(p)
	if err != nil {
		return fmt.Errorf("write file: %w", err)
	}
	if rel == "." {
		return fmt.Errorf("write file %q: is the root: %w", p, errdefs.ErrInvalidArgument)
	}
	if max <= 0 {
		max = DefaultMaxBytes
	}
	uid := r.m.rootID()
	dir, base := split(rel)
	dfd, err := r.res().mkdirAll(dir, 0o755, uid, uid)
	if err != nil {
		return wrapErrno("write file", p, err)
	}
	defer unix.Close(dfd)
	tmp := ".deltabox-" + randomSuffix()
	fd, err := unix.Openat(dfd, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return wrapErrno("write file", p, err)
	}
	f := os.NewFile(uintptr(fd), tmp)
	defer func() {
		if f != nil {
			f.Close()
		}
		if err != nil {
			unix.Unlinkat(dfd, tmp, 0)
		}
	}()
	n, err := io.Copy(f, io.LimitReader(ctxReader{ctx, rd}, max+1))
	if err != nil {
		// A full disk (ENOSPC from the write) is resource exhausted.
		return fmt.Errorf("write file %q: %w", p, classed(err))
	}
	if n > max {
		return fmt.Errorf("write file %q: more than %d bytes: %w", p, max, errdefs.ErrResourceExhausted)
	}
	if err := unix.Fchown(fd, uid, uid); err != nil {
		return wrapErrno("write file", p, err)
	}
	if err := unix.Fchmod(fd, toUnixMode(perm)); err != nil {
		return wrapErrno("write file", p, err)
	}
	err = f.Close()
	f = nil
	if err != nil {
		return fmt.Errorf("write file %q: %w", p, classed(err))
	}
	if err := unix.Renameat(dfd, tmp, dfd, base); err != nil {
		return wrapErrno("write file", p, err)
	}
	return nil
}

func randomSuffix() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// ctxReader stops a copy when its context is done.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}
