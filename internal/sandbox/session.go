//go:build linux

package sandbox

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
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
)

// A session is a long-lived bash or python process in the sandbox whose
// state (cwd, variables, functions, globals) persists between calls. A call
// writes the snippet to the session's stdin; the session runs it with
// /dev/null as its stdin and then writes an end marker, with a random nonce,
// to stdout (followed by the exit code) and to stderr. Output before the
// markers is the call's. A session that dies or times out is discarded; the
// next call starts a fresh one.
type session struct {
	kind SessionKind
	p    *proc

	mu sync.Mutex // one call at a time
}

const bashPrelude = `shopt -s expand_aliases
__dbx_end() { printf '\036__dbx_%s\036%d\n' "$1" "$2"; printf '\036__dbx_%s\036' "$1" >&2; }
`

// pythonDriver runs snippets in one persistent __main__ namespace. It reads
// "<nonce> <length>\n" then the code from a private dup of its stdin (the
// snippet's stdin is /dev/null), prints the repr of a trailing expression,
// prints a traceback (without the driver's frames) and returns 1 on an
// exception, and honours SystemExit's code without exiting.
const pythonDriver = `
import ast, linecache, os, sys, traceback
def _dbx_main():
    fin = os.fdopen(os.dup(0), 'rb', buffering=0)
    nul = os.open('/dev/null', os.O_RDONLY)
    os.dup2(nul, 0)
    os.close(nul)
    sys.stdin = open('/dev/null')
    g = {'__name__': '__main__', '__builtins__': __builtins__}
    n_call = 0
    def readline():
        b = bytearray()
        while True:
            c = fin.read(1)
            if not c:
                return None
            if c == b'\n':
                return bytes(b)
            b += c
    def readn(n):
        b = bytearray()
        while len(b) < n:
            c = fin.read(n - len(b))
            if not c:
                return None
            b += c
        return bytes(b)
    while True:
        h = readline()
        if h is None:
            os._exit(0)
        nonce, size = h.decode().split()
        src = readn(int(size))
        if src is None:
            os._exit(0)
        src = src.decode()
        n_call += 1
        name = '<deltabox-%d>' % n_call
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        rc = 0
        try:
            tree = ast.parse(src, name, 'exec')
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, name, 'exec'), g)
            if last is not None:
                v = eval(compile(last, name, 'eval'), g)
                if v is not None:
                    print(repr(v))
        except SystemExit as e:
            if e.code is None:
                rc = 0
            elif isinstance(e.code, int):
                rc = e.code
            else:
                print(e.code, file=sys.stderr)
                rc = 1
        except BaseException as e:
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != name:
                tb = tb.tb_next
            traceback.print_exception(type(e), e, tb)
            rc = 1
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        m = ('\x1e__dbx_%s\x1e' % nonce).encode()
        os.write(1, m + (b'%d\n' % rc))
        os.write(2, m)
_dbx_main()
`

// Session runs a snippet in the sandbox's persistent session of req.Kind.
func (s *Sandbox) Session(ctx context.Context, req SessionRequest) (ExecResult, error) {
	if req.Kind != SessionShell && req.Kind != SessionPython {
		return ExecResult{}, fmt.Errorf("session in %q: unknown kind: %w", s.id, errdefs.ErrInvalidArgument)
	}
	if strings.IndexByte(req.Code, 0) >= 0 {
		return ExecResult{}, fmt.Errorf("session in %q: code contains a NUL byte: %w", s.id, errdefs.ErrInvalidArgument)
	}
	began := time.Now()
	// The next checkpoint's generation, unless it is ready (a fork's
	// sandbox gets it here, at its first call, not during the fork).
	s.prepareNext()
	ss, err := s.lockSession(ctx, req.Kind)
	if err != nil {
		return ExecResult{}, err
	}
	// A step after a checkpoint or restore: the next checkpoint's clones
	// are made ahead once it is done and the session free (see cloneAhead).
	step := s.callStarts(req.Kind)
	defer func() {
		ss.mu.Unlock()
		if step {
			s.wantAhead()
		}
	}()
	res, alive, err := ss.call(ctx, s, req)
	res.Duration = time.Since(began)
	if !alive {
		s.dropSession(ss)
	}
	if err != nil {
		return res, fmt.Errorf("%s session in %q: %w", req.Kind, s.id, err)
	}
	return res, nil
}

// lockSession returns the sandbox's session of kind, started if need be,
// locked, with its pending replay done.
func (s *Sandbox) lockSession(ctx context.Context, kind SessionKind) (*session, error) {
	var ss *session
	for {
		var err error
		if ss, err = s.session(ctx, kind); err != nil {
			return nil, fmt.Errorf("%s session in %q: %w", kind, s.id, err)
		}
		ss.mu.Lock()
		// A checkpoint or restore that held it meanwhile may have
		// replaced it (its process became a template or is gone): the
		// call goes to the one that took its place.
		s.mu.Lock()
		current := s.sess[kind] == ss
		s.mu.Unlock()
		if current {
			break
		}
		ss.mu.Unlock()
	}
	if err := s.replayPending(ctx, ss); err != nil {
		ss.mu.Unlock()
		s.dropSession(ss)
		return nil, fmt.Errorf("%s session in %q: %w", kind, s.id, err)
	}
	return ss, nil
}

func (s *Sandbox) session(ctx context.Context, kind SessionKind) (*session, error) {
	s.mu.Lock()
	if ss, ok := s.sess[kind]; ok {
		s.mu.Unlock()
		return ss, nil
	}
	s.mu.Unlock()
	var argv []string
	switch kind {
	case SessionShell:
		argv = []string{"bash", "--noprofile", "--norc"}
	case SessionPython:
		argv = []string{"python3", "-u", "-q", "-c", pythonDriver}
	}
	defer s.changing()()
	p, err := s.start(ctx, argv, s.env, s.defaultWorkdir(), "session-"+kind.String(), true)
	if err != nil {
		return nil, err
	}
	ss := &session{kind: kind, p: p}
	if kind == SessionShell {
		if _, err := io.WriteString(p.stdin, bashPrelude); err != nil {
			ss.kill()
			return nil, fmt.Errorf("start bash session: %w", err)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if other, ok := s.sess[kind]; ok {
		// Lost a race with a concurrent first call: use the winner.
		go func() { ss.kill(); s.deleteChild(ss.p.cg) }()
		return other, nil
	}
	s.sess[kind] = ss
	go s.prepareNext() // for the first checkpoint of the session
	return ss, nil
}

func (s *Sandbox) dropSession(ss *session) {
	s.mu.Lock()
	if s.sess[ss.kind] == ss {
		delete(s.sess, ss.kind)
	}
	s.mu.Unlock()
	ss.kill()
	s.deleteChild(ss.p.cg)
}

func (ss *session) kill() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = ss.p.cg.Kill(ctx)
	ss.closePipes()
}

func (ss *session) closePipes() { ss.p.closeHostEnds() }

// call runs one snippet. alive is false when the session must be discarded.
func (ss *session) call(ctx context.Context, s *Sandbox, req SessionRequest) (res ExecResult, alive bool, err error) {
	var nb [8]byte
	_, _ = rand.Read(nb[:])
	nonce := hex.EncodeToString(nb[:])
	var msg string
	switch ss.kind {
	case SessionShell:
		msg = "IFS= read -r -d '' __dbx_src; eval \"$__dbx_src\" </dev/null; __dbx_end " + nonce + " $?\n" + req.Code + "\x00"
	case SessionPython:
		msg = nonce + " " + strconv.Itoa(len(req.Code)) + "\n" + req.Code
	}
	marker := []byte("\x1e__dbx_" + nonce + "\x1e")
	limit := req.OutputLimit
	if limit <= 0 {
		limit = DefaultOutputLimit
	}
	outW := &limitWriter{w: orDiscard(req.Stdout), n: limit}
	errW := &limitWriter{w: orDiscard(req.Stderr), n: limit}

	type result struct {
		tail []byte
		err  error
	}
	outCh, errCh := make(chan result, 1), make(chan result, 1)
	go func() { t, err := readUntil(ss.p.stdout, outW, marker, true); outCh <- result{t, err} }()
	go func() { t, err := readUntil(ss.p.stderr, errW, marker, false); errCh <- result{t, err} }()
	if _, err := io.WriteString(ss.p.stdin, msg); err != nil {
		// The session is dead; its exit status says why.
		return ss.finishDead(ctx, outW, errW), false, nil
	}

	var timer <-chan time.Time
	if req.Timeout > 0 {
		t := time.NewTimer(req.Timeout)
		defer t.Stop()
		timer = t.C
	}
	var out, serr result
	gotOut, gotErr := false, false
	for !gotOut || !gotErr {
		select {
		case out = <-outCh:
			gotOut = true
		case serr = <-errCh:
			gotErr = true
		case <-timer:
			ss.kill()
			return ExecResult{ExitCode: ExitTimeout, TimedOut: true, StdoutTruncated: outW.stop(), StderrTruncated: errW.stop()}, false, nil
		case <-ctx.Done():
			ss.kill()
			outW.stop()
			errW.stop()
			return ExecResult{}, false, ctx.Err()
		}
		if (gotOut && out.err != nil) || (gotErr && serr.err != nil) {
			// A stream ended without its marker: the session died. The
			// other one's last bytes come first (it ends at once, unless
			// something the session started still holds it).
			grace := time.After(200 * time.Millisecond)
			for !gotOut || !gotErr {
				select {
				case <-outCh:
					gotOut = true
				case <-errCh:
					gotErr = true
				case <-grace:
					gotOut, gotErr = true, true
				}
			}
			return ss.finishDead(ctx, outW, errW), false, nil
		}
	}
	code, perr := strconv.Atoi(strings.TrimSpace(string(out.tail)))
	if perr != nil {
		return ExecResult{}, false, fmt.Errorf("bad end marker %q", out.tail)
	}
	return ExecResult{ExitCode: code, StdoutTruncated: outW.stop(), StderrTruncated: errW.stop()}, true, nil
}

// finishDead reports a session that died mid-call: what it printed was
// already forwarded; the exit code is its own.
func (ss *session) finishDead(ctx context.Context, outW, errW *limitWriter) ExecResult {
	res := ExecResult{ExitCode: 128 + 9, StdoutTruncated: outW.stop(), StderrTruncated: errW.stop()}
	select {
	case st := <-ss.p.status:
		res.ExitCode = exitCodeOf(st)
	case <-time.After(2 * time.Second):
	case <-ctx.Done():
	}
	return res
}

// readUntil copies r to w until marker; with wantLine, it then reads up to
// the next newline and returns it. Bytes that follow belong to no call and
// are dropped with the next read's prefix check.
func readUntil(r *os.File, w io.Writer, marker []byte, wantLine bool) ([]byte, error) {
	buf := make([]byte, 0, 64<<10)
	chunk := make([]byte, 32<<10)
	found := -1
	for found < 0 {
		n, err := r.Read(chunk)
		buf = append(buf, chunk[:n]...)
		if i := bytes.Index(buf, marker); i >= 0 {
			found = i
			break
		}
		// Forward everything that cannot be the start of the marker.
		keep := len(marker) - 1
		if len(buf) > keep {
			_, _ = w.Write(buf[:len(buf)-keep])
			buf = append(buf[:0], buf[len(buf)-keep:]...)
		}
		if err != nil {
			_, _ = w.Write(buf)
			if errors.Is(err, io.EOF) {
				return nil, io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
	_, _ = w.Write(buf[:found])
	rest := buf[found+len(marker):]
	if !wantLine {
		return nil, nil
	}
	for bytes.IndexByte(rest, '\n') < 0 {
		n, err := r.Read(chunk)
		rest = append(rest, chunk[:n]...)
		if err != nil {
			return nil, io.ErrUnexpectedEOF
		}
	}
	return rest[:bytes.IndexByte(rest, '\n')], nil
}

func exitCodeOf(status int) int { return exitCode(unix.WaitStatus(status)) }
