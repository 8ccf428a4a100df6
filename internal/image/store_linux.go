//go:build linux

package image

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
)

// DefaultMaxSize bounds what Import unpacks (file content, after
// decompression) unless WithMaxSize says otherwise.
const DefaultMaxSize = 16 << 30

// DefaultMaxEntries bounds the number of entries Import unpacks.
const DefaultMaxEntries = 2_000_000

// defaultEnv is the environment of an image that names none.
var defaultEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
}

// hostEnv is the host image's environment.
var hostEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"HOME=/root",
	"LANG=C.UTF-8",
}

var nameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,63}$`)

type config struct {
	hostRoot   string
	maxSize    int64
	maxEntries int64
}

// Opt configures a store.
type Opt func(*config) error

// WithHostRoot sets the directory the host image is built over ("/" by
// default). Tests point it at a fake host root.
func WithHostRoot(dir string) Opt {
	return func(c *config) error {
		if !filepath.IsAbs(dir) {
			return fmt.Errorf("host root %q is not absolute: %w", dir, errdefs.ErrInvalidArgument)
		}
		c.hostRoot = filepath.Clean(dir)
		return nil
	}
}

// WithMaxSize bounds the bytes of file content one Import may unpack.
func WithMaxSize(n int64) Opt {
	return func(c *config) error {
		if n <= 0 {
			return fmt.Errorf("max size %d: %w", n, errdefs.ErrInvalidArgument)
		}
		c.maxSize = n
		return nil
	}
}

// WithMaxEntries bounds the number of entries one Import may unpack.
func WithMaxEntries(n int64) Opt {
	return func(c *config) error {
		if n <= 0 {
			return fmt.Errorf("max entries %d: %w", n, errdefs.ErrInvalidArgument)
		}
		c.maxEntries = n
		return nil
	}
}

// store keeps images on disk:
//
//	root/images/<name>/rootfs      the image's only lower
//	root/images/<name>/meta.json   its Info, minus Lowers
//	root/host/layer-<fingerprint>  generated top lower of the host image
//	root/tmp/                      imports and removals in progress
//
// An import is built under tmp and renamed into images/ when complete, and a
// removal renames out of images/ first, so images/ only ever holds whole
// images; New clears tmp/ of what a crash left.
type store struct {
	root string
	cfg  config

	// mu serialises building the host layer and the final renames of
	// Import and Remove.
	mu sync.Mutex
	// hostMounted is set when this store mounted the tmpfs under root/host
	// (see hostLayerFS).
	hostMounted bool
}

var (
	_ Store     = (*store)(nil)
	_ io.Closer = (*store)(nil)
)

// New opens (creating it if needed) the image store under root.
//
// The store may mount a small tmpfs at root/host for the host image's
// generated layer (see hostLayerFS); Close detaches it.
func New(root string, opts ...Opt) (Store, error) {
	cfg := config{hostRoot: "/", maxSize: DefaultMaxSize, maxEntries: DefaultMaxEntries}
	for _, o := range opts {
		if err := o(&cfg); err != nil {
			return nil, fmt.Errorf("new image store %q: %w", root, err)
		}
	}
	if !filepath.IsAbs(root) {
		return nil, fmt.Errorf("new image store %q: root is not absolute: %w", root, errdefs.ErrInvalidArgument)
	}
	s := &store{root: filepath.Clean(root), cfg: cfg}
	for _, d := range []string{s.root, s.imagesDir(), s.hostDir(), s.tmpDir()} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("new image store %q: %w", root, err)
		}
	}
	// Leftovers of imports or removals a crash interrupted.
	ents, err := os.ReadDir(s.tmpDir())
	if err != nil {
		return nil, fmt.Errorf("new image store %q: %w", root, err)
	}
	for _, e := range ents {
		if err := os.RemoveAll(filepath.Join(s.tmpDir(), e.Name())); err != nil {
			return nil, fmt.Errorf("new image store %q: clear %q: %w", root, e.Name(), err)
		}
	}
	return s, nil
}

func (s *store) imagesDir() string { return filepath.Join(s.root, "images") }
func (s *store) hostDir() string   { return filepath.Join(s.root, "host") }
func (s *store) tmpDir() string    { return filepath.Join(s.root, "tmp") }

// Close detaches the tmpfs this store mounted for the host layer, if any.
// Sandboxes whose overlays already use the layer keep it (a lazy unmount).
func (s *store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.hostMounted {
		return nil
	}
	if err := unix.Unmount(s.hostDir(), unix.MNT_DETACH); err != nil {
		return fmt.Errorf("close image store %q: unmount %q: %w", s.root, s.hostDir(), err)
	}
	s.hostMounted = false
	return nil
}

func checkName(name string) error {
	if !nameRE.MatchString(name) {
		return fmt.Errorf("image name %q: want %s: %w", name, nameRE, errdefs.ErrInvalidArgument)
	}
	return nil
}

// meta is what meta.json holds.
type meta struct {
	Name    string    `json:"name"`
	Kind    Kind      `json:"kind"`
	Created time.Time `json:"created"`
	Size    int64     `json:"size"`
	Env     []string  `json:"env"`
}

func (s *store) Get(ctx context.Context, name string) (Info, error) {
	if name == HostImage {
		return s.hostInfo(ctx)
	}
	if err := checkName(name); err != nil {
		return Info{}, fmt.Errorf("get image: %w", err)
	}
	info, err := s.readInfo(name)
	if err != nil {
		return Info{}, fmt.Errorf("get image %q: %w", name, err)
	}
	return info, nil
}

func (s *store) readInfo(name string) (Info, error) {
	dir := filepath.Join(s.imagesDir(), name)
	b, err := os.ReadFile(filepath.Join(dir, "meta.json"))
	if errors.Is(err, os.ErrNotExist) {
		return Info{}, errdefs.ErrNotFound
	}
	if err != nil {
		return Info{}, err
	}
	var m meta
	if err := json.Unmarshal(b, &m); err != nil {
		return Info{}, fmt.Errorf("parse meta.json: %w: %w", errdefs.ErrInternal, err)
	}
	return Info{
		Name:    m.Name,
		Kind:    m.Kind,
		Created: m.Created,
		Size:    m.Size,
		Lowers:  []string{filepath.Join(dir, "rootfs")},
		Env:     m.Env,
	}, nil
}

func (s *store) List(ctx context.Context) ([]Info, error) {
	host, err := s.hostInfo(ctx)
	if err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	out := []Info{host}
	ents, err := os.ReadDir(s.imagesDir())
	if err != nil {
		return nil, fmt.Errorf("list images: %w", err)
	}
	for _, e := range ents {
		info, err := s.readInfo(e.Name())
		if errdefs.IsNotFound(err) { // removed meanwhile
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("list images: %q: %w", e.Name(), err)
		}
		out = append(out, info)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

func (s *store) Remove(ctx context.Context, name string) error {
	if name == HostImage {
		return fmt.Errorf("remove image %q: the built-in image cannot be removed: %w", name, errdefs.ErrFailedPrecondition)
	}
	if err := checkName(name); err != nil {
		return fmt.Errorf("remove image: %w", err)
	}
	trash, err := os.MkdirTemp(s.tmpDir(), "rm-")
	if err != nil {
		return fmt.Errorf("remove image %q: %w", name, err)
	}
	s.mu.Lock()
	err = os.Rename(filepath.Join(s.imagesDir(), name), filepath.Join(trash, name))
	s.mu.Unlock()
	if errors.Is(err, os.ErrNotExist) {
		os.Remove(trash)
		return fmt.Errorf("remove image %q: %w", name, errdefs.ErrNotFound)
	}
	if err != nil {
		os.Remove(trash)
		return fmt.Errorf("remove image %q: %w", name, err)
	}
	if err := os.RemoveAll(trash); err != nil {
		// The image is gone from images/; New finishes the job.
		return fmt.Errorf("remove image %q: clean up: %w", name, err)
	}
	return nil
}

// writeFileSync writes data to path atomically and durably: temp file, fsync,
// rename, fsync of the directory.
func writeFileSync(path string, data []byte, perm os.FileMode) (err error) {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+"-")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if _, err = f.Write(data); err != nil {
		return err
	}
	if err = f.Chmod(perm); err != nil {
		return err
	}
	if err = f.Sync(); err != nil {
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	if err = os.Rename(f.Name(), path); err != nil {
		return err
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// syncFS flushes the filesystem holding dir, so that what was written below
// dir is durable before the rename that publishes it.
func syncFS(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Syncfs(fd)
}
