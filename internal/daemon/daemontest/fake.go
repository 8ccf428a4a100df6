//go:build linux

// Package daemontest is a fake daemon.Backend and a helper that serves it on
// a unix socket, for the tests of the daemon, the SDK and the CLI.
package daemontest

import (
	"context"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/image"
	"github.com/deltabox/deltabox/internal/safefs"
	"github.com/deltabox/deltabox/internal/sandbox"
)

// Fake is an in-memory Backend. Sandboxes are map entries; each has a
// directory under Dir that Files opens with safefs. Exec understands a few
// commands (see Exec). Checkpoints copy a sandbox's directory (see
// Checkpoint). Ids and times are deterministic: sandboxes are sb-0001,
// sb-0002, ...; checkpoints ck-0001, ...; every duration is a fixed number.
// It is safe for concurrent use.
type Fake struct {
	// Dir holds one directory per sandbox, its "root filesystem".
	Dir string

	// Gate, when non-nil, is what the "stream" command waits on between its
	// two outputs: close it to let the command finish.
	Gate chan struct{}

	// mu guards everything below.
	mu        sync.Mutex
	err       error
	next      int
	sandboxes map[string]*fakeSandbox
	images    map[string]image.Info
	// checkpoints and the counters that name them and their trees.
	checkpoints      map[string]*fakeCheckpoint
	nextCk, nextTree int
	// lastExec is the last ExecRequest seen, without its streams.
	lastExec sandbox.ExecRequest
}

type fakeSandbox struct {
	info    sandbox.Info
	running int // commands running
	tree    int // the checkpoint tree it lives in
	// sessions run in it (reset by a restore to the checkpoint's)
	shell, python bool
}

var _ daemon.Backend = (*Fake)(nil)

// NewFake returns an empty fake whose sandbox roots live under dir.
func NewFake(dir string) *Fake {
	return &Fake{
		Dir:         dir,
		sandboxes:   map[string]*fakeSandbox{},
		checkpoints: map[string]*fakeCheckpoint{},
		images: map[string]image.Info{
			image.HostImage: {Name: image.HostImage, Kind: image.KindHost, Created: time.Unix(1_700_000_000, 0).UTC()},
		},
	}
}

// FailWith makes every method fail with err (nil: work again).
func (f *Fake) FailWith(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.err = err
}

// LastExec returns the last exec request (its streams cleared).
func (f *Fake) LastExec() sandbox.ExecRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.lastExec
}

func (f *Fake) fail() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}

func (f *Fake) SystemInfo(ctx context.Context) (daemon.SystemInfo, error) {
	if err := f.fail(); err != nil {
		return daemon.SystemInfo{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return daemon.SystemInfo{
		Version: "test", Storage: "copy", StateDir: f.Dir, Kernel: "6.1.0-test",
		CgroupMode: "v2", Overlay: true, Sandboxes: len(f.sandboxes), Images: len(f.images),
	}, nil
}

func (f *Fake) CreateSandbox(ctx context.Context, cfg sandbox.Config) (sandbox.Info, error) {
	if err := f.fail(); err != nil {
		return sandbox.Info{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	name := cfg.Image
	if name == "" {
		name = image.HostImage
	}
	if _, ok := f.images[name]; !ok {
		return sandbox.Info{}, fmt.Errorf("image %q: %w", name, errdefs.ErrNotFound)
	}
	if cfg.Workdir == "" {
		cfg.Workdir = "/work"
	}
	f.next++
	id := fmt.Sprintf("sb-%04d", f.next)
	if err := os.MkdirAll(filepath.Join(f.Dir, id, cfg.Workdir), 0o755); err != nil {
		return sandbox.Info{}, err
	}
	info := sandbox.Info{ID: id, Config: cfg, State: sandbox.StateRunning, Created: time.Unix(1_700_000_000+int64(f.next), 0).UTC(), InitPid: 1000 + f.next}
	f.nextTree++
	f.sandboxes[id] = &fakeSandbox{info: info, tree: f.nextTree}
	return info, nil
}

func (f *Fake) get(id string) (*fakeSandbox, error) {
	sb, ok := f.sandboxes[id]
	if !ok {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	return sb, nil
}

func (f *Fake) GetSandbox(ctx context.Context, id string) (sandbox.Info, error) {
	if err := f.fail(); err != nil {
		return sandbox.Info{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.get(id)
	if err != nil {
		return sandbox.Info{}, err
	}
	return sb.info, nil
}

func (f *Fake) ListSandboxes(ctx context.Context) ([]sandbox.Info, error) {
	if err := f.fail(); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []sandbox.Info
	for _, id := range slices.Sorted(maps.Keys(f.sandboxes)) {
		out = append(out, f.sandboxes[id].info)
	}
	return out, nil
}

func (f *Fake) DeleteSandbox(ctx context.Context, id string, force bool) error {
	if err := f.fail(); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.get(id)
	if err != nil {
		return err
	}
	if sb.running > 0 && !force {
		return fmt.Errorf("delete sandbox %q: a command is running: %w", id, errdefs.ErrFailedPrecondition)
	}
	delete(f.sandboxes, id)
	return os.RemoveAll(filepath.Join(f.Dir, id))
}

// Exec runs a fake command:
//
//	echo ARGS...   ARGS joined by spaces and a newline on stdout; exit 0
//	fail MSG N     MSG on stderr; exit N
//	cat            stdin to stdout; exit 0
//	stream         "first\n" on stdout, wait for Gate, "second\n" on stderr; exit 0
//	sleep D        wait D or the timeout (then exit 124, timed out)
//	env            the request's env, one per line, on stdout
//	anything else  "NAME: command not found" on stderr; exit 127
func (f *Fake) Exec(ctx context.Context, id string, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	if err := f.fail(); err != nil {
		return sandbox.ExecResult{}, err
	}
	f.mu.Lock()
	sb, err := f.get(id)
	if err != nil {
		f.mu.Unlock()
		return sandbox.ExecResult{}, err
	}
	sb.running++
	rec := req
	rec.Stdin, rec.Stdout, rec.Stderr = nil, nil, nil
	f.lastExec = rec
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		sb.running--
		f.mu.Unlock()
	}()

	start := time.Now()
	res := sandbox.ExecResult{}
	stdout, stderr := orDiscard(req.Stdout), orDiscard(req.Stderr)
	argv := req.Argv
	switch argv[0] {
	case "echo":
		fmt.Fprintln(stdout, strings.Join(argv[1:], " "))
	case "fail":
		if len(argv) != 3 {
			return res, fmt.Errorf("fail: want MSG N: %w", errdefs.ErrInvalidArgument)
		}
		fmt.Fprint(stderr, argv[1])
		res.ExitCode, _ = strconv.Atoi(argv[2])
	case "cat":
		if req.Stdin != nil {
			if _, err := io.Copy(stdout, req.Stdin); err != nil {
				return res, err
			}
		}
	case "stream":
		io.WriteString(stdout, "first\n")
		if f.Gate != nil {
			select {
			case <-f.Gate:
			case <-ctx.Done():
				return res, ctx.Err()
			}
		}
		io.WriteString(stderr, "second\n")
	case "sleep":
		d, err := time.ParseDuration(argv[len(argv)-1])
		if err != nil {
			return res, fmt.Errorf("sleep: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		var timeout <-chan time.Time
		if req.Timeout > 0 {
			timeout = time.After(req.Timeout)
		}
		select {
		case <-time.After(d):
		case <-timeout:
			res.ExitCode, res.TimedOut = 124, true
		case <-ctx.Done():
			return res, ctx.Err()
		}
	case "env":
		for _, kv := range append(slices.Clone(sb.info.Config.Env), req.Env...) {
			fmt.Fprintln(stdout, kv)
		}
	default:
		fmt.Fprintf(stderr, "%s: command not found\n", argv[0])
		res.ExitCode = 127
	}
	res.Duration = time.Since(start)
	return res, nil
}

// Session runs a fake snippet: it prints "KIND: CODE" on stdout and exits 0,
// unless the code is "exit N", which exits N.
func (f *Fake) Session(ctx context.Context, id string, req sandbox.SessionRequest) (sandbox.ExecResult, error) {
	if err := f.fail(); err != nil {
		return sandbox.ExecResult{}, err
	}
	f.mu.Lock()
	sb, err := f.get(id)
	if err == nil {
		if req.Kind == sandbox.SessionPython {
			sb.python = true
		} else {
			sb.shell = true
		}
	}
	f.mu.Unlock()
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	var res sandbox.ExecResult
	if n, ok := strings.CutPrefix(req.Code, "exit "); ok {
		res.ExitCode, _ = strconv.Atoi(n)
		return res, nil
	}
	fmt.Fprintf(orDiscard(req.Stdout), "%s: %s\n", req.Kind, req.Code)
	return res, nil
}

func (f *Fake) Files(ctx context.Context, id string, write bool) (*safefs.Root, func(), error) {
	if err := f.fail(); err != nil {
		return nil, nil, err
	}
	f.mu.Lock()
	_, err := f.get(id)
	f.mu.Unlock()
	if err != nil {
		return nil, nil, err
	}
	root, err := safefs.Open(filepath.Join(f.Dir, id), safefs.IDMap{})
	if err != nil {
		return nil, nil, err
	}
	return root, func() { root.Close() }, nil
}

func (f *Fake) ImportImage(ctx context.Context, name string, r io.Reader) (image.Info, error) {
	if err := f.fail(); err != nil {
		return image.Info{}, err
	}
	n, err := io.Copy(io.Discard, r)
	if err != nil {
		return image.Info{}, fmt.Errorf("import image %q: %w", name, err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.images[name]; ok {
		return image.Info{}, fmt.Errorf("image %q: %w", name, errdefs.ErrAlreadyExists)
	}
	info := image.Info{Name: name, Kind: image.KindRootfs, Created: time.Unix(1_700_000_100, 0).UTC(), Size: n}
	f.images[name] = info
	return info, nil
}

func (f *Fake) ListImages(ctx context.Context) ([]image.Info, error) {
	if err := f.fail(); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []image.Info
	for _, name := range slices.Sorted(maps.Keys(f.images)) {
		out = append(out, f.images[name])
	}
	return out, nil
}

func (f *Fake) RemoveImage(ctx context.Context, name string) error {
	if err := f.fail(); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if name == image.HostImage {
		return fmt.Errorf("remove image %q: built in: %w", name, errdefs.ErrFailedPrecondition)
	}
	if _, ok := f.images[name]; !ok {
		return fmt.Errorf("image %q: %w", name, errdefs.ErrNotFound)
	}
	delete(f.images, name)
	return nil
}

func orDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}
