package daemon

import (
	"context"
	"io"
	"time"

	"github.com/deltabox/deltabox/internal/image"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/safefs"
	"github.com/deltabox/deltabox/internal/sandbox"
)

// Backend is what the API handlers serve: the state manager
// (internal/statemgr) implements it. Handlers translate requests, call it, and
// convert its errors (which wrap errdefs classes) to RPC codes in one table.
//
// THIS FILE IS THE AGREED CONTRACT between the API and the state manager.
type Backend interface {
	SystemInfo(ctx context.Context) (SystemInfo, error)

	CreateSandbox(ctx context.Context, cfg sandbox.Config) (sandbox.Info, error)
	GetSandbox(ctx context.Context, id string) (sandbox.Info, error)
	ListSandboxes(ctx context.Context) ([]sandbox.Info, error)
	// DeleteSandbox stops and removes a sandbox. Without force it fails with
	// ErrFailedPrecondition while a command runs in it.
	DeleteSandbox(ctx context.Context, id string, force bool) error

	Exec(ctx context.Context, id string, req sandbox.ExecRequest) (sandbox.ExecResult, error)
	Session(ctx context.Context, id string, req sandbox.SessionRequest) (sandbox.ExecResult, error)

	// Files opens the sandbox's root filesystem; release closes it. write
	// says the call may change it.
	Files(ctx context.Context, id string, write bool) (root *safefs.Root, release func(), err error)

	ImportImage(ctx context.Context, name string, r io.Reader) (image.Info, error)
	ListImages(ctx context.Context) ([]image.Info, error)
	RemoveImage(ctx context.Context, name string) error

	Checkpointer
}

// SystemInfo is what `deltabox info` shows.
type SystemInfo struct {
	Version     string
	Storage     string // layer store backend in use: btrfs | overlay | copy
	StateDir    string
	Kernel      string
	CgroupMode  string // v1 | v2 | hybrid
	CRIU        string // version, or "" when missing
	Btrfs       bool
	Overlay     bool
	IDMapMounts bool
	Sandboxes   int
	Images      int
	// Templates is how many checkpoints hold live process templates;
	// TemplateBytes their private memory, TemplateBudget its bound.
	Templates      int
	TemplateBytes  int64
	TemplateBudget int64
}

// Checkpointer is the checkpoint half of the Backend: coupled checkpoints of
// a sandbox's filesystem and process state, restore in place, fork, and the
// checkpoint tree. The state manager implements it; every Backend does.
type Checkpointer interface {
	// Checkpoint takes a coupled checkpoint of a running sandbox; its parent
	// is the sandbox's head, and it becomes the new head.
	Checkpoint(ctx context.Context, sandboxID string, opts CheckpointOptions) (Checkpoint, error)
	// Restore rolls a sandbox back, in place, to a checkpoint of its tree.
	Restore(ctx context.Context, sandboxID, checkpointID string) (RestoreResult, error)
	// Fork creates n new sandboxes, each exactly as at the checkpoint.
	Fork(ctx context.Context, checkpointID string, n int) (ForkResult, error)
	// Tree returns the checkpoint tree that holds a sandbox or checkpoint
	// (every tree when id is "").
	Tree(ctx context.Context, id string) (Tree, error)
	GetCheckpoint(ctx context.Context, id string) (Checkpoint, error)
	ListCheckpoints(ctx context.Context) ([]Checkpoint, error)
	// DeleteCheckpoint removes checkpoints; with recursive, their
	// descendants too; without, one that has children fails with
	// ErrFailedPrecondition. Layers are freed once nothing references them.
	DeleteCheckpoint(ctx context.Context, id string, recursive bool) error
	// Diff lists the files added, modified and removed from a to b.
	Diff(ctx context.Context, a, b string) ([]layer.Change, error)
}

// CheckpointOptions name and label a checkpoint.
type CheckpointOptions struct {
	Name   string
	Labels map[string]string
}

// Checkpoint describes one node of a checkpoint tree.
type Checkpoint struct {
	ID      string
	Parent  string // "" for a root
	Sandbox string // the sandbox it was taken of
	Name    string
	Labels  map[string]string
	Created time.Time
	PauseMs float64 // how long the sandbox was frozen
	// Processes says what of each process was captured.
	Processes []ProcessState
	// Heads lists the sandboxes whose head it is.
	Heads []string
}

// ProcessPath is how a process's state is kept or brought back.
type ProcessPath string

const (
	PathTemplate ProcessPath = "template" // a frozen fork template (memory exact)
	PathCRIU     ProcessPath = "criu"     // a CRIU image
	PathReplay   ProcessPath = "replay"   // session state kept as data and replayed
	PathNone     ProcessPath = "none"     // not captured: started fresh, or stopped
)

// ProcessState is one process of a checkpoint or restore.
type ProcessState struct {
	Name string      // "shell session", "python session", or the command line
	Path ProcessPath // at restore: how it came back
	// Reason says why a process was not captured.
	Reason string
}

// RestoreResult is what a restore did.
type RestoreResult struct {
	RestoreMs float64
	Processes []ProcessState
}

// ForkResult lists the new sandboxes.
type ForkResult struct {
	IDs    []string
	ForkMs float64
}

// Tree is a forest of checkpoints with the sandboxes that live in it.
type Tree struct {
	Checkpoints []Checkpoint // parents before children
	Sandboxes   []sandbox.Info
}
