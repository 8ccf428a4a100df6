//go:build linux

package daemon

import (
	"context"
	"errors"
	"io"
	"sync"

	"connectrpc.com/connect"

	v1 "github.com/deltabox/deltabox/api/deltabox/v1"
	"github.com/deltabox/deltabox/internal/sandbox"
)

func (s *service) Exec(ctx context.Context, req *connect.Request[v1.ExecRequest], stream *connect.ServerStream[v1.ExecResponse]) error {
	return s.exec(ctx, req.Msg, nil, stream.Send)
}

// ExecInteractive reads the start message, then forwards every stdin message
// to the command through a pipe while its output streams back.
func (s *service) ExecInteractive(ctx context.Context, stream *connect.BidiStream[v1.ExecInteractiveRequest, v1.ExecResponse]) error {
	first, err := stream.Receive()
	if errors.Is(err, io.EOF) {
		return invalid("exec: empty request stream")
	}
	if err != nil {
		return err
	}
	start := first.GetStart()
	if start == nil {
		return invalid("exec: the first message must be the start")
	}
	pr, pw := io.Pipe()
	defer pr.Close() // unblocks the forwarder when the command ignores stdin
	go func() {
		for {
			m, err := stream.Receive()
			if errors.Is(err, io.EOF) {
				pw.Close()
				return
			}
			if err != nil {
				pw.CloseWithError(err)
				return
			}
			switch m := m.Msg.(type) {
			case *v1.ExecInteractiveRequest_Stdin:
				if _, err := pw.Write(m.Stdin); err != nil {
					return // the command is done with stdin
				}
			case *v1.ExecInteractiveRequest_StdinEof:
				pw.Close()
				return
			default:
				pw.CloseWithError(invalid("exec: a second start message"))
				return
			}
		}
	}()
	return s.exec(ctx, start, pr, stream.Send)
}

func (s *service) exec(ctx context.Context, m *v1.ExecRequest, stdin io.Reader, send func(*v1.ExecResponse) error) error {
	if err := validSandboxID(m.SandboxId); err != nil {
		return err
	}
	if err := validArgv(m.Argv); err != nil {
		return err
	}
	if err := validEnv(m.Env); err != nil {
		return err
	}
	if m.Cwd != "" {
		if err := validPath("cwd", m.Cwd); err != nil {
			return err
		}
	}
	if err := validLimit("output limit", m.OutputLimit); err != nil {
		return err
	}
	timeout, err := duration("timeout", m.Timeout)
	if err != nil {
		return err
	}
	out := newOutput(send)
	defer out.close()
	res, err := s.b.Exec(ctx, m.SandboxId, sandbox.ExecRequest{
		Argv:        m.Argv,
		Env:         m.Env,
		Cwd:         m.Cwd,
		Timeout:     timeout,
		Stdin:       stdin,
		Stdout:      out.stdout(),
		Stderr:      out.stderr(),
		OutputLimit: m.OutputLimit,
	})
	if err != nil {
		return err
	}
	return out.exit(res)
}

var sessionKinds = map[v1.SessionKind]sandbox.SessionKind{
	v1.SessionKind_SESSION_KIND_SHELL:  sandbox.SessionShell,
	v1.SessionKind_SESSION_KIND_PYTHON: sandbox.SessionPython,
}

func (s *service) RunSession(ctx context.Context, req *connect.Request[v1.RunSessionRequest], stream *connect.ServerStream[v1.ExecResponse]) error {
	m := req.Msg
	if err := validSandboxID(m.SandboxId); err != nil {
		return err
	}
	kind, ok := sessionKinds[m.Kind]
	if !ok {
		return invalid("bad session kind %v", m.Kind)
	}
	if err := validLimit("output limit", m.OutputLimit); err != nil {
		return err
	}
	timeout, err := duration("timeout", m.Timeout)
	if err != nil {
		return err
	}
	out := newOutput(stream.Send)
	defer out.close()
	res, err := s.b.Session(ctx, m.SandboxId, sandbox.SessionRequest{
		Kind:        kind,
		Code:        m.Code,
		Timeout:     timeout,
		Stdout:      out.stdout(),
		Stderr:      out.stderr(),
		OutputLimit: m.OutputLimit,
	})
	if err != nil {
		return err
	}
	return out.exit(res)
}

// output turns a command's two output streams into ExecResponse messages on
// one stream. The backend may write stdout and stderr concurrently; mu
// serialises the sends. Writes after close fail, so a backend that keeps a
// writer past Exec's return cannot touch a finished stream.
type output struct {
	// mu guards send and closed.
	mu     sync.Mutex
	send   func(*v1.ExecResponse) error
	closed bool
}

func newOutput(send func(*v1.ExecResponse) error) *output { return &output{send: send} }

func (o *output) stdout() io.Writer {
	return chunkWriter(func(b []byte) error {
		return o.emit(&v1.ExecResponse{Event: &v1.ExecResponse_Stdout{Stdout: b}})
	})
}

func (o *output) stderr() io.Writer {
	return chunkWriter(func(b []byte) error {
		return o.emit(&v1.ExecResponse{Event: &v1.ExecResponse_Stderr{Stderr: b}})
	})
}

func (o *output) emit(m *v1.ExecResponse) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.closed {
		return io.ErrClosedPipe
	}
	return o.send(m)
}

func (o *output) exit(res sandbox.ExecResult) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.closed = true
	return o.send(exitToProto(res))
}

func (o *output) close() {
	o.mu.Lock()
	o.closed = true
	o.mu.Unlock()
}

// chunkWriter sends what is written in messages of at most ChunkSize bytes.
// send must not keep the slice (Connect marshals it before returning).
type chunkWriter func([]byte) error

func (w chunkWriter) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		c := min(len(p), v1.ChunkSize)
		if err := w(p[:c]); err != nil {
			return n, err
		}
		n += c
		p = p[c:]
	}
	return n, nil
}
