//go:build linux

package image

import (
	"bytes"
	"compress/gzip"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/deltabox/deltabox/errdefs"
)

// FuzzImport feeds arbitrary streams to Import (decompression, detection,
// extraction) and asserts that a failure leaves nothing behind and that
// nothing is ever written beside the store.
func FuzzImport(f *testing.F) {
	f.Add(rootfsTar(f))
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(rootfsTar(f))
	zw.Close()
	f.Add(gz.Bytes())
	f.Add(mkTar(f, ent{name: "manifest.json", body: `[{"Config":"c","Layers":["l"]}]`}, ent{name: "c", body: "{}"}))
	f.Add(mkTar(f, ent{name: "oci-layout", body: `{"imageLayoutVersion":"1.0.0"}`}, ent{name: "index.json", body: `{"manifests":[]}`}))
	f.Fuzz(func(t *testing.T, data []byte) {
		if os.Geteuid() != 0 {
			t.Skip("requires root")
		}
		dir := t.TempDir()
		root := filepath.Join(dir, "store")
		// No host image is built here, so the store mounts nothing.
		st, err := New(root, WithMaxSize(1<<20), WithMaxEntries(500))
		must(t, err)
		s := st.(*store)
		info, err := s.Import(context.Background(), "img", bytes.NewReader(data))
		if err != nil {
			if errdefs.Classify(err) == errdefs.ClassUnknown {
				t.Errorf("Import = %v: no error class", err)
			}
			checkNothingLeft(t, root, "img")
		} else if _, err := os.Stat(info.Lowers[0]); err != nil {
			t.Errorf("Import succeeded but its rootfs is missing: %v", err)
		}
		ents, err := os.ReadDir(dir)
		must(t, err)
		if len(ents) != 1 {
			t.Errorf("Import wrote beside the store: %d entries in its parent", len(ents))
		}
	})
}
