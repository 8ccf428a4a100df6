//go:build linux

package daemontest

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/sandbox"
)

// The fake's checkpoint tree. A checkpoint is a copy of the sandbox's
// directory under Dir/.checkpoints; restore and fork copy it back. Every
// sandbox starts its own tree; forks join their checkpoint's. The durations
// are fixed so that tests can compare output whole.
const (
	FakePauseMs   = 2.1
	FakeRestoreMs = 3.5
	FakeForkMs    = 4.2
)

type fakeCheckpoint struct {
	info   daemon.Checkpoint // Heads unset: computed from the sandboxes
	tree   int
	config sandbox.Config // the source's, for forks
	shell  bool           // a shell session was captured
}

func (f *Fake) ckDir(id string) string { return filepath.Join(f.Dir, ".checkpoints", id) }

func (f *Fake) getCk(id string) (*fakeCheckpoint, error) {
	ck, ok := f.checkpoints[id]
	if !ok {
		return nil, fmt.Errorf("checkpoint %q: %w", id, errdefs.ErrNotFound)
	}
	return ck, nil
}

// ckInfo is a checkpoint with its heads; f.mu is held.
func (f *Fake) ckInfo(ck *fakeCheckpoint) daemon.Checkpoint {
	info := ck.info
	info.Labels = maps.Clone(info.Labels)
	info.Processes = slices.Clone(info.Processes)
	for _, id := range slices.Sorted(maps.Keys(f.sandboxes)) {
		if f.sandboxes[id].info.Head == ck.info.ID {
			info.Heads = append(info.Heads, id)
		}
	}
	return info
}

// sortedCks lists the checkpoints oldest first (parents before children);
// f.mu is held.
func (f *Fake) sortedCks() []*fakeCheckpoint {
	var out []*fakeCheckpoint
	for _, id := range slices.Sorted(maps.Keys(f.checkpoints)) {
		out = append(out, f.checkpoints[id])
	}
	return out
}

// Checkpoint copies the sandbox's directory. The processes it reports are
// its sessions: a shell session is captured as data (replay), a python
// session is not (none), as in the state manager's slow path.
func (f *Fake) Checkpoint(ctx context.Context, id string, opts daemon.CheckpointOptions) (daemon.Checkpoint, error) {
	if err := f.fail(); err != nil {
		return daemon.Checkpoint{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.get(id)
	if err != nil {
		return daemon.Checkpoint{}, err
	}
	f.nextCk++
	ck := &fakeCheckpoint{
		info: daemon.Checkpoint{
			ID: fmt.Sprintf("ck-%04d", f.nextCk), Parent: sb.info.Head, Sandbox: id,
			Name: opts.Name, Labels: maps.Clone(opts.Labels),
			Created: time.Unix(1_700_001_000+int64(f.nextCk), 0).UTC(), PauseMs: FakePauseMs,
		},
		tree: sb.tree, config: sb.info.Config, shell: sb.shell,
	}
	if sb.shell {
		ck.info.Processes = append(ck.info.Processes, daemon.ProcessState{Name: "shell session", Path: daemon.PathReplay})
	}
	if sb.python {
		ck.info.Processes = append(ck.info.Processes, daemon.ProcessState{Name: "python session", Path: daemon.PathNone,
			Reason: "python state is not capturable as data; a fresh session starts on restore"})
	}
	if err := copyTree(filepath.Join(f.Dir, id), f.ckDir(ck.info.ID)); err != nil {
		return daemon.Checkpoint{}, fmt.Errorf("checkpoint sandbox %q: %w", id, err)
	}
	f.checkpoints[ck.info.ID] = ck
	sb.info.Head = ck.info.ID
	return f.ckInfo(ck), nil
}

func (f *Fake) Restore(ctx context.Context, id, ckID string) (daemon.RestoreResult, error) {
	if err := f.fail(); err != nil {
		return daemon.RestoreResult{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, err := f.get(id)
	if err != nil {
		return daemon.RestoreResult{}, err
	}
	ck, err := f.getCk(ckID)
	if err != nil {
		return daemon.RestoreResult{}, err
	}
	if ck.tree != sb.tree {
		return daemon.RestoreResult{}, fmt.Errorf("restore sandbox %q to %q: the checkpoint belongs to another tree (fork it instead): %w", id, ckID, errdefs.ErrFailedPrecondition)
	}
	if sb.running > 0 {
		return daemon.RestoreResult{}, fmt.Errorf("restore sandbox %q: a command is running: %w", id, errdefs.ErrFailedPrecondition)
	}
	root := filepath.Join(f.Dir, id)
	if err := os.RemoveAll(root); err != nil {
		return daemon.RestoreResult{}, err
	}
	if err := copyTree(f.ckDir(ckID), root); err != nil {
		return daemon.RestoreResult{}, fmt.Errorf("restore sandbox %q to %q: %w", id, ckID, err)
	}
	sb.info.Head, sb.shell, sb.python = ckID, ck.shell, false
	return daemon.RestoreResult{RestoreMs: FakeRestoreMs, Processes: slices.Clone(ck.info.Processes)}, nil
}

func (f *Fake) Fork(ctx context.Context, ckID string, n int) (daemon.ForkResult, error) {
	if err := f.fail(); err != nil {
		return daemon.ForkResult{}, err
	}
	if n < 1 || n > daemon.MaxFork {
		return daemon.ForkResult{}, fmt.Errorf("fork %q: n = %d: %w", ckID, n, errdefs.ErrInvalidArgument)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	ck, err := f.getCk(ckID)
	if err != nil {
		return daemon.ForkResult{}, err
	}
	res := daemon.ForkResult{ForkMs: FakeForkMs}
	for range n {
		f.next++
		id := fmt.Sprintf("sb-%04d", f.next)
		if err := copyTree(f.ckDir(ckID), filepath.Join(f.Dir, id)); err != nil {
			return daemon.ForkResult{}, fmt.Errorf("fork %q: %w", ckID, err)
		}
		f.sandboxes[id] = &fakeSandbox{
			info: sandbox.Info{ID: id, Config: ck.config, State: sandbox.StateRunning, Head: ckID,
				Created: time.Unix(1_700_000_000+int64(f.next), 0).UTC(), InitPid: 1000 + f.next},
			tree: ck.tree, shell: ck.shell,
		}
		res.IDs = append(res.IDs, id)
	}
	return res, nil
}

func (f *Fake) Tree(ctx context.Context, id string) (daemon.Tree, error) {
	if err := f.fail(); err != nil {
		return daemon.Tree{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	tree := -1
	if id != "" {
		if sb, ok := f.sandboxes[id]; ok {
			tree = sb.tree
		} else if ck, ok := f.checkpoints[id]; ok {
			tree = ck.tree
		} else {
			return daemon.Tree{}, fmt.Errorf("sandbox or checkpoint %q: %w", id, errdefs.ErrNotFound)
		}
	}
	var t daemon.Tree
	for _, ck := range f.sortedCks() {
		if tree < 0 || ck.tree == tree {
			t.Checkpoints = append(t.Checkpoints, f.ckInfo(ck))
		}
	}
	for _, sid := range slices.Sorted(maps.Keys(f.sandboxes)) {
		if sb := f.sandboxes[sid]; tree < 0 || sb.tree == tree {
			t.Sandboxes = append(t.Sandboxes, sb.info)
		}
	}
	return t, nil
}

func (f *Fake) GetCheckpoint(ctx context.Context, id string) (daemon.Checkpoint, error) {
	if err := f.fail(); err != nil {
		return daemon.Checkpoint{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	ck, err := f.getCk(id)
	if err != nil {
		return daemon.Checkpoint{}, err
	}
	return f.ckInfo(ck), nil
}

func (f *Fake) ListCheckpoints(ctx context.Context) ([]daemon.Checkpoint, error) {
	if err := f.fail(); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []daemon.Checkpoint
	for _, ck := range f.sortedCks() {
		out = append(out, f.ckInfo(ck))
	}
	return out, nil
}

// DeleteCheckpoint follows the state manager: without recursive a checkpoint
// with children stays; sandboxes whose head goes take its parent.
func (f *Fake) DeleteCheckpoint(ctx context.Context, id string, recursive bool) error {
	if err := f.fail(); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	target, err := f.getCk(id)
	if err != nil {
		return err
	}
	children := map[string][]string{}
	for _, ck := range f.sortedCks() {
		children[ck.info.Parent] = append(children[ck.info.Parent], ck.info.ID)
	}
	if n := len(children[id]); n > 0 && !recursive {
		return fmt.Errorf("delete checkpoint %q: it has %d children (use recursive): %w", id, n, errdefs.ErrFailedPrecondition)
	}
	doomed := map[string]bool{}
	var walk func(string)
	walk = func(c string) {
		doomed[c] = true
		for _, ch := range children[c] {
			walk(ch)
		}
	}
	walk(id)
	for c := range doomed {
		delete(f.checkpoints, c)
		if err := os.RemoveAll(f.ckDir(c)); err != nil {
			return err
		}
	}
	for _, sb := range f.sandboxes {
		if doomed[sb.info.Head] {
			sb.info.Head = target.info.Parent
		}
	}
	return nil
}

// Diff compares two directories (a sandbox's, or a checkpoint's copy):
// a path is modified when its type, permissions, content or link target
// differ.
func (f *Fake) Diff(ctx context.Context, a, b string) ([]layer.Change, error) {
	if err := f.fail(); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	da, err := f.dirOf(a)
	if err != nil {
		return nil, err
	}
	db, err := f.dirOf(b)
	if err != nil {
		return nil, err
	}
	fa, err := snapshot(da)
	if err != nil {
		return nil, err
	}
	fb, err := snapshot(db)
	if err != nil {
		return nil, err
	}
	var out []layer.Change
	for p, vb := range fb {
		va, ok := fa[p]
		switch {
		case !ok:
			out = append(out, layer.Change{Path: p, Kind: layer.ChangeAdd})
		case va != vb:
			out = append(out, layer.Change{Path: p, Kind: layer.ChangeModify})
		}
	}
	for p := range fa {
		if _, ok := fb[p]; !ok {
			out = append(out, layer.Change{Path: p, Kind: layer.ChangeDelete})
		}
	}
	slices.SortFunc(out, func(x, y layer.Change) int { return strings.Compare(x.Path, y.Path) })
	return out, nil
}

// dirOf resolves a sandbox or checkpoint id to its directory; f.mu is held.
func (f *Fake) dirOf(id string) (string, error) {
	if _, ok := f.sandboxes[id]; ok {
		return filepath.Join(f.Dir, id), nil
	}
	if _, ok := f.checkpoints[id]; ok {
		return f.ckDir(id), nil
	}
	return "", fmt.Errorf("sandbox or checkpoint %q: %w", id, errdefs.ErrNotFound)
}

// snapshot describes every path below dir (as "/rel") by type, permissions
// and content or link target.
func snapshot(dir string) (map[string]string, error) {
	out := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		desc := fi.Mode().String()
		switch {
		case fi.Mode().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			desc += "\x00" + string(b)
		case fi.Mode()&fs.ModeSymlink != 0:
			t, err := os.Readlink(p)
			if err != nil {
				return err
			}
			desc += "\x00" + t
		}
		rel, _ := filepath.Rel(dir, p)
		out["/"+filepath.ToSlash(rel)] = desc
		return nil
	})
	return out, err
}

// copyTree copies directories, regular files and symlinks from src to a new
// dst, with their permissions.
func copyTree(src, dst string) error {
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		to := filepath.Join(dst, rel)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case fi.IsDir():
			if err := os.MkdirAll(to, 0o755); err != nil {
				return err
			}
			return os.Chmod(to, fi.Mode().Perm())
		case fi.Mode().IsRegular():
			return copyFile(p, to, fi.Mode().Perm())
		case fi.Mode()&fs.ModeSymlink != 0:
			t, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return os.Symlink(t, to)
		}
		return nil
	})
}

func copyFile(src, dst string, perm fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
