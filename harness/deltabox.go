package harness

import (
	"context"
	"fmt"
	"io/fs"
	"path"
	"sync"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	deltabox "github.com/deltabox/deltabox/sdk"
)

// SandboxWorkspace is the workspace of a DeltaBox executor inside its
// sandbox.
const SandboxWorkspace = "/work"

// NewDeltaBox returns the DeltaBox backend: each executor is a sandbox of
// its own, created through c with opts (its Workdir is forced to
// SandboxWorkspace), and deleted by Close. The executors are Branchers.
func NewDeltaBox(c *deltabox.Client, opts deltabox.CreateOptions) Backend {
	return &sandboxBackend{c: c, opts: opts}
}

type sandboxBackend struct {
	c    *deltabox.Client
	opts deltabox.CreateOptions
}

func (b *sandboxBackend) NewExecutor(ctx context.Context, job string) (Executor, error) {
	opts := b.opts
	opts.Workdir = SandboxWorkspace
	labels := map[string]string{"harness.job": job}
	for k, v := range b.opts.Labels {
		labels[k] = v
	}
	opts.Labels = labels
	sb, err := b.c.Create(ctx, opts)
	if err != nil {
		return nil, fmt.Errorf("job %q: create sandbox: %w", job, err)
	}
	return NewSandboxExecutor(b.c, sb), nil
}

// NewSandboxExecutor wraps an existing sandbox, which it then owns: Close
// deletes it.
func NewSandboxExecutor(c *deltabox.Client, sb *deltabox.Sandbox) Brancher {
	return &sandboxExec{c: c, sb: sb}
}

// sandboxExec is one job's sandbox.
type sandboxExec struct {
	c  *deltabox.Client
	sb *deltabox.Sandbox

	mu     sync.Mutex // serialises calls; guards closed
	closed bool
}

var _ Brancher = (*sandboxExec)(nil)

// SandboxID is the id of the sandbox behind a DeltaBox executor, "" for
// other executors.
func SandboxID(ex Executor) string {
	if s, ok := ex.(*sandboxExec); ok {
		return s.sb.ID()
	}
	return ""
}

func (s *sandboxExec) Workspace() string { return SandboxWorkspace }

func (s *sandboxExec) lock() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return fmt.Errorf("sandbox %q: executor closed: %w", s.sb.ID(), errdefs.ErrFailedPrecondition)
	}
	return nil
}

func (s *sandboxExec) Exec(ctx context.Context, c Cmd) (ExecResult, error) {
	if err := s.lock(); err != nil {
		return ExecResult{}, err
	}
	defer s.mu.Unlock()
	if len(c.Argv) == 0 {
		return ExecResult{}, fmt.Errorf("exec: no command: %w", errdefs.ErrInvalidArgument)
	}
	cwd, err := resolve(SandboxWorkspace, c.Cwd)
	if err != nil {
		return ExecResult{}, err
	}
	r, err := s.sb.Exec(ctx, c.Argv, deltabox.ExecOptions{
		Env: c.Env, Cwd: cwd, Timeout: c.Timeout, Stdout: c.Stdout, Stderr: c.Stderr,
	})
	if err != nil {
		return ExecResult{}, fmt.Errorf("sandbox %q: exec %q: %w", s.sb.ID(), c.Argv[0], err)
	}
	return ExecResult{ExitCode: r.ExitCode, TimedOut: r.TimedOut, Duration: r.Duration}, nil
}

func (s *sandboxExec) Shell(ctx context.Context, code string, opts SessionOptions) (ExecResult, error) {
	if err := s.lock(); err != nil {
		return ExecResult{}, err
	}
	defer s.mu.Unlock()
	r, err := s.sb.Shell(ctx, code, deltabox.SessionOptions{Timeout: opts.Timeout, Stdout: opts.Stdout, Stderr: opts.Stderr})
	if err != nil {
		return ExecResult{}, fmt.Errorf("sandbox %q: shell: %w", s.sb.ID(), err)
	}
	return ExecResult{ExitCode: r.ExitCode, TimedOut: r.TimedOut, Duration: r.Duration}, nil
}

func (s *sandboxExec) ReadFile(ctx context.Context, p string) ([]byte, error) {
	abs, unlock, err := s.enter(p)
	if err != nil {
		return nil, err
	}
	defer unlock()
	b, err := s.sb.ReadFile(ctx, abs)
	if err != nil {
		return nil, fmt.Errorf("read %q: %w", p, err)
	}
	return b, nil
}

func (s *sandboxExec) WriteFile(ctx context.Context, p string, data []byte, perm fs.FileMode) error {
	abs, unlock, err := s.enter(p)
	if err != nil {
		return err
	}
	defer unlock()
	if err := s.sb.WriteFile(ctx, abs, data, perm); err != nil {
		return fmt.Errorf("write %q: %w", p, err)
	}
	return nil
}

func (s *sandboxExec) ListDir(ctx context.Context, p string) ([]FileInfo, error) {
	abs, unlock, err := s.enter(p)
	if err != nil {
		return nil, err
	}
	defer unlock()
	ents, err := s.sb.ListDir(ctx, abs)
	if err != nil {
		return nil, fmt.Errorf("list %q: %w", p, err)
	}
	out := make([]FileInfo, len(ents))
	for i, e := range ents {
		out[i] = sdkFileInfo(e, rel(SandboxWorkspace, path.Join(abs, e.Name)))
	}
	return out, nil
}

func (s *sandboxExec) Stat(ctx context.Context, p string) (FileInfo, error) {
	abs, unlock, err := s.enter(p)
	if err != nil {
		return FileInfo{}, err
	}
	defer unlock()
	fi, err := s.sb.Stat(ctx, abs)
	if err != nil {
		return FileInfo{}, fmt.Errorf("stat %q: %w", p, err)
	}
	return sdkFileInfo(fi, rel(SandboxWorkspace, abs)), nil
}

func (s *sandboxExec) Remove(ctx context.Context, p string, recursive bool) error {
	abs, unlock, err := s.enter(p)
	if err != nil {
		return err
	}
	defer unlock()
	if abs == SandboxWorkspace {
		return fmt.Errorf("remove %q: the workspace itself: %w", p, errdefs.ErrInvalidArgument)
	}
	if err := s.sb.Remove(ctx, abs, recursive); err != nil {
		return fmt.Errorf("remove %q: %w", p, err)
	}
	return nil
}

// Close deletes the sandbox (its checkpoints stay: they belong to the
// tree, see DeleteCheckpoint).
func (s *sandboxExec) Close(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	if err := s.sb.Delete(ctx, deltabox.DeleteOptions{Force: true}); err != nil {
		return fmt.Errorf("delete sandbox %q: %w", s.sb.ID(), err)
	}
	return nil
}

func (s *sandboxExec) Checkpoint(ctx context.Context, name string) (Snapshot, error) {
	if err := s.lock(); err != nil {
		return Snapshot{}, err
	}
	defer s.mu.Unlock()
	var opts []deltabox.CheckpointOption
	if name != "" {
		if len(name) > 128 {
			name = name[:128]
		}
		opts = append(opts, deltabox.WithCheckpointName(name))
	}
	ck, err := s.sb.Checkpoint(ctx, opts...)
	if err != nil {
		return Snapshot{}, fmt.Errorf("checkpoint sandbox %q: %w", s.sb.ID(), err)
	}
	return Snapshot{ID: ck.ID, Pause: ck.Pause}, nil
}

func (s *sandboxExec) Restore(ctx context.Context, id string) (time.Duration, error) {
	if err := s.lock(); err != nil {
		return 0, err
	}
	defer s.mu.Unlock()
	r, err := s.sb.Restore(ctx, id)
	if err != nil {
		return 0, fmt.Errorf("restore sandbox %q to %q: %w", s.sb.ID(), id, err)
	}
	return r.Duration, nil
}

func (s *sandboxExec) Fork(ctx context.Context, id string, n int) ([]Brancher, time.Duration, error) {
	r, err := s.c.Fork(ctx, id, n)
	if err != nil {
		return nil, 0, fmt.Errorf("fork %q: %w", id, err)
	}
	out := make([]Brancher, len(r.Sandboxes))
	for i, sb := range r.Sandboxes {
		out[i] = NewSandboxExecutor(s.c, sb)
	}
	return out, r.Duration, nil
}

func (s *sandboxExec) DeleteCheckpoint(ctx context.Context, id string) error {
	if err := s.c.DeleteCheckpoint(ctx, id, true); err != nil {
		return fmt.Errorf("delete checkpoint %q: %w", id, err)
	}
	return nil
}

func sdkFileInfo(fi deltabox.FileInfo, relPath string) FileInfo {
	return FileInfo{Name: fi.Name, Path: relPath, Size: fi.Size, Mode: fi.Mode, ModTime: fi.ModTime}
}

// enter locks the executor for one call and resolves p in the sandbox's
// workspace; the caller defers unlock.
func (s *sandboxExec) enter(p string) (abs string, unlock func(), err error) {
	if err := s.lock(); err != nil {
		return "", nil, err
	}
	if abs, err = resolve(SandboxWorkspace, p); err != nil {
		s.mu.Unlock()
		return "", nil, err
	}
	return abs, s.mu.Unlock, nil
}
