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
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
)

// v2 is a cgroup on the unified hierarchy. It is immutable.
type v2 struct {
	name   string // "/deltabox/sb-1"
	dir    string
	parent string // the shared "deltabox" directory; "" for a child
	ops    fsOps
}

var _ Cgroup = (*v2)(nil)

// v2Controllers are enabled for the sandbox cgroups, when available.
var v2Controllers = [...]string{"cpu", "memory", "pids"}

func newV2(ctx context.Context, c config, name string, lim Limits) (_ Cgroup, err error) {
	parent := filepath.Join(c.root, c.parent)
	cg := &v2{name: path.Join("/", c.parent, name), dir: filepath.Join(parent, name), parent: parent, ops: c.ops}
	avail, err := readString(filepath.Join(c.root, "cgroup.controllers"))
	if err != nil {
		return nil, fmt.Errorf("create cgroup %q: %w: %w", name, err, errdefs.ErrUnavailable)
	}
	have := strings.Fields(avail)
	need := map[string]bool{"memory": lim.MemoryBytes > 0, "pids": lim.Pids > 0, "cpu": lim.CPUs > 0}
	var enable []string
	for _, ctrl := range v2Controllers {
		switch {
		case slices.Contains(have, ctrl):
			enable = append(enable, ctrl)
		case need[ctrl]:
			return nil, fmt.Errorf("create cgroup %q: no v2 %s controller: %w", name, ctrl, errdefs.ErrUnavailable)
		}
	}
	// Controllers reach a cgroup only if every ancestor enables them for
	// its children: the root (usually done by systemd), then our parent,
	// which holds no processes and so may.
	if err := enableControllers(c.root, enable); err != nil {
		return nil, fmt.Errorf("create cgroup %q: %w", name, classify(err))
	}
	// A concurrent Delete may remove the shared parent once it is empty,
	// between our steps: start again on ENOENT.
	for try := 0; ; try++ {
		err = mkdirParent(c.ops, parent)
		if err == nil {
			err = enableControllers(parent, enable)
		}
		if err == nil {
			err = c.ops.mkdir(cg.dir)
		}
		if errors.Is(err, fs.ErrNotExist) && try < 3 {
			continue
		}
		break
	}
	if err != nil {
		rmdirIfEmpty(c.ops, parent)
		return nil, fmt.Errorf("create cgroup %q: %w", name, classify(err))
	}
	defer func() {
		if err != nil {
			_ = rmdirTree(ctx, c.ops, cg.dir)
			rmdirIfEmpty(c.ops, parent)
		}
	}()
	if err := cg.setLimits(lim); err != nil {
		return nil, fmt.Errorf("create cgroup %q: %w", name, err)
	}
	return cg, nil
}

func loadV2(c config, name string) (Cgroup, error) {
	parent := filepath.Join(c.root, c.parent)
	cg := &v2{name: path.Join("/", c.parent, name), dir: filepath.Join(parent, name), parent: parent, ops: c.ops}
	if !exists(cg.dir) {
		return nil, fmt.Errorf("load cgroup %q: %w", name, errdefs.ErrNotFound)
	}
	return cg, nil
}

// enableControllers adds the missing ones of ctrls to dir's
// cgroup.subtree_control.
func enableControllers(dir string, ctrls []string) error {
	cur, err := readString(filepath.Join(dir, "cgroup.subtree_control"))
	if err != nil {
		return err
	}
	var add []string
	for _, ctrl := range ctrls {
		if !slices.Contains(strings.Fields(cur), ctrl) {
			add = append(add, "+"+ctrl)
		}
	}
	if len(add) == 0 {
		return nil
	}
	return writeFile(filepath.Join(dir, "cgroup.subtree_control"), strings.Join(add, " "))
}

// SetLimits validates and writes lim.
func (c *v2) SetLimits(lim Limits) error {
	if err := lim.Validate(); err != nil {
		return fmt.Errorf("set limits of cgroup %q: %w", c.name, err)
	}
	return c.setLimits(lim)
}

func (c *v2) setLimits(lim Limits) error {
	if lim.MemoryBytes > 0 {
		if err := writeFile(filepath.Join(c.dir, "memory.max"), strconv.FormatInt(lim.MemoryBytes, 10)); err != nil {
			return classify(err)
		}
		// memory.swap.max exists only with swap accounting.
		if swap := filepath.Join(c.dir, "memory.swap.max"); exists(swap) {
			if err := writeFile(swap, "0"); err != nil {
				return classify(err)
			}
		}
	}
	if lim.Pids > 0 {
		if err := writeFile(filepath.Join(c.dir, "pids.max"), strconv.FormatInt(lim.Pids, 10)); err != nil {
			return classify(err)
		}
	}
	if lim.CPUs > 0 {
		v := fmt.Sprintf("%d %d", cpuQuota(lim.CPUs), cpuPeriod)
		if err := writeFile(filepath.Join(c.dir, "cpu.max"), v); err != nil {
			return classify(err)
		}
	}
	return nil
}

func (c *v2) Name() string { return c.name }

func (c *v2) Add(pid int) error {
	if err := writeFile(filepath.Join(c.dir, "cgroup.procs"), strconv.Itoa(pid)); err != nil {
		if errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("add pid %d to cgroup %q: %w: %w", pid, c.name, err, errdefs.ErrNotFound)
		}
		return fmt.Errorf("add pid %d to cgroup %q: %w", pid, c.name, classify(err))
	}
	return nil
}

func (c *v2) Procs() ([]int, error) {
	pids, err := procsTree(c.dir)
	if err != nil {
		return nil, fmt.Errorf("list processes of cgroup %q: %w", c.name, classify(err))
	}
	return pids, nil
}

// Freeze writes 1 to cgroup.freeze and waits for cgroup.events to report
// "frozen 1". If ctx ends first it thaws.
func (c *v2) Freeze(ctx context.Context) error {
	if err := c.setFrozen(ctx, true); err != nil {
		_ = writeFile(filepath.Join(c.dir, "cgroup.freeze"), "0")
		return fmt.Errorf("freeze cgroup %q: %w", c.name, classify(err))
	}
	return nil
}

func (c *v2) Thaw(ctx context.Context) error {
	if err := c.setFrozen(ctx, false); err != nil {
		return fmt.Errorf("thaw cgroup %q: %w", c.name, classify(err))
	}
	return nil
}

func (c *v2) setFrozen(ctx context.Context, frozen bool) error {
	want := "0"
	if frozen {
		want = "1"
	}
	if err := writeFile(filepath.Join(c.dir, "cgroup.freeze"), want); err != nil {
		return err
	}
	return poll(ctx, func() (bool, error) {
		v, err := readKey(filepath.Join(c.dir, "cgroup.events"), "frozen")
		return v == want, err
	})
}

// Kill writes 1 to cgroup.kill (Linux 5.14+), which SIGKILLs the whole
// subtree atomically with respect to forks, then waits for it to empty;
// without cgroup.kill it falls back to freeze, SIGKILL, thaw.
func (c *v2) Kill(ctx context.Context) error {
	kill := filepath.Join(c.dir, "cgroup.kill")
	if !exists(kill) {
		if err := killTree(ctx, c); err != nil {
			return fmt.Errorf("kill cgroup %q: %w", c.name, classify(err))
		}
		return nil
	}
	last := time.Time{}
	err := poll(ctx, func() (bool, error) {
		pids, err := c.Procs()
		if err != nil || len(pids) == 0 {
			return true, err
		}
		// Again every 100 ms, for processes that joined meanwhile.
		if time.Since(last) > 100*time.Millisecond {
			if err := writeFile(kill, "1"); err != nil {
				return false, err
			}
			last = time.Now()
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("kill cgroup %q: %w", c.name, classify(err))
	}
	return nil
}

func (c *v2) Delete(ctx context.Context) error {
	if !exists(c.dir) {
		return nil
	}
	if err := c.Kill(ctx); err != nil {
		return fmt.Errorf("delete: %w", err)
	}
	if err := rmdirTree(ctx, c.ops, c.dir); err != nil {
		return fmt.Errorf("delete cgroup %q: %w", c.name, classify(err))
	}
	if c.parent != "" {
		rmdirIfEmpty(c.ops, c.parent)
	}
	return nil
}

func (c *v2) Stats() (Stats, error) {
	var st Stats
	var err error
	wrap := func(err error) error { return fmt.Errorf("stats of cgroup %q: %w", c.name, classify(err)) }
	// Files of controllers that are not enabled are absent: they read as 0.
	if p := filepath.Join(c.dir, "memory.current"); exists(p) {
		if st.MemoryUsage, err = readUint(p); err != nil {
			return st, wrap(err)
		}
	}
	if p := filepath.Join(c.dir, "memory.events"); exists(p) {
		if st.OOMKills, err = readKeyUint(p, "oom_kill"); err != nil {
			return st, wrap(err)
		}
	}
	if p := filepath.Join(c.dir, "pids.current"); exists(p) {
		if st.PidsCurrent, err = readUint(p); err != nil {
			return st, wrap(err)
		}
	}
	return st, nil
}

// Child creates a subdirectory with no controllers enabled, so the
// sandbox cgroup may keep processes of its own ("no internal processes"
// applies only to cgroups that enable controllers for their children).
// Freeze and kill are core cgroup features and work on it.
func (c *v2) Child(name string) (Cgroup, error) {
	if err := validName(name); err != nil {
		return nil, err
	}
	ch := &v2{name: path.Join(c.name, name), dir: filepath.Join(c.dir, name), ops: c.ops}
	if err := c.ops.mkdir(ch.dir); err != nil {
		return nil, fmt.Errorf("create child %q of cgroup %q: %w", name, c.name, classify(err))
	}
	return ch, nil
}

func (c *v2) ProcsFile() (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(c.dir, "cgroup.procs"), os.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open procs file of cgroup %q: %w", c.name, classify(err))
	}
	return f, nil
}

func (c *v2) TasksFile() (*os.File, error) {
	// O_RDONLY, not O_PATH: clone3 does not take O_PATH descriptors.
	f, err := os.OpenFile(c.dir, os.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open directory of cgroup %q: %w", c.name, classify(err))
	}
	return f, nil
}

func (c *v2) Version() int { return 2 }
