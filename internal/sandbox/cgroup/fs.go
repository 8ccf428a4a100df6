//go:build linux

package cgroup

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// writeFile writes s to an existing cgroup file in one write(2), as cgroupfs
// wants; it never creates the file.
func writeFile(path, s string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(s)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %q to %s: %w", s, path, err)
	}
	return nil
}

func readString(path string) (string, error) {
	b, err := os.ReadFile(path)
	return strings.TrimSpace(string(b)), err
}

// readUint reads a file holding one number ("max" reads as 0).
func readUint(path string) (uint64, error) {
	s, err := readString(path)
	if err != nil {
		return 0, err
	}
	if s == "max" {
		return 0, nil
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parse %s: %w", path, err)
	}
	return v, nil
}

// readKey reads the value of key in a flat-keyed file ("key value" lines,
// such as memory.events, cgroup.events, memory.oom_control). A missing key
// reads as "".
func readKey(path, key string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		k, v, ok := strings.Cut(s.Text(), " ")
		if ok && k == key {
			return strings.TrimSpace(v), nil
		}
	}
	return "", s.Err()
}

func readKeyUint(path, key string) (uint64, error) {
	v, err := readKey(path, key)
	if err != nil || v == "" {
		return 0, err
	}
	return strconv.ParseUint(v, 10, 64)
}

// readPids reads a cgroup.procs file.
func readPids(path string) ([]int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out []int
	for _, f := range strings.Fields(string(b)) {
		p, err := strconv.Atoi(f)
		if err != nil {
			return nil, fmt.Errorf("parse %s: %q: %w", path, f, err)
		}
		out = append(out, p)
	}
	return out, nil
}

// subtree lists dir and every directory below it, deepest first (the order
// in which they can be removed).
func subtree(dir string) ([]string, error) {
	var out []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil // removed meanwhile
			}
			return err
		}
		if d.IsDir() {
			out = append(out, p)
		}
		return nil
	})
	slices.Reverse(out) // WalkDir is pre-order: reversed, children precede parents
	return out, err
}

// procsTree lists the processes of dir and of every cgroup below it.
func procsTree(dir string) ([]int, error) {
	dirs, err := subtree(dir)
	if err != nil {
		return nil, err
	}
	var out []int
	for _, d := range dirs {
		pids, err := readPids(filepath.Join(d, "cgroup.procs"))
		if err != nil {
			// A child removed while we walk (a command's cgroup going away
			// as it ends): ENOENT, or ENODEV from a file opened just
			// before the rmdir. It has no processes.
			if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENODEV) {
				continue
			}
			return nil, err
		}
		out = append(out, pids...)
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// rmdirTree removes dir and the cgroups below it, leaf first. A cgroup whose
// last tasks are still exiting refuses with EBUSY for a moment: retry until
// ctx ends. A missing dir is not an error.
func rmdirTree(ctx context.Context, ops fsOps, dir string) error {
	dirs, err := subtree(dir)
	if err != nil {
		return err
	}
	for _, d := range dirs {
		err := poll(ctx, func() (bool, error) {
			err := ops.rmdir(d)
			switch {
			case err == nil, errors.Is(err, fs.ErrNotExist):
				return true, nil
			case errors.Is(err, syscall.EBUSY):
				return false, nil
			}
			return false, err
		})
		if err != nil {
			return fmt.Errorf("remove cgroup %s: %w", d, err)
		}
	}
	return nil
}

// rmdirIfEmpty removes a shared parent directory once its last cgroup is
// gone; another sandbox may be using it, so any error is ignored.
func rmdirIfEmpty(ops fsOps, dir string) { _ = ops.rmdir(dir) }

// mkdirParent creates a shared parent directory if it is missing.
func mkdirParent(ops fsOps, dir string) error {
	if err := ops.mkdir(dir); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	return nil
}

// poll calls done until it reports true or an error, or ctx ends; the wait
// between calls grows from 1 ms to 20 ms.
func poll(ctx context.Context, done func() (bool, error)) error {
	// Freezing idle tasks takes well under a millisecond: start polling
	// fast, it is on the checkpoint's critical path.
	wait := 50 * time.Microsecond
	for {
		ok, err := done()
		if err != nil || ok {
			return err
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		wait = min(wait*2, 10*time.Millisecond)
	}
}

// freezeThawer is the part of a Cgroup that killTree drives.
type freezeThawer interface {
	Procs() ([]int, error)
	Freeze(ctx context.Context) error
	Thaw(ctx context.Context) error
}

// killTree kills every process of c: freeze (so that nothing forks while
// pids are read), SIGKILL each, thaw (frozen tasks die on thaw), and wait for
// the cgroup to empty; repeat until it is empty, for processes that joined
// meanwhile. A freeze that cannot complete (a task in uninterruptible sleep)
// does not stop the kill.
func killTree(ctx context.Context, c freezeThawer) error {
	for {
		pids, err := c.Procs()
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		fctx, cancel := context.WithTimeout(ctx, time.Second)
		ferr := c.Freeze(fctx)
		cancel()
		if pids, err = c.Procs(); err != nil {
			return err
		}
		for _, p := range pids {
			_ = unix.Kill(p, unix.SIGKILL) // ESRCH: already gone
		}
		if ferr == nil {
			if err := c.Thaw(ctx); err != nil {
				return err
			}
		}
		wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		err = poll(wctx, func() (bool, error) {
			pids, err := c.Procs()
			return len(pids) == 0, err
		})
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}

// mountinfo lists the cgroup v1 mounts: controller (or "name=x") → mount
// point.
func v1Mounts(root string) (map[string]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]string{}
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 64<<10), 1<<20)
	for s.Scan() {
		// id parent maj:min root mountpoint opts [optional…] - fstype source superopts
		pre, post, ok := strings.Cut(s.Text(), " - ")
		if !ok {
			continue
		}
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(qf) < 3 || qf[0] != "cgroup" {
			continue
		}
		mp := pf[4]
		if filepath.Dir(mp) != filepath.Clean(root) {
			continue
		}
		for _, o := range strings.Split(qf[2], ",") {
			out[o] = mp
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no cgroup v1 hierarchy mounted under %s", root)
	}
	return out, s.Err()
}
