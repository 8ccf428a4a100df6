package harness

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/deltabox/deltabox/errdefs"
)

// NewLocal returns the local backend: each executor works in a fresh
// directory of its own below dir ("" means the system's temporary
// directory), removed by Close. It isolates paths only (file operations are
// confined to the directory, symlinks included); commands run on the host
// as the calling user. It is for development.
func NewLocal(dir string) Backend { return localBackend{dir: dir} }

type localBackend struct{ dir string }

var nameUnsafe = regexp.MustCompile(`[^A-Za-z0-9_.-]+`)

func (b localBackend) NewExecutor(ctx context.Context, job string) (Executor, error) {
	prefix := nameUnsafe.ReplaceAllString(job, "_")
	if len(prefix) > 40 {
		prefix = prefix[:40]
	}
	dir, err := os.MkdirTemp(b.dir, "harness-"+prefix+"-")
	if err != nil {
		return nil, fmt.Errorf("job %q: make workspace: %w", job, err)
	}
	dir, err = filepath.EvalSymlinks(dir)
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("job %q: make workspace: %w", job, err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("job %q: open workspace: %w", job, err)
	}
	return &local{dir: dir, root: root}, nil
}

// local is one job's directory on the host.
type local struct {
	dir string

	mu      sync.Mutex // serialises calls; guards the fields below
	root    *os.Root   // nil once closed
	session *localSession
}

var _ Executor = (*local)(nil)

func (l *local) Workspace() string { return l.dir }

// name turns p into a name relative to the workspace, for os.Root.
func (l *local) name(p string) (string, error) {
	abs, err := resolve(l.dir, p)
	if err != nil {
		return "", err
	}
	return rel(l.dir, abs), nil
}

func (l *local) open() error {
	if l.root == nil {
		return fmt.Errorf("workspace %q: executor closed: %w", l.dir, errdefs.ErrFailedPrecondition)
	}
	return nil
}

func (l *local) Exec(ctx context.Context, c Cmd) (ExecResult, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.open(); err != nil {
		return ExecResult{}, err
	}
	if len(c.Argv) == 0 {
		return ExecResult{}, fmt.Errorf("exec: no command: %w", errdefs.ErrInvalidArgument)
	}
	cwd, err := l.name(c.Cwd)
	if err != nil {
		return ExecResult{}, err
	}
	if fi, err := l.root.Stat(cwd); err != nil {
		return ExecResult{}, fmt.Errorf("exec: cwd %q: %w", c.Cwd, fsErr(err))
	} else if !fi.IsDir() {
		return ExecResult{}, fmt.Errorf("exec: cwd %q is not a directory: %w", c.Cwd, errdefs.ErrInvalidArgument)
	}
	runCtx := ctx
	if c.Timeout > 0 {
		var cancel context.CancelFunc
		runCtx, cancel = context.WithTimeout(ctx, c.Timeout)
		defer cancel()
	}
	cmd := exec.CommandContext(runCtx, c.Argv[0], c.Argv[1:]...)
	cmd.Dir = filepath.Join(l.dir, cwd)
	cmd.Env = append(os.Environ(), "WORKSPACE="+l.dir)
	cmd.Env = append(cmd.Env, c.Env...)
	cmd.Stdout, cmd.Stderr = orDiscard(c.Stdout), orDiscard(c.Stderr)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = time.Second
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return ExecResult{}, fmt.Errorf("exec %q: %w", c.Argv[0], errors.Join(err, errdefs.ErrNotFound))
	}
	err = cmd.Wait()
	// Whatever the command left running in its group goes with it.
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	res := ExecResult{Duration: time.Since(start), ExitCode: cmd.ProcessState.ExitCode()}
	if ctx.Err() != nil {
		return res, fmt.Errorf("exec %q: %w", c.Argv[0], ctx.Err())
	}
	if runCtx.Err() != nil {
		res.ExitCode, res.TimedOut = 124, true
		return res, nil
	}
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		res.ExitCode = 128 + int(ws.Signal())
	}
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) && !errors.Is(err, exec.ErrWaitDelay) {
		return res, fmt.Errorf("exec %q: %w", c.Argv[0], err)
	}
	return res, nil
}

func (l *local) Shell(ctx context.Context, code string, opts SessionOptions) (ExecResult, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.open(); err != nil {
		return ExecResult{}, err
	}
	if l.session == nil {
		s, err := startLocalSession(l.dir)
		if err != nil {
			return ExecResult{}, err
		}
		l.session = s
	}
	res, alive, err := l.session.run(ctx, code, opts)
	if !alive {
		l.session.kill()
		l.session = nil
	}
	return res, err
}

func (l *local) ReadFile(ctx context.Context, p string) ([]byte, error) {
	n, unlock, err := l.enter(p)
	if err != nil {
		return nil, err
	}
	defer unlock()
	b, err := l.root.ReadFile(n)
	if err != nil {
		return nil, fmt.Errorf("read %q: %w", p, fsErr(err))
	}
	return b, nil
}

func (l *local) WriteFile(ctx context.Context, p string, data []byte, perm fs.FileMode) error {
	n, unlock, err := l.enter(p)
	if err != nil {
		return err
	}
	defer unlock()
	if perm == 0 {
		perm = 0o644
	}
	if d := filepath.Dir(n); d != "." {
		if err := l.root.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("write %q: %w", p, fsErr(err))
		}
	}
	// Write a sibling and rename it over, so a reader never sees half a file.
	tmp := n + ".harness-tmp"
	if err := l.root.WriteFile(tmp, data, perm); err != nil {
		l.root.Remove(tmp)
		return fmt.Errorf("write %q: %w", p, fsErr(err))
	}
	if err := l.root.Rename(tmp, n); err != nil {
		l.root.Remove(tmp)
		return fmt.Errorf("write %q: %w", p, fsErr(err))
	}
	return nil
}

func (l *local) ListDir(ctx context.Context, p string) ([]FileInfo, error) {
	n, unlock, err := l.enter(p)
	if err != nil {
		return nil, err
	}
	defer unlock()
	f, err := l.root.Open(n)
	if err != nil {
		return nil, fmt.Errorf("list %q: %w", p, fsErr(err))
	}
	defer f.Close()
	ents, err := f.ReadDir(-1)
	if err != nil {
		return nil, fmt.Errorf("list %q: %w", p, fsErr(err))
	}
	out := make([]FileInfo, 0, len(ents))
	for _, e := range ents {
		fi, err := e.Info()
		if err != nil {
			continue // removed meanwhile
		}
		out = append(out, toFileInfo(filepath.ToSlash(filepath.Join(n, e.Name())), fi))
	}
	slices.SortFunc(out, func(a, b FileInfo) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

func (l *local) Stat(ctx context.Context, p string) (FileInfo, error) {
	n, unlock, err := l.enter(p)
	if err != nil {
		return FileInfo{}, err
	}
	defer unlock()
	fi, err := l.root.Lstat(n)
	if err != nil {
		return FileInfo{}, fmt.Errorf("stat %q: %w", p, fsErr(err))
	}
	return toFileInfo(n, fi), nil
}

func (l *local) Remove(ctx context.Context, p string, recursive bool) error {
	n, unlock, err := l.enter(p)
	if err != nil {
		return err
	}
	defer unlock()
	if n == "." {
		return fmt.Errorf("remove %q: the workspace itself: %w", p, errdefs.ErrInvalidArgument)
	}
	if recursive {
		if _, err := l.root.Lstat(n); err != nil {
			return fmt.Errorf("remove %q: %w", p, fsErr(err))
		}
		err = l.root.RemoveAll(n)
	} else {
		err = l.root.Remove(n)
	}
	if err != nil {
		return fmt.Errorf("remove %q: %w", p, fsErr(err))
	}
	return nil
}

func (l *local) Close(ctx context.Context) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.root == nil {
		return nil
	}
	if l.session != nil {
		l.session.kill()
		l.session = nil
	}
	l.root.Close()
	l.root = nil
	if err := os.RemoveAll(l.dir); err != nil {
		return fmt.Errorf("remove workspace %q: %w", l.dir, err)
	}
	return nil
}

func toFileInfo(name string, fi fs.FileInfo) FileInfo {
	return FileInfo{Name: fi.Name(), Path: filepath.ToSlash(name), Size: fi.Size(), Mode: fi.Mode(), ModTime: fi.ModTime()}
}

// fsErr adds the errdefs class of a file system error.
func fsErr(err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return errors.Join(err, errdefs.ErrNotFound)
	case errors.Is(err, fs.ErrExist):
		return errors.Join(err, errdefs.ErrAlreadyExists)
	case errors.Is(err, fs.ErrPermission):
		return errors.Join(err, errdefs.ErrPermissionDenied)
	case errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR), errors.Is(err, syscall.ENOTEMPTY):
		return errors.Join(err, errdefs.ErrFailedPrecondition)
	case strings.Contains(err.Error(), "escapes from parent"), strings.Contains(err.Error(), "path escapes"):
		return errors.Join(err, errdefs.ErrInvalidArgument)
	}
	return err
}

func orDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}

// localSession is a persistent bash process. Each snippet is eval'd, then
// the session prints a marker with its exit code on stdout and a marker on
// stderr: output up to the markers is the snippet's.
type localSession struct {
	cmd         *exec.Cmd
	stdin       io.WriteCloser
	stdout      chan []byte // closed at EOF
	stderr      chan []byte
	done        chan struct{} // closed when the process has been waited for
	mark        []byte
	outq, errq  []byte // read but not yet handed out
	outEOF, eof bool
}

func startLocalSession(dir string) (*localSession, error) {
	var nonce [8]byte
	rand.Read(nonce[:])
	s := &localSession{
		stdout: make(chan []byte, 16), stderr: make(chan []byte, 16), done: make(chan struct{}),
		mark: []byte("\x1e__harness_" + hex.EncodeToString(nonce[:]) + "__"),
	}
	s.cmd = exec.Command("bash", "--noprofile", "--norc")
	s.cmd.Dir = dir
	s.cmd.Env = append(os.Environ(), "WORKSPACE="+dir)
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	var err error
	if s.stdin, err = s.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	out, err := s.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	errp, err := s.cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start shell session: %w", err)
	}
	pump := func(r io.Reader, ch chan<- []byte) {
		defer close(ch)
		for {
			buf := make([]byte, 32<<10)
			n, err := r.Read(buf)
			if n > 0 {
				ch <- buf[:n]
			}
			if err != nil {
				return
			}
		}
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); pump(out, s.stdout) }()
	go func() { defer wg.Done(); pump(errp, s.stderr) }()
	go func() { wg.Wait(); s.cmd.Wait(); close(s.done) }()
	return s, nil
}

// kill ends the session's process group and waits for it.
func (s *localSession) kill() {
	_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
	s.stdin.Close()
	// Drain so the pumps can finish.
	go func() {
		for range s.stdout {
		}
	}()
	go func() {
		for range s.stderr {
		}
	}()
	<-s.done
}

// run runs one snippet; alive is false when the session is gone (exited,
// timed out, cancelled) and must be replaced.
func (s *localSession) run(ctx context.Context, code string, opts SessionOptions) (res ExecResult, alive bool, err error) {
	start := time.Now()
	quoted := "'" + strings.ReplaceAll(code, "'", `'\''`) + "'"
	script := fmt.Sprintf("eval -- %s </dev/null\nprintf '%%s %%d\\n' '%s' $?\nprintf '%%s\\n' '%s' >&2\n", quoted, s.mark, s.mark)
	if _, err := io.WriteString(s.stdin, script); err != nil {
		return ExecResult{}, false, fmt.Errorf("shell session: %w", err)
	}
	var timeout <-chan time.Time
	if opts.Timeout > 0 {
		t := time.NewTimer(opts.Timeout)
		defer t.Stop()
		timeout = t.C
	}
	stdout, stderr := orDiscard(opts.Stdout), orDiscard(opts.Stderr)
	exit, gotOut, gotErr := -1, false, false
	for !gotOut || !gotErr {
		select {
		case b, ok := <-s.stdout:
			if !ok {
				gotOut, s.outEOF = true, true
				stdout.Write(s.outq)
				s.outq = nil
				continue
			}
			s.outq = append(s.outq, b...)
			var done bool
			s.outq, exit, done = s.scan(s.outq, stdout, true)
			gotOut = gotOut || done
		case b, ok := <-s.stderr:
			if !ok {
				gotErr, s.eof = true, true
				stderr.Write(s.errq)
				s.errq = nil
				continue
			}
			s.errq = append(s.errq, b...)
			var done bool
			s.errq, _, done = s.scan(s.errq, stderr, false)
			gotErr = gotErr || done
		case <-timeout:
			return ExecResult{ExitCode: 124, TimedOut: true, Duration: time.Since(start)}, false, nil
		case <-ctx.Done():
			return ExecResult{}, false, fmt.Errorf("shell session: %w", ctx.Err())
		}
	}
	res = ExecResult{ExitCode: exit, Duration: time.Since(start)}
	if s.outEOF || s.eof {
		// The snippet ended the shell (exit N): report its status.
		<-s.done
		res.ExitCode = s.cmd.ProcessState.ExitCode()
		return res, false, nil
	}
	return res, true, nil
}

// scan writes what of q precedes the marker and returns the rest; done
// once the marker (and, on stdout, its exit code line) was seen.
func (s *localSession) scan(q []byte, w io.Writer, withCode bool) (rest []byte, exit int, done bool) {
	i := bytes.Index(q, s.mark)
	if i < 0 {
		// Hold back what could be the start of a marker.
		keep := min(len(q), len(s.mark)-1)
		w.Write(q[:len(q)-keep])
		return q[len(q)-keep:], -1, false
	}
	nl := bytes.IndexByte(q[i:], '\n')
	if nl < 0 {
		w.Write(q[:i])
		return q[i:], -1, false
	}
	w.Write(q[:i])
	line := string(q[i+len(s.mark) : i+nl])
	exit = -1
	if withCode {
		exit, _ = strconv.Atoi(strings.TrimSpace(line))
	}
	return q[i+nl+1:], exit, true
}

// enter locks the executor for one call and resolves p in its workspace; the
// caller defers unlock.
func (l *local) enter(p string) (name string, unlock func(), err error) {
	l.mu.Lock()
	if err := l.open(); err != nil {
		l.mu.Unlock()
		return "", nil, err
	}
	if name, err = l.name(p); err != nil {
		l.mu.Unlock()
		return "", nil, err
	}
	return name, l.mu.Unlock, nil
}
