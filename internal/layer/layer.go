// Package layer defines DeltaFS: a store of filesystem layers that commits and
// branches a sandbox's writable filesystem in O(1).
//
// # Words
//
// A layer is a filesystem delta over an image (the read-only base the caller
// supplies; the store never sees it). An active layer is writable and is
// mounted by at most one sandbox. A committed layer is immutable; it has a
// parent (another committed layer, or none when it sits directly on the
// image). The chain of committed layers from a layer down to the image is what
// a checkpoint's filesystem is. The content of a layer is its chain merged with
// overlay semantics (whiteouts and opaque directories hide what lies below).
//
// # Lifecycle
//
//	Branch(ctx, "")        -> active A1 (empty, directly over the image)
//	Mounts(ctx, A1)        -> View: overlay upper/work over lowers; the caller mounts it
//	... the sandbox writes through the mount ...
//	Commit(ctx, A1)        -> committed C1 (A1's content at this instant) and the
//	                          active layer the sandbox goes on with
//	Branch(ctx, C1)        -> active A2 whose content starts equal to C1
//	Diff(ctx, C1, A2)      -> what A2 changed
//	Remove(ctx, A2); Remove(ctx, C1)   (a layer with children cannot be removed)
//
// # Cost
//
// Commit and Branch copy no file data and do not grow with the number of files
// in the layer, except in the copy backend, which is the slow reference (and
// the "copytree" baseline of the benchmarks). Writes after a commit never reach
// the committed layer; branches never see each other's writes.
//
// # Concurrency
//
// A Store is safe for concurrent use. Operations on different layers run in
// parallel; operations that change the same layer are serialised by the store.
package layer

import (
	"context"
	"time"
)

// Kind is the kind of a layer.
type Kind uint8

const (
	KindUnknown Kind = iota
	KindActive
	KindCommitted
)

func (k Kind) String() string {
	switch k {
	case KindActive:
		return "active"
	case KindCommitted:
		return "committed"
	}
	return "unknown"
}

// Info describes one layer.
type Info struct {
	ID      string
	Kind    Kind
	Parent  string // the committed layer below; "" when directly on the image
	Created time.Time
	Labels  map[string]string
}

// View is what to mount to see a layer's content: an overlay with Upper (and
// its Work directory) over Lowers, top first, over the caller's image layers.
// A committed layer's view is read-only: Upper and Work are empty and Lowers
// holds its whole chain. Paths are absolute and valid until the layer is
// removed.
type View struct {
	Upper  string
	Work   string
	Lowers []string
}

// Usage is what a layer holds exclusively (not shared with its parents).
type Usage struct {
	Size   int64 // bytes
	Inodes int64
}

// ChangeKind is the kind of one change between two layers' contents.
type ChangeKind uint8

const (
	ChangeUnknown ChangeKind = iota
	ChangeAdd
	ChangeModify
	ChangeDelete
)

func (k ChangeKind) String() string {
	switch k {
	case ChangeAdd:
		return "added"
	case ChangeModify:
		return "modified"
	case ChangeDelete:
		return "removed"
	}
	return "unknown"
}

// Change is one path that differs between two layers, relative to the root
// ("/etc/hosts").
type Change struct {
	Path string
	Kind ChangeKind
}

// Store is a store of layers. See the package documentation for the words and
// the lifecycle. Every error wraps an errdefs class: ErrNotFound for an
// unknown id, ErrFailedPrecondition for an operation on the wrong kind of
// layer or removing a layer that has children, ErrInvalidArgument for bad ids.
type Store interface {
	// Branch creates an active layer whose content starts equal to parent's,
	// or empty when parent is "".
	Branch(ctx context.Context, parent string, opts ...Opt) (Info, error)

	// Commit freezes the content of the active layer at this instant into a
	// new committed layer, and returns it with the active layer the sandbox
	// goes on writing into. When next.ID == active, the active layer's view is
	// unchanged and its mount stays live (snapshot-capable backends). Otherwise
	// active no longer exists: its content became the committed layer, and the
	// caller must switch to Mounts(next) and stop writing through the old view
	// (the overlay layer switch; the caller freezes the writers first).
	Commit(ctx context.Context, active string, opts ...Opt) (committed, next Info, err error)

	// Mounts returns the view of a layer (see View).
	Mounts(ctx context.Context, id string) (View, error)

	Stat(ctx context.Context, id string) (Info, error)
	Walk(ctx context.Context, fn func(Info) error) error
	Usage(ctx context.Context, id string) (Usage, error)

	// Diff lists the paths whose content differs from layer a's to layer b's,
	// sorted by path. Either may be active or committed; "" is the empty layer.
	Diff(ctx context.Context, a, b string) ([]Change, error)

	// Remove removes a layer. It fails with ErrFailedPrecondition while other
	// layers have it as parent.
	Remove(ctx context.Context, id string) error

	Close() error
}

// LiveCommitter is implemented by stores that can commit an active layer while
// it stays mounted and written to (btrfs snapshots): the committed layer gets
// the content at this instant and the active layer goes on unchanged, with no
// remount. The checkpoint's slow path (processes that stay where they are)
// needs it.
type LiveCommitter interface {
	CommitLive(ctx context.Context, active string, opts ...Opt) (Info, error)
}

// Preparer is implemented by stores whose commit can be prepared ahead
// (btrfs): PrepareCommit copies an active layer's content, while nothing
// writes it, into a copy that is not a layer yet; CommitPrepared later makes
// the active layer's content as it is then the committed layer and has the
// active layer, same id, go on in the copy. The commit itself then copies
// nothing and flushes nothing (a snapshot is a transaction commit: a device
// flush): a checkpoint whose writers were idle since the copy pays for it
// while they were idle, not in its pause. It is correct only when nothing
// wrote the active layer between the two calls; the caller knows that, the
// store cannot. A copy never committed is discarded (DiscardPrepared, or the
// next Open, which removes what no layer records).
type Preparer interface {
	PrepareCommit(ctx context.Context, active string) (Prepared, error)
	// CommitPrepared returns the committed layer. From the instant its
	// WithCaptured hook runs, the writers must be on p.View (Mounts of the
	// active layer returns it once the commit returns); the old view is the
	// committed layer's.
	CommitPrepared(ctx context.Context, p Prepared, opts ...Opt) (Info, error)
	DiscardPrepared(ctx context.Context, p Prepared) error
}

// Prepared is a copy of an active layer made by PrepareCommit.
type Prepared struct {
	Active string // the layer copied
	Dir    string // the copy's directory name in the store
	View   View   // the copy's view: what the writers go on in
}

// Compactor is implemented by stores that can merge a long chain of committed
// layers into fewer, off the critical path.
type Compactor interface {
	Compact(ctx context.Context, id string) error
}

// Opt sets an option of one operation.
type Opt func(*Config) error

// Config is what Opts set. Backends read it; callers use the With functions.
type Config struct {
	Labels map[string]string
	// Captured, when set, is called by a commit as soon as the content is
	// captured into the new layer, before the store's own bookkeeping. See
	// WithCaptured.
	Captured func()
}

// WithCaptured has a commit call fn at the instant the content is captured
// (for btrfs, once the snapshot exists), before the store records the new
// layer. A caller that froze the writers for the commit lets them go there,
// so that the freeze does not include the store's metadata write. If the
// process dies between the two, the unrecorded layer is removed when the
// store is opened again; the commit was never acknowledged. fn is called at
// most once, and not at all when the capture fails.
func WithCaptured(fn func()) Opt {
	return func(c *Config) error { c.Captured = fn; return nil }
}

// WithLabels attaches labels to the layer an operation creates.
func WithLabels(l map[string]string) Opt {
	return func(c *Config) error {
		if c.Labels == nil {
			c.Labels = map[string]string{}
		}
		for k, v := range l {
			c.Labels[k] = v
		}
		return nil
	}
}

// ApplyOpts returns the Config of opts.
func ApplyOpts(opts ...Opt) (Config, error) {
	var c Config
	for _, o := range opts {
		if err := o(&c); err != nil {
			return c, err
		}
	}
	return c, nil
}
