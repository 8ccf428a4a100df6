package statemgr

import (
	"log/slog"

	"github.com/deltabox/deltabox/internal/layer"
)

// DefaultWarmRestores is the daemon's WarmRestores: bench/templates
// measured the first step after a rollback that rewrites a 200 MiB heap at
// about half the time with it (the copy-on-write faults done ahead).
const DefaultWarmRestores = 256 << 20

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
	// WarmRestores has restores made ready ahead pre-fault, for writing, up
	// to this many bytes of the memory their templates wrote (0: off; see
	// sandbox.WithWarm).
	WarmRestores int64
	// InitBinary is the deltabox-init binary inits start from; "" looks for
	// it beside the running executable (see sandbox.WithInitBinary).
	InitBinary string
	// NoSeccomp starts sandboxes without the seccomp filter (tests only).
	NoSeccomp bool
}
