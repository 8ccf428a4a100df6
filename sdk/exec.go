package deltabox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"

	v1 "github.com/deltabox/deltabox/api/deltabox/v1"
	"github.com/deltabox/deltabox/errdefs"
)

// ExecOptions tune one command.
type ExecOptions struct {
	Env     []string      // K=V, over the sandbox's environment
	Cwd     string        // absolute; "" means the sandbox's workdir
	Timeout time.Duration // kills the command (exit code 124); 0 means none
	// Stdin, when set, is copied to the command's standard input (then
	// closed at EOF); otherwise the command reads /dev/null. Exec returns
	// when the command ends, but a Read on Stdin already blocked at that time
	// keeps its goroutine until it returns.
	Stdin io.Reader
	// Stdout and Stderr receive the output as it is produced; nil discards.
	// They are written from one goroutine, never concurrently.
	Stdout, Stderr io.Writer
	// OutputLimit bounds each stream; the daemon then writes a truncation
	// marker. 0 means 16 MiB.
	OutputLimit int64
}

// ExecResult is how a command ended.
type ExecResult struct {
	ExitCode        int           `json:"exit_code"` // 124 on timeout; 128+n when killed by signal n
	TimedOut        bool          `json:"timed_out"`
	StdoutTruncated bool          `json:"stdout_truncated"`
	StderrTruncated bool          `json:"stderr_truncated"`
	Duration        time.Duration `json:"duration"`
}

// Exec runs argv in the sandbox and streams its output to opts.Stdout and
// opts.Stderr. A command that runs and fails is not an error: see
// ExecResult.ExitCode.
func (s *Sandbox) Exec(ctx context.Context, argv []string, opts ExecOptions) (ExecResult, error) {
	req := &v1.ExecRequest{
		SandboxId:   s.id,
		Argv:        argv,
		Env:         opts.Env,
		Cwd:         opts.Cwd,
		OutputLimit: opts.OutputLimit,
	}
	if opts.Timeout > 0 {
		req.Timeout = durationpb.New(opts.Timeout)
	}
	if opts.Stdin != nil {
		return s.execInteractive(ctx, req, opts)
	}
	stream, err := s.c.rpc.Exec(ctx, connect.NewRequest(req))
	if err != nil {
		return ExecResult{}, s.c.err(err)
	}
	defer stream.Close()
	return s.c.output(receiver(stream), opts.Stdout, opts.Stderr)
}

// execInteractive runs a command with stdin over the bidirectional RPC. One
// goroutine owns the request side (Send, CloseRequest) and copies stdin;
// this one reads the output.
func (s *Sandbox) execInteractive(ctx context.Context, req *v1.ExecRequest, opts ExecOptions) (ExecResult, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // ends the stream, and with it a Send the copier is blocked in
	stream := s.c.rpc.ExecInteractive(ctx)
	if err := stream.Send(&v1.ExecInteractiveRequest{Msg: &v1.ExecInteractiveRequest_Start{Start: req}}); err != nil && !errors.Is(err, io.EOF) {
		return ExecResult{}, s.c.err(err)
	}
	go func() {
		buf := make([]byte, v1.ChunkSize)
		for {
			n, err := opts.Stdin.Read(buf)
			if n > 0 {
				if stream.Send(&v1.ExecInteractiveRequest{Msg: &v1.ExecInteractiveRequest_Stdin{Stdin: buf[:n]}}) != nil {
					return
				}
			}
			if err != nil || ctx.Err() != nil {
				// EOF or a broken stdin both end the command's stdin.
				stream.CloseRequest()
				return
			}
		}
	}()
	defer stream.CloseResponse()
	return s.c.output(stream.Receive, opts.Stdout, opts.Stderr)
}

// output reads ExecResponses until the exit and writes their output.
func (c *Client) output(recv func() (*v1.ExecResponse, error), stdout, stderr io.Writer) (ExecResult, error) {
	if stdout == nil {
		stdout = io.Discard
	}
	if stderr == nil {
		stderr = io.Discard
	}
	for {
		m, err := recv()
		if errors.Is(err, io.EOF) {
			return ExecResult{}, fmt.Errorf("exec: the daemon ended the stream without an exit status: %w", errdefs.ErrInternal)
		}
		if err != nil {
			return ExecResult{}, c.err(err)
		}
		switch ev := m.Event.(type) {
		case *v1.ExecResponse_Stdout:
			if _, err := stdout.Write(ev.Stdout); err != nil {
				return ExecResult{}, fmt.Errorf("exec: write stdout: %w", err)
			}
		case *v1.ExecResponse_Stderr:
			if _, err := stderr.Write(ev.Stderr); err != nil {
				return ExecResult{}, fmt.Errorf("exec: write stderr: %w", err)
			}
		case *v1.ExecResponse_Exit:
			x := ev.Exit
			return ExecResult{
				ExitCode:        int(x.ExitCode),
				TimedOut:        x.TimedOut,
				StdoutTruncated: x.StdoutTruncated,
				StderrTruncated: x.StderrTruncated,
				Duration:        x.Duration.AsDuration(),
			}, nil
		}
	}
}

// Output is a command's collected output, from Run.
type Output struct {
	ExecResult
	Stdout string `json:"stdout"`
	Stderr string `json:"stderr"`
}

// Run runs argv and collects its output (up to opts.OutputLimit per
// stream); opts.Stdout and opts.Stderr, if set, still see it live.
func (s *Sandbox) Run(ctx context.Context, argv []string, opts ExecOptions) (Output, error) {
	var out, errb bytes.Buffer
	opts.Stdout = tee(&out, opts.Stdout)
	opts.Stderr = tee(&errb, opts.Stderr)
	res, err := s.Exec(ctx, argv, opts)
	return Output{ExecResult: res, Stdout: out.String(), Stderr: errb.String()}, err
}

func tee(buf *bytes.Buffer, w io.Writer) io.Writer {
	if w == nil {
		return buf
	}
	return io.MultiWriter(buf, w)
}

// SessionOptions tune one snippet of a session.
type SessionOptions struct {
	// Timeout kills the session (the next call starts a fresh one, with
	// fresh state); 0 means none.
	Timeout        time.Duration
	Stdout, Stderr io.Writer // nil discards
	OutputLimit    int64
}

// Shell runs code in the sandbox's persistent bash session: cwd, variables,
// functions and options persist across calls. The exit code is the
// snippet's last command's.
func (s *Sandbox) Shell(ctx context.Context, code string, opts SessionOptions) (ExecResult, error) {
	return s.session(ctx, v1.SessionKind_SESSION_KIND_SHELL, code, opts)
}

// Python runs code in the sandbox's persistent Python session: globals
// persist across calls. The exit code says whether the snippet raised.
func (s *Sandbox) Python(ctx context.Context, code string, opts SessionOptions) (ExecResult, error) {
	return s.session(ctx, v1.SessionKind_SESSION_KIND_PYTHON, code, opts)
}

func (s *Sandbox) session(ctx context.Context, kind v1.SessionKind, code string, opts SessionOptions) (ExecResult, error) {
	req := &v1.RunSessionRequest{SandboxId: s.id, Kind: kind, Code: code, OutputLimit: opts.OutputLimit}
	if opts.Timeout > 0 {
		req.Timeout = durationpb.New(opts.Timeout)
	}
	stream, err := s.c.rpc.RunSession(ctx, connect.NewRequest(req))
	if err != nil {
		return ExecResult{}, s.c.err(err)
	}
	defer stream.Close()
	return s.c.output(receiver(stream), opts.Stdout, opts.Stderr)
}

// receiver adapts a server stream to a receive function that returns io.EOF
// at its end.
func receiver[T any](stream *connect.ServerStreamForClient[T]) func() (*T, error) {
	return func() (*T, error) {
		if !stream.Receive() {
			if err := stream.Err(); err != nil {
				return nil, err
			}
			return nil, io.EOF
		}
		return stream.Msg(), nil
	}
}
