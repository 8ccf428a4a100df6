//go:build linux

// Package cgroup owns the control groups of sandboxes: it creates a sandbox's
// cgroup with its limits, moves processes in, freezes, kills and deletes, on
// cgroup v1 (and hybrid) and on the v2 unified hierarchy.
//
// # Words
//
// A sandbox cgroup is created by [New] under a parent directory named
// "deltabox" in every hierarchy it uses (every cgroup DeltaBox creates lives
// under a directory whose name starts with "deltabox", so that the test leak
// checker and daemon recovery can find them). A child cgroup ([Cgroup.Child])
// holds one exec: the runtime puts each command in its own child so that it
// can be frozen and killed as a tree, including descendants that called
// setsid or double-forked.
//
// # Modes
//
//   - v2 (unified): one hierarchy at /sys/fs/cgroup. A child is a plain
//     subdirectory with no controllers enabled; its processes are accounted
//     (memory, pids, cpu) to the sandbox cgroup. Freeze is cgroup.freeze,
//     kill is cgroup.kill.
//   - v1 and hybrid: one hierarchy per controller (/sys/fs/cgroup/memory,
//     …/pids, …/cpu, …/freezer). A hybrid machine also mounts a v2 hierarchy
//     (/sys/fs/cgroup/unified) but keeps the controllers on v1, so it is
//     driven exactly like v1. A sandbox cgroup exists in the memory, pids,
//     cpu and freezer hierarchies. A child exists ONLY in the freezer
//     hierarchy: the freezer is what makes a tree freezable and killable, and
//     limits are the sandbox's anyway (v1 limits are hierarchical), so a
//     process in a child stays in the sandbox cgroup of the other
//     hierarchies. Stats of a v1 child are therefore the sandbox's.
//
// # Lifecycle
//
//	cg, _ := cgroup.New(ctx, id, cgroup.Limits{MemoryBytes: 512 << 20, Pids: 1024, CPUs: 1})
//	cg.Add(initPid)                 // or pass cg.ProcsFile() into the sandbox
//	ex, _ := cg.Child("exec-1")     // per command; its ProcsFile goes to the shim
//	ex.Kill(ctx); ex.Delete(ctx)
//	cg.Freeze(ctx); …; cg.Thaw(ctx) // around a checkpoint
//	cg.Delete(ctx)                  // kills what is left, removes every directory
//
// # Joining from inside a user namespace
//
// The runtime opens a cgroup's cgroup.procs (or, on v1, tasks) as host root
// ([Cgroup.ProcsFile], [Cgroup.TasksFile]) and passes the fd into the
// sandbox, where a pre-exec shim (or a locked thread of init) writes "0" to
// join. The kernel checks the credentials the file was opened with, not the
// writer's, so a process whose uid is an unprivileged host uid (uid 0 of a
// user namespace mapped to 100000) can join, although it could not open the
// file itself: TestJoinFromUserNamespace proves it on this kernel for v1.
//
// # Why not github.com/containerd/cgroups/v3
//
// The module is in go.mod, but this package talks to cgroupfs directly (a few
// hundred lines of file I/O): importing cgroup1 or cgroup2 pulls in cilium/ebpf,
// godbus, go-systemd, runtime-spec and logrus (none of which are in go.sum);
// its v1 New creates a cgroup in every mounted hierarchy while we want four
// (and only the freezer for a child); its Freeze polls with no context and no
// deadline; it has no cgroup.kill, no way to open cgroup.procs for an fd to
// hand over, and no v1 "kill a tree" (freeze, SIGKILL, thaw, wait).
//
// All methods are safe for concurrent use; a Cgroup holds no mutable state.
package cgroup

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
)

// Limits are a sandbox cgroup's limits. Zero means unlimited.
type Limits struct {
	MemoryBytes int64   // v1 memory.limit_in_bytes (+ memsw: no swap); v2 memory.max, memory.swap.max=0
	Pids        int64   // pids.max
	CPUs        float64 // CFS quota in CPUs: 1.5 is 150 ms every 100 ms
}

// Validate reports whether l can be applied.
func (l Limits) Validate() error {
	switch {
	case l.MemoryBytes < 0:
		return fmt.Errorf("memory limit %d: %w", l.MemoryBytes, errdefs.ErrInvalidArgument)
	case l.MemoryBytes > 0 && l.MemoryBytes < 1<<20:
		return fmt.Errorf("memory limit %d is below 1 MiB: %w", l.MemoryBytes, errdefs.ErrInvalidArgument)
	case l.Pids < 0:
		return fmt.Errorf("pids limit %d: %w", l.Pids, errdefs.ErrInvalidArgument)
	case l.CPUs < 0:
		return fmt.Errorf("cpu limit %g: %w", l.CPUs, errdefs.ErrInvalidArgument)
	case l.CPUs > 0 && cpuQuota(l.CPUs) < minQuota:
		return fmt.Errorf("cpu limit %g is below %g: %w", l.CPUs, float64(minQuota)/cpuPeriod, errdefs.ErrInvalidArgument)
	}
	return nil
}

const (
	cpuPeriod = 100000 // µs, the kernel's default CFS period
	minQuota  = 1000   // µs, the kernel's minimum quota
)

func cpuQuota(cpus float64) int64 { return int64(cpus*cpuPeriod + 0.5) }

// Stats are a cgroup's counters.
type Stats struct {
	MemoryUsage uint64 // bytes charged now (v1 memory.usage_in_bytes, v2 memory.current)
	PidsCurrent uint64 // tasks now (pids.current)
	OOMKills    uint64 // processes killed by the OOM killer (memory.oom_control / memory.events oom_kill)
}

// Cgroup is a sandbox cgroup or one of its children.
type Cgroup interface {
	// Name is the cgroup's path relative to the hierarchy root
	// ("/deltabox/sb-1/exec-2").
	Name() string
	// Add moves the process (all its threads) into the cgroup, in every
	// hierarchy the cgroup uses.
	Add(pid int) error
	// Procs lists the processes of the cgroup and of its children.
	Procs() ([]int, error)
	// Freeze stops every process of the cgroup and its children and returns
	// once the kernel reports them frozen.
	Freeze(ctx context.Context) error
	// Thaw resumes what Freeze stopped.
	Thaw(ctx context.Context) error
	// Kill SIGKILLs every process of the cgroup and its children, including
	// ones forked meanwhile, and returns once the cgroup is empty.
	Kill(ctx context.Context) error
	// Delete kills what is left and removes the cgroup's directories, leaf
	// first. Deleting a deleted cgroup is not an error.
	Delete(ctx context.Context) error
	// SetLimits changes the cgroup's limits (a pre-made cgroup taken for a
	// sandbox with limits of its own).
	SetLimits(lim Limits) error
	// Stats reads the cgroup's counters.
	Stats() (Stats, error)
	// Child creates a child cgroup (see the package doc for what a child is
	// on each mode). It fails with ErrAlreadyExists if it exists.
	Child(name string) (Cgroup, error)
	// ProcsFile opens, for writing, the cgroup.procs file through which a
	// process joins the cgroup (the freezer hierarchy's on v1): a pre-exec
	// shim writes "0" to it. The caller closes it.
	ProcsFile() (*os.File, error)
	// TasksFile opens what a spawner uses to start a process in the cgroup
	// without a shim. On v1 it is the freezer hierarchy's tasks file, open
	// for writing: "0" written to it moves only the writing thread, so a
	// multi-threaded init can lock a thread, move it in, fork, and move it
	// back through its home cgroup's tasks file. On v2, where a thread cannot
	// leave its process's domain cgroup, it is the cgroup directory, open for
	// clone3's CLONE_INTO_CGROUP (syscall.SysProcAttr.CgroupFD). The caller
	// closes it.
	TasksFile() (*os.File, error)
	// Version is 1 on v1 and hybrid machines, 2 on v2.
	Version() int
}

// Mode is how the machine's cgroups are mounted.
type Mode uint8

const (
	ModeUnknown Mode = iota
	ModeV1           // only v1 hierarchies
	ModeHybrid       // v1 hierarchies plus an (empty) v2 one at <root>/unified
	ModeUnified      // v2 at the root
)

func (m Mode) String() string {
	switch m {
	case ModeV1:
		return "v1"
	case ModeHybrid:
		return "hybrid"
	case ModeUnified:
		return "v2"
	}
	return "unknown"
}

// DefaultRoot is where cgroup hierarchies are mounted.
const DefaultRoot = "/sys/fs/cgroup"

// DefaultParent is the directory under which sandbox cgroups are created.
const DefaultParent = "deltabox"

// DetectMode reports how cgroups are mounted at root ("" means DefaultRoot).
func DetectMode(root string) (Mode, error) {
	if root == "" {
		root = DefaultRoot
	}
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err != nil {
		return ModeUnknown, fmt.Errorf("detect cgroup mode: statfs %s: %w: %w", root, err, errdefs.ErrUnavailable)
	}
	if st.Type == unix.CGROUP2_SUPER_MAGIC {
		return ModeUnified, nil
	}
	if err := unix.Statfs(filepath.Join(root, "unified"), &st); err == nil && st.Type == unix.CGROUP2_SUPER_MAGIC {
		return ModeHybrid, nil
	}
	if _, err := v1Mounts(root); err != nil {
		return ModeUnknown, fmt.Errorf("detect cgroup mode: %w: %w", err, errdefs.ErrUnavailable)
	}
	return ModeV1, nil
}

type config struct {
	root   string
	parent string
	mode   Mode
	ops    fsOps
}

// Opt configures New.
type Opt func(*config) error

// WithRoot sets where the hierarchies are mounted (default DefaultRoot).
func WithRoot(root string) Opt {
	return func(c *config) error { c.root = root; return nil }
}

// WithParent sets the parent directory name (default DefaultParent). It must
// start with "deltabox".
func WithParent(parent string) Opt {
	return func(c *config) error {
		if !strings.HasPrefix(parent, DefaultParent) || validName(parent) != nil {
			return fmt.Errorf("cgroup parent %q must be a name starting with %q: %w", parent, DefaultParent, errdefs.ErrInvalidArgument)
		}
		c.parent = parent
		return nil
	}
}

// WithMode overrides mode detection.
func WithMode(m Mode) Opt {
	return func(c *config) error { c.mode = m; return nil }
}

// New creates the sandbox cgroup name under the parent with limits lim, in
// the implementation that the machine's mode calls for. It fails with
// ErrAlreadyExists if the cgroup exists, and removes what it created if it
// fails.
func New(ctx context.Context, name string, lim Limits, opts ...Opt) (Cgroup, error) {
	c, err := configure(name, opts)
	if err != nil {
		return nil, err
	}
	if err := lim.Validate(); err != nil {
		return nil, fmt.Errorf("create cgroup %q: %w", name, err)
	}
	switch c.mode {
	case ModeV1, ModeHybrid:
		return newV1(ctx, c, name, lim)
	case ModeUnified:
		return newV2(ctx, c, name, lim)
	}
	return nil, fmt.Errorf("create cgroup %q: mode %v: %w", name, c.mode, errdefs.ErrUnavailable)
}

// Load returns the existing sandbox cgroup name (for a daemon that restarts
// and finds a sandbox, or its orphan). It fails with ErrNotFound if the
// cgroup exists in no hierarchy.
func Load(name string, opts ...Opt) (Cgroup, error) {
	c, err := configure(name, opts)
	if err != nil {
		return nil, err
	}
	switch c.mode {
	case ModeV1, ModeHybrid:
		return loadV1(c, name)
	case ModeUnified:
		return loadV2(c, name)
	}
	return nil, fmt.Errorf("load cgroup %q: mode %v: %w", name, c.mode, errdefs.ErrUnavailable)
}

// Remove kills the processes of the sandbox cgroup name and removes it, in
// every hierarchy; a cgroup that does not exist is not an error. It is how
// recovery cleans an orphan up.
func Remove(ctx context.Context, name string, opts ...Opt) error {
	cg, err := Load(name, opts...)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	return cg.Delete(ctx)
}

func configure(name string, opts []Opt) (config, error) {
	c := config{root: DefaultRoot, parent: DefaultParent, ops: realOps()}
	for _, o := range opts {
		if err := o(&c); err != nil {
			return c, err
		}
	}
	if err := validName(name); err != nil {
		return c, err
	}
	if c.mode == ModeUnknown {
		m, err := DetectMode(c.root)
		if err != nil {
			return c, err
		}
		c.mode = m
	}
	return c, nil
}

func validName(name string) error {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00\n") || len(name) > 200 {
		return fmt.Errorf("cgroup name %q: %w", name, errdefs.ErrInvalidArgument)
	}
	return nil
}

// fsOps are the two operations whose cgroupfs behaviour a plain directory
// cannot imitate: mkdir populates the interface files, rmdir removes a
// directory that still holds them. Tests of the v2 logic swap in a fake.
type fsOps struct {
	mkdir func(path string) error
	rmdir func(path string) error
}

func realOps() fsOps {
	return fsOps{
		mkdir: func(p string) error { return os.Mkdir(p, 0o755) },
		rmdir: func(p string) error { return unix.Rmdir(p) },
	}
}

// classify wraps a filesystem error with its errdefs class.
func classify(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
	case errors.Is(err, os.ErrExist):
		return fmt.Errorf("%w: %w", err, errdefs.ErrAlreadyExists)
	case errors.Is(err, os.ErrPermission):
		return fmt.Errorf("%w: %w", err, errdefs.ErrPermissionDenied)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return fmt.Errorf("%w: %w", err, errdefs.ErrDeadlineExceeded)
	case errors.Is(err, unix.ENOSPC), errors.Is(err, unix.EAGAIN):
		return fmt.Errorf("%w: %w", err, errdefs.ErrResourceExhausted)
	}
	return fmt.Errorf("%w: %w", err, errdefs.ErrInternal)
}
