//go:build linux

package safefs

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/testutil"
)

var shift = IDMap{HostBase: 100000, Size: 65536}

// fixture is a temp dir holding a sandbox root ("root") and, beside it, a
// host directory ("outside") that nothing may ever reach.
type fixture struct {
	dir, root, outside string
	r                  *Root
}

func newFixture(t *testing.T, m IDMap) *fixture {
	t.Helper()
	dir := t.TempDir()
	f := &fixture{dir: dir, root: filepath.Join(dir, "root"), outside: filepath.Join(dir, "outside")}
	for _, d := range []string{"root/etc", "root/work/sub", "outside"} {
		must(t, os.MkdirAll(filepath.Join(dir, d), 0o755))
	}
	must(t, os.WriteFile(filepath.Join(f.root, "etc/passwd"), []byte("sandbox passwd"), 0o644))
	must(t, os.WriteFile(filepath.Join(f.outside, "secret"), []byte("host secret"), 0o600))
	links := map[string]string{
		"abs":          "/etc",                               // absolute: the sandbox's /etc
		"chain1":       "chain2",                             // chain1 -> chain2 -> ../../../../etc
		"chain2":       "../../../../etc",                    //
		"hostlink":     filepath.Join(f.outside, "secret"),   // the host path of a host file
		"hostdir":      f.outside,                            // a parent component pointing at the host
		"proclink":     "/proc/self/root/etc/passwd",         // a magic link on the host
		"work/up":      "../..",                              // climbs to the root, no further
		"work/sub/out": "../../../../../../" + f.outside[1:], // relative, far up
	}
	for name, target := range links {
		must(t, os.Symlink(target, filepath.Join(f.root, name)))
	}
	r, err := Open(f.root, m)
	must(t, err)
	t.Cleanup(func() { r.Close() })
	f.r = r
	return f
}

// checkOutside fails t if anything beside the root changed.
func (f *fixture) checkOutside(t *testing.T, before map[string]string) {
	t.Helper()
	after := snapshot(t, f.outside)
	if !maps.Equal(before, after) {
		t.Errorf("outside changed: before %v, after %v", keys(before), keys(after))
	}
	if b, err := os.ReadFile(filepath.Join(f.root, "etc/passwd")); err != nil || string(b) != "sandbox passwd" {
		t.Errorf("root/etc/passwd = %q, %v; want it untouched", b, err)
	}
}

func TestReadEscapes(t *testing.T) {
	testutil.RequiresRoot(t)
	f := newFixture(t, shift)
	ctx := context.Background()
	for _, tc := range []struct {
		path string
		want string // content, or "" when an error is wanted
		err  error
	}{
		{"../../etc/passwd", "", errdefs.ErrInvalidArgument},
		{"/../etc/passwd", "", errdefs.ErrInvalidArgument},
		{"/work/../../etc/passwd", "", errdefs.ErrInvalidArgument},
		{"/etc/passwd", "sandbox passwd", nil},
		{"etc/passwd", "sandbox passwd", nil},
		{"/abs/passwd", "sandbox passwd", nil},
		{"/chain1/passwd", "sandbox passwd", nil},
		{"/work/up/etc/passwd", "sandbox passwd", nil},
		{"/work/up/work/up/abs/passwd", "sandbox passwd", nil},
		{"/hostlink", "", errdefs.ErrNotFound},
		{"/hostdir/secret", "", errdefs.ErrNotFound},
		{"/work/sub/out/secret", "", errdefs.ErrNotFound},
		{"/proclink", "", errdefs.ErrNotFound},
		{"/etc", "", errdefs.ErrFailedPrecondition},
		{"/missing", "", errdefs.ErrNotFound},
	} {
		t.Run(tc.path, func(t *testing.T) {
			var buf bytes.Buffer
			_, err := f.r.ReadFile(ctx, tc.path, &buf, 0)
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("ReadFile(%q) = %v, want %v", tc.path, err, tc.err)
				}
				if strings.Contains(buf.String(), "host secret") {
					t.Fatalf("ReadFile(%q) leaked the host secret", tc.path)
				}
				return
			}
			if err != nil || buf.String() != tc.want {
				t.Fatalf("ReadFile(%q) = %q, %v, want %q", tc.path, buf.String(), err, tc.want)
			}
		})
	}
}

func TestWriteEscapes(t *testing.T) {
	testutil.RequiresRoot(t)
	f := newFixture(t, shift)
	ctx := context.Background()
	before := snapshot(t, f.outside)
	for _, tc := range []struct {
		path string
		err  error // nil: must succeed, inside the root
	}{
		{"../../evil", errdefs.ErrInvalidArgument},
		{"/work/../../evil", errdefs.ErrInvalidArgument},
		{"/hostdir/evil", errdefs.ErrNotFound},
		{"/work/sub/out/evil", errdefs.ErrNotFound},
		{"/abs/evil", nil},          // the sandbox's /etc/evil
		{"/chain1/evil2", nil},      // same
		{"/hostlink", nil},          // replaces the symlink itself
		{"/work/new/dir/file", nil}, // parents created
		{"/", errdefs.ErrInvalidArgument},
	} {
		t.Run(tc.path, func(t *testing.T) {
			err := f.r.WriteFile(ctx, tc.path, strings.NewReader("x"), 0o644, 0)
			if tc.err == nil && err != nil || tc.err != nil && !errors.Is(err, tc.err) {
				t.Fatalf("WriteFile(%q) = %v, want %v", tc.path, err, tc.err)
			}
		})
	}
	f.checkOutside(t, before)
	for _, p := range []string{"etc/evil", "etc/evil2", "work/new/dir/file"} {
		if _, err := os.Stat(filepath.Join(f.root, p)); err != nil {
			t.Errorf("stat root/%s: %v", p, err)
		}
	}
	if fi, err := os.Lstat(filepath.Join(f.root, "hostlink")); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("root/hostlink: %v, %v; want a regular file in place of the link", fi, err)
	}
}

func TestTarInEscapes(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		dst  string
		ents []ent
		pre  map[string]string // symlinks made in the root first
		err  error
	}{
		{name: "dotdot", ents: []ent{{name: "../evil", body: "x"}}, err: errdefs.ErrInvalidArgument},
		{name: "deep dotdot", ents: []ent{{name: "a/b/../../../evil", body: "x"}}, err: errdefs.ErrInvalidArgument},
		{name: "absolute", ents: []ent{{name: "/evil", body: "x"}}, err: errdefs.ErrInvalidArgument},
		{name: "absolute etc", ents: []ent{{name: "/etc/passwd", body: "x"}}, err: errdefs.ErrInvalidArgument},
		{name: "through symlink to root", ents: []ent{{name: "l", typ: tar.TypeSymlink, link: "/"}, {name: "l/evil", body: "x"}}, err: errdefs.ErrInvalidArgument},
		{name: "through symlink up", ents: []ent{{name: "l", typ: tar.TypeSymlink, link: "../.."}, {name: "l/evil", body: "x"}}, err: errdefs.ErrInvalidArgument},
		{name: "through symlink chain", ents: []ent{{name: "a", typ: tar.TypeSymlink, link: "b"}, {name: "b", typ: tar.TypeSymlink, link: ".."}, {name: "a/evil", body: "x"}}, err: errdefs.ErrInvalidArgument},
		{name: "through symlink to host", ents: []ent{{name: "l", typ: tar.TypeSymlink, link: "@outside"}, {name: "l/evil", body: "x"}}, err: errdefs.ErrInvalidArgument},
		{name: "through existing symlink", pre: map[string]string{"work/pre": "/etc"}, ents: []ent{{name: "pre/evil", body: "x"}}, err: errdefs.ErrInvalidArgument},
		{name: "file over existing symlink", pre: map[string]string{"work/pre": "/etc/passwd"}, ents: []ent{{name: "pre", body: "replaced"}}},
		{name: "dir over existing symlink", pre: map[string]string{"work/pre": "@outside"}, ents: []ent{{name: "pre", typ: tar.TypeDir, mode: 0o755}, {name: "pre/f", body: "x"}}},
		{name: "hardlink outside", ents: []ent{{name: "h", typ: tar.TypeLink, link: "../../etc/passwd"}}, err: errdefs.ErrInvalidArgument},
		{name: "hardlink absolute", ents: []ent{{name: "h", typ: tar.TypeLink, link: "/etc/passwd"}}, err: errdefs.ErrInvalidArgument},
		{name: "hardlink to existing file not in archive", pre: map[string]string{"work/sub/lnk": "x"}, ents: []ent{{name: "h", typ: tar.TypeLink, link: "sub/lnk"}}, err: errdefs.ErrInvalidArgument},
		{name: "hardlink through symlink", ents: []ent{{name: "l", typ: tar.TypeSymlink, link: "/etc"}, {name: "h", typ: tar.TypeLink, link: "l/passwd"}}, err: errdefs.ErrInvalidArgument},
		{name: "hardlink to itself", ents: []ent{{name: "h", typ: tar.TypeLink, link: "h"}}, err: errdefs.ErrInvalidArgument},
		{name: "char device", ents: []ent{{name: "null", typ: tar.TypeChar}}, err: errdefs.ErrInvalidArgument},
		{name: "block device", ents: []ent{{name: "sda", typ: tar.TypeBlock}}, err: errdefs.ErrInvalidArgument},
		{name: "absolute symlink kept as data", ents: []ent{{name: "l", typ: tar.TypeSymlink, link: "/etc/passwd"}}},
		{name: "hardlink inside", ents: []ent{{name: "a", body: "x"}, {name: "h", typ: tar.TypeLink, link: "./a"}}},
		{name: "dst is a symlink to host", dst: "/hostdir", ents: []ent{{name: "evil", body: "x"}}, err: errdefs.ErrNotFound},
		{name: "dst escapes", dst: "/../x", ents: []ent{{name: "evil", body: "x"}}, err: errdefs.ErrInvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, shift)
			for name, target := range tc.pre {
				target = strings.ReplaceAll(target, "@outside", f.outside)
				if name == "work/sub/lnk" {
					must(t, os.WriteFile(filepath.Join(f.root, name), []byte(target), 0o644))
					continue
				}
				must(t, os.Symlink(target, filepath.Join(f.root, name)))
			}
			for i := range tc.ents {
				tc.ents[i].link = strings.ReplaceAll(tc.ents[i].link, "@outside", f.outside)
			}
			before := snapshot(t, f.outside)
			dst := tc.dst
			if dst == "" {
				dst = "/work"
			}
			err := f.r.TarIn(ctx, dst, bytes.NewReader(mkTar(t, tc.ents...)), Limits{})
			if tc.err == nil && err != nil || tc.err != nil && !errors.Is(err, tc.err) {
				t.Fatalf("TarIn(%s) = %v, want %v", tc.name, err, tc.err)
			}
			f.checkOutside(t, before)
			// Nothing named evil anywhere in the whole temp dir.
			for p := range snapshot(t, f.dir) {
				if strings.Contains(p, "evil") {
					t.Errorf("TarIn(%s) created %q", tc.name, p)
				}
			}
		})
	}
}

func TestTarInLimits(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := context.Background()
	long := strings.Repeat("a/", 2100) + "f"
	for _, tc := range []struct {
		name string
		lim  Limits
		ents []ent
		err  error
	}{
		{"entries", Limits{MaxEntries: 3}, []ent{{name: "a"}, {name: "b"}, {name: "c"}, {name: "d"}}, errdefs.ErrResourceExhausted},
		{"bytes", Limits{MaxBytes: 10}, []ent{{name: "a", body: "12345678"}, {name: "b", body: "12345678"}}, errdefs.ErrResourceExhausted},
		{"absurd entry", Limits{}, []ent{{name: "a", size: 1 << 40}}, errdefs.ErrResourceExhausted},
		{"long path", Limits{}, []ent{{name: long, body: "x"}}, errdefs.ErrInvalidArgument},
		{"long component", Limits{}, []ent{{name: strings.Repeat("x", 300), body: "x"}}, errdefs.ErrInvalidArgument},
		{"uid out of range", Limits{}, []ent{{name: "a", body: "x", uid: 70000}}, errdefs.ErrInvalidArgument},
		{"within limits", Limits{MaxEntries: 2, MaxBytes: 16}, []ent{{name: "a", body: "12345678"}, {name: "b", body: "12345678"}}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, shift)
			err := f.r.TarIn(ctx, "/work/x", bytes.NewReader(mkTar(t, tc.ents...)), tc.lim)
			if tc.err == nil && err != nil || tc.err != nil && !errors.Is(err, tc.err) {
				t.Fatalf("TarIn(%s) = %v, want %v", tc.name, err, tc.err)
			}
		})
	}
}

func TestTarInTruncated(t *testing.T) {
	testutil.RequiresRoot(t)
	f := newFixture(t, shift)
	data := mkTar(t, ent{name: "a", body: strings.Repeat("x", 4096)})
	err := f.r.TarIn(context.Background(), "/work", bytes.NewReader(data[:1024]), Limits{})
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("TarIn(truncated) = %v, want %v", err, errdefs.ErrInvalidArgument)
	}
	err = f.r.TarIn(context.Background(), "/work", strings.NewReader(strings.Repeat("garbage!", 200)), Limits{})
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("TarIn(garbage) = %v, want %v", err, errdefs.ErrInvalidArgument)
	}
}

// buildTree makes a tree with every kind of entry cp must keep.
func buildTree(t *testing.T, dir string, base uint32) {
	t.Helper()
	mtime := time.Date(2024, 5, 6, 7, 8, 9, 123456789, time.UTC)
	must(t, os.MkdirAll(filepath.Join(dir, "empty"), 0o755))
	must(t, os.MkdirAll(filepath.Join(dir, "sticky"), 0o755))
	must(t, os.Chmod(filepath.Join(dir, "sticky"), 0o777|os.ModeSticky))
	must(t, os.WriteFile(filepath.Join(dir, "file"), []byte("hello\x00world"), 0o640))
	must(t, os.WriteFile(filepath.Join(dir, "suid"), []byte("#!/bin/sh\n"), 0o755))
	must(t, os.Chmod(filepath.Join(dir, "suid"), 0o755|os.ModeSetuid|os.ModeSetgid))
	must(t, os.Symlink("file", filepath.Join(dir, "rel")))
	must(t, os.Symlink("/etc/passwd", filepath.Join(dir, "abs")))
	must(t, os.Symlink("../../../../..", filepath.Join(dir, "up")))
	must(t, os.Link(filepath.Join(dir, "file"), filepath.Join(dir, "hard")))
	must(t, unix.Mkfifo(filepath.Join(dir, "fifo"), 0o600))
	must(t, os.MkdirAll(filepath.Join(dir, "sticky/deep/er"), 0o700))
	must(t, os.WriteFile(filepath.Join(dir, "sticky/deep/er/f"), bytes.Repeat([]byte{7}, 100000), 0o600))
	_ = unix.Setxattr(filepath.Join(dir, "file"), "user.note", []byte("kept"), 0) // best effort: fs may lack user xattrs
	// Ownership: the sandbox's uid 1000, and one host id outside the map.
	must(t, filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		must(t, err)
		return os.Lchown(p, int(base+1000), int(base+1000))
	}))
	must(t, os.Lchown(filepath.Join(dir, "rel"), 5, 5))
	// chown cleared setuid: set it again.
	must(t, os.Chmod(filepath.Join(dir, "suid"), 0o755|os.ModeSetuid|os.ModeSetgid))
	must(t, filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		must(t, err)
		ts := []unix.Timespec{unix.NsecToTimespec(mtime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
		return unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW)
	}))
}

type node struct {
	mode     fs.FileMode
	uid, gid uint32
	mtime    int64
	content  string
}

func describe(t *testing.T, dir string, base uint32) map[string]node {
	t.Helper()
	out := map[string]node{}
	inodes := map[uint64]string{}
	must(t, filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		must(t, err)
		rel, _ := filepath.Rel(dir, p)
		st := fi.Sys().(*syscall.Stat_t)
		n := node{mode: fi.Mode(), uid: st.Uid - base, gid: st.Gid - base, mtime: st.Mtim.Nano()}
		if st.Uid < base {
			n.uid, n.gid = st.Uid, st.Gid
		}
		if fi.IsDir() && rel == "." {
			n.mtime = 0 // the top's own mtime changes with its parent's writes
		}
		switch {
		case fi.Mode().IsRegular():
			b, _ := os.ReadFile(p)
			n.content = string(b)
			if first, ok := inodes[st.Ino]; ok {
				n.content = "link to " + first
			} else {
				inodes[st.Ino] = rel
			}
			if v, err := xattr(p, "user.note"); err == nil {
				n.content += " xattr=" + v
			}
		case fi.Mode()&fs.ModeSymlink != 0:
			n.content, _ = os.Readlink(p)
		}
		out[rel] = n
		return nil
	}))
	return out
}

func xattr(p, name string) (string, error) {
	buf := make([]byte, 256)
	n, err := unix.Lgetxattr(p, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

func TestRoundTrip(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := context.Background()
	src := newFixture(t, shift)
	buildTree(t, filepath.Join(src.root, "work/src"), shift.HostBase)
	// The other sandbox's ids start elsewhere: the archive carries sandbox ids.
	other := IDMap{HostBase: 300000, Size: 65536}
	dst := newFixture(t, other)

	var buf bytes.Buffer
	must(t, src.r.TarOut(ctx, "/work/src", &buf))
	// Entries are named after the directory, ids are the sandbox's.
	tr := tar.NewReader(bytes.NewReader(buf.Bytes()))
	seen := map[string]*tar.Header{}
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		seen[h.Name] = h
	}
	for name, want := range map[string]int{"src/": 1000, "src/file": 1000, "src/rel": overflowID} {
		if h := seen[name]; h == nil || h.Uid != want {
			t.Errorf("archive entry %q = %+v, want uid %d", name, h, want)
		}
	}
	if h := seen["src/abs"]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "/etc/passwd" {
		t.Errorf("archive entry src/abs = %+v, want a symlink to /etc/passwd, not followed", h)
	}
	if h := seen["src/hard"]; h == nil || h.Typeflag != tar.TypeLink || h.Linkname != "src/file" {
		t.Errorf("archive entry src/hard = %+v, want a hardlink to src/file", h)
	}

	must(t, dst.r.TarIn(ctx, "/work/copy", bytes.NewReader(buf.Bytes()), Limits{}))
	want := describe(t, filepath.Join(src.root, "work/src"), shift.HostBase)
	got := describe(t, filepath.Join(dst.root, "work/copy/src"), other.HostBase)
	// rel was owned by host uid 5, outside the map: it comes back as nobody.
	r := want["rel"]
	r.uid, r.gid = overflowID, overflowID
	want["rel"] = r
	if len(got) != len(want) {
		t.Errorf("round trip: got %v, want %v", len(got), len(want))
	}
	for k, w := range want {
		if g, ok := got[k]; !ok || g.mode != w.mode || g.uid != w.uid || g.gid != w.gid || g.mtime != w.mtime || g.content != w.content {
			t.Errorf("round trip %q = %+v, want %+v", k, got[k], w)
		}
	}

	// The same through Stat.
	fi, err := dst.r.Stat(ctx, "/work/copy/src/suid")
	must(t, err)
	if fi.Mode != 0o755|fs.ModeSetuid|fs.ModeSetgid || fi.UID != 1000 || fi.Name != "suid" || fi.Path != "/work/copy/src/suid" {
		t.Errorf("Stat(suid) = %+v", fi)
	}
	fi, err = dst.r.Stat(ctx, "/work/copy/src/abs")
	must(t, err)
	if fi.Mode&fs.ModeSymlink == 0 || fi.LinkTarget != "/etc/passwd" {
		t.Errorf("Stat(abs) = %+v, want the link itself", fi)
	}
}

func TestTarOutFile(t *testing.T) {
	testutil.RequiresRoot(t)
	f := newFixture(t, shift)
	var buf bytes.Buffer
	must(t, f.r.TarOut(context.Background(), "/abs/passwd", &buf))
	tr := tar.NewReader(&buf)
	h, err := tr.Next()
	must(t, err)
	if h.Name != "passwd" || h.Size != int64(len("sandbox passwd")) {
		t.Fatalf("TarOut(/abs/passwd) entry = %+v", h)
	}
	if err := f.r.TarOut(context.Background(), "/hostdir/secret", &buf); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("TarOut(/hostdir/secret) = %v, want %v", err, errdefs.ErrNotFound)
	}
	buf.Reset()
	must(t, f.r.TarOut(context.Background(), "/", &buf))
	if strings.Contains(buf.String(), "host secret") {
		t.Fatal("TarOut(/) followed a symlink out of the root")
	}
}

func TestFileOps(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := context.Background()
	f := newFixture(t, shift)
	r := f.r

	must(t, r.WriteFile(ctx, "/work/a/b/c.txt", strings.NewReader("content"), 0o4755, 0))
	for _, p := range []string{"work/a", "work/a/b", "work/a/b/c.txt"} {
		var st unix.Stat_t
		must(t, unix.Lstat(filepath.Join(f.root, p), &st))
		if st.Uid != shift.HostBase || st.Gid != shift.HostBase {
			t.Errorf("owner of %q = %d:%d, want %d", p, st.Uid, st.Gid, shift.HostBase)
		}
	}
	fi, err := r.Stat(ctx, "/work/a/b/c.txt")
	must(t, err)
	if fi.Mode != 0o755|fs.ModeSetuid || fi.UID != 0 || fi.GID != 0 || fi.Size != 7 {
		t.Errorf("Stat = %+v, want setuid 0755 owned by 0", fi)
	}
	// Replace atomically; no temp file left.
	must(t, r.WriteFile(ctx, "/work/a/b/c.txt", strings.NewReader("new"), 0o600, 0))
	ents, err := r.ListDir(ctx, "/work/a/b")
	must(t, err)
	if len(ents) != 1 || ents[0].Name != "c.txt" || ents[0].Size != 3 || ents[0].Mode != 0o600 {
		t.Errorf("ListDir = %+v", ents)
	}
	// Too big: nothing written.
	err = r.WriteFile(ctx, "/work/big", strings.NewReader("0123456789"), 0o644, 5)
	if !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Errorf("WriteFile(over max) = %v, want %v", err, errdefs.ErrResourceExhausted)
	}
	if _, err := r.Stat(ctx, "/work/big"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Stat(/work/big) = %v, want %v", err, errdefs.ErrNotFound)
	}
	// ReadFile with max.
	var buf bytes.Buffer
	must(t, r.WriteFile(ctx, "/work/ten", strings.NewReader("0123456789"), 0o644, 0))
	if n, err := r.ReadFile(ctx, "/work/ten", &buf, 4); !errors.Is(err, errdefs.ErrResourceExhausted) || buf.Len() > 4 || n > 4 {
		t.Errorf("ReadFile(max 4) = %d, %v, wrote %d", n, err, buf.Len())
	}
	buf.Reset()
	if n, err := r.ReadFile(ctx, "/work/ten", &buf, 10); err != nil || n != 10 || buf.String() != "0123456789" {
		t.Errorf("ReadFile(max 10) = %d, %v, %q", n, err, buf.String())
	}
	// Mkdir.
	if err := r.Mkdir(ctx, "/work/x/y", 0o700, false); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Mkdir(no parents) = %v, want %v", err, errdefs.ErrNotFound)
	}
	must(t, r.Mkdir(ctx, "/work/x/y", 0o700, true))
	must(t, r.Mkdir(ctx, "/work/x/y", 0o700, true))
	if err := r.Mkdir(ctx, "/work/x/y", 0o700, false); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("Mkdir(existing) = %v, want %v", err, errdefs.ErrAlreadyExists)
	}
	if fi, err := r.Stat(ctx, "/work/x/y"); err != nil || fi.Mode != fs.ModeDir|0o700 {
		t.Errorf("Stat(/work/x/y) = %+v, %v", fi, err)
	}
	// Remove.
	if err := r.Remove(ctx, "/work/x", false); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("Remove(non-empty) = %v, want %v", err, errdefs.ErrFailedPrecondition)
	}
	if err := r.Remove(ctx, "/", true); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Remove(/) = %v, want %v", err, errdefs.ErrInvalidArgument)
	}
	if err := r.Remove(ctx, "/nope", false); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Remove(/nope) = %v, want %v", err, errdefs.ErrNotFound)
	}
	before := snapshot(t, f.outside)
	must(t, os.Symlink(f.outside, filepath.Join(f.root, "work/x/y/tohost")))
	must(t, r.Remove(ctx, "/work/x", true))
	must(t, r.Remove(ctx, "/hostdir", false)) // the link, not its target
	f.checkOutside(t, before)
	if _, err := os.Lstat(filepath.Join(f.root, "work/x")); !os.IsNotExist(err) {
		t.Errorf("work/x still there: %v", err)
	}
	// Stat of ids outside the map.
	must(t, os.Chown(filepath.Join(f.root, "etc/passwd"), 7, 7))
	if fi, err := r.Stat(ctx, "/etc/passwd"); err != nil || fi.UID != overflowID {
		t.Errorf("Stat(host-owned) = %+v, %v, want uid %d", fi, err, overflowID)
	}
	if fi, err := r.Stat(ctx, "/"); err != nil || !fi.Mode.IsDir() || fi.Path != "/" {
		t.Errorf("Stat(/) = %+v, %v", fi, err)
	}
	if ents, err := r.ListDir(ctx, "/abs"); err != nil || len(ents) != 1 || ents[0].Path != "/abs/passwd" {
		t.Errorf("ListDir(/abs) = %+v, %v; want the sandbox's /etc", ents, err)
	}
	must(t, r.Close())
	must(t, r.Close())
	if _, err := r.Stat(ctx, "/etc"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("Stat after Close = %v, want %v", err, errdefs.ErrFailedPrecondition)
	}
	if _, err := Open(filepath.Join(f.dir, "nope"), IDMap{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Open(missing) = %v, want %v", err, errdefs.ErrNotFound)
	}
}

func TestIdentityMap(t *testing.T) {
	testutil.RequiresRoot(t)
	dir := t.TempDir()
	r, err := Open(dir, IDMap{})
	must(t, err)
	defer r.Close()
	data := mkTar(t, ent{name: "./", typ: tar.TypeDir, mode: 0o755}, ent{name: "./home/u/f", body: "x", uid: 1000})
	must(t, r.TarIn(context.Background(), "/", bytes.NewReader(data), Limits{}))
	var st unix.Stat_t
	must(t, unix.Lstat(filepath.Join(dir, "home/u/f"), &st))
	if st.Uid != 1000 {
		t.Errorf("uid = %d, want 1000 (identity)", st.Uid)
	}
	must(t, unix.Lstat(filepath.Join(dir, "home"), &st))
	if st.Uid != 0 {
		t.Errorf("implicit parent uid = %d, want 0", st.Uid)
	}
}
