//go:build linux

package image

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/bzip2"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/ulikunitz/xz"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/safefs"
)

// streamKind is what an import stream turned out to be.
type streamKind uint8

const (
	streamUnknown streamKind = iota
	streamRootfs
	streamDockerSave
	streamOCILayout
)

// Import unpacks r into a directory under tmp/ and renames it into images/
// only when complete, so a failure leaves nothing behind.
//
// The (decompressed) stream is first spooled to a file: a docker-save
// archive needs random access, and whether a tar is a rootfs or an image is
// only known once its entries were seen.
func (s *store) Import(ctx context.Context, name string, r io.Reader) (_ Info, err error) {
	if err := checkName(name); err != nil {
		return Info{}, fmt.Errorf("import image: %w", err)
	}
	final := filepath.Join(s.imagesDir(), name)
	if name == HostImage {
		return Info{}, fmt.Errorf("import image %q: %w", name, errdefs.ErrAlreadyExists)
	}
	if _, err := os.Lstat(final); err == nil {
		return Info{}, fmt.Errorf("import image %q: %w", name, errdefs.ErrAlreadyExists)
	}
	work, err := os.MkdirTemp(s.tmpDir(), "import-")
	if err != nil {
		return Info{}, fmt.Errorf("import image %q: %w", name, err)
	}
	defer os.RemoveAll(work) // the image dir has moved out on success
	img := filepath.Join(work, "image")
	scratch := filepath.Join(work, "scratch")
	for _, d := range []string{img, scratch} {
		if err := os.Mkdir(d, 0o700); err != nil {
			return Info{}, fmt.Errorf("import image %q: %w", name, err)
		}
	}
	info, err := s.unpack(ctx, r, img, scratch)
	if err != nil {
		return Info{}, fmt.Errorf("import image %q: %w", name, err)
	}
	info.Name = name
	b, err := json.Marshal(meta{Name: name, Kind: info.Kind, Created: info.Created, Size: info.Size, Env: info.Env})
	if err != nil {
		return Info{}, fmt.Errorf("import image %q: %w", name, err)
	}
	if err := writeFileSync(filepath.Join(img, "meta.json"), b, 0o600); err != nil {
		return Info{}, fmt.Errorf("import image %q: %w", name, err)
	}
	if err := syncFS(img); err != nil {
		return Info{}, fmt.Errorf("import image %q: %w", name, err)
	}
	s.mu.Lock()
	err = os.Rename(img, final)
	s.mu.Unlock()
	if errors.Is(err, syscall.EEXIST) || errors.Is(err, syscall.ENOTEMPTY) {
		return Info{}, fmt.Errorf("import image %q: %w", name, errdefs.ErrAlreadyExists)
	}
	if err != nil {
		return Info{}, fmt.Errorf("import image %q: %w", name, err)
	}
	if err := syncDir(s.imagesDir()); err != nil {
		return Info{}, fmt.Errorf("import image %q: %w", name, err)
	}
	info.Lowers = []string{filepath.Join(final, "rootfs")}
	return info, nil
}

// unpack fills img/rootfs from r and returns the image's Info (no name, no
// lowers). scratch is for the spooled stream and an OCI layout.
func (s *store) unpack(ctx context.Context, r io.Reader, img, scratch string) (Info, error) {
	lim := safefs.Limits{MaxBytes: s.cfg.maxSize, MaxEntries: s.cfg.maxEntries}
	spool := filepath.Join(scratch, "stream.tar")
	if err := s.spool(ctx, r, spool); err != nil {
		return Info{}, err
	}
	kind, err := detect(spool, s.cfg.maxSize)
	if err != nil {
		return Info{}, err
	}
	rootfs := filepath.Join(img, "rootfs")
	if err := os.Mkdir(rootfs, 0o755); err != nil {
		return Info{}, err
	}
	info := Info{Created: time.Now().UTC(), Env: slices.Clone(defaultEnv)}
	var image v1.Image
	switch kind {
	case streamRootfs:
		info.Kind = KindRootfs
		f, err := os.Open(spool)
		if err != nil {
			return Info{}, err
		}
		defer f.Close()
		if err := extract(ctx, rootfs, f, lim); err != nil {
			return Info{}, err
		}
	case streamDockerSave:
		info.Kind = KindOCI
		image, err = tarball.ImageFromPath(spool, nil)
		if err != nil {
			return Info{}, fmt.Errorf("load docker-save archive: %w: %w", errdefs.ErrInvalidArgument, err)
		}
	case streamOCILayout:
		info.Kind = KindOCI
		dir := filepath.Join(scratch, "layout")
		if err := os.Mkdir(dir, 0o700); err != nil {
			return Info{}, err
		}
		f, err := os.Open(spool)
		if err != nil {
			return Info{}, err
		}
		err = extract(ctx, dir, f, lim)
		f.Close()
		if err != nil {
			return Info{}, fmt.Errorf("unpack oci layout: %w", err)
		}
		image, err = imageFromLayout(dir)
		if err != nil {
			return Info{}, err
		}
	}
	if image != nil {
		cfg, err := image.ConfigFile()
		if err != nil {
			return Info{}, fmt.Errorf("read image config: %w: %w", errdefs.ErrInvalidArgument, err)
		}
		if len(cfg.Config.Env) > 0 {
			info.Env = slices.Clone(cfg.Config.Env)
		}
		rc := mutate.Extract(image)
		err = extract(ctx, rootfs, rc, lim)
		rc.Close()
		if err != nil {
			return Info{}, fmt.Errorf("flatten image: %w", err)
		}
	}
	size, err := diskUsage(rootfs)
	if err != nil {
		return Info{}, err
	}
	info.Size = size
	return info, nil
}

// spool writes the decompressed stream to path, bounded by the store's
// limits (content plus a generous allowance for tar headers).
func (s *store) spool(ctx context.Context, r io.Reader, path string) error {
	rd, closeFn, err := decompress(r)
	if err != nil {
		return err
	}
	defer closeFn()
	max := s.cfg.maxSize
	if s.cfg.maxEntries < (math.MaxInt64-max)/2048 {
		max += s.cfg.maxEntries * 2048
	} else {
		max = math.MaxInt64 - 1
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	n, err := io.Copy(f, io.LimitReader(ctxReader{ctx, rd}, max+1))
	if err != nil {
		if errdefs.Classify(err) == errdefs.ClassUnknown && !errors.Is(err, ctx.Err()) {
			err = fmt.Errorf("%w: %w", errdefs.ErrInvalidArgument, err)
		}
		return fmt.Errorf("read stream: %w", err)
	}
	if n > max {
		return fmt.Errorf("stream larger than %d bytes: %w", max, errdefs.ErrResourceExhausted)
	}
	return nil
}

var (
	magicGzip  = []byte{0x1f, 0x8b}
	magicXz    = []byte{0xfd, '7', 'z', 'X', 'Z', 0x00}
	magicBzip2 = []byte("BZh")
)

// decompress recognises gzip, xz and bzip2 by their magic numbers and passes
// anything else through as is.
func decompress(r io.Reader) (io.Reader, func(), error) {
	br := bufio.NewReaderSize(r, 64<<10)
	head, _ := br.Peek(6)
	switch {
	case bytes.HasPrefix(head, magicGzip):
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, nil, fmt.Errorf("gzip stream: %w: %w", errdefs.ErrInvalidArgument, err)
		}
		return zr, func() { zr.Close() }, nil
	case bytes.HasPrefix(head, magicXz):
		zr, err := xz.NewReader(br)
		if err != nil {
			return nil, nil, fmt.Errorf("xz stream: %w: %w", errdefs.ErrInvalidArgument, err)
		}
		return zr, func() {}, nil
	case bytes.HasPrefix(head, magicBzip2):
		return bzip2.NewReader(br), func() {}, nil
	}
	return br, func() {}, nil
}

// detect reads the headers of the spooled tar (skipping content by seeking)
// and says what it holds. An entry larger than max is refused already here.
func detect(path string, max int64) (streamKind, error) {
	f, err := os.Open(path)
	if err != nil {
		return streamUnknown, err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	top := map[string]bool{}
	n := 0
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return streamUnknown, fmt.Errorf("not a tar stream (nor gzip, xz or bzip2): %w: %w", errdefs.ErrInvalidArgument, err)
		}
		n++
		if hdr.Size > max {
			return streamUnknown, fmt.Errorf("entry %q of %d bytes exceeds the limit of %d: %w", hdr.Name, hdr.Size, max, errdefs.ErrResourceExhausted)
		}
		top[strings.TrimPrefix(hdr.Name, "./")] = true
	}
	switch {
	case n == 0:
		return streamUnknown, fmt.Errorf("empty stream: %w", errdefs.ErrInvalidArgument)
	case top["manifest.json"]:
		return streamDockerSave, nil
	case top["oci-layout"] && top["index.json"]:
		return streamOCILayout, nil
	}
	return streamRootfs, nil
}

// imageFromLayout picks the image of an OCI layout: the one for this
// platform, else the only one.
func imageFromLayout(dir string) (v1.Image, error) {
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("load oci layout: %w: %w", errdefs.ErrInvalidArgument, err)
	}
	var images []v1.Image
	var pick func(idx v1.ImageIndex, depth int) (v1.Image, error)
	pick = func(idx v1.ImageIndex, depth int) (v1.Image, error) {
		m, err := idx.IndexManifest()
		if err != nil {
			return nil, err
		}
		for _, d := range m.Manifests {
			switch {
			case d.MediaType.IsImage():
				im, err := idx.Image(d.Digest)
				if err != nil {
					return nil, err
				}
				if d.Platform != nil && d.Platform.OS == runtime.GOOS && d.Platform.Architecture == runtime.GOARCH {
					return im, nil
				}
				if d.Platform == nil || d.Platform.OS != "unknown" { // attestation manifests say unknown/unknown
					images = append(images, im)
				}
			case d.MediaType.IsIndex() && depth < 4:
				child, err := idx.ImageIndex(d.Digest)
				if err != nil {
					return nil, err
				}
				if im, err := pick(child, depth+1); err != nil || im != nil {
					return im, err
				}
			}
		}
		return nil, nil
	}
	im, err := pick(idx, 0)
	if err != nil {
		return nil, fmt.Errorf("load oci layout: %w: %w", errdefs.ErrInvalidArgument, err)
	}
	if im != nil {
		return im, nil
	}
	if len(images) != 1 {
		return nil, fmt.Errorf("oci layout holds %d images and none for %s/%s: %w", len(images), runtime.GOOS, runtime.GOARCH, errdefs.ErrInvalidArgument)
	}
	return images[0], nil
}

// extract unpacks a tar stream into dir with safefs, ids kept as they are
// (the identity map). Device nodes are dropped rather than refused: rootfs
// tarballs (debootstrap) often carry /dev/null and friends, and the runtime
// mounts its own /dev.
func extract(ctx context.Context, dir string, r io.Reader, lim safefs.Limits) error {
	root, err := safefs.Open(dir, safefs.IDMap{})
	if err != nil {
		return err
	}
	defer root.Close()
	rc := dropDevices(r)
	defer rc.Close()
	return root.TarIn(ctx, "/", rc, lim)
}

// dropDevices re-encodes a tar stream without its device entries. Closing
// the result stops the goroutine.
func dropDevices(r io.Reader) io.ReadCloser {
	pr, pw := io.Pipe()
	go func() {
		tr := tar.NewReader(r)
		tw := tar.NewWriter(pw)
		for {
			hdr, err := tr.Next()
			if err == io.EOF {
				pw.CloseWithError(tw.Close())
				return
			}
			if err != nil {
				pw.CloseWithError(err)
				return
			}
			if hdr.Typeflag == tar.TypeChar || hdr.Typeflag == tar.TypeBlock {
				continue
			}
			if hdr.Typeflag == tar.TypeGNUSparse { // expanded by the reader
				hdr.Typeflag = tar.TypeReg
			}
			for k := range hdr.PAXRecords {
				if strings.HasPrefix(k, "GNU.sparse.") {
					delete(hdr.PAXRecords, k)
				}
			}
			hdr.Format = tar.FormatPAX
			if err := tw.WriteHeader(hdr); err != nil {
				pw.CloseWithError(err)
				return
			}
			if _, err := io.Copy(tw, tr); err != nil {
				pw.CloseWithError(err)
				return
			}
		}
	}()
	return pr
}

// diskUsage is the bytes allocated below dir, each inode counted once.
func diskUsage(dir string) (int64, error) {
	var total int64
	seen := map[uint64]bool{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok || seen[st.Ino] {
			return nil
		}
		seen[st.Ino] = true
		total += st.Blocks * 512
		return nil
	})
	return total, err
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
