package harness

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"path"
	"strings"
	"time"

	"github.com/deltabox/deltabox/errdefs"
)

// Cmd is one command to run.
type Cmd struct {
	Argv    []string
	Env     []string      // K=V, over the executor's environment
	Cwd     string        // relative to the workspace, or absolute inside it; "" is the workspace
	Timeout time.Duration // kills the command's whole process tree (exit 124); 0 means none
	// Stdout and Stderr receive output as it is produced; nil discards.
	Stdout, Stderr io.Writer
}

// ExecResult is how a command or a session snippet ended. A command that
// runs and fails is not an error: see ExitCode.
type ExecResult struct {
	ExitCode int // 124 on timeout
	TimedOut bool
	Duration time.Duration
}

// SessionOptions tune one snippet of the persistent shell session.
type SessionOptions struct {
	// Timeout kills the session; the next call starts a fresh one.
	Timeout        time.Duration
	Stdout, Stderr io.Writer
}

// FileInfo describes a file of the workspace.
type FileInfo struct {
	Name    string
	Path    string // relative to the workspace, slash-separated
	Size    int64
	Mode    fs.FileMode
	ModTime time.Time
}

// IsDir reports whether the file is a directory.
func (fi FileInfo) IsDir() bool { return fi.Mode.IsDir() }

// Executor runs one job's commands and touches its files. Paths are
// relative to the workspace or absolute inside it; others fail with
// errdefs.ErrInvalidArgument.
//
// An Executor serialises its own calls (one at a time, in call order as
// far as the mutex is fair); it is safe for concurrent use.
type Executor interface {
	// Workspace is the workspace's absolute path as the job's commands see
	// it.
	Workspace() string
	// Exec runs a command. ctx ending kills it.
	Exec(ctx context.Context, cmd Cmd) (ExecResult, error)
	// Shell runs code in the job's persistent bash session: cwd, variables
	// and functions persist across calls.
	Shell(ctx context.Context, code string, opts SessionOptions) (ExecResult, error)
	ReadFile(ctx context.Context, path string) ([]byte, error)
	// WriteFile replaces the file (creating parent directories); perm 0
	// means 0644.
	WriteFile(ctx context.Context, path string, data []byte, perm fs.FileMode) error
	// ListDir lists a directory, sorted by name.
	ListDir(ctx context.Context, path string) ([]FileInfo, error)
	// Stat describes a file without following a final symlink.
	Stat(ctx context.Context, path string) (FileInfo, error)
	Remove(ctx context.Context, path string, recursive bool) error
	// Close stops the job's processes and removes its workspace.
	Close(ctx context.Context) error
}

// Backend makes executors, one per job.
type Backend interface {
	// NewExecutor makes a fresh executor with an empty workspace of its own;
	// job names it (for labels and directory names).
	NewExecutor(ctx context.Context, job string) (Executor, error)
}

// Snapshot is one checkpoint a Brancher took.
type Snapshot struct {
	ID    string
	Pause time.Duration // how long the job was frozen
}

// Brancher is an Executor whose whole state (files and processes) can be
// checkpointed, rolled back in place and forked: what BestOfN and MCTS need.
type Brancher interface {
	Executor
	// Checkpoint captures the state; name labels it in the tree.
	Checkpoint(ctx context.Context, name string) (Snapshot, error)
	// Restore rolls the state back to a checkpoint of this executor's
	// tree; running commands are killed. It returns how long it took.
	Restore(ctx context.Context, id string) (time.Duration, error)
	// Fork makes n new executors, each as at the checkpoint id. The caller
	// closes them.
	Fork(ctx context.Context, id string, n int) ([]Brancher, time.Duration, error)
	// DeleteCheckpoint removes a checkpoint and its descendants.
	DeleteCheckpoint(ctx context.Context, id string) error
}

// resolve turns p (relative to root, or absolute) into a clean absolute
// path inside root, or fails with errdefs.ErrInvalidArgument. It is lexical:
// backends confine symlinks themselves.
func resolve(root, p string) (string, error) {
	if p == "" {
		p = "."
	}
	if strings.ContainsRune(p, 0) {
		return "", fmt.Errorf("path %q: NUL byte: %w", p, errdefs.ErrInvalidArgument)
	}
	abs := p
	if !path.IsAbs(p) {
		abs = path.Join(root, p)
	}
	abs = path.Clean(abs)
	if abs != root && !strings.HasPrefix(abs, strings.TrimSuffix(root, "/")+"/") {
		return "", fmt.Errorf("path %q is outside the workspace %q: %w", p, root, errdefs.ErrInvalidArgument)
	}
	return abs, nil
}

// rel is abs relative to root ("." for root).
func rel(root, abs string) string {
	if abs == root {
		return "."
	}
	return strings.TrimPrefix(abs, strings.TrimSuffix(root, "/")+"/")
}
