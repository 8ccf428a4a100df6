//go:build linux

package daemon_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/deltabox/deltabox/api/deltabox/v1"
	"github.com/deltabox/deltabox/api/deltabox/v1/deltaboxv1connect"
	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/daemon/daemontest"
	"github.com/deltabox/deltabox/internal/sandbox"
	deltabox "github.com/deltabox/deltabox/sdk"
)

func dial(t *testing.T, sock string, opts ...deltabox.Option) *deltabox.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := deltabox.Dial(ctx, append([]deltabox.Option{deltabox.WithSocket(sock)}, opts...)...)
	if err != nil {
		t.Fatalf("Dial(%q) = %v", sock, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func sandboxConfig() sandbox.Config { return sandbox.Config{} }

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestSandboxLifecycle(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	c := dial(t, sock)
	ctx := testCtx(t)

	sb, err := c.Create(ctx, deltabox.CreateOptions{
		Env:    []string{"A=1"},
		Labels: map[string]string{"job": "t1"},
		Limits: deltabox.Limits{MemoryBytes: 1 << 30, Pids: 512, CPUs: 1.5},
	})
	if err != nil {
		t.Fatalf("Create = %v", err)
	}
	info := sb.Info()
	if info.ID == "" || info.Image != "host" || info.State != deltabox.StateRunning || info.Workdir != "/work" ||
		info.Labels["job"] != "t1" || info.Limits.CPUs != 1.5 || info.Limits.MemoryBytes != 1<<30 || info.Created.IsZero() {
		t.Errorf("Create info = %+v", info)
	}
	got, err := c.Get(ctx, sb.ID())
	if err != nil || got.Info().ID != sb.ID() {
		t.Fatalf("Get(%q) = %+v, %v", sb.ID(), got, err)
	}
	list, err := c.List(ctx)
	if err != nil || len(list) != 1 || list[0].ID != sb.ID() {
		t.Fatalf("List = %+v, %v", list, err)
	}
	if err := sb.Delete(ctx, deltabox.DeleteOptions{}); err != nil {
		t.Fatalf("Delete = %v", err)
	}
	if _, err := c.Get(ctx, sb.ID()); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Get after delete = %v, want ErrNotFound", err)
	}
	si, err := c.Info(ctx)
	if err != nil || si.Storage != "copy" || si.CgroupMode != "v2" {
		t.Fatalf("Info = %+v, %v", si, err)
	}
}

// TestErrorClassesRoundTrip pins the two tables: every class the backend
// returns reaches the SDK as the same class, with the backend's message.
func TestErrorClassesRoundTrip(t *testing.T) {
	t.Parallel()
	sock, fake := daemontest.ServeFake(t)
	c := dial(t, sock)
	ctx := testCtx(t)
	sentinels := []error{
		errdefs.ErrNotFound, errdefs.ErrAlreadyExists, errdefs.ErrInvalidArgument,
		errdefs.ErrFailedPrecondition, errdefs.ErrUnavailable, errdefs.ErrResourceExhausted,
		errdefs.ErrDeadlineExceeded, errdefs.ErrPermissionDenied, errdefs.ErrUnimplemented,
		errdefs.ErrInternal,
	}
	calls := map[string]func() error{
		"unary": func() error { _, err := c.List(ctx); return err },
		"stream": func() error {
			_, err := c.Sandbox("sb-1").Exec(ctx, []string{"echo"}, deltabox.ExecOptions{})
			return err
		},
		"bidi": func() error {
			_, err := c.Sandbox("sb-1").Exec(ctx, []string{"cat"}, deltabox.ExecOptions{Stdin: strings.NewReader("x")})
			return err
		},
	}
	for _, want := range sentinels {
		for name, call := range calls {
			t.Run(fmt.Sprintf("%s/%s", want, name), func(t *testing.T) {
				fake.FailWith(fmt.Errorf("thing %q: %w", "x", want))
				defer fake.FailWith(nil)
				err := call()
				if got := errdefs.Classify(err); got != errdefs.Classify(want) {
					t.Fatalf("class of %v = %v, want %v", err, got, errdefs.Classify(want))
				}
				if !strings.Contains(err.Error(), `thing "x"`) {
					t.Errorf("message %q lost the backend's text", err)
				}
			})
		}
	}
	t.Run("unclassified", func(t *testing.T) {
		fake.FailWith(errors.New("boom"))
		defer fake.FailWith(nil)
		_, err := c.List(ctx)
		if !errors.Is(err, errdefs.ErrInternal) {
			t.Fatalf("List = %v, want ErrInternal", err)
		}
	})
}

func TestValidation(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	c := dial(t, sock)
	ctx := testCtx(t)
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		call func() error
	}{
		{"bad id", func() error { _, err := c.Get(ctx, "../etc"); return err }},
		{"empty id", func() error { _, err := c.Get(ctx, ""); return err }},
		{"negative memory", func() error {
			_, err := c.Create(ctx, deltabox.CreateOptions{Limits: deltabox.Limits{MemoryBytes: -1}})
			return err
		}},
		{"negative pids", func() error {
			_, err := c.Create(ctx, deltabox.CreateOptions{Limits: deltabox.Limits{Pids: -5}})
			return err
		}},
		{"bad env", func() error { _, err := c.Create(ctx, deltabox.CreateOptions{Env: []string{"NOEQUALS"}}); return err }},
		{"bad env key", func() error { _, err := c.Create(ctx, deltabox.CreateOptions{Env: []string{"1A=b"}}); return err }},
		{"bad label", func() error {
			_, err := c.Create(ctx, deltabox.CreateOptions{Labels: map[string]string{"a b": "c"}})
			return err
		}},
		{"relative workdir", func() error { _, err := c.Create(ctx, deltabox.CreateOptions{Workdir: "work"}); return err }},
		{"empty argv", func() error { _, err := sb.Exec(ctx, nil, deltabox.ExecOptions{}); return err }},
		{"empty argv0", func() error { _, err := sb.Exec(ctx, []string{""}, deltabox.ExecOptions{}); return err }},
		{"exec bad env", func() error {
			_, err := sb.Exec(ctx, []string{"echo"}, deltabox.ExecOptions{Env: []string{"=x"}})
			return err
		}},
		{"relative cwd", func() error { _, err := sb.Exec(ctx, []string{"echo"}, deltabox.ExecOptions{Cwd: "tmp"}); return err }},
		{"negative output limit", func() error {
			_, err := sb.Exec(ctx, []string{"echo"}, deltabox.ExecOptions{OutputLimit: -1})
			return err
		}},
		{"bad image name", func() error { return c.RemoveImage(ctx, "../x") }},
		{"relative file path", func() error { _, err := sb.Stat(ctx, "etc/passwd"); return err }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.call(); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("%s = %v, want ErrInvalidArgument", tc.name, err)
			}
		})
	}
}

// chanWriter hands each write to a channel, so a test can see output while
// the command still runs.
type chanWriter chan string

func (w chanWriter) Write(p []byte) (int, error) { w <- string(p); return len(p), nil }

// TestExecStreams proves output arrives while the command still runs: the
// fake "stream" command writes "first", then blocks on a gate that the test
// opens only after it has received "first".
func TestExecStreams(t *testing.T) {
	t.Parallel()
	sock, fake := daemontest.ServeFake(t)
	fake.Gate = make(chan struct{})
	c := dial(t, sock)
	ctx := testCtx(t)
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := make(chanWriter, 10)
	type result struct {
		res deltabox.ExecResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := sb.Exec(ctx, []string{"stream"}, deltabox.ExecOptions{Stdout: out, Stderr: out})
		done <- result{res, err}
	}()
	select {
	case got := <-out:
		if got != "first\n" {
			t.Fatalf("first chunk = %q, want %q", got, "first\n")
		}
	case r := <-done:
		t.Fatalf("Exec returned before its first output streamed: %+v", r)
	case <-ctx.Done():
		t.Fatal("no output while the command runs")
	}
	select {
	case r := <-done:
		t.Fatalf("Exec returned while the command is blocked: %+v", r)
	default:
	}
	close(fake.Gate)
	r := <-done
	if r.err != nil || r.res.ExitCode != 0 {
		t.Fatalf("Exec = %+v, %v", r.res, r.err)
	}
	if got := <-out; got != "second\n" {
		t.Fatalf("second chunk = %q, want %q", got, "second\n")
	}
}

func TestExecResult(t *testing.T) {
	t.Parallel()
	sock, fake := daemontest.ServeFake(t)
	c := dial(t, sock)
	ctx := testCtx(t)
	sb, err := c.Create(ctx, deltabox.CreateOptions{Env: []string{"BASE=1"}})
	if err != nil {
		t.Fatal(err)
	}
	out, err := sb.Run(ctx, []string{"fail", "oops", "3"}, deltabox.ExecOptions{})
	if err != nil || out.ExitCode != 3 || out.Stderr != "oops" || out.Stdout != "" {
		t.Fatalf("Run(fail) = %+v, %v", out, err)
	}
	out, err = sb.Run(ctx, []string{"sleep", "1h"}, deltabox.ExecOptions{Timeout: 50 * time.Millisecond})
	if err != nil || out.ExitCode != 124 || !out.TimedOut {
		t.Fatalf("Run(sleep) with timeout = %+v, %v", out, err)
	}
	out, err = sb.Run(ctx, []string{"env"}, deltabox.ExecOptions{Env: []string{"X=y z"}, Cwd: "/tmp"})
	if err != nil || out.Stdout != "BASE=1\nX=y z\n" {
		t.Fatalf("Run(env) = %+v, %v", out, err)
	}
	if got := fake.LastExec(); got.Cwd != "/tmp" || got.Timeout != 0 {
		t.Errorf("backend saw %+v", got)
	}
	// A big output arrives whole, in chunks.
	big := strings.Repeat("x", 3*v1.ChunkSize+17)
	out, err = sb.Run(ctx, []string{"echo", big}, deltabox.ExecOptions{})
	if err != nil || out.Stdout != big+"\n" {
		t.Fatalf("Run(echo big) = %d bytes, %v", len(out.Stdout), err)
	}
}

func TestExecStdin(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	c := dial(t, sock)
	ctx := testCtx(t)
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	in := strings.Repeat("hello stdin\n", 20000) // several chunks
	out, err := sb.Run(ctx, []string{"cat"}, deltabox.ExecOptions{Stdin: strings.NewReader(in)})
	if err != nil || out.ExitCode != 0 || out.Stdout != in {
		t.Fatalf("Run(cat) = %d bytes, %v; want %d bytes", len(out.Stdout), err, len(in))
	}
	// Interactive: the output of one line comes back before the next is sent.
	pr, pw := io.Pipe()
	lines := make(chanWriter, 10)
	done := make(chan error, 1)
	go func() {
		_, err := sb.Exec(ctx, []string{"cat"}, deltabox.ExecOptions{Stdin: pr, Stdout: lines})
		done <- err
	}()
	for _, l := range []string{"one\n", "two\n"} {
		io.WriteString(pw, l)
		if got := <-lines; got != l {
			t.Fatalf("echoed %q, want %q", got, l)
		}
	}
	pw.Close()
	if err := <-done; err != nil {
		t.Fatalf("interactive Exec = %v", err)
	}
}

func TestSessions(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	c := dial(t, sock)
	ctx := testCtx(t)
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	res, err := sb.Shell(ctx, "cd /tmp", deltabox.SessionOptions{Stdout: &out})
	if err != nil || res.ExitCode != 0 || out.String() != "shell: cd /tmp\n" {
		t.Fatalf("Shell = %+v, %q, %v", res, out.String(), err)
	}
	out.Reset()
	res, err = sb.Python(ctx, "x = 1", deltabox.SessionOptions{Stdout: &out})
	if err != nil || out.String() != "python: x = 1\n" {
		t.Fatalf("Python = %+v, %q, %v", res, out.String(), err)
	}
	res, err = sb.Shell(ctx, "exit 7", deltabox.SessionOptions{})
	if err != nil || res.ExitCode != 7 {
		t.Fatalf("Shell(exit 7) = %+v, %v", res, err)
	}
}

func TestSocket(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode = %v, want a socket with 0600", fi.Mode())
	}
	// A second daemon on the same socket refuses to start.
	srv, err := daemon.New(daemontest.NewFake(t.TempDir()), daemon.WithSocket(sock))
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Listen(); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("second Listen on %s = %v, want ErrAlreadyExists", sock, err)
	}
	// A stale socket (nobody listening) is replaced.
	dir, _ := os.MkdirTemp("", "dbx")
	defer os.RemoveAll(dir)
	stale := filepath.Join(dir, "s.sock")
	ln, err := net.Listen("unix", stale)
	if err != nil {
		t.Fatal(err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	daemontest.Serve(t, daemontest.NewFake(t.TempDir()), daemon.WithSocket(stale)) // overrides its own socket
	dial(t, stale)
	// A regular file is never removed.
	file := filepath.Join(dir, "file")
	os.WriteFile(file, []byte("keep"), 0o644)
	srv, _ = daemon.New(daemontest.NewFake(t.TempDir()), daemon.WithSocket(file))
	if err := srv.Listen(); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("Listen on a regular file = %v, want ErrFailedPrecondition", err)
	}
}

func TestShutdownRemovesSocket(t *testing.T) {
	t.Parallel()
	dir, _ := os.MkdirTemp("", "dbx")
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "d.sock")
	srv, err := daemon.New(daemontest.NewFake(t.TempDir()), daemon.WithSocket(sock))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	for i := 0; ; i++ {
		if _, err := os.Stat(sock); err == nil {
			break
		} else if i > 500 {
			t.Fatal("socket never appeared")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve = %v", err)
	}
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket after shutdown: %v", err)
	}
}

func TestUnreachable(t *testing.T) {
	t.Parallel()
	sock := filepath.Join(t.TempDir(), "nope.sock")
	_, err := deltabox.Dial(testCtx(t), deltabox.WithSocket(sock))
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("Dial(missing socket) = %v, want ErrUnavailable", err)
	}
	if msg := err.Error(); !strings.Contains(msg, sock) || !strings.Contains(msg, "deltabox serve") {
		t.Errorf("message %q should name the socket and how to start the daemon", msg)
	}
	// A stale socket: the file exists but nobody listens (connection refused).
	dir, _ := os.MkdirTemp("", "dbx")
	defer os.RemoveAll(dir)
	stale := filepath.Join(dir, "s.sock")
	ln, err := net.Listen("unix", stale)
	if err != nil {
		t.Fatal(err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	c, err := deltabox.New(deltabox.WithSocket(stale))
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Sandbox("sb-1").Exec(testCtx(t), []string{"echo"}, deltabox.ExecOptions{})
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "deltabox serve") {
		t.Fatalf("Exec via a stale socket = %v, want ErrUnavailable with a hint", err)
	}
}

func unixHTTPClient(sock string) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
	}}
}

// TestJSONOverHTTP1 is what a curl user does: a plain HTTP/1.1 POST of JSON.
func TestJSONOverHTTP1(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	hc := unixHTTPClient(sock)
	post := func(method, body string) (int, string) {
		req, _ := http.NewRequest("POST", "http://deltabox/deltabox.v1.DeltaBoxService/"+method, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		res, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		if res.ProtoMajor != 1 {
			t.Errorf("proto = %s, want HTTP/1.x", res.Proto)
		}
		return res.StatusCode, string(b)
	}
	code, body := post("CreateSandbox", `{"env":["A=1"],"labels":{"k":"v"}}`)
	if code != 200 || !strings.Contains(body, `"id":"sb-0001"`) || !strings.Contains(body, `"state":"SANDBOX_STATE_RUNNING"`) {
		t.Fatalf("CreateSandbox = %d %s", code, body)
	}
	code, body = post("GetSandbox", `{"id":"missing"}`)
	if code != 404 || !strings.Contains(body, `"code":"not_found"`) {
		t.Fatalf("GetSandbox(missing) = %d %s", code, body)
	}
	code, body = post("GetSandbox", `{"id":`)
	if code != 400 || !strings.Contains(body, `"code":"invalid_argument"`) {
		t.Fatalf("malformed JSON = %d %s, want 400 invalid_argument", code, body)
	}
}

func TestGRPC(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	c := dial(t, sock, deltabox.WithGRPC())
	ctx := testCtx(t)
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out, err := sb.Run(ctx, []string{"echo", "grpc"}, deltabox.ExecOptions{})
	if err != nil || out.Stdout != "grpc\n" {
		t.Fatalf("Run over gRPC = %+v, %v", out, err)
	}
	if _, err := c.Get(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Get over gRPC = %v, want ErrNotFound", err)
	}
}

func TestOversizedRequest(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t, daemon.WithReadMaxBytes(64<<10))
	// The SDK would refuse to send it; use a raw client with no send limit.
	rpc := deltaboxv1connect.NewDeltaBoxServiceClient(unixHTTPClient(sock), "http://deltabox")
	_, err := rpc.CreateSandbox(testCtx(t), connect.NewRequest(&v1.CreateSandboxRequest{
		Labels: map[string]string{"big": strings.Repeat("x", 100<<10)},
	}))
	if connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Fatalf("oversized CreateSandbox = %v, want resource_exhausted", err)
	}
	if !strings.Contains(err.Error(), "larger than") {
		t.Errorf("message %q does not say what was too large", err)
	}
}

func TestTCPNeedsToken(t *testing.T) {
	t.Parallel()
	if _, err := daemon.New(daemontest.NewFake(t.TempDir()), daemon.WithTCP("127.0.0.1:0", "")); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("WithTCP without a token = %v, want ErrInvalidArgument", err)
	}
	_, srv := daemontest.Serve(t, daemontest.NewFake(t.TempDir()), daemon.WithTCP("127.0.0.1:0", "s3cret"))
	addr := srv.TCPAddr().String()
	ctx := testCtx(t)

	// Raw HTTP without the token: 401.
	res, err := http.Post("http://"+addr+"/deltabox.v1.DeltaBoxService/ListSandboxes", "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusUnauthorized {
		t.Fatalf("no token: HTTP %d, want 401", res.StatusCode)
	}
	for _, tc := range []struct {
		name  string
		token string
		ok    bool
	}{{"none", "", false}, {"wrong", "s3cre", false}, {"right", "s3cret", true}} {
		c, err := deltabox.New(deltabox.WithAddr(addr), deltabox.WithToken(tc.token))
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.List(ctx)
		if tc.ok != (err == nil) {
			t.Errorf("token %s: List = %v", tc.name, err)
		}
		if !tc.ok && (connect.CodeOf(err) != connect.CodeUnauthenticated || !errors.Is(err, errdefs.ErrPermissionDenied)) {
			t.Errorf("token %s: List = %v, want unauthenticated (ErrPermissionDenied)", tc.name, err)
		}
		if tc.ok { // bidi over TCP h2c too
			sb, err := c.Create(ctx, deltabox.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			out, err := sb.Run(ctx, []string{"cat"}, deltabox.ExecOptions{Stdin: strings.NewReader("tcp")})
			if err != nil || out.Stdout != "tcp" {
				t.Errorf("cat over TCP = %+v, %v", out, err)
			}
		}
		c.Close()
	}
}

func TestDeleteWhileRunning(t *testing.T) {
	t.Parallel()
	sock, fake := daemontest.ServeFake(t)
	fake.Gate = make(chan struct{})
	c := dial(t, sock)
	ctx := testCtx(t)
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := make(chanWriter, 4)
	done := make(chan error, 1)
	go func() {
		_, err := sb.Exec(ctx, []string{"stream"}, deltabox.ExecOptions{Stdout: out})
		done <- err
	}()
	<-out // running
	if err := sb.Delete(ctx, deltabox.DeleteOptions{}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("Delete while running = %v, want ErrFailedPrecondition", err)
	}
	close(fake.Gate)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := sb.Delete(ctx, deltabox.DeleteOptions{}); err != nil {
		t.Fatalf("Delete = %v", err)
	}
}

// TestStreamingJSONOverHTTP1 is what a client with only an HTTP/1.1 library
// and a JSON parser does (the Python client): a Connect streaming call with
// enveloped JSON messages.
func TestStreamingJSONOverHTTP1(t *testing.T) {
	t.Parallel()
	sock, fake := daemontest.ServeFake(t)
	if _, err := fake.CreateSandbox(testCtx(t), sandboxConfig()); err != nil {
		t.Fatal(err)
	}
	body := []byte(`{"sandboxId":"sb-0001","argv":["fail","bad","4"]}`)
	env := make([]byte, 5+len(body))
	env[4] = byte(len(body)) // flags 0, big-endian length (< 256 here)
	copy(env[5:], body)
	req, _ := http.NewRequest("POST", "http://deltabox/deltabox.v1.DeltaBoxService/Exec", bytes.NewReader(env))
	req.Header.Set("Content-Type", "application/connect+json")
	res, err := unixHTTPClient(sock).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	var msgs []string
	for {
		var hdr [5]byte
		if _, err := io.ReadFull(res.Body, hdr[:]); err != nil {
			break
		}
		n := int(hdr[1])<<24 | int(hdr[2])<<16 | int(hdr[3])<<8 | int(hdr[4])
		b := make([]byte, n)
		if _, err := io.ReadFull(res.Body, b); err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, fmt.Sprintf("%d %s", hdr[0], b))
	}
	// stderr "bad" is base64 "YmFk"; the end-of-stream message has flag 2.
	want := []string{`0 {"stderr":"YmFk"}`, `0 {"exit":{"exitCode":4`, `2 {}`}
	if len(msgs) != 3 {
		t.Fatalf("messages = %q", msgs)
	}
	for i, w := range want {
		if !strings.HasPrefix(msgs[i], w) {
			t.Errorf("message %d = %q, want prefix %q", i, msgs[i], w)
		}
	}
}
