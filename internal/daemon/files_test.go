//go:build linux

package daemon_test

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/daemon/daemontest"
	deltabox "github.com/deltabox/deltabox/sdk"
)

func TestFiles(t *testing.T) {
	t.Parallel()
	sock, fake := daemontest.ServeFake(t)
	c := dial(t, sock)
	ctx := testCtx(t)
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	hostRoot := filepath.Join(fake.Dir, sb.ID())

	// Larger than a chunk, so both directions stream several messages.
	data := bytes.Repeat([]byte("0123456789abcdef"), 20000)
	if err := sb.WriteFile(ctx, "/work/dir/f.bin", data, 0o640); err != nil {
		t.Fatalf("WriteFile = %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(hostRoot, "work/dir/f.bin")); err != nil || !bytes.Equal(b, data) {
		t.Fatalf("file on the host: %d bytes, %v; want %d", len(b), err, len(data))
	}
	got, err := sb.ReadFile(ctx, "/work/dir/f.bin")
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("ReadFile = %d bytes, %v", len(got), err)
	}
	if _, err := sb.ReadFileTo(ctx, "/work/dir/f.bin", io.Discard, 1000); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("ReadFileTo over max = %v, want ErrResourceExhausted", err)
	}
	fi, err := sb.Stat(ctx, "/work/dir/f.bin")
	if err != nil || fi.Size != int64(len(data)) || fi.Mode != 0o640 || fi.Name != "f.bin" || fi.IsDir() {
		t.Fatalf("Stat = %+v, %v", fi, err)
	}
	if err := sb.Mkdir(ctx, "/work/a/b", 0o700, true); err != nil {
		t.Fatalf("Mkdir = %v", err)
	}
	list, err := sb.ListDir(ctx, "/work")
	if err != nil || len(list) != 2 || list[0].Name != "a" || !list[0].IsDir() || list[1].Name != "dir" {
		t.Fatalf("ListDir = %+v, %v", list, err)
	}
	if _, err := sb.Stat(ctx, "/nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Stat(missing) = %v, want ErrNotFound", err)
	}
	if err := sb.Remove(ctx, "/work/a", false); err == nil {
		t.Fatal("Remove of a non-empty directory without recursive succeeded")
	}
	if err := sb.Remove(ctx, "/work/a", true); err != nil {
		t.Fatalf("Remove recursive = %v", err)
	}
	// Paths cannot leave the sandbox's root.
	outside := filepath.Join(fake.Dir, "outside")
	os.WriteFile(outside, []byte("secret"), 0o644)
	if b, err := sb.ReadFile(ctx, "/../outside"); err == nil && string(b) == "secret" {
		t.Fatal("ReadFile(/../outside) read a file outside the sandbox")
	}
}

func TestUploadDownload(t *testing.T) {
	t.Parallel()
	sock, fake := daemontest.ServeFake(t)
	c := dial(t, sock)
	ctx := testCtx(t)
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var archive bytes.Buffer
	tw := tar.NewWriter(&archive)
	big := strings.Repeat("z", 200<<10)
	tw.WriteHeader(&tar.Header{Name: "src/", Typeflag: tar.TypeDir, Mode: 0o755})
	tw.WriteHeader(&tar.Header{Name: "src/main.go", Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(big))})
	io.WriteString(tw, big)
	tw.WriteHeader(&tar.Header{Name: "src/link", Typeflag: tar.TypeSymlink, Linkname: "main.go"})
	tw.Close()
	if err := sb.Upload(ctx, "/work", &archive); err != nil {
		t.Fatalf("Upload = %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(fake.Dir, sb.ID(), "work/src/main.go")); err != nil || string(b) != big {
		t.Fatalf("uploaded file: %d bytes, %v", len(b), err)
	}
	var out bytes.Buffer
	if err := sb.Download(ctx, "/work/src", &out); err != nil {
		t.Fatalf("Download = %v", err)
	}
	names := map[string]string{}
	tr := tar.NewReader(&out)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(tr)
		names[strings.TrimSuffix(h.Name, "/")] = string(b)
	}
	if names["src/main.go"] != big || len(names) != 3 {
		t.Fatalf("downloaded entries %v", len(names))
	}

	// An archive escaping its directory is refused.
	var evil bytes.Buffer
	tw = tar.NewWriter(&evil)
	tw.WriteHeader(&tar.Header{Name: "../../escape", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1})
	tw.Write([]byte("x"))
	tw.Close()
	if err := sb.Upload(ctx, "/work", &evil); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("Upload(escaping) = %v, want ErrInvalidArgument", err)
	}
	if _, err := os.Stat(filepath.Join(fake.Dir, "escape")); err == nil {
		t.Fatal("an archive entry escaped the sandbox")
	}
}

func TestCopyInOut(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	c := dial(t, sock)
	ctx := testCtx(t)
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(t.TempDir(), "proj")
	os.MkdirAll(filepath.Join(src, "pkg"), 0o755)
	os.WriteFile(filepath.Join(src, "README"), []byte("hi"), 0o644)
	os.WriteFile(filepath.Join(src, "pkg", "run.sh"), []byte("#!/bin/sh\n"), 0o755)
	os.Symlink("README", filepath.Join(src, "link"))

	// Into an existing directory: it goes inside under its name.
	if err := sb.CopyIn(ctx, src, "/work"); err != nil {
		t.Fatalf("CopyIn = %v", err)
	}
	if fi, err := sb.Stat(ctx, "/work/proj/pkg/run.sh"); err != nil || fi.Mode.Perm() != 0o755 {
		t.Fatalf("Stat copied file = %+v, %v", fi, err)
	}
	// To a new name: it becomes that name.
	if err := sb.CopyIn(ctx, filepath.Join(src, "README"), "/work/renamed.txt"); err != nil {
		t.Fatalf("CopyIn file = %v", err)
	}
	if b, err := sb.ReadFile(ctx, "/work/renamed.txt"); err != nil || string(b) != "hi" {
		t.Fatalf("renamed copy = %q, %v", b, err)
	}

	dst := t.TempDir()
	if err := sb.CopyOut(ctx, "/work/proj", filepath.Join(dst, "back")); err != nil {
		t.Fatalf("CopyOut = %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(dst, "back", "pkg", "run.sh")); err != nil || string(b) != "#!/bin/sh\n" {
		t.Fatalf("copied back: %q, %v", b, err)
	}
	if fi, err := os.Stat(filepath.Join(dst, "back", "pkg", "run.sh")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("mode of copied back file: %v, %v", fi.Mode(), err)
	}
	if l, err := os.Readlink(filepath.Join(dst, "back", "link")); err != nil || l != "README" {
		t.Fatalf("symlink copied back: %q, %v", l, err)
	}
	// Into an existing local directory: inside, under its name.
	if err := sb.CopyOut(ctx, "/work/renamed.txt", dst); err != nil {
		t.Fatalf("CopyOut file = %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(dst, "renamed.txt")); err != nil || string(b) != "hi" {
		t.Fatalf("file copied out: %q, %v", b, err)
	}
	if fi, err := os.Lstat(filepath.Join(dst, "renamed.txt")); err != nil || fi.Mode().Type() != 0 || fi.Mode()&fs.ModePerm != 0o644 {
		t.Fatalf("file copied out: %v, %v", fi.Mode(), err)
	}
}
