//go:build linux

package safefs

import (
	"archive/tar"
	"bytes"
	"context"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// FuzzTarIn feeds arbitrary streams to the tar decoder path and asserts that
// nothing is ever created, changed or removed outside dst: not beside the
// root, and not in the root outside dst.
func FuzzTarIn(f *testing.F) {
	for _, ents := range [][]ent{
		{{name: "a", body: "x"}, {name: "d/", typ: tar.TypeDir, mode: 0o755}, {name: "d/f", body: "y"}},
		{{name: "../evil", body: "x"}},
		{{name: "l", typ: tar.TypeSymlink, link: "/"}, {name: "l/evil", body: "x"}},
		{{name: "l", typ: tar.TypeSymlink, link: ".."}, {name: "l/etc/passwd", body: "x"}},
		{{name: "a", body: "x"}, {name: "h", typ: tar.TypeLink, link: "a"}, {name: "a", typ: tar.TypeDir}},
		{{name: "h", typ: tar.TypeLink, link: "../etc/passwd"}},
		{{name: "p", typ: tar.TypeFifo}, {name: "p/x", body: "x"}},
	} {
		f.Add(mkTar(f, ents...))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if os.Geteuid() != 0 {
			t.Skip("requires root")
		}
		dir := t.TempDir()
		root := filepath.Join(dir, "root")
		for _, d := range []string{"root/etc", "root/dst", "outside"} {
			must(t, os.MkdirAll(filepath.Join(dir, d), 0o755))
		}
		must(t, os.WriteFile(filepath.Join(root, "etc/passwd"), []byte("p"), 0o644))
		must(t, os.WriteFile(filepath.Join(dir, "outside/secret"), []byte("s"), 0o600))
		must(t, os.Symlink(filepath.Join(dir, "outside"), filepath.Join(root, "dst/host")))
		r, err := Open(root, shift)
		must(t, err)
		defer r.Close()
		before := snapshot(t, dir)
		lim := Limits{MaxBytes: 1 << 20, MaxEntries: 1000}
		_ = r.TarIn(context.Background(), "/dst", bytes.NewReader(data), lim)
		after := snapshot(t, dir)
		for p, v := range after {
			if p == "root/dst" || strings.HasPrefix(p, "root/dst/") {
				continue
			}
			if before[p] != v {
				t.Fatalf("TarIn created or changed %q outside dst", p)
			}
		}
		for p := range before {
			if _, ok := after[p]; !ok && !strings.HasPrefix(p, "root/dst/") {
				t.Fatalf("TarIn removed %q outside dst", p)
			}
		}
		// Into the root itself: nothing beside it changes.
		outside := snapshot(t, filepath.Join(dir, "outside"))
		_ = r.TarIn(context.Background(), "/", bytes.NewReader(data), lim)
		if !maps.Equal(outside, snapshot(t, filepath.Join(dir, "outside"))) {
			t.Fatal("TarIn into the root changed a host directory beside it")
		}
	})
}
