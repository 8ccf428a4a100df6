//go:build linux

package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/ulikunitz/xz"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/testutil"
)

type ent struct {
	name, body, link string
	typ              byte
	mode             int64
	size             int64
}

func mkTar(t testing.TB, ents ...ent) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		typ := e.typ
		if typ == 0 {
			typ = tar.TypeReg
		}
		mode := e.mode
		if mode == 0 {
			mode = 0o644
		}
		h := &tar.Header{Name: e.name, Typeflag: typ, Linkname: e.link, Mode: mode, ModTime: time.Unix(1700000000, 0)}
		if typ == tar.TypeReg {
			h.Size = int64(len(e.body))
			if e.size != 0 {
				h.Size = e.size
			}
		}
		must(t, tw.WriteHeader(h))
		if typ == tar.TypeReg && e.size == 0 {
			_, err := tw.Write([]byte(e.body))
			must(t, err)
		}
	}
	if err := tw.Close(); err != nil && !strings.Contains(err.Error(), "missed writing") {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func rootfsTar(t testing.TB) []byte {
	return mkTar(t,
		ent{name: "./", typ: tar.TypeDir, mode: 0o755},
		ent{name: "./etc/", typ: tar.TypeDir, mode: 0o755},
		ent{name: "./etc/os-release", body: "ID=tiny\n"},
		ent{name: "./bin/", typ: tar.TypeDir, mode: 0o755},
		ent{name: "./bin/sh", body: "#!sh", mode: 0o755},
		ent{name: "./bin/ping", body: "ping", mode: 0o4755},
		ent{name: "./usr/bin/sh", typ: tar.TypeSymlink, link: "/bin/sh"},
		ent{name: "./bin/sh2", typ: tar.TypeLink, link: "./bin/sh"},
		ent{name: "./empty/", typ: tar.TypeDir, mode: 0o700},
		ent{name: "./dev/null", typ: tar.TypeChar},
	)
}

// checkNothingLeft asserts no image called name exists and tmp/ is empty.
func checkNothingLeft(t *testing.T, root, name string) {
	t.Helper()
	if _, err := os.Lstat(filepath.Join(root, "images", name)); !os.IsNotExist(err) {
		t.Errorf("images/%s exists after a failed import (%v)", name, err)
	}
	if ents, _ := os.ReadDir(filepath.Join(root, "tmp")); len(ents) != 0 {
		t.Errorf("tmp/ holds %d entries after a failed import", len(ents))
	}
}

func TestImportRootfs(t *testing.T) {
	testutil.RequiresRoot(t)
	testutil.CheckLeaks(t)
	ctx := context.Background()
	s, _ := newStore(t)
	plain := rootfsTar(t)
	var gz, xzb bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, err := zw.Write(plain)
	must(t, err)
	must(t, zw.Close())
	xw, err := xz.NewWriter(&xzb)
	must(t, err)
	_, err = xw.Write(plain)
	must(t, err)
	must(t, xw.Close())

	for _, tc := range []struct {
		name string
		data []byte
	}{{"plain", plain}, {"gzip.1", gz.Bytes()}, {"xz_1", xzb.Bytes()}} {
		t.Run(tc.name, func(t *testing.T) {
			info, err := s.Import(ctx, tc.name, bytes.NewReader(tc.data))
			if err != nil {
				t.Fatalf("Import(%q) = %v", tc.name, err)
			}
			if info.Name != tc.name || info.Kind != KindRootfs || len(info.Lowers) != 1 || info.Size <= 0 {
				t.Fatalf("Import(%q) = %+v", tc.name, info)
			}
			if !slices.Equal(info.Env, defaultEnv) {
				t.Errorf("Env = %q, want %q", info.Env, defaultEnv)
			}
			fsroot := info.Lowers[0]
			if b, err := os.ReadFile(filepath.Join(fsroot, "etc/os-release")); err != nil || string(b) != "ID=tiny\n" {
				t.Errorf("etc/os-release = %q, %v", b, err)
			}
			if l, err := os.Readlink(filepath.Join(fsroot, "usr/bin/sh")); err != nil || l != "/bin/sh" {
				t.Errorf("usr/bin/sh -> %q, %v", l, err)
			}
			if fi, err := os.Stat(filepath.Join(fsroot, "bin/ping")); err != nil || fi.Mode() != 0o755|os.ModeSetuid {
				t.Errorf("bin/ping mode = %v, %v", fi, err)
			}
			if fi, err := os.Stat(filepath.Join(fsroot, "empty")); err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 {
				t.Errorf("empty = %v, %v", fi, err)
			}
			if _, err := os.Lstat(filepath.Join(fsroot, "dev/null")); !os.IsNotExist(err) {
				t.Errorf("dev/null imported (%v); device nodes are dropped", err)
			}
			got, err := s.Get(ctx, tc.name)
			if err != nil || got.Lowers[0] != fsroot || got.Kind != KindRootfs || got.Size != info.Size {
				t.Errorf("Get(%q) = %+v, %v; want %+v", tc.name, got, err, info)
			}
		})
	}
	list, err := s.List(ctx)
	must(t, err)
	var names []string
	for _, i := range list {
		names = append(names, i.Name)
	}
	if want := []string{"gzip.1", "host", "plain", "xz_1"}; !slices.Equal(names, want) {
		t.Errorf("List = %q, want %q", names, want)
	}
	must(t, s.Remove(ctx, "plain"))
	if _, err := s.Get(ctx, "plain"); !errdefs.IsNotFound(err) {
		t.Errorf("Get(removed) = %v, want %v", err, errdefs.ErrNotFound)
	}
	if err := s.Remove(ctx, "plain"); !errdefs.IsNotFound(err) {
		t.Errorf("Remove(removed) = %v, want %v", err, errdefs.ErrNotFound)
	}
}

// testImage is a two-layer image: the second layer deletes a file of the
// first with a whiteout, so flattening is visible.
func testImage(t *testing.T) v1.Image {
	t.Helper()
	layer := func(ents ...ent) v1.Layer {
		b := mkTar(t, ents...)
		l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
		must(t, err)
		return l
	}
	img, err := mutate.AppendLayers(empty.Image,
		layer(ent{name: "app/", typ: tar.TypeDir, mode: 0o755}, ent{name: "app/main", body: "main", mode: 0o755}, ent{name: "app/gone", body: "x"}),
		layer(ent{name: "app/.wh.gone", body: ""}, ent{name: "app/link", typ: tar.TypeSymlink, link: "main"}),
	)
	must(t, err)
	img, err = mutate.Config(img, v1.Config{Env: []string{"PATH=/app:/usr/bin", "MODE=test"}})
	must(t, err)
	return img
}

func checkOCI(t *testing.T, info Info) {
	t.Helper()
	if info.Kind != KindOCI || !slices.Equal(info.Env, []string{"PATH=/app:/usr/bin", "MODE=test"}) {
		t.Errorf("info = %+v", info)
	}
	fsroot := info.Lowers[0]
	if b, err := os.ReadFile(filepath.Join(fsroot, "app/main")); err != nil || string(b) != "main" {
		t.Errorf("app/main = %q, %v", b, err)
	}
	if l, err := os.Readlink(filepath.Join(fsroot, "app/link")); err != nil || l != "main" {
		t.Errorf("app/link -> %q, %v", l, err)
	}
	for _, p := range []string{"app/gone", "app/.wh.gone"} {
		if _, err := os.Lstat(filepath.Join(fsroot, p)); !os.IsNotExist(err) {
			t.Errorf("%s present after flattening (%v)", p, err)
		}
	}
}

func TestImportDockerSave(t *testing.T) {
	testutil.RequiresRoot(t)
	s, _ := newStore(t)
	ref, err := name.ParseReference("example.com/deltabox/test:1")
	must(t, err)
	var buf bytes.Buffer
	must(t, tarball.Write(ref, testImage(t), &buf))
	info, err := s.Import(context.Background(), "docker", &buf)
	must(t, err)
	checkOCI(t, info)
}

func TestImportOCILayout(t *testing.T) {
	testutil.RequiresRoot(t)
	s, _ := newStore(t)
	dir := t.TempDir()
	p, err := layout.Write(dir, empty.Index)
	must(t, err)
	must(t, p.AppendImage(testImage(t), layout.WithPlatform(v1.Platform{OS: runtime.GOOS, Architecture: runtime.GOARCH})))
	var buf bytes.Buffer
	tarDir(t, dir, &buf)
	info, err := s.Import(context.Background(), "oci", &buf)
	must(t, err)
	checkOCI(t, info)
}

// tarDir writes dir as a tar, names relative to dir.
func tarDir(t *testing.T, dir string, w io.Writer) {
	t.Helper()
	tw := tar.NewWriter(w)
	must(t, filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		must(t, err)
		rel, _ := filepath.Rel(dir, p)
		if rel == "." {
			return nil
		}
		h, err := tar.FileInfoHeader(fi, "")
		must(t, err)
		h.Name = rel
		must(t, tw.WriteHeader(h))
		if fi.Mode().IsRegular() {
			b, err := os.ReadFile(p)
			must(t, err)
			_, err = tw.Write(b)
			must(t, err)
		}
		return nil
	}))
	must(t, tw.Close())
}

func TestImportErrors(t *testing.T) {
	testutil.RequiresRoot(t)
	ctx := context.Background()
	s, root := newStore(t, WithMaxSize(1024), WithMaxEntries(50))
	_, err := s.Import(ctx, "taken", bytes.NewReader(rootfsTar(t)))
	must(t, err)
	var gzGarbage bytes.Buffer
	zw := gzip.NewWriter(&gzGarbage)
	zw.Write(bytes.Repeat([]byte("not a tar "), 100))
	zw.Close()
	many := []ent{}
	for i := range 60 {
		many = append(many, ent{name: "f" + strings.Repeat("x", i)})
	}
	for _, tc := range []struct {
		name string
		img  string
		data []byte
		err  error
	}{
		{"bad name", "Bad/Name", rootfsTar(t), errdefs.ErrInvalidArgument},
		{"dot name", ".hidden", rootfsTar(t), errdefs.ErrInvalidArgument},
		{"long name", strings.Repeat("a", 65), rootfsTar(t), errdefs.ErrInvalidArgument},
		{"duplicate", "taken", rootfsTar(t), errdefs.ErrAlreadyExists},
		{"host", "host", rootfsTar(t), errdefs.ErrAlreadyExists},
		{"garbage", "garbage", bytes.Repeat([]byte("garbage!"), 1000), errdefs.ErrInvalidArgument},
		{"gzip garbage", "gzgarbage", gzGarbage.Bytes(), errdefs.ErrInvalidArgument},
		{"empty", "empty", nil, errdefs.ErrInvalidArgument},
		{"bomb bytes", "bomb", mkTar(t, ent{name: "big", body: strings.Repeat("x", 2000)}), errdefs.ErrResourceExhausted},
		{"bomb header", "bomb2", mkTar(t, ent{name: "big", size: 1 << 40}), errdefs.ErrResourceExhausted},
		{"bomb entries", "bomb3", mkTar(t, many...), errdefs.ErrResourceExhausted},
		{"escape", "escape", mkTar(t, ent{name: "../../evil", body: "x"}), errdefs.ErrInvalidArgument},
		{"broken docker-save", "docker", mkTar(t, ent{name: "manifest.json", body: "[{]"}), errdefs.ErrInvalidArgument},
		{"broken oci layout", "oci", mkTar(t, ent{name: "oci-layout", body: "{}"}, ent{name: "index.json", body: "{}"}), errdefs.ErrInvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := s.Import(ctx, tc.img, bytes.NewReader(tc.data))
			if !errors.Is(err, tc.err) {
				t.Fatalf("Import(%s) = %v, want %v", tc.name, err, tc.err)
			}
			if tc.img != "taken" && tc.img != "host" {
				checkNothingLeft(t, root, tc.img)
			}
		})
	}
	if _, err := os.Lstat(filepath.Join(filepath.Dir(root), "evil")); !os.IsNotExist(err) {
		t.Errorf("escape created evil beside the store (%v)", err)
	}
}

func TestNewClearsLeftovers(t *testing.T) {
	testutil.RequiresRoot(t)
	s, root := newStore(t)
	_ = s
	must(t, os.MkdirAll(filepath.Join(root, "tmp/import-123/image/rootfs"), 0o700))
	s2, err := New(root)
	must(t, err)
	defer s2.(io.Closer).Close()
	if ents, _ := os.ReadDir(filepath.Join(root, "tmp")); len(ents) != 0 {
		t.Errorf("tmp/ holds %d entries after New", len(ents))
	}
	if _, err := New("relative"); !errdefs.IsInvalidArgument(err) {
		t.Errorf("New(relative) = %v, want %v", err, errdefs.ErrInvalidArgument)
	}
}
