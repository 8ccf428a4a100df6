//go:build linux

package layertest

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// Entry is what a test compares of one path of a mounted layer.
type Entry struct {
	Type   string // "file", "dir", "symlink", "fifo", "char", "block", "socket"
	Mode   uint32 // permission bits with setuid, setgid, sticky
	UID    uint32
	GID    uint32
	Size   int64  // files
	Hash   string // files: sha256 of the content
	Target string // symlinks
	Rdev   uint64 // devices
	Xattrs string // user.* xattrs, sorted, "k=v;"
	Mtime  int64  // files, ns
	Ino    uint64 `json:"-"`
	Blocks int64  `json:"-"`
}

func typeOf(m uint32) string {
	switch m & unix.S_IFMT {
	case unix.S_IFREG:
		return "file"
	case unix.S_IFDIR:
		return "dir"
	case unix.S_IFLNK:
		return "symlink"
	case unix.S_IFIFO:
		return "fifo"
	case unix.S_IFCHR:
		return "char"
	case unix.S_IFBLK:
		return "block"
	case unix.S_IFSOCK:
		return "socket"
	}
	return "unknown"
}

func userXattrs(p string) (string, error) {
	buf := make([]byte, 64<<10)
	n, err := unix.Llistxattr(p, buf)
	if err != nil {
		if err == unix.ENOTSUP {
			return "", nil
		}
		return "", err
	}
	var kv []string
	for _, k := range strings.Split(string(buf[:n]), "\x00") {
		if !strings.HasPrefix(k, "user.") {
			continue
		}
		v := make([]byte, 64<<10)
		m, err := unix.Lgetxattr(p, k, v)
		if err != nil {
			return "", err
		}
		kv = append(kv, k+"="+string(v[:m])+";")
	}
	sort.Strings(kv)
	return strings.Join(kv, ""), nil
}

// ReadTree returns every entry under dir (a mounted layer), by path relative
// to dir ("/a/b"), the root excluded.
func ReadTree(dir string) (map[string]Entry, error) {
	out := map[string]Entry{}
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
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
		e := Entry{Type: typeOf(st.Mode), Mode: st.Mode & 0o7777, UID: st.Uid, GID: st.Gid, Ino: st.Ino, Blocks: st.Blocks}
		switch e.Type {
		case "file":
			e.Size = st.Size
			e.Mtime = st.Mtim.Nano()
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			h := sha256.New()
			_, err = io.Copy(h, f)
			f.Close()
			if err != nil {
				return err
			}
			e.Hash = hex.EncodeToString(h.Sum(nil))[:16]
		case "symlink":
			e.Mode = 0
			if e.Target, err = os.Readlink(p); err != nil {
				return err
			}
		case "char", "block":
			e.Rdev = st.Rdev
		}
		if e.Xattrs, err = userXattrs(p); err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		out[strings.TrimPrefix(p, dir)] = e
		return nil
	})
	return out, err
}

// dumpOnFailure lists dir (types, modes, owners, xattrs) in t's log when t
// has failed by the time its cleanups run.
func dumpOnFailure(t *testing.T, dir string) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		out, _ := exec.Command("sh", "-c", "cd "+dir+" && find . -printf '%M %U:%G %s %p %l\\n' | sort | head -300").CombinedOutput()
		t.Logf("listing of %s:\n%s", dir, out)
	})
}
