//go:build linux

// Package initproto is the protocol between the daemon (package sandbox)
// and a sandbox's init (package initproc): the messages and the connection
// both ends use.
//
// The daemon and a sandbox's init talk over a SOCK_SEQPACKET socketpair (fd
// 3 in the init). One packet is one JSON message, with the files it carries
// attached as SCM_RIGHTS. Requests carry an ID; the init's answer carries
// the same ID. Exit events are unsolicited. The daemon treats everything the
// init says as untrusted input: the workload can ptrace its init, so a
// message can be forged; it can only lie about its own sandbox.
package initproto

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Ops of the init protocol.
const (
	OpConfig  = "config"  // daemon -> init: set up the root and report ready; files: detached root mount[, cgroup tasks]
	OpReady   = "ready"   // init -> daemon
	OpSpawn   = "spawn"   // daemon -> init: start a process; files: stdin, stdout, stderr[, cgroup tasks]
	OpSpawned = "spawned" // init -> daemon: Pid
	OpExited  = "exited"  // init -> daemon: Pid, Status (a wait status)
	OpSignal  = "signal"  // daemon -> init: Pid, Signal
	OpReroot  = "reroot"  // daemon -> init: pivot into a new root; files: detached root mount[, cgroup tasks]; Config: its hostname, if any
	OpError   = "error"   // init -> daemon: Err, for the request ID
	// OpHello is the init's first message, unasked: a nested init's host pid
	// comes with it, as the kernel's SCM_CREDENTIALS (see generation).
	OpHello = "hello"
	// OpGenerate asks an init to start the init of a child generation, in
	// new pid, mount, net, uts and ipc namespaces nested under its own;
	// files: the child's end of its control socket. Answer: spawned.
	OpGenerate = "generate"
	// OpHold asks an init to keep files open until OpRelease, and answers
	// with their fd numbers (Fds): a template's clone takes them with
	// pidfd_getfd, its way of receiving fresh stdio inside its namespaces.
	OpHold    = "hold"
	OpRelease = "release" // daemon -> init: close the held Fds
	// OpPersist gives a generation that holds templates a listening socket:
	// from then on the init outlives its daemon and serves the next one that
	// connects (re-adoption after a restart); files: the listener.
	OpPersist = "persist"
)

// MaxPacket bounds one message (argv and env included).
const MaxPacket = 1 << 20

// MaxFiles is the most files one message carries.
const MaxFiles = 8

// Message is one packet of the protocol; which fields are set depends on Op.
type Message struct {
	Op     string    `json:"op"`
	ID     uint64    `json:"id,omitempty"`
	Config *Config   `json:"config,omitempty"`
	Spawn  *SpawnReq `json:"spawn,omitempty"`
	Pid    int       `json:"pid,omitempty"`
	Status int       `json:"status,omitempty"`
	Signal int       `json:"signal,omitempty"`
	Err    string    `json:"err,omitempty"`
	Trace  string    `json:"trace,omitempty"` // ready: how long the init's steps took
	// Orphan marks the exit of a process the init did not spawn (a
	// template's clone: clone(CLONE_PARENT) made it the init's child).
	Orphan bool  `json:"orphan,omitempty"`
	Fds    []int `json:"fds,omitempty"` // hold's answer, release's request

	PeerPid int `json:"-"` // the sender's pid in our namespace, when the socket passes credentials
}

// Config is what the init sets up before it reports ready.
type Config struct {
	Hostname string `json:"hostname"`
	// Seccomp is the filter every process the init starts runs under,
	// compiled once by the daemon (the init does not link the compiler: its
	// package initialisation alone cost every boot a tenth of its CPU).
	// Empty only in tests of the runtime itself.
	Seccomp []unix.SockFilter `json:"seccomp,omitempty"`
}

// SpawnReq starts one process. Files: stdin, stdout, stderr, then, when
// Cgroup is set, an fd of the v1 cgroup "tasks" file (or, on v2, the cgroup
// directory) the process must start in.
type SpawnReq struct {
	Argv   []string `json:"argv"`
	Env    []string `json:"env"`
	Cwd    string   `json:"cwd"`
	Cgroup bool     `json:"cgroup"`
	V2     bool     `json:"v2"`
}

// Conn is one end of the socketpair. Send is safe for concurrent use; Recv
// must be called from one goroutine. Both go through Go's poller (a
// non-blocking fd behind an *os.File and its RawConn), not blocking system
// calls: a goroutine blocked in a raw recvmsg holds its thread, and the
// wake-up of the goroutine waiting for the answer then needs a second
// thread, which on a VM cost milliseconds per round trip. The poller also
// makes Close safe while a Recv blocks. (Not net.UnixConn: package net
// alone made the init's boot a tenth slower and its binary dynamic, unable
// to start in an image without glibc's loader.)
type Conn struct {
	f   *os.File
	rc  syscall.RawConn
	buf []byte // Recv's, reused (Recv has one caller)

	mu sync.Mutex // serialises Send
}

// NewConn makes a Conn of a dup of f's socket; the caller closes f.
func NewConn(f *os.File) (*Conn, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("control socket: %w", err)
	}
	nf := os.NewFile(uintptr(fd), "control")
	rc, err := nf.SyscallConn()
	if err != nil {
		nf.Close()
		return nil, fmt.Errorf("control socket: %w", err)
	}
	return &Conn{f: nf, rc: rc}, nil
}

// Close closes the connection; a Recv blocked on it returns ErrClosed.
func (c *Conn) Close() error { return c.f.Close() }

// Shutdown is Close: the name says it may be called while another
// goroutine receives.
func (c *Conn) Shutdown() error { return c.f.Close() }

// Send sends m with files attached. It does not close the files.
func (c *Conn) Send(m Message, files ...*os.File) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if len(b) > MaxPacket {
		return fmt.Errorf("init message of %d bytes exceeds %d", len(b), MaxPacket)
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
	var serr error
	err = c.rc.Write(func(fd uintptr) bool {
		serr = unix.Sendmsg(int(fd), b, oob, nil, 0)
		return !errors.Is(serr, unix.EAGAIN)
	})
	// Keep the files alive until the kernel has taken its references.
	for _, f := range files {
		_ = f.Fd()
	}
	if err == nil {
		err = serr
	}
	if errors.Is(err, unix.EPIPE) || errors.Is(err, unix.ECONNRESET) {
		return ErrClosed
	}
	return err
}

// ErrClosed is returned by Recv and Send when the peer is gone.
var ErrClosed = errors.New("init connection closed")

// Recv receives one message and the files attached to it, which the caller
// owns. The files arrive close-on-exec (MSG_CMSG_CLOEXEC).
func (c *Conn) Recv() (Message, []*os.File, error) {
	oob := make([]byte, unix.CmsgSpace(MaxFiles*4)+unix.CmsgSpace(unix.SizeofUcred))
	var n, oobn, flags int
	var rerr error
	err := c.rc.Read(func(fd uintptr) bool {
		n, oobn, flags, rerr = c.recv(int(fd), oob)
		return !errors.Is(rerr, unix.EAGAIN)
	})
	if err == nil {
		err = rerr
	}
	if err != nil {
		if errors.Is(err, os.ErrClosed) || errors.Is(err, unix.ECONNRESET) {
			return Message{}, nil, ErrClosed
		}
		return Message{}, nil, err
	}
	if n == 0 && oobn == 0 {
		return Message{}, nil, ErrClosed
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
		CloseFiles(files)
		return Message{}, nil, fmt.Errorf("init message truncated")
	}
	var m Message
	if err := json.Unmarshal(c.buf[:n], &m); err != nil {
		CloseFiles(files)
		return Message{}, nil, fmt.Errorf("decode init message: %w", err)
	}
	m.PeerPid = peer
	return m, files, nil
}

// minBuf is Recv's first buffer: every message but a spawn with a large
// environment fits.
const minBuf = 4 << 10

// recv receives the next packet into c.buf, sized first by a peek
// (MSG_PEEK|MSG_TRUNC gives a packet's length): a buffer of MaxPacket per
// connection, zeroed by the allocator, cost every init boot and every new
// generation's connection in the daemon a megabyte of page faults (measured:
// the largest part of the daemon's CPU in a fork of 64).
func (c *Conn) recv(fd int, oob []byte) (n, oobn, flags int, err error) {
	size, _, err := unix.Recvfrom(fd, nil, unix.MSG_PEEK|unix.MSG_TRUNC|unix.MSG_DONTWAIT)
	if err != nil {
		return 0, 0, 0, err
	}
	if size > MaxPacket {
		return 0, 0, 0, fmt.Errorf("init message of %d bytes exceeds %d", size, MaxPacket)
	}
	if cap(c.buf) < size {
		c.buf = make([]byte, max(size, minBuf))
	}
	n, oobn, flags, _, err = unix.Recvmsg(fd, c.buf[:cap(c.buf)], oob, unix.MSG_CMSG_CLOEXEC|unix.MSG_DONTWAIT)
	return n, oobn, flags, err
}

// CloseFiles closes every non-nil file of files.
func CloseFiles(files []*os.File) {
	for _, f := range files {
		if f != nil {
			f.Close()
		}
	}
}
