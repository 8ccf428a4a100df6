//go:build linux

// Package daemon serves the DeltaBox API (api/deltabox/v1) over Connect RPC
// on a root-only unix socket and, optionally, on TCP with a bearer token. It
// owns the API edge: input validation, the one error-to-code table
// (errors.go) and request logging; the work itself is done by a Backend.
//
// # Transports
//
// Both listeners serve HTTP/1.1 and unencrypted HTTP/2 (h2c), so the Connect
// protocol (JSON or binary), gRPC and gRPC-Web all work; the bidirectional
// ExecInteractive needs HTTP/2.
//
// # Security
//
// The unix socket is created with mode 0600: only root may talk to the
// daemon, which can run anything as root-in-a-namespace. The TCP listener is
// opt-in and every request must carry `Authorization: Bearer <token>`.
package daemon

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/deltabox/deltabox/api/deltabox/v1/deltaboxv1connect"
	"github.com/deltabox/deltabox/errdefs"
)

// DefaultSocket is where the daemon listens unless told otherwise.
const DefaultSocket = "/run/deltabox/deltabox.sock"

// DefaultReadMaxBytes bounds one request message. Byte streams are cut into
// 64 KiB chunks, so only absurd (or hostile) requests come near it.
const DefaultReadMaxBytes = 4 << 20

type config struct {
	socket          string
	listen, token   string
	logger          *slog.Logger
	readMaxBytes    int
	shutdownTimeout time.Duration
}

// Opt configures a Server.
type Opt func(*config) error

// WithSocket sets the unix socket path ("" for none; DefaultSocket if
// unset).
func WithSocket(path string) Opt {
	return func(c *config) error { c.socket = path; return nil }
}

// WithTCP also serves on a TCP address, for clients that present token. An
// empty token is refused: TCP is never open to everyone.
func WithTCP(addr, token string) Opt {
	return func(c *config) error {
		if addr == "" {
			return fmt.Errorf("tcp listener: empty address: %w", errdefs.ErrInvalidArgument)
		}
		if token == "" {
			return fmt.Errorf("tcp listener on %s needs a token: %w", addr, errdefs.ErrInvalidArgument)
		}
		c.listen, c.token = addr, token
		return nil
	}
}

// WithLogger sets the logger (slog.Default() if unset).
func WithLogger(l *slog.Logger) Opt {
	return func(c *config) error { c.logger = l; return nil }
}

// WithReadMaxBytes bounds the size of one request message.
func WithReadMaxBytes(n int) Opt {
	return func(c *config) error {
		if n <= 0 {
			return fmt.Errorf("read limit %d: %w", n, errdefs.ErrInvalidArgument)
		}
		c.readMaxBytes = n
		return nil
	}
}

// WithShutdownTimeout bounds how long Serve waits for running requests after
// its context ends before it cuts them off (10s if unset).
func WithShutdownTimeout(d time.Duration) Opt {
	return func(c *config) error { c.shutdownTimeout = d; return nil }
}

// Server is the daemon's RPC server. Its methods are safe for concurrent
// use; Serve runs once.
type Server struct {
	cfg     config
	backend Backend
	handler http.Handler // the Connect handler, without auth

	// mu guards the listeners.
	mu     sync.Mutex
	unixLn net.Listener
	tcpLn  net.Listener
}

// New returns a server for backend. It does no I/O: Listen (or Serve) binds.
func New(backend Backend, opts ...Opt) (*Server, error) {
	cfg := config{
		socket:          DefaultSocket,
		logger:          slog.Default(),
		readMaxBytes:    DefaultReadMaxBytes,
		shutdownTimeout: 10 * time.Second,
	}
	for _, o := range opts {
		if err := o(&cfg); err != nil {
			return nil, err
		}
	}
	if backend == nil {
		return nil, fmt.Errorf("daemon: nil backend: %w", errdefs.ErrInvalidArgument)
	}
	if cfg.socket == "" && cfg.listen == "" {
		return nil, fmt.Errorf("daemon: neither a socket nor a tcp address: %w", errdefs.ErrInvalidArgument)
	}
	s := &Server{cfg: cfg, backend: backend}
	path, h := deltaboxv1connect.NewDeltaBoxServiceHandler(
		&service{b: backend},
		connect.WithInterceptors(edge{log: cfg.logger}),
		connect.WithReadMaxBytes(cfg.readMaxBytes),
		connect.WithSendMaxBytes(cfg.readMaxBytes),
		// Exec output comes in small chunks, mostly over a local socket:
		// compressing them costs more than it saves.
		connect.WithCompressMinBytes(8<<10),
	)
	mux := http.NewServeMux()
	mux.Handle(path, h)
	s.handler = mux
	return s, nil
}

// Handler is the API as an http.Handler, without the TCP token check: for
// embedding the daemon in another server, and for tests.
func (s *Server) Handler() http.Handler { return s.handler }

// Listen binds the listeners. Serve calls it when it has not been called.
func (s *Server) Listen() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.unixLn != nil || s.tcpLn != nil {
		return nil
	}
	if s.cfg.socket != "" {
		ln, err := listenUnix(s.cfg.socket)
		if err != nil {
			return err
		}
		s.unixLn = ln
	}
	if s.cfg.listen != "" {
		ln, err := net.Listen("tcp", s.cfg.listen)
		if err != nil {
			if s.unixLn != nil {
				s.unixLn.Close()
				os.Remove(s.cfg.socket)
				s.unixLn = nil
			}
			return fmt.Errorf("listen on %s: %w", s.cfg.listen, err)
		}
		s.tcpLn = ln
	}
	return nil
}

// TCPAddr is the bound TCP address (nil before Listen or without TCP).
func (s *Server) TCPAddr() net.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.tcpLn == nil {
		return nil
	}
	return s.tcpLn.Addr()
}

// Serve serves until ctx ends, then shuts down gracefully: it stops
// accepting, waits up to the shutdown timeout for running requests (whose
// contexts are then cancelled) and removes the socket.
func (s *Server) Serve(ctx context.Context) error {
	if err := s.Listen(); err != nil {
		return err
	}
	s.mu.Lock()
	unixLn, tcpLn := s.unixLn, s.tcpLn
	s.mu.Unlock()

	log := s.cfg.logger
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	newServer := func(h http.Handler) *http.Server {
		return &http.Server{
			Handler:           h,
			Protocols:         protocols,
			ReadHeaderTimeout: 10 * time.Second,
			IdleTimeout:       5 * time.Minute,
			// Agents run many commands at once on one connection.
			HTTP2:    &http.HTTP2Config{MaxConcurrentStreams: 1024},
			ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		}
	}
	var servers []*http.Server
	errc := make(chan error, 2)
	if unixLn != nil {
		hs := newServer(s.handler)
		servers = append(servers, hs)
		log.Info("serving", "socket", s.cfg.socket)
		go func() { errc <- hs.Serve(unixLn) }()
	}
	if tcpLn != nil {
		hs := newServer(requireToken(s.cfg.token, s.handler))
		servers = append(servers, hs)
		log.Info("serving", "tcp", tcpLn.Addr().String())
		go func() { errc <- hs.Serve(tcpLn) }()
	}

	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errc:
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.shutdownTimeout)
	defer cancel()
	for _, hs := range servers {
		if err := hs.Shutdown(sctx); err != nil {
			log.Warn("requests still running at shutdown; cutting them off", "err", err)
			hs.Close()
		}
	}
	if unixLn != nil {
		os.Remove(s.cfg.socket)
	}
	if errors.Is(serveErr, http.ErrServerClosed) {
		serveErr = nil
	}
	return serveErr
}

// ProbeSocket checks that a daemon could listen at path: it fails with
// ErrAlreadyExists when another daemon answers there and with
// ErrFailedPrecondition when path is something other than a socket. A
// missing path or a stale socket (nobody answers) is fine. `deltabox serve`
// calls it before it opens the state, Listen again when it binds.
func ProbeSocket(path string) error {
	fi, err := os.Lstat(path)
	if err != nil {
		return nil
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s exists and is not a socket: %w", path, errdefs.ErrFailedPrecondition)
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return fmt.Errorf("another daemon is serving on %s: %w", path, errdefs.ErrAlreadyExists)
	}
	return nil
}

// listenUnix listens on a unix socket at path with mode 0600. It refuses to
// take over a socket that another daemon answers on and replaces a stale one.
// The socket is bound inside a fresh 0700 directory, chmodded, then renamed
// into place, so it is never reachable with a looser mode.
func listenUnix(path string) (net.Listener, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("socket directory: %w", err)
	}
	if err := ProbeSocket(path); err != nil {
		return nil, err
	}
	if _, err := os.Lstat(path); err == nil {
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("remove stale socket: %w", err)
		}
	}
	tmpDir, err := os.MkdirTemp(dir, ".deltabox-sock-")
	if err != nil {
		return nil, fmt.Errorf("socket: %w", err)
	}
	defer os.RemoveAll(tmpDir)
	tmp := filepath.Join(tmpDir, "s")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(false) // it is renamed; Serve removes it by its final name
	if err := os.Chmod(tmp, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("socket mode: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		ln.Close()
		return nil, fmt.Errorf("socket: %w", err)
	}
	return ln, nil
}

// requireToken lets through only requests that carry the bearer token; the
// others get Unauthenticated (HTTP 401) in their protocol's error format.
func requireToken(token string, next http.Handler) http.Handler {
	want := []byte("Bearer " + token)
	ew := connect.NewErrorWriter()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got := []byte(r.Header.Get("Authorization"))
		if subtle.ConstantTimeCompare(got, want) == 1 {
			next.ServeHTTP(w, r)
			return
		}
		err := connect.NewError(connect.CodeUnauthenticated, errors.New("missing or wrong bearer token"))
		if ew.IsSupported(r) {
			ew.Write(w, r, err)
			return
		}
		w.Header().Set("WWW-Authenticate", `Bearer realm="deltabox"`)
		http.Error(w, err.Error(), http.StatusUnauthorized)
	})
}

// edge is the interceptor at the API edge: it converts every handler error
// with the one table (toConnect) and logs each call.
type edge struct{ log *slog.Logger }

func (e edge) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		start := time.Now()
		res, err := next(ctx, req)
		return res, e.done(ctx, req.Spec().Procedure, req.Peer().Protocol, start, err)
	}
}

func (e edge) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (e edge) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		start := time.Now()
		err := next(ctx, conn)
		return e.done(ctx, conn.Spec().Procedure, conn.Peer().Protocol, start, err)
	}
}

func (e edge) done(ctx context.Context, procedure, protocol string, start time.Time, err error) error {
	err = toConnect(err)
	method := procedure[strings.LastIndexByte(procedure, '/')+1:]
	attrs := []any{"method", method, "protocol", protocol, "duration", time.Since(start)}
	if err == nil {
		e.log.DebugContext(ctx, "rpc", attrs...)
		return nil
	}
	code := connect.CodeOf(err)
	attrs = append(attrs, "code", code.String(), "err", err)
	level := slog.LevelInfo
	if code == connect.CodeInternal || code == connect.CodeUnknown {
		level = slog.LevelError
	}
	e.log.Log(ctx, level, "rpc failed", attrs...)
	return err
}
