//go:build linux

package core

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// OpaqueXattr marks an overlay directory that hides what lies below it. The
// overlay is mounted by host root without userxattr, so it is trusted.*.
const OpaqueXattr = "trusted.overlay.opaque"

// IsWhiteout reports whether st is an overlay whiteout (a 0/0 char device).
func IsWhiteout(st *unix.Stat_t) bool {
	return st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == 0
}

func isOpaque(p string) bool {
	b := make([]byte, 8)
	n, err := unix.Lgetxattr(p, OpaqueXattr, b)
	return err == nil && n == 1 && b[0] == 'y'
}

// Xattrs returns every extended attribute of p (not following symlinks).
func Xattrs(p string) (map[string][]byte, error) {
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(p, buf)
	if errors.Is(err, unix.ERANGE) {
		sz, err2 := unix.Llistxattr(p, nil)
		if err2 != nil {
			return nil, err2
		}
		buf = make([]byte, sz)
		n, err = unix.Llistxattr(p, buf)
	}
	if err != nil {
		if errors.Is(err, unix.ENOTSUP) {
			return nil, nil
		}
		return nil, err
	}
	var out map[string][]byte
	for _, name := range strings.Split(string(buf[:n]), "\x00") {
		if name == "" {
			continue
		}
		v := make([]byte, 256)
		m, err := unix.Lgetxattr(p, name, v)
		if errors.Is(err, unix.ERANGE) {
			sz, err2 := unix.Lgetxattr(p, name, nil)
			if err2 != nil {
				return nil, err2
			}
			v = make([]byte, sz)
			m, err = unix.Lgetxattr(p, name, v)
		}
		if err != nil {
			if errors.Is(err, unix.ENODATA) {
				continue
			}
			return nil, err
		}
		if out == nil {
			out = map[string][]byte{}
		}
		out[name] = v[:m]
	}
	return out, nil
}

// copier copies filesystem trees exactly: types, modes (setuid bits too),
// owners, xattrs (trusted.* included, so whiteouts and opaque directories
// survive), times, sparse files and hardlinks within one copy.
type copier struct {
	reflink bool                 // try FICLONE before copying data
	link    bool                 // hardlink regular files from src (immutable sources only)
	links   map[[2]uint64]string // (dev, ino) of a multiply linked source -> its first copy
}

func newCopier(reflink, link bool) *copier {
	return &copier{reflink: reflink, link: link, links: map[[2]uint64]string{}}
}

// CopyTree copies the directory src to dst (which must not exist), using
// FICLONE reflinks where the filesystem allows.
func CopyTree(src, dst string) error {
	return newCopier(true, false).copyPath(src, dst)
}

func (c *copier) copyPath(src, dst string) error {
	var st unix.Stat_t
	if err := unix.Lstat(src, &st); err != nil {
		return fmt.Errorf("copy %q: %w", src, err)
	}
	return c.copyEntry(src, dst, &st)
}

func (c *copier) copyEntry(src, dst string, st *unix.Stat_t) error {
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		if err := unix.Mkdir(dst, 0o700); err != nil {
			return fmt.Errorf("copy %q: %w", src, err)
		}
		ents, err := os.ReadDir(src)
		if err != nil {
			return fmt.Errorf("copy %q: %w", src, err)
		}
		for _, e := range ents {
			if err := c.copyPath(filepath.Join(src, e.Name()), filepath.Join(dst, e.Name())); err != nil {
				return err
			}
		}
	case unix.S_IFREG:
		key := [2]uint64{st.Dev, st.Ino}
		if first, ok := c.links[key]; ok {
			if err := unix.Link(first, dst); err != nil {
				return fmt.Errorf("copy %q: %w", src, err)
			}
			return nil // attributes are the inode's, already set
		}
		if c.link {
			if err := unix.Link(src, dst); err == nil {
				return nil
			}
		}
		if err := c.copyFile(src, dst, st); err != nil {
			return err
		}
		if st.Nlink > 1 {
			c.links[key] = dst
		}
	case unix.S_IFLNK:
		target, err := os.Readlink(src)
		if err != nil {
			return fmt.Errorf("copy %q: %w", src, err)
		}
		if err := unix.Symlink(target, dst); err != nil {
			return fmt.Errorf("copy %q: %w", src, err)
		}
	default: // devices (whiteouts too), fifos, sockets
		if err := unix.Mknod(dst, st.Mode, int(st.Rdev)); err != nil {
			return fmt.Errorf("copy %q: %w", src, err)
		}
	}
	return copyAttrs(src, dst, st)
}

func (c *copier) copyFile(src, dst string, st *unix.Stat_t) error {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("copy %q: %w", src, err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("copy %q: %w", src, err)
	}
	defer out.Close()
	if c.reflink && st.Size > 0 {
		if err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd())); err == nil {
			return nil
		}
	}
	// Copy data segments only, so that sparse files stay sparse.
	var off int64
	for off < st.Size {
		data, err := unix.Seek(int(in.Fd()), off, unix.SEEK_DATA)
		if err != nil {
			break // ENXIO: only a hole remains
		}
		hole, err := unix.Seek(int(in.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			hole = st.Size
		}
		if _, err := in.Seek(data, io.SeekStart); err != nil {
			return fmt.Errorf("copy %q: %w", src, err)
		}
		if _, err := out.Seek(data, io.SeekStart); err != nil {
			return fmt.Errorf("copy %q: %w", src, err)
		}
		if _, err := io.CopyN(out, in, hole-data); err != nil {
			return fmt.Errorf("copy %q: %w", src, err)
		}
		off = hole
	}
	if err := out.Truncate(st.Size); err != nil {
		return fmt.Errorf("copy %q: %w", src, err)
	}
	return nil
}

// copyAttrs gives dst src's owner, mode, xattrs and times. The owner goes
// first: chown clears setuid bits.
func copyAttrs(src, dst string, st *unix.Stat_t) error {
	if err := unix.Lchown(dst, int(st.Uid), int(st.Gid)); err != nil {
		return fmt.Errorf("copy %q: %w", src, err)
	}
	isLink := st.Mode&unix.S_IFMT == unix.S_IFLNK
	if !isLink {
		if err := unix.Chmod(dst, st.Mode&0o7777); err != nil {
			return fmt.Errorf("copy %q: %w", src, err)
		}
	}
	xs, err := Xattrs(src)
	if err != nil {
		return fmt.Errorf("copy %q: xattrs: %w", src, err)
	}
	for k, v := range xs {
		if err := unix.Lsetxattr(dst, k, v, 0); err != nil {
			return fmt.Errorf("copy %q: set xattr %s: %w", src, k, err)
		}
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, dst, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("copy %q: %w", src, err)
	}
	return nil
}

// Flatten merges overlay layers (top first) into dst, a new directory, so
// that dst alone shows what the stack shows. Whiteouts and opaque
// directories are kept: they may hide the image below. Regular files are
// hardlinked from the (immutable) layers when possible.
func Flatten(lowers []string, dst string) error {
	c := newCopier(true, true)
	if err := os.Mkdir(dst, 0o755); err != nil {
		return fmt.Errorf("flatten into %q: %w", dst, err)
	}
	for i := len(lowers) - 1; i >= 0; i-- {
		if err := c.apply(lowers[i], dst); err != nil {
			return fmt.Errorf("flatten %q into %q: %w", lowers[i], dst, err)
		}
	}
	return nil
}

// apply applies the layer directory src onto dst with overlay semantics.
func (c *copier) apply(src, dst string) error {
	var st unix.Stat_t
	if err := unix.Lstat(src, &st); err != nil {
		return err
	}
	if err := copyAttrs(src, dst, &st); err != nil {
		return err
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range ents {
		s, d := filepath.Join(src, e.Name()), filepath.Join(dst, e.Name())
		var est, dst2 unix.Stat_t
		if err := unix.Lstat(s, &est); err != nil {
			return err
		}
		derr := unix.Lstat(d, &dst2)
		if est.Mode&unix.S_IFMT == unix.S_IFDIR {
			switch {
			case derr == nil && dst2.Mode&unix.S_IFMT == unix.S_IFDIR && !isOpaque(s):
				// merge into the directory below
			case derr == nil && dst2.Mode&unix.S_IFMT == unix.S_IFDIR:
				if err := os.RemoveAll(d); err != nil {
					return err
				}
				if err := os.Mkdir(d, 0o700); err != nil {
					return err
				}
			default:
				wasWhiteout := derr == nil && IsWhiteout(&dst2)
				if derr == nil {
					if err := os.RemoveAll(d); err != nil {
						return err
					}
				}
				if err := os.Mkdir(d, 0o700); err != nil {
					return err
				}
				if wasWhiteout {
					// A directory over a whiteout hides what is below.
					if err := unix.Lsetxattr(d, OpaqueXattr, []byte("y"), 0); err != nil {
						return err
					}
				}
			}
			if err := c.apply(s, d); err != nil {
				return err
			}
			continue
		}
		if derr == nil {
			if err := os.RemoveAll(d); err != nil {
				return err
			}
		}
		if err := c.copyEntry(s, d, &est); err != nil {
			return err
		}
	}
	// Times last: adding entries changed them.
	return unix.UtimesNanoAt(unix.AT_FDCWD, dst, []unix.Timespec{st.Atim, st.Mtim}, unix.AT_SYMLINK_NOFOLLOW)
}

// node is one path of a merged view.
type node struct {
	real     string // the file that shows at this path
	st       unix.Stat_t
	whiteout bool
	opaque   bool             // a directory that hides the image's directory below it
	children map[string]*node // directories only
}

// Merge builds the tree an overlay of lowers (top first) shows. A whiteout
// stays in the tree as a marker: it hides a file of the image.
func Merge(lowers []string) (*node, error) {
	root := &node{children: map[string]*node{}}
	for i := len(lowers) - 1; i >= 0; i-- {
		if err := mergeDir(root, lowers[i]); err != nil {
			return nil, fmt.Errorf("read layer %q: %w", lowers[i], err)
		}
	}
	return root, nil
}

func mergeDir(n *node, dir string) error {
	if err := unix.Lstat(dir, &n.st); err != nil {
		return err
	}
	n.real = dir
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		p := filepath.Join(dir, e.Name())
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		cur := n.children[e.Name()]
		switch {
		case st.Mode&unix.S_IFMT == unix.S_IFDIR:
			if cur == nil || cur.children == nil || isOpaque(p) {
				// Over a file or a whiteout, a directory hides the image's
				// too (overlay stops its lookup there).
				hides := cur != nil || isOpaque(p)
				cur = &node{children: map[string]*node{}, opaque: hides}
				n.children[e.Name()] = cur
			}
			if err := mergeDir(cur, p); err != nil {
				return err
			}
		case IsWhiteout(&st):
			n.children[e.Name()] = &node{real: p, st: st, whiteout: true}
		default:
			n.children[e.Name()] = &node{real: p, st: st}
		}
	}
	return nil
}

// Change is one differing path; Kind is 'A', 'M' or 'D'.
type Change struct {
	Path string
	Kind byte
}

// DiffTrees lists what differs from a to b (see layer.Store.Diff), sorted.
func DiffTrees(a, b *node) ([]Change, error) {
	var out []Change
	err := diffNode("/", a, b, &out)
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, err
}

func visible(n *node) bool { return n != nil && !n.whiteout }

func diffNode(p string, a, b *node, out *[]Change) error {
	names := map[string]bool{}
	for k := range a.children {
		names[k] = true
	}
	for k := range b.children {
		names[k] = true
	}
	for name := range names {
		cp := filepath.Join(p, name)
		x, y := a.children[name], b.children[name]
		switch {
		case !visible(x) && !visible(y):
			// Neither shows a file of its own; they differ when one hides
			// the image's file (a whiteout, or an opaque directory above)
			// and the other lets it through.
			hx, hy := x != nil || a.opaque, y != nil || b.opaque
			switch {
			case hy && !hx:
				*out = append(*out, Change{cp, 'D'})
			case hx && !hy:
				*out = append(*out, Change{cp, 'A'})
			}
		case !visible(x):
			addAll(cp, y, 'A', out)
		case !visible(y):
			addAll(cp, x, 'D', out)
		default:
			same, err := sameEntry(x, y)
			if err != nil {
				return err
			}
			if !same {
				*out = append(*out, Change{cp, 'M'})
			}
			switch {
			case x.children != nil && y.children != nil:
				if err := diffNode(cp, x, y, out); err != nil {
					return err
				}
			case x.children != nil:
				addChildren(cp, x, 'D', out)
			case y.children != nil:
				addChildren(cp, y, 'A', out)
			}
		}
	}
	return nil
}

func addAll(p string, n *node, kind byte, out *[]Change) {
	*out = append(*out, Change{p, kind})
	addChildren(p, n, kind, out)
}

func addChildren(p string, n *node, kind byte, out *[]Change) {
	for name, c := range n.children {
		if visible(c) {
			addAll(filepath.Join(p, name), c, kind, out)
		}
	}
}

// sameEntry compares what a user sees of two entries: type, mode, owner,
// xattrs (but overlay's own), and for regular files size, mtime and bytes,
// for symlinks the target, for devices the number. Directory times and sizes
// are not compared: they change with their entries.
func sameEntry(x, y *node) (bool, error) {
	a, b := &x.st, &y.st
	if a.Mode != b.Mode || a.Uid != b.Uid || a.Gid != b.Gid {
		return false, nil
	}
	switch a.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		if a.Size != b.Size || a.Mtim != b.Mtim {
			return false, nil
		}
	case unix.S_IFLNK:
		ta, err1 := os.Readlink(x.real)
		tb, err2 := os.Readlink(y.real)
		if err := errors.Join(err1, err2); err != nil {
			return false, err
		}
		if ta != tb {
			return false, nil
		}
	case unix.S_IFCHR, unix.S_IFBLK:
		if a.Rdev != b.Rdev {
			return false, nil
		}
	}
	xa, err := Xattrs(x.real)
	if err != nil {
		return false, err
	}
	xb, err := Xattrs(y.real)
	if err != nil {
		return false, err
	}
	if !sameXattrs(xa, xb) {
		return false, nil
	}
	if a.Mode&unix.S_IFMT == unix.S_IFREG && !(a.Dev == b.Dev && a.Ino == b.Ino) {
		return sameContent(x.real, y.real)
	}
	return true, nil
}

func sameXattrs(a, b map[string][]byte) bool {
	strip := func(m map[string][]byte) map[string][]byte {
		out := map[string][]byte{}
		for k, v := range m {
			if !strings.HasPrefix(k, "trusted.overlay.") {
				out[k] = v
			}
		}
		return out
	}
	a, b = strip(a), strip(b)
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || !bytes.Equal(v, w) {
			return false
		}
	}
	return true
}

func sameContent(p, q string) (bool, error) {
	f, err := os.Open(p)
	if err != nil {
		return false, err
	}
	defer f.Close()
	g, err := os.Open(q)
	if err != nil {
		return false, err
	}
	defer g.Close()
	bf, bg := make([]byte, 1<<16), make([]byte, 1<<16)
	for {
		n, err1 := io.ReadFull(f, bf)
		m, err2 := io.ReadFull(g, bg)
		if n != m || !bytes.Equal(bf[:n], bg[:m]) {
			return false, nil
		}
		if err1 != nil || err2 != nil {
			return (err1 == io.EOF || err1 == io.ErrUnexpectedEOF) && (err2 == io.EOF || err2 == io.ErrUnexpectedEOF), nil
		}
	}
}

// CountTree returns the bytes (regular file sizes and symlink lengths) and
// inodes (entries, the root excluded) under dir.
func CountTree(dir string) (size, inodes int64, err error) {
	seen := map[uint64]bool{}
	err = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == dir {
			return nil
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		if seen[st.Ino] {
			return nil
		}
		if st.Nlink > 1 {
			seen[st.Ino] = true
		}
		inodes++
		if st.Mode&unix.S_IFMT == unix.S_IFREG || st.Mode&unix.S_IFMT == unix.S_IFLNK {
			size += st.Size
		}
		return nil
	})
	return size, inodes, err
}
