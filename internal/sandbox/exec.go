//go:build linux

package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/sandbox/cgroup"
	"github.com/deltabox/deltabox/internal/sandbox/initproto"
)

// Exit codes of commands that did not exit by themselves, as coreutils'
// timeout and shells report them.
const (
	ExitTimeout  = 124
	ExitNotFound = 127
)

// outputGrace is how long output is still read after a command exits, for
// what it wrote just before; background processes that keep the pipes open
// do not hold the call longer than outputGraceMax.
const (
	outputGrace    = 100 * time.Millisecond
	outputGraceMax = 2 * time.Second
)

// proc is one process started in the sandbox, with the host ends of its
// stdio.
type proc struct {
	pid    int
	status chan int
	dead   <-chan struct{} // closed when the generation it runs in is gone
	origin *generation     // the generation whose init is its parent
	cg     cgroup.Cgroup   // its own child cgroup: killing it kills its whole tree
	stdin  *os.File        // nil when it reads /dev/null
	stdout *os.File
	stderr *os.File
}

// start starts argv in the sandbox in a new child cgroup, known in
// s.children as key, with pipes for its stdio (stdin only when withStdin).
// The cgroup's own name is unique: one of the same key that a restore
// replaced may still be on its way out.
func (s *Sandbox) start(ctx context.Context, argv, env []string, cwd, key string, withStdin bool) (_ *proc, err error) {
	s.mu.Lock()
	if s.rerooting {
		s.mu.Unlock()
		return nil, fmt.Errorf("sandbox %q is being restored: %w", s.id, errdefs.ErrUnavailable)
	}
	cg, err := s.cg.Child(s.uniqueName(key))
	if err == nil {
		s.children[key] = cg
	}
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			s.deleteChild(cg)
		}
	}()
	tasks, err := cg.TasksFile()
	if err != nil {
		return nil, err
	}
	defer tasks.Close()

	p := &proc{cg: cg}
	var childIn *os.File
	if withStdin {
		r, w, err := os.Pipe()
		if err != nil {
			return nil, err
		}
		childIn, p.stdin = r, w
	} else {
		f, err := os.Open(os.DevNull)
		if err != nil {
			return nil, err
		}
		childIn = f
	}
	defer childIn.Close()
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer outW.Close()
	errR, errW, err := os.Pipe()
	if err != nil {
		outR.Close()
		return nil, err
	}
	defer errW.Close()
	p.stdout, p.stderr = outR, errR
	defer func() {
		if err != nil {
			p.closeHostEnds()
		}
	}()

	req := &initproto.SpawnReq{Argv: argv, Env: env, Cwd: cwd, Cgroup: true, V2: cg.Version() == 2}
	s.switchMu.RLock()
	defer s.switchMu.RUnlock()
	g := s.cur()
	reply, err := g.request(ctx, initproto.Message{Op: initproto.OpSpawn, Spawn: req}, childIn, outW, errW, tasks)
	if err != nil {
		return nil, classifySpawnError(err)
	}
	if reply.Op != initproto.OpSpawned || reply.Pid <= 1 {
		return nil, fmt.Errorf("spawn: unexpected answer %q", reply.Op)
	}
	p.pid = reply.Pid
	p.status = g.waitChan(reply.Pid)
	p.origin = g
	p.dead = g.deadCh
	return p, nil
}

func classifySpawnError(err error) error {
	msg := err.Error()
	switch {
	case strings.Contains(msg, "working directory"):
		return fmt.Errorf("%s: %w", msg, errdefs.ErrInvalidArgument)
	case strings.Contains(msg, "executable file not found"), strings.Contains(msg, "no such file"):
		return fmt.Errorf("%s: %w", msg, errdefs.ErrNotFound)
	case strings.Contains(msg, "permission denied"), strings.Contains(msg, "exec format error"):
		return fmt.Errorf("%s: %w", msg, errdefs.ErrPermissionDenied)
	}
	return err
}

func (p *proc) closeHostEnds() {
	for _, f := range []*os.File{p.stdin, p.stdout, p.stderr} {
		if f != nil {
			f.Close()
		}
	}
}

// Exec runs one command to completion, streaming its output.
func (s *Sandbox) Exec(ctx context.Context, req ExecRequest) (ExecResult, error) {
	if len(req.Argv) == 0 || req.Argv[0] == "" {
		return ExecResult{}, fmt.Errorf("exec in %q: empty command: %w", s.id, errdefs.ErrInvalidArgument)
	}
	if req.Timeout < 0 {
		return ExecResult{}, fmt.Errorf("exec in %q: negative timeout: %w", s.id, errdefs.ErrInvalidArgument)
	}
	began := time.Now()
	cwd := req.Cwd
	if cwd == "" {
		cwd = s.defaultWorkdir()
	}
	s.mu.Lock()
	s.execs++
	n := s.execs
	s.mu.Unlock()
	defer s.changing()()
	p, err := s.start(ctx, req.Argv, MergeEnv(s.env, req.Env), cwd, "exec-"+strconv.Itoa(n), req.Stdin != nil)
	if err != nil {
		if errdefs.IsNotFound(err) {
			// Like a shell: a missing command is exit code 127, not a failure
			// of the call.
			if req.Stderr != nil {
				fmt.Fprintf(req.Stderr, "deltabox: %s: command not found\n", req.Argv[0])
			}
			return ExecResult{ExitCode: ExitNotFound, Duration: time.Since(began)}, nil
		}
		return ExecResult{}, fmt.Errorf("exec in %q: %w", s.id, err)
	}
	if p.stdin != nil {
		go func() {
			_, _ = io.Copy(p.stdin, req.Stdin)
			p.stdin.Close()
		}()
	}
	limit := req.OutputLimit
	if limit <= 0 {
		limit = DefaultOutputLimit
	}
	outW := &limitWriter{w: orDiscard(req.Stdout), n: limit}
	errW := &limitWriter{w: orDiscard(req.Stderr), n: limit}
	var wg sync.WaitGroup
	outDone, errDone := copyOutput(&wg, p.stdout, outW), copyOutput(&wg, p.stderr, errW)

	res, waitErr := s.wait(ctx, p, req.Timeout)
	if procs, err := p.cg.Procs(); err == nil && len(procs) == 0 {
		// Nothing else can hold the pipes: read them to the end, however
		// long a loaded machine takes to deliver it.
		<-outDone
		<-errDone
	} else {
		// Background processes the command left may keep them open.
		drain(p, outDone, errDone)
	}
	wg.Wait()
	p.closeHostEnds()
	res.StdoutTruncated, res.StderrTruncated = outW.stop(), errW.stop()
	res.Duration = time.Since(began)
	s.releaseCgroup(p.cg)
	if waitErr != nil {
		return res, fmt.Errorf("exec in %q: %w", s.id, waitErr)
	}
	return res, nil
}

// wait waits for p to exit; on timeout or cancellation it kills p's whole
// tree (its cgroup) first.
func (s *Sandbox) wait(ctx context.Context, p *proc, timeout time.Duration) (ExecResult, error) {
	var timer <-chan time.Time
	if timeout > 0 {
		t := time.NewTimer(timeout)
		defer t.Stop()
		timer = t.C
	}
	var res ExecResult
	var err error
	select {
	case st := <-p.status:
		res.ExitCode = exitCode(unix.WaitStatus(st))
		return res, nil
	case <-timer:
		res.TimedOut = true
	case <-ctx.Done():
		err = ctx.Err()
	case <-p.dead:
		return ExecResult{ExitCode: 128 + int(unix.SIGKILL)}, fmt.Errorf("sandbox stopped: %w", errdefs.ErrUnavailable)
	}
	kctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if kerr := p.cg.Kill(kctx); kerr != nil {
		err = errors.Join(err, kerr)
	}
	select {
	case st := <-p.status:
		res.ExitCode = exitCode(unix.WaitStatus(st))
	case <-p.dead:
	case <-kctx.Done():
	}
	if res.TimedOut {
		res.ExitCode = ExitTimeout
	}
	return res, err
}

// releaseCgroup removes an exec's cgroup unless background processes it
// started still live in it (they stay until the sandbox is destroyed).
func (s *Sandbox) releaseCgroup(cg cgroup.Cgroup) {
	if procs, err := cg.Procs(); err == nil && len(procs) == 0 {
		s.deleteChild(cg)
	}
}

// deleteChild kills what is left in a child cgroup and removes it.
func (s *Sandbox) deleteChild(cg cgroup.Cgroup) {
	_ = cg.Delete(context.Background())
	s.mu.Lock()
	for name, c := range s.children {
		if c == cg {
			delete(s.children, name)
		}
	}
	s.mu.Unlock()
}

func exitCode(ws unix.WaitStatus) int {
	switch {
	case ws.Exited():
		return ws.ExitStatus()
	case ws.Signaled():
		return 128 + int(ws.Signal())
	}
	return -1
}

func (s *Sandbox) defaultWorkdir() string {
	if s.workdir != "" {
		return s.workdir
	}
	return "/work"
}

// MergeEnv returns base with over's variables (K=V) replacing or added.
func MergeEnv(base, over []string) []string {
	out := make([]string, 0, len(base)+len(over))
	idx := map[string]int{}
	for _, list := range [][]string{base, over} {
		for _, kv := range list {
			k, _, _ := strings.Cut(kv, "=")
			if i, ok := idx[k]; ok {
				out[i] = kv
				continue
			}
			idx[k] = len(out)
			out = append(out, kv)
		}
	}
	return out
}

// copyOutput copies r to w until EOF or until drain stops it; the returned
// channel is closed when it is done.
func copyOutput(wg *sync.WaitGroup, r *os.File, w io.Writer) chan struct{} {
	done := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(done)
		_, _ = io.Copy(w, r)
	}()
	return done
}

// drain gives the output copiers a short grace after the process exited:
// what it wrote is read, but background processes that hold the pipes open
// do not hold the call.
func drain(p *proc, done ...chan struct{}) {
	deadline := time.Now().Add(outputGraceMax)
	for _, d := range done {
		select {
		case <-d:
			continue
		case <-time.After(outputGrace):
		}
		// Still open: let whatever is buffered be read, then stop.
		for _, f := range []*os.File{p.stdout, p.stderr} {
			_ = f.SetReadDeadline(time.Now().Add(outputGrace))
		}
		select {
		case <-d:
		case <-time.After(time.Until(deadline)):
			for _, f := range []*os.File{p.stdout, p.stderr} {
				_ = f.SetReadDeadline(time.Now())
			}
			<-d
		}
	}
}

func orDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}

// limitWriter passes at most n bytes to w, then writes TruncationMarker once
// and discards the rest (still consuming it, so the writer never blocks).
type limitWriter struct {
	mu        sync.Mutex // a session call's reader may still write when the call returns
	w         io.Writer
	n         int64
	truncated bool
	closed    bool // see stop
}

// stop ends the forwarding (the call that owned the writer returned: it is
// its caller's again) and reports whether the output was truncated.
func (l *limitWriter) stop() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	return l.truncated
}

func (l *limitWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.truncated || l.closed {
		return len(b), nil
	}
	if int64(len(b)) <= l.n {
		l.n -= int64(len(b))
		_, err := l.w.Write(b)
		if err != nil {
			// A client that went away must not block the command: discard.
			l.truncated = true
		}
		return len(b), nil
	}
	_, _ = l.w.Write(b[:l.n])
	_, _ = io.WriteString(l.w, TruncationMarker)
	l.n = 0
	l.truncated = true
	return len(b), nil
}
