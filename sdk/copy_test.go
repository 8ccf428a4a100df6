package deltabox

import (
	"archive/tar"
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// FuzzExtractTar feeds CopyOut's extractor archives from a hostile daemon:
// whatever they hold, nothing may appear outside the target directory.
func FuzzExtractTar(f *testing.F) {
	add := func(hdrs ...*tar.Header) {
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		for _, h := range hdrs {
			tw.WriteHeader(h)
			if h.Size > 0 {
				tw.Write(bytes.Repeat([]byte("x"), int(h.Size)))
			}
		}
		tw.Close()
		f.Add(b.Bytes())
	}
	add(&tar.Header{Name: "src/", Typeflag: tar.TypeDir, Mode: 0o755},
		&tar.Header{Name: "src/a", Typeflag: tar.TypeReg, Mode: 0o644, Size: 3})
	add(&tar.Header{Name: "../escape", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1})
	add(&tar.Header{Name: "src/l", Typeflag: tar.TypeSymlink, Linkname: "/"},
		&tar.Header{Name: "src/l/escape", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1})
	add(&tar.Header{Name: "src/l", Typeflag: tar.TypeSymlink, Linkname: "../.."},
		&tar.Header{Name: "src/l/escape", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1})
	add(&tar.Header{Name: "src/h", Typeflag: tar.TypeLink, Linkname: "../../etc/passwd"})
	f.Fuzz(func(t *testing.T, archive []byte) {
		outer := t.TempDir()
		target := filepath.Join(outer, "target")
		os.Mkdir(target, 0o755)
		extractTar(bytes.NewReader(archive), target, "src", "dst")
		entries, _ := os.ReadDir(outer)
		if len(entries) != 1 {
			t.Fatalf("extract wrote outside its target: %v", entries)
		}
	})
}
