// Package deltabox is the Go client of DeltaBox, the OS-level sandbox for AI
// agents. It talks to the daemon (`deltabox serve`) over its Connect RPC API
// (api/deltabox/v1).
//
// # Connecting
//
// Dial connects to the daemon's unix socket (/run/deltabox/deltabox.sock, or
// $DELTABOX_SOCKET), or over TCP with WithAddr and WithToken (or
// $DELTABOX_ADDR and $DELTABOX_TOKEN). New does the same without checking
// that the daemon answers.
//
// # Sandboxes
//
// Client.Create starts a sandbox and returns a *Sandbox, a handle holding its
// id; Client.Sandbox makes a handle from a known id without a call. Run
// commands with Sandbox.Exec (output streams to your writers as it is
// produced), keep state across calls with Sandbox.Shell and Sandbox.Python,
// move files with ReadFile/WriteFile, Upload/Download (tar streams) and
// CopyIn/CopyOut (local paths), and remove it with Delete.
//
// # Checkpoints
//
// Sandbox.Checkpoint captures a sandbox's filesystem and processes at one
// instant (it is frozen meanwhile; Checkpoint.Pause says how long).
// Checkpoints form a tree: a sandbox's head is the checkpoint it last took or
// restored, and the next checkpoint's parent is the head. Sandbox.Restore
// rolls a sandbox back in place (same id, same handle); Client.Fork makes N
// new sandboxes from a checkpoint; Client.Tree shows the tree, Client.Diff
// what changed between two checkpoints or sandboxes.
//
// # Errors
//
// Errors from the daemon keep their class: test them with errors.Is against
// the errdefs sentinels (errdefs.ErrNotFound, ...). A daemon that cannot be
// reached gives errdefs.ErrUnavailable.
//
// A Client and its Sandboxes are safe for concurrent use.
package deltabox

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"

	"connectrpc.com/connect"

	v1 "github.com/deltabox/deltabox/api/deltabox/v1"
	"github.com/deltabox/deltabox/api/deltabox/v1/deltaboxv1connect"
	"github.com/deltabox/deltabox/errdefs"
)

// DefaultSocket is the daemon's default unix socket.
const DefaultSocket = "/run/deltabox/deltabox.sock"

// The environment variables New reads when no option says otherwise.
const (
	EnvSocket = "DELTABOX_SOCKET"
	EnvAddr   = "DELTABOX_ADDR"
	EnvToken  = "DELTABOX_TOKEN"
)

// maxMessageBytes bounds one message the client reads; streams are chunked
// far below it.
const maxMessageBytes = 4 << 20

type options struct {
	socket, addr, token string
	grpc                bool
	httpClient          *http.Client
}

// Option configures a Client.
type Option func(*options)

// WithSocket connects to the daemon's unix socket at path.
func WithSocket(path string) Option { return func(o *options) { o.socket, o.addr = path, "" } }

// WithAddr connects over TCP: "host:port" (unencrypted HTTP/2) or an
// http:// or https:// URL. TCP needs WithToken.
func WithAddr(addr string) Option { return func(o *options) { o.addr = addr } }

// WithToken sets the bearer token for TCP.
func WithToken(token string) Option { return func(o *options) { o.token = token } }

// WithGRPC speaks gRPC instead of the Connect protocol.
func WithGRPC() Option { return func(o *options) { o.grpc = true } }

// WithHTTPClient uses c (with a base URL from WithAddr) instead of the
// client New builds: for proxies, custom TLS, tests. Interactive exec needs
// it to speak HTTP/2.
func WithHTTPClient(c *http.Client) Option { return func(o *options) { o.httpClient = c } }

// Client is a connection to a DeltaBox daemon.
type Client struct {
	rpc    deltaboxv1connect.DeltaBoxServiceClient
	target string // for messages: the socket path or the address
	local  bool   // connected to a unix socket
	http   *http.Client
}

// New returns a client. It does not connect: the first call does. Without
// options it uses $DELTABOX_ADDR (with $DELTABOX_TOKEN) if set, otherwise
// $DELTABOX_SOCKET, otherwise DefaultSocket.
func New(opts ...Option) (*Client, error) {
	o := options{socket: os.Getenv(EnvSocket), addr: os.Getenv(EnvAddr), token: os.Getenv(EnvToken)}
	for _, opt := range opts {
		opt(&o)
	}
	if o.socket == "" {
		o.socket = DefaultSocket
	}
	c := &Client{}
	var baseURL string
	var tr http.RoundTripper
	if o.addr != "" {
		baseURL = o.addr
		if !strings.Contains(baseURL, "://") {
			baseURL = "http://" + baseURL
		}
		c.target = o.addr
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.Protocols = new(http.Protocols)
		if strings.HasPrefix(baseURL, "https://") {
			t.Protocols.SetHTTP1(true)
			t.Protocols.SetHTTP2(true)
			t.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12}
		} else if strings.HasPrefix(baseURL, "http://") {
			t.Protocols.SetUnencryptedHTTP2(true)
		} else {
			return nil, fmt.Errorf("daemon address %q: want host:port or an http(s) URL: %w", o.addr, errdefs.ErrInvalidArgument)
		}
		tr = t
	} else {
		baseURL = "http://deltabox"
		c.target, c.local = o.socket, true
		path := o.socket
		t := &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", path)
			},
			Protocols: new(http.Protocols),
		}
		t.Protocols.SetUnencryptedHTTP2(true)
		tr = t
	}
	if o.token != "" {
		tr = bearer{token: o.token, next: tr}
	}
	c.http = o.httpClient
	if c.http == nil {
		c.http = &http.Client{Transport: tr}
	}
	copts := []connect.ClientOption{
		connect.WithReadMaxBytes(maxMessageBytes),
		connect.WithSendMaxBytes(maxMessageBytes),
	}
	if o.grpc {
		copts = append(copts, connect.WithGRPC())
	}
	c.rpc = deltaboxv1connect.NewDeltaBoxServiceClient(c.http, baseURL, copts...)
	return c, nil
}

// Dial returns a client after checking that the daemon answers.
func Dial(ctx context.Context, opts ...Option) (*Client, error) {
	c, err := New(opts...)
	if err != nil {
		return nil, err
	}
	if _, err := c.Info(ctx); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// Close releases idle connections. Calls in flight are not affected.
func (c *Client) Close() error {
	c.http.CloseIdleConnections()
	return nil
}

// SystemInfo describes the daemon and the kernel features it found.
type SystemInfo struct {
	Version     string `json:"version"`
	Storage     string `json:"storage"` // btrfs | overlay | copy
	StateDir    string `json:"state_dir"`
	Kernel      string `json:"kernel"`
	CgroupMode  string `json:"cgroup_mode"` // v1 | v2 | hybrid
	CRIU        string `json:"criu"`        // version, "" when missing
	Btrfs       bool   `json:"btrfs"`
	Overlay     bool   `json:"overlay"`
	IDMapMounts bool   `json:"idmap_mounts"`
	// Templates is how many checkpoints hold live process templates;
	// TemplateBytes their private memory, TemplateBudget its bound.
	Templates      int   `json:"templates"`
	TemplateBytes  int64 `json:"template_bytes"`
	TemplateBudget int64 `json:"template_budget_bytes"`
	Sandboxes      int   `json:"sandboxes"`
	Images         int   `json:"images"`
}

// Info describes the daemon.
func (c *Client) Info(ctx context.Context) (SystemInfo, error) {
	res, err := c.rpc.Info(ctx, connect.NewRequest(&v1.InfoRequest{}))
	if err != nil {
		return SystemInfo{}, c.err(err)
	}
	m := res.Msg
	return SystemInfo{
		Version: m.Version, Storage: m.Storage, StateDir: m.StateDir, Kernel: m.Kernel,
		CgroupMode: m.CgroupMode, CRIU: m.Criu, Btrfs: m.Btrfs, Overlay: m.Overlay,
		IDMapMounts: m.IdmapMounts, Sandboxes: int(m.Sandboxes), Images: int(m.Images),
		Templates: int(m.Templates), TemplateBytes: m.TemplateBytes, TemplateBudget: m.TemplateBudgetBytes,
	}, nil
}

// bearer adds the token to every request.
type bearer struct {
	token string
	next  http.RoundTripper
}

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return b.next.RoundTrip(r)
}
