//go:build linux

package sandbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// The init protocol: the daemon and a sandbox's init talk over a SOCK_SEQPACKET
// socketpair (fd 3 in the init). One packet is one JSON message, with the
// files it carries attached as SCM_RIGHTS. Requests carry an ID; the init's
// answer carries the same ID. Exit events are unsolicited. The daemon treats
// everything the init says as untrusted input: the workload can ptrace its
// init, so a message can be forged; it can only lie about its own sandbox.

// Ops of the init protocol.
const (
	opConfig  = "config"  // daemon -> init: set up the root and report ready; files: detached root mount[, cgroup tasks]
	opReady   = "ready"   // init -> daemon
	opSpawn   = "spawn"   // daemon -> init: start a process; files: stdin, stdout, stderr[, cgroup tasks]
	opSpawned = "spawned" // init -> daemon: Pid
	opExited  = "exited"  // init -> daemon: Pid, Status (a wait status)
	opSignal  = "signal"  // daemon -> init: Pid, Signal
	opReroot  = "reroot"  // daemon -> init: pivot into a new root; files: detached root mount
	opError   = "error"   // init -> daemon: Err, for the request ID
	// opHello is the init's first message, unasked: a nested init's host pid
	// comes with it, as the kernel's SCM_CREDENTIALS (see generation).
	opHello = "hello"
	// opGenerate asks an init to start the init of a child generation, in
	// new pid, mount, net, uts and ipc namespaces nested under its own;
	// files: the child's end of its control socket. Answer: spawned.
	opGenerate = "generate"
	// opHold asks an init to keep files open until opRelease, and answers
	// with their fd numbers (Fds): a template's clone takes them with
	// pidfd_getfd, its way of receiving fresh stdio inside its namespaces.
	opHold    = "hold"
	opRelease = "release" // daemon -> init: close the held Fds
	// opPersist gives a generation that holds templates a listening socket:
	// from then on the init outlives its daemon and serves the next one that
	// connects (re-adoption after a restart); files: the listener.
	opPersist = "persist"
)

// maxPacket bounds one message (argv and env included).
const maxPacket = 1 << 20

// maxFiles is the most files one message carries.
const maxFiles = 8

type message struct {
	Op     string      `json:"op"`
	ID     uint64      `json:"id,omitempty"`
	Config *initConfig `json:"config,omitempty"`
	Spawn  *spawnReq   `json:"spawn,omitempty"`
	Pid    int         `json:"pid,omitempty"`
	Status int         `json:"status,omitempty"`
	Signal int         `json:"signal,omitempty"`
	Err    string      `json:"err,omitempty"`
	Trace  string      `json:"trace,omitempty"` // ready: how long the init's steps took
	// Orphan marks the exit of a process the init did not spawn (a
	// template's clone: clone(CLONE_PARENT) made it the init's child).
	Orphan bool  `json:"orphan,omitempty"`
	Fds    []int `json:"fds,omitempty"` // hold's answer, release's request

	peerPid int // the sender's pid in our namespace, when the socket passes credentials
}

// initConfig is what the init sets up before it reports ready.
type initConfig struct {
	Hostname string `json:"hostname"`
	// Seccomp applies the default filter to the init (and so to everything
	// it starts). Off only in tests of the runtime itself.
	Seccomp bool `json:"seccomp"`
}

// spawnReq starts one process. Files: stdin, stdout, stderr, then, when
// Cgroup is set, an fd of the v1 cgroup "tasks" file (or, on v2, the cgroup
// directory) the process must start in.
type spawnReq struct {
	Argv   []string `json:"argv"`
	Env    []string `json:"env"`
	Cwd    string   `json:"cwd"`
	Cgroup bool     `json:"cgroup"`
	V2     bool     `json:"v2"`
}

// conn is one end of the socketpair. Send is safe for concurrent use; Recv
// must be called from one goroutine. It goes through Go's network poller
// (a net.UnixConn), not blocking system calls: a goroutine blocked in a raw
// recvmsg holds its thread, and the wake-up of the goroutine waiting for
// the answer then needs a second thread, which on a VM cost milliseconds
// per round trip. The poller also makes Close safe while a Recv blocks.
type conn struct {
	c   *net.UnixConn
	buf []byte // Recv's, reused (Recv has one caller)

	mu sync.Mutex // serialises Send
}

// newConn makes a conn of a dup of f's socket; the caller closes f.
func newConn(f *os.File) (*conn, error) {
	fc, err := net.FileConn(f)
	if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	uc, ok := fc.(*net.UnixConn)
	if !ok {
		fc.Close()
		return nil, fmt.Errorf("control socket: not a unix socket")
	}
	return &conn{c: uc}, nil
}

// Close closes the connection; a Recv blocked on it returns errClosed.
func (c *conn) Close() error { return c.c.Close() }

// Shutdown is Close: the name says it may be called while another
// goroutine receives.
func (c *conn) Shutdown() error { return c.c.Close() }

// Send sends m with files attached. It does not close the files.
func (c *conn) Send(m message, files ...*os.File) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if len(b) > maxPacket {
		return fmt.Errorf("init message of %d bytes exceeds %d", len(b), maxPacket)
	}
	var oob []byte
	if len(files) > 0 {
		fds := make([]int, len(files))
		for i, f := range files {
			fds[i] = int(f.Fd())
		}
		oob = unix.UnixRights(fds...)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	_, _, err = c.c.WriteMsgUnix(b, oob, nil)
	// Keep the files alive until the kernel has taken its references.
	for _, f := range files {
		_ = f.Fd()
	}
	return err
}

// errClosed is returned by Recv when the peer is gone.
var errClosed = errors.New("init connection closed")

// Recv receives one message and the files attached to it, which the caller
// owns. The files arrive close-on-exec (Go receives with MSG_CMSG_CLOEXEC).
func (c *conn) Recv() (message, []*os.File, error) {
	if c.buf == nil {
		c.buf = make([]byte, maxPacket)
	}
	buf := c.buf
	oob := make([]byte, unix.CmsgSpace(maxFiles*4)+unix.CmsgSpace(unix.SizeofUcred))
	n, oobn, flags, _, err := c.c.ReadMsgUnix(buf, oob)
	if err != nil {
		if errors.Is(err, net.ErrClosed) || errors.Is(err, io.EOF) || errors.Is(err, unix.ECONNRESET) {
			return message{}, nil, errClosed
		}
		return message{}, nil, err
	}
	if n == 0 && oobn == 0 {
		return message{}, nil, errClosed
	}
	var files []*os.File
	peer := 0
	if oobn > 0 {
		cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err == nil {
			for _, cm := range cmsgs {
				if cm.Header.Level == unix.SOL_SOCKET && cm.Header.Type == unix.SCM_CREDENTIALS {
					if cred, err := unix.ParseUnixCredentials(&cm); err == nil {
						peer = int(cred.Pid)
					}
					continue
				}
				fds, err := unix.ParseUnixRights(&cm)
				if err != nil {
					continue
				}
				for _, fd := range fds {
					files = append(files, os.NewFile(uintptr(fd), "passed"))
				}
			}
		}
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		closeFiles(files)
		return message{}, nil, fmt.Errorf("init message truncated")
	}
	var m message
	if err := json.Unmarshal(buf[:n], &m); err != nil {
		closeFiles(files)
		return message{}, nil, fmt.Errorf("decode init message: %w", err)
	}
	m.peerPid = peer
	return m, files, nil
}

func closeFiles(files []*os.File) {
	for _, f := range files {
		if f != nil {
			f.Close()
		}
	}
}
