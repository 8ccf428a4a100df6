//go:build linux

// Package safefs reads and writes files inside a sandbox's root filesystem
// from the host, confined to that root: every path is resolved with openat2
// RESOLVE_IN_ROOT, so ".." and symlinks (absolute or relative) can never leave
// it, and ownership is shifted between the sandbox's ids and the host's.
//
// THIS FILE IS THE AGREED API (written before the implementation): keep the
// exported names and signatures; implement them in other files.
package safefs

import (
	"context"
	"io"
	"io/fs"
	"time"
)

// IDMap shifts ids: an id n inside the sandbox is HostBase+n on the host, for
// n < Size. The zero IDMap is the identity (an image being built).
type IDMap struct {
	HostBase uint32
	Size     uint32
}

// FileInfo describes one file as the sandbox sees it.
type FileInfo struct {
	Name       string // base name
	Path       string // absolute path inside the root
	Size       int64
	Mode       fs.FileMode // type bits + permissions incl. setuid/setgid/sticky
	ModTime    time.Time
	UID, GID   uint32 // as seen inside the sandbox
	LinkTarget string // for symlinks
}

// Limits bound what TarIn accepts (tar bombs) and what ReadFile returns.
type Limits struct {
	MaxBytes   int64 // total bytes of file content; 0 means DefaultMaxBytes
	MaxEntries int64 // entries; 0 means DefaultMaxEntries
}

const (
	DefaultMaxBytes   = 4 << 30
	DefaultMaxEntries = 1_000_000
)

// Root is an open sandbox root. It is safe for concurrent use.
type Root struct{ impl rootImpl }

// Open opens dir as a root whose ids are shifted by m.
func Open(dir string, m IDMap) (*Root, error) { return open(dir, m) }

// Close releases the root's dirfd. Calls after Close fail; a second Close is
// a no-op.
func (r *Root) Close() error { return r.impl.close() }

// ReadFile copies the content of the regular file at path to w, at most max
// bytes (0: no limit); more fails with ErrResourceExhausted and nothing beyond
// max is written.
func (r *Root) ReadFile(ctx context.Context, path string, w io.Writer, max int64) (int64, error) {
	return r.impl.readFile(ctx, path, w, max)
}

// WriteFile replaces the file at path with what rd yields (at most max bytes,
// 0: DefaultMaxBytes), creating missing parent directories (0755, owned by the
// sandbox's root). The new file is owned by the sandbox's root and has mode
// perm. The replacement is atomic (temp file + rename).
func (r *Root) WriteFile(ctx context.Context, path string, rd io.Reader, perm fs.FileMode, max int64) error {
	return r.impl.writeFile(ctx, path, rd, perm, max)
}

// Stat describes path without following a final symlink.
func (r *Root) Stat(ctx context.Context, path string) (FileInfo, error) {
	return r.impl.stat(ctx, path)
}

// ListDir lists a directory, sorted by name.
func (r *Root) ListDir(ctx context.Context, path string) ([]FileInfo, error) {
	return r.impl.listDir(ctx, path)
}

// Mkdir creates a directory (and its parents when parents is set).
func (r *Root) Mkdir(ctx context.Context, path string, perm fs.FileMode, parents bool) error {
	return r.impl.mkdir(ctx, path, perm, parents)
}

// Remove removes a file or an empty directory; with recursive, a whole tree.
// Removing "/" is refused.
func (r *Root) Remove(ctx context.Context, path string, recursive bool) error {
	return r.impl.remove(ctx, path, recursive)
}

// TarOut writes a tar stream of path (a file, or a directory and everything
// below it) to w. Entry names are relative to path's parent, so the archive of
// /work/src holds "src/...". Ids are shown as inside the sandbox.
func (r *Root) TarOut(ctx context.Context, path string, w io.Writer) error {
	return r.impl.tarOut(ctx, path, w)
}

// TarIn extracts a tar stream into the directory dst (created if missing):
// regular files, directories, symlinks, hardlinks (to entries inside the
// root), fifos; modes, mtimes and xattrs kept; ids shifted to the host.
// Entries escaping dst through ".." or absolute names, links pointing out,
// device nodes and anything over lim are refused with ErrInvalidArgument or
// ErrResourceExhausted, before anything outside dst is touched.
func (r *Root) TarIn(ctx context.Context, dst string, rd io.Reader, lim Limits) error {
	return r.impl.tarIn(ctx, dst, rd, lim)
}
