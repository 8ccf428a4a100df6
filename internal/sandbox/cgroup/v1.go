//go:build linux

package cgroup

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
)

// The v1 controllers a sandbox cgroup lives in. The freezer is required
// (freeze, kill a tree); the others only when a limit needs them.
const (
	ctrlFreezer = "freezer"
	ctrlMemory  = "memory"
	ctrlPids    = "pids"
	ctrlCPU     = "cpu"
)

var v1Controllers = [...]string{ctrlFreezer, ctrlMemory, ctrlPids, ctrlCPU}

// v1 is a cgroup on v1 hierarchies. It is immutable.
type v1 struct {
	name string            // "/deltabox/sb-1"
	dirs map[string]string // controller → directory (a child shares its parent's, except the freezer)
	// owned are the directories this cgroup created and Delete removes.
	owned []string
	// parents are the shared "deltabox" directories, removed best-effort
	// when the last sandbox cgroup is deleted (nil for a child).
	parents []string
	ops     fsOps
}

var _ Cgroup = (*v1)(nil)

func newV1(ctx context.Context, c config, name string, lim Limits) (_ Cgroup, err error) {
	mounts, err := v1Mounts(c.root)
	if err != nil {
		return nil, fmt.Errorf("create cgroup %q: %w: %w", name, err, errdefs.ErrUnavailable)
	}
	need := map[string]bool{ctrlFreezer: true, ctrlMemory: lim.MemoryBytes > 0, ctrlPids: lim.Pids > 0, ctrlCPU: lim.CPUs > 0}
	cg := &v1{name: path.Join("/", c.parent, name), dirs: map[string]string{}, ops: c.ops}
	defer func() {
		if err != nil {
			_ = cg.removeOwned(ctx)
		}
	}()
	for _, ctrl := range v1Controllers {
		mp, ok := mounts[ctrl]
		if !ok {
			if need[ctrl] {
				return nil, fmt.Errorf("create cgroup %q: no v1 %s hierarchy: %w", name, ctrl, errdefs.ErrUnavailable)
			}
			continue
		}
		parent := filepath.Join(mp, c.parent)
		dir := filepath.Join(parent, name)
		// A concurrent Delete may remove the shared parent between our two
		// mkdirs: start again on ENOENT.
		for try := 0; ; try++ {
			if err := mkdirParent(c.ops, parent); err != nil {
				return nil, fmt.Errorf("create cgroup %q: %w", name, classify(err))
			}
			err = c.ops.mkdir(dir)
			if errors.Is(err, fs.ErrNotExist) && try < 3 {
				continue
			}
			break
		}
		if err != nil {
			return nil, fmt.Errorf("create cgroup %q: %w", name, classify(err))
		}
		cg.dirs[ctrl] = dir
		cg.owned = append(cg.owned, dir)
		cg.parents = append(cg.parents, parent)
	}
	if err := cg.setLimits(lim); err != nil {
		return nil, fmt.Errorf("create cgroup %q: %w", name, err)
	}
	return cg, nil
}

func loadV1(c config, name string) (Cgroup, error) {
	mounts, err := v1Mounts(c.root)
	if err != nil {
		return nil, fmt.Errorf("load cgroup %q: %w: %w", name, err, errdefs.ErrUnavailable)
	}
	cg := &v1{name: path.Join("/", c.parent, name), dirs: map[string]string{}, ops: c.ops}
	for _, ctrl := range v1Controllers {
		mp, ok := mounts[ctrl]
		if !ok {
			continue
		}
		parent := filepath.Join(mp, c.parent)
		dir := filepath.Join(parent, name)
		if !exists(dir) {
			continue
		}
		cg.dirs[ctrl] = dir
		cg.owned = append(cg.owned, dir)
		cg.parents = append(cg.parents, parent)
	}
	if len(cg.owned) == 0 {
		return nil, fmt.Errorf("load cgroup %q: %w", name, errdefs.ErrNotFound)
	}
	return cg, nil
}

// SetLimits validates and writes lim.
func (c *v1) SetLimits(lim Limits) error {
	if err := lim.Validate(); err != nil {
		return fmt.Errorf("set limits of cgroup %q: %w", c.name, err)
	}
	return c.setLimits(lim)
}

func (c *v1) setLimits(lim Limits) error {
	if lim.MemoryBytes > 0 {
		d, v := c.dirs[ctrlMemory], strconv.FormatInt(lim.MemoryBytes, 10)
		if err := writeFile(filepath.Join(d, "memory.limit_in_bytes"), v); err != nil {
			return classify(err)
		}
		// With swap accounting, memory+swap = memory means no swap. The
		// memory limit goes first: memsw may never be below it.
		if memsw := filepath.Join(d, "memory.memsw.limit_in_bytes"); exists(memsw) {
			if err := writeFile(memsw, v); err != nil {
				return classify(err)
			}
		}
	}
	if lim.Pids > 0 {
		if err := writeFile(filepath.Join(c.dirs[ctrlPids], "pids.max"), strconv.FormatInt(lim.Pids, 10)); err != nil {
			return classify(err)
		}
	}
	if lim.CPUs > 0 {
		d := c.dirs[ctrlCPU]
		if err := writeFile(filepath.Join(d, "cpu.cfs_period_us"), strconv.Itoa(cpuPeriod)); err != nil {
			return classify(err)
		}
		if err := writeFile(filepath.Join(d, "cpu.cfs_quota_us"), strconv.FormatInt(cpuQuota(lim.CPUs), 10)); err != nil {
			return classify(err)
		}
	}
	return nil
}

func exists(p string) bool { _, err := os.Stat(p); return err == nil }

func (c *v1) Name() string { return c.name }

// freezer is the cgroup's freezer directory, which a cgroup loaded half
// created may lack.
func (c *v1) freezer() (string, error) {
	d, ok := c.dirs[ctrlFreezer]
	if !ok {
		return "", fmt.Errorf("cgroup %q has no freezer cgroup: %w", c.name, errdefs.ErrFailedPrecondition)
	}
	return d, nil
}

func (c *v1) Add(pid int) error {
	for _, ctrl := range v1Controllers {
		if d, ok := c.dirs[ctrl]; ok {
			if err := writeFile(filepath.Join(d, "cgroup.procs"), strconv.Itoa(pid)); err != nil {
				if errors.Is(err, unix.ESRCH) {
					return fmt.Errorf("add pid %d to cgroup %q: %w: %w", pid, c.name, err, errdefs.ErrNotFound)
				}
				return fmt.Errorf("add pid %d to cgroup %q: %w", pid, c.name, classify(err))
			}
		}
	}
	return nil
}

// Procs reads the freezer hierarchy, the one in which children exist.
func (c *v1) Procs() ([]int, error) {
	d, err := c.freezer()
	if err != nil {
		return nil, err
	}
	pids, err := procsTree(d)
	if err != nil {
		return nil, fmt.Errorf("list processes of cgroup %q: %w", c.name, classify(err))
	}
	return pids, nil
}

// Freeze writes FROZEN and waits for freezer.state to read FROZEN (it reads
// FREEZING while tasks are still running to the freezing point). Writing
// FROZEN again retries tasks that were busy (runc does the same). If ctx
// ends first it thaws, so that a cgroup is never left half frozen.
func (c *v1) Freeze(ctx context.Context) error {
	d, err := c.freezer()
	if err != nil {
		return err
	}
	state := filepath.Join(d, "freezer.state")
	n := 0
	err = poll(ctx, func() (bool, error) {
		if n%8 == 0 {
			if err := writeFile(state, "FROZEN"); err != nil {
				return false, err
			}
		}
		n++
		s, err := readString(state)
		return s == "FROZEN", err
	})
	if err != nil {
		_ = writeFile(state, "THAWED")
		return fmt.Errorf("freeze cgroup %q: %w", c.name, classify(err))
	}
	return nil
}

func (c *v1) Thaw(ctx context.Context) error {
	d, err := c.freezer()
	if err != nil {
		return err
	}
	state := filepath.Join(d, "freezer.state")
	if err := writeFile(state, "THAWED"); err != nil {
		return fmt.Errorf("thaw cgroup %q: %w", c.name, classify(err))
	}
	// A child frozen by itself stays frozen when its parent thaws: one a
	// kill of it left so (the daemon died between its freeze and thaw)
	// would hold its killed tasks forever, and a later kill of the parent
	// would wait for them in vain.
	if dirs, err := subtree(d); err == nil {
		for _, sd := range dirs {
			if sd == d {
				continue
			}
			if s, err := readString(filepath.Join(sd, "freezer.state")); err == nil && s != "THAWED" {
				_ = writeFile(filepath.Join(sd, "freezer.state"), "THAWED")
			}
		}
	}
	err = poll(ctx, func() (bool, error) {
		s, err := readString(state)
		return s == "THAWED", err
	})
	if err != nil {
		return fmt.Errorf("thaw cgroup %q: %w", c.name, classify(err))
	}
	return nil
}

func (c *v1) Kill(ctx context.Context) error {
	if err := killTree(ctx, c); err != nil {
		return fmt.Errorf("kill cgroup %q: %w", c.name, classify(err))
	}
	return nil
}

func (c *v1) Delete(ctx context.Context) error {
	// Without its freezer directory (a half-created orphan) there is
	// nothing to kill through; rmdir then fails if tasks remain.
	if d, ok := c.dirs[ctrlFreezer]; ok && exists(d) {
		if err := c.Kill(ctx); err != nil {
			return fmt.Errorf("delete: %w", err)
		}
	}
	if err := c.removeOwned(ctx); err != nil {
		return fmt.Errorf("delete cgroup %q: %w", c.name, classify(err))
	}
	return nil
}

func (c *v1) removeOwned(ctx context.Context) error {
	var first error
	for _, d := range c.owned {
		if err := rmdirTree(ctx, c.ops, d); err != nil && first == nil {
			first = err
		}
	}
	for _, p := range c.parents {
		rmdirIfEmpty(c.ops, p)
	}
	return first
}

func (c *v1) Stats() (Stats, error) {
	var st Stats
	var err error
	if d, ok := c.dirs[ctrlMemory]; ok {
		if st.MemoryUsage, err = readUint(filepath.Join(d, "memory.usage_in_bytes")); err != nil {
			return st, fmt.Errorf("stats of cgroup %q: %w", c.name, classify(err))
		}
		if st.OOMKills, err = readKeyUint(filepath.Join(d, "memory.oom_control"), "oom_kill"); err != nil {
			return st, fmt.Errorf("stats of cgroup %q: %w", c.name, classify(err))
		}
	}
	if d, ok := c.dirs[ctrlPids]; ok {
		if st.PidsCurrent, err = readUint(filepath.Join(d, "pids.current")); err != nil {
			return st, fmt.Errorf("stats of cgroup %q: %w", c.name, classify(err))
		}
	}
	return st, nil
}

// Child creates the child in the freezer hierarchy only; in the others the
// child shares its parent's directory (see the package doc).
func (c *v1) Child(name string) (Cgroup, error) {
	if err := validName(name); err != nil {
		return nil, err
	}
	fd, err := c.freezer()
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(fd, name)
	if err := c.ops.mkdir(dir); err != nil {
		return nil, fmt.Errorf("create child %q of cgroup %q: %w", name, c.name, classify(err))
	}
	ch := &v1{name: path.Join(c.name, name), dirs: map[string]string{}, owned: []string{dir}, ops: c.ops}
	for k, v := range c.dirs {
		ch.dirs[k] = v
	}
	ch.dirs[ctrlFreezer] = dir
	return ch, nil
}

func (c *v1) ProcsFile() (*os.File, error) {
	d, err := c.freezer()
	if err != nil {
		return nil, err
	}
	p := filepath.Join(d, "cgroup.procs")
	f, err := os.OpenFile(p, os.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open procs file of cgroup %q: %w", c.name, classify(err))
	}
	return f, nil
}

func (c *v1) TasksFile() (*os.File, error) {
	d, err := c.freezer()
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(d, "tasks"), os.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open tasks file of cgroup %q: %w", c.name, classify(err))
	}
	return f, nil
}

func (c *v1) Version() int { return 1 }
