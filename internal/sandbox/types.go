package sandbox

import (
	"io"
	"time"
)

// Limits are a sandbox's cgroup limits. Zero means the default.
type Limits struct {
	MemoryBytes int64   // memory.limit_in_bytes / memory.max
	Pids        int64   // pids.max
	CPUs        float64 // CFS quota in CPUs (1.5 = one and a half cores)
}

// Config is what a sandbox is created with. It is kept for the sandbox's life
// and copied to forks.
type Config struct {
	Image   string            // image name; "" means "host"
	Env     []string          // K=V, added to every command's environment
	Workdir string            // default cwd; "" means /work
	Labels  map[string]string // free-form, for the client
	Limits  Limits
}

// State is the state of a sandbox.
type State uint8

const (
	StateUnknown State = iota
	StateCreating
	StateRunning
	StateStopped // its processes are gone (init died, or recovered after a daemon restart)
	StateDeleted
)

func (s State) String() string {
	switch s {
	case StateCreating:
		return "creating"
	case StateRunning:
		return "running"
	case StateStopped:
		return "stopped"
	case StateDeleted:
		return "deleted"
	}
	return "unknown"
}

// Info describes a sandbox.
type Info struct {
	ID      string
	Config  Config
	State   State
	Created time.Time
	InitPid int    // host pid of the sandbox's init; 0 when not running
	Head    string // the checkpoint it last took or restored ("" for none)
}

// ExecRequest is one command to run in a sandbox.
type ExecRequest struct {
	Argv    []string
	Env     []string // K=V, over the sandbox's Config.Env
	Cwd     string   // "" means the sandbox's workdir
	Timeout time.Duration
	// Stdin, when set, is copied to the command's standard input; otherwise
	// the command reads /dev/null.
	Stdin io.Reader
	// Stdout and Stderr receive the output as it is produced (streaming),
	// at most OutputLimit bytes each, then a truncation marker.
	Stdout, Stderr io.Writer
	OutputLimit    int64 // 0 means DefaultOutputLimit
}

// DefaultOutputLimit is the per-stream output limit of an exec.
const DefaultOutputLimit = 16 << 20

// TruncationMarker is written to a stream after OutputLimit bytes.
const TruncationMarker = "\n[deltabox: output truncated]\n"

// ExecResult is how a command ended.
type ExecResult struct {
	ExitCode        int // 124 on timeout; 128+n when killed by signal n
	TimedOut        bool
	StdoutTruncated bool
	StderrTruncated bool
	Duration        time.Duration
}

// SessionKind is the kind of a persistent session.
type SessionKind uint8

const (
	SessionUnknown SessionKind = iota
	SessionShell
	SessionPython
)

func (k SessionKind) String() string {
	switch k {
	case SessionShell:
		return "shell"
	case SessionPython:
		return "python"
	}
	return "unknown"
}

// SessionRequest is one snippet of code for a sandbox's persistent session.
type SessionRequest struct {
	Kind           SessionKind
	Code           string
	Timeout        time.Duration // a timeout kills the session; the next call starts a fresh one
	Stdout, Stderr io.Writer
	OutputLimit    int64
}
