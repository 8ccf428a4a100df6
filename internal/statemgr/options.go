package statemgr

import (
	"log/slog"

	"github.com/deltabox/deltabox/internal/layer"
)

// Options configure a Manager.
type Options struct {
	Root    string // state directory (metadata, layers, images, mount points)
	Storage string // layer store backend: btrfs | overlay | copy; "" picks by probing
	// Layers, when set, is the layer store to use instead of opening one by
	// Storage (tests give a small one); the manager closes it.
	Layers layer.Store
	Logger *slog.Logger
	// CgroupParent is the cgroup directory sandboxes go under (default
	// "deltabox"; it must start with "deltabox").
	CgroupParent string
	// WarmPool is how many prepared sandboxes to keep ready for creates
	// (0: none). Each is a booted init waiting for its root: it takes the
	// process start off a create's path at the cost of an idle process.
	WarmPool int
	// TemplateBudget bounds the private memory of checkpoints' process
	// templates; past it the least recently used are evicted (their
	// checkpoints keep filesystem and session data). 0 means 25% of RAM.
	TemplateBudget int64
	// KeepTemplates leaves checkpoints' process templates running when the
	// manager closes, for the next manager on the same Root to re-adopt
	// (the daemon sets it). Otherwise Close kills them.
	KeepTemplates bool
	// InitBinary is the deltabox-init binary inits start from; "" looks for
	// it beside the running executable (see sandbox.WithInitBinary).
	InitBinary string
	// NoSeccomp starts sandboxes without the seccomp filter (tests only).
	NoSeccomp bool
}
