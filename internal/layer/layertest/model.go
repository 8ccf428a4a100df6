//go:build linux

package layertest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/deltabox/deltabox/internal/layer"
	"golang.org/x/sys/unix"
)

// SeedEnv sets the seed of the model-based test (to replay a failure).
const SeedEnv = "LAYERTEST_SEED"

// ModelSeed returns the seed from SeedEnv, or a new one; it logs the seed
// when t fails.
func ModelSeed(t testing.TB) uint64 {
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv(SeedEnv); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("%s=%q: %v", SeedEnv, v, err)
		}
		seed = s
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("model seed: %s=%d", SeedEnv, seed)
		}
	})
	return seed
}

// StepsEnv overrides the number of steps of the model-based test (for a
// longer soak than the default).
const StepsEnv = "LAYERTEST_STEPS"

func modelSteps(t testing.TB, def int) int {
	if v := os.Getenv(StepsEnv); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			t.Fatalf("%s=%q: %v", StepsEnv, v, err)
		}
		return n
	}
	return def
}

// inode is the model of one file, directory or symlink.
type inode struct {
	typ    string // "file", "dir", "symlink", "fifo"
	data   []byte
	target string
	mode   uint32
	uid    uint32
	gid    uint32
	xattrs map[string]string
	mtime  int64 // files: ns, 0 when unknown (written since the last utimes)
	ver    int   // bumped on every change of a file's data or mtime
	linked bool  // was hardlinked: never changed again (overlay copy-up breaks links)
}

// fsModel is the content of one layer: path -> inode (hardlinks share one).
type fsModel map[string]*inode

func (m fsModel) clone() fsModel {
	copies := map[*inode]*inode{}
	out := fsModel{}
	for p, in := range m {
		c, ok := copies[in]
		if !ok {
			cc := *in
			cc.data = slices.Clone(in.data)
			cc.xattrs = map[string]string{}
			for k, v := range in.xattrs {
				cc.xattrs[k] = v
			}
			c = &cc
			copies[in] = c
		}
		out[p] = c
	}
	return out
}

func (in *inode) entry() Entry {
	e := Entry{Type: in.typ, Mode: in.mode, UID: in.uid, GID: in.gid}
	var kv []string
	for k, v := range in.xattrs {
		kv = append(kv, k+"="+v+";")
	}
	sort.Strings(kv)
	e.Xattrs = strings.Join(kv, "")
	switch in.typ {
	case "file":
		e.Size = int64(len(in.data))
		h := sha256.Sum256(in.data)
		e.Hash = hex.EncodeToString(h[:])[:16]
		e.Mtime = in.mtime
	case "symlink":
		e.Mode = 0
		e.Target = in.target
	}
	return e
}

type branchState struct {
	id    string
	mnt   string
	model fsModel
}

type modelRun struct {
	t         *testing.T
	s         layer.Store
	r         *rand.Rand
	actives   []*branchState
	committed map[string]fsModel
	parents   map[string]string // committed layer -> its model parent committed layer ("" for none)
	log       []string
}

// RunModel runs steps random operations (file operations through the mounts,
// interleaved with commits, branches, removals and switches between
// branches) against s and an in-memory model of every layer's content, and
// compares the two every few steps and at the end.
func RunModel(t *testing.T, s layer.Store, root string, seed uint64, steps int) {
	mr := &modelRun{t: t, s: s, r: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), committed: map[string]fsModel{}, parents: map[string]string{}}
	t.Cleanup(func() {
		if t.Failed() {
			n := len(mr.log)
			t.Logf("last operations (seed %d):\n  %s", seed, strings.Join(mr.log[max(0, n-40):], "\n  "))
		}
	})
	mr.newBranch("")
	for i := 0; i < steps && !t.Failed(); i++ {
		b := mr.actives[mr.r.IntN(len(mr.actives))]
		switch x := mr.r.IntN(100); {
		case x < 3:
			mr.commit(b)
		case x < 5 && len(mr.committed) > 0:
			if len(mr.actives) >= 4 {
				mr.removeBranch(mr.actives[mr.r.IntN(len(mr.actives))])
			}
			ids := make([]string, 0, len(mr.committed))
			for id := range mr.committed {
				ids = append(ids, id)
			}
			sort.Strings(ids)
			mr.newBranch(ids[mr.r.IntN(len(ids))])
		case x < 6:
			mr.diffCheck(b)
		default:
			mr.fileOp(b)
		}
		if i%50 == 49 && slices.Contains(mr.actives, b) {
			mr.compare(b.id, b.mnt, b.model)
		}
	}
	for _, b := range mr.actives {
		mr.compare(b.id, b.mnt, b.model)
		mr.diffCheck(b)
	}
	ids := make([]string, 0, len(mr.committed))
	for id := range mr.committed {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for i, id := range ids {
		if i%3 == 0 || i == len(ids)-1 { // a sample keeps the test fast
			m := Mount(t, s, id)
			mr.compare(id, m, mr.committed[id])
			unmount(t, m)
		}
	}
}

func (mr *modelRun) logf(format string, args ...any) {
	mr.log = append(mr.log, fmt.Sprintf(format, args...))
}

func (mr *modelRun) newBranch(parent string) {
	in := branch(mr.t, mr.s, parent)
	model := fsModel{}
	if parent != "" {
		model = mr.committed[parent].clone()
	}
	mr.logf("branch %s from %q", in.ID, parent)
	mr.actives = append(mr.actives, &branchState{id: in.ID, mnt: Mount(mr.t, mr.s, in.ID), model: model})
}

func (mr *modelRun) removeBranch(b *branchState) {
	mr.logf("remove %s", b.id)
	unmount(mr.t, b.mnt)
	if err := mr.s.Remove(context.Background(), b.id); err != nil {
		mr.t.Fatalf("Remove(%q): %v", b.id, err)
	}
	mr.actives = slices.DeleteFunc(mr.actives, func(x *branchState) bool { return x == b })
}

func (mr *modelRun) commit(b *branchState) {
	c, n, mnt := commit(mr.t, mr.s, b.id, b.mnt)
	mr.logf("commit %s -> %s, next %s", b.id, c.ID, n.ID)
	mr.committed[c.ID] = b.model.clone()
	mr.parents[c.ID] = c.Parent
	b.id, b.mnt = n.ID, mnt
}

func (mr *modelRun) compare(id, mnt string, model fsModel) {
	got, err := ReadTree(mnt)
	if err != nil {
		mr.t.Fatalf("read layer %q: %v", id, err)
	}
	want := map[string]Entry{}
	for p, in := range model {
		want[p] = in.entry()
	}
	for p, e := range got {
		g := e
		if w, ok := want[p]; ok && w.Mtime == 0 {
			g.Mtime = 0 // unknown to the model
		}
		got[p] = g
	}
	compareTrees(mr.t, id, got, want)
	if mr.t.Failed() {
		mr.t.FailNow()
	}
}

// diffCheck compares Diff(parent, b) with the model's difference.
func (mr *modelRun) diffCheck(b *branchState) {
	in, err := mr.s.Stat(context.Background(), b.id)
	if err != nil {
		mr.t.Fatal(err)
	}
	pm := fsModel{}
	if in.Parent != "" {
		pm = mr.committed[in.Parent]
	}
	var want []layer.Change
	for p, x := range pm {
		y, ok := b.model[p]
		switch {
		case !ok:
			want = append(want, layer.Change{Path: p, Kind: layer.ChangeDelete})
		case x.typ != y.typ:
			want = append(want, layer.Change{Path: p, Kind: layer.ChangeModify})
		default:
			ex, ey := x.entry(), y.entry()
			ex.Mtime, ey.Mtime = 0, 0
			if x.typ != "file" || x.ver == y.ver {
				ex.Hash, ey.Hash = "", ""
			} else if ex == ey {
				ex.Hash = "changed"
			}
			if ex != ey {
				want = append(want, layer.Change{Path: p, Kind: layer.ChangeModify})
			}
		}
	}
	for p := range b.model {
		if _, ok := pm[p]; !ok {
			want = append(want, layer.Change{Path: p, Kind: layer.ChangeAdd})
		}
	}
	mr.logf("diff %q %s", in.Parent, b.id)
	wantDiff(mr.t, mr.s, in.Parent, b.id, want)
	if mr.t.Failed() {
		mr.t.FailNow()
	}
}

var names = []string{"a", "b", "c", "d", "e"}

// pick returns a random path of model whose inode satisfies ok.
func (mr *modelRun) pick(m fsModel, ok func(p string, in *inode) bool) (string, bool) {
	var ps []string
	for p, in := range m {
		if ok(p, in) {
			ps = append(ps, p)
		}
	}
	if len(ps) == 0 {
		return "", false
	}
	sort.Strings(ps)
	return ps[mr.r.IntN(len(ps))], true
}

// newPath returns a path that does not exist, in an existing directory.
func (mr *modelRun) newPath(m fsModel) (string, bool) {
	dirs := []string{"/"}
	for p, in := range m {
		if in.typ == "dir" {
			dirs = append(dirs, p)
		}
	}
	sort.Strings(dirs)
	for i := 0; i < 5; i++ {
		p := path.Join(dirs[mr.r.IntN(len(dirs))], names[mr.r.IntN(len(names))])
		if _, ok := m[p]; !ok {
			return p, true
		}
	}
	return "", false
}

func (mr *modelRun) data() []byte {
	b := make([]byte, mr.r.IntN(3000))
	for i := range b {
		b[i] = byte(mr.r.Uint32())
	}
	return b
}

// inherit applies what creating in a setgid directory does: the new entry
// takes the directory's group, and a new directory its setgid bit.
func inherit(m fsModel, p string, in *inode) *inode {
	if d, ok := m[path.Dir(p)]; ok && d.mode&0o2000 != 0 {
		in.gid = d.gid
		if in.typ == "dir" {
			in.mode |= 0o2000
		}
	}
	return in
}

func mutable(p string, in *inode) bool { return in.typ == "file" && !in.linked }

func (mr *modelRun) fileOp(b *branchState) {
	m, root := b.model, b.mnt
	fail := func(op string, err error) {
		mr.t.Fatalf("%s in layer %q: %v", op, b.id, err)
	}
	switch op := mr.r.IntN(14); op {
	case 0: // create
		p, ok := mr.newPath(m)
		if !ok {
			return
		}
		d := mr.data()
		mr.logf("create %s (%d bytes)", p, len(d))
		if err := os.WriteFile(root+p, d, 0o644); err != nil {
			fail("create", err)
		}
		if err := os.Chmod(root+p, 0o644); err != nil {
			fail("create", err)
		}
		m[p] = inherit(m, p, &inode{typ: "file", data: d, mode: 0o644})
	case 1, 2: // write at an offset, append
		p, ok := mr.pick(m, mutable)
		if !ok {
			return
		}
		in := m[p]
		d := mr.data()
		off := len(in.data)
		if op == 1 {
			off = mr.r.IntN(len(in.data) + 1)
		}
		mr.logf("write %s at %d (%d bytes)", p, off, len(d))
		f, err := os.OpenFile(root+p, os.O_WRONLY, 0)
		if err == nil {
			_, err = f.WriteAt(d, int64(off))
			f.Close()
		}
		if err != nil {
			fail("write", err)
		}
		if end := off + len(d); end > len(in.data) {
			in.data = append(in.data, make([]byte, end-len(in.data))...)
		}
		copy(in.data[off:], d)
		in.mtime, in.ver = 0, in.ver+1
	case 3: // truncate to a different size
		p, ok := mr.pick(m, mutable)
		if !ok {
			return
		}
		in := m[p]
		n := mr.r.IntN(4000)
		if n == len(in.data) {
			n++
		}
		mr.logf("truncate %s to %d", p, n)
		if err := os.Truncate(root+p, int64(n)); err != nil {
			fail("truncate", err)
		}
		if n < len(in.data) {
			in.data = in.data[:n]
		} else {
			in.data = append(in.data, make([]byte, n-len(in.data))...)
		}
		in.mtime, in.ver = 0, in.ver+1
	case 4: // rename
		src, ok := mr.pick(m, func(string, *inode) bool { return true })
		if !ok {
			return
		}
		dst, ok := mr.newPath(m)
		if !ok || dst == src || strings.HasPrefix(dst, src+"/") {
			return
		}
		err := os.Rename(root+src, root+dst)
		if errors.Is(err, unix.EXDEV) && m[src].typ == "dir" {
			mr.logf("rename %s %s: EXDEV (directory in a lower layer)", src, dst)
			return
		}
		mr.logf("rename %s %s", src, dst)
		if err != nil {
			fail("rename", err)
		}
		for p, in := range m {
			if p == src || strings.HasPrefix(p, src+"/") {
				delete(m, p)
				m[dst+strings.TrimPrefix(p, src)] = in
			}
		}
	case 5: // unlink
		p, ok := mr.pick(m, func(_ string, in *inode) bool { return in.typ != "dir" })
		if !ok {
			return
		}
		mr.logf("unlink %s", p)
		if err := os.Remove(root + p); err != nil {
			fail("unlink", err)
		}
		delete(m, p)
	case 6: // mkdir
		p, ok := mr.newPath(m)
		if !ok {
			return
		}
		mr.logf("mkdir %s", p)
		if err := os.Mkdir(root+p, 0o755); err != nil {
			fail("mkdir", err)
		}
		m[p] = inherit(m, p, &inode{typ: "dir", mode: 0o755})
	case 7: // rmdir (empty) or rm -rf
		p, ok := mr.pick(m, func(_ string, in *inode) bool { return in.typ == "dir" })
		if !ok {
			return
		}
		mr.logf("rm -rf %s", p)
		if err := os.RemoveAll(root + p); err != nil {
			fail("rmdir", err)
		}
		for q := range m {
			if q == p || strings.HasPrefix(q, p+"/") {
				delete(m, q)
			}
		}
	case 8: // symlink or fifo
		p, ok := mr.newPath(m)
		if !ok {
			return
		}
		if mr.r.IntN(4) == 0 {
			mr.logf("mkfifo %s", p)
			if err := unix.Mkfifo(root+p, 0o600); err != nil {
				fail("mkfifo", err)
			}
			m[p] = inherit(m, p, &inode{typ: "fifo", mode: 0o600})
			return
		}
		target := names[mr.r.IntN(len(names))] + "/../x"
		mr.logf("symlink %s -> %s", p, target)
		if err := os.Symlink(target, root+p); err != nil {
			fail("symlink", err)
		}
		m[p] = inherit(m, p, &inode{typ: "symlink", target: target, mode: 0o777})
	case 9: // link
		src, ok := mr.pick(m, mutable)
		if !ok {
			return
		}
		dst, ok := mr.newPath(m)
		if !ok {
			return
		}
		mr.logf("link %s %s", src, dst)
		if err := os.Link(root+src, root+dst); err != nil {
			fail("link", err)
		}
		m[src].linked = true
		m[dst] = m[src]
	case 10: // chmod
		p, ok := mr.pick(m, func(_ string, in *inode) bool {
			return (in.typ == "dir" || in.typ == "file" || in.typ == "fifo") && !in.linked
		})
		if !ok {
			return
		}
		modes := []uint32{0o600, 0o644, 0o755, 0o4755, 0o2755, 0o1777, 0o700}
		mode := modes[mr.r.IntN(len(modes))]
		mr.logf("chmod %s %o", p, mode)
		if err := unix.Chmod(root+p, mode); err != nil {
			fail("chmod", err)
		}
		m[p].mode = mode
	case 11: // chown
		p, ok := mr.pick(m, func(_ string, in *inode) bool { return !in.linked })
		if !ok {
			return
		}
		uid, gid := uint32(mr.r.IntN(3)*1000), uint32(mr.r.IntN(3)*1000)
		mr.logf("chown %s %d:%d", p, uid, gid)
		if err := unix.Lchown(root+p, int(uid), int(gid)); err != nil {
			fail("chown", err)
		}
		in := m[p]
		in.uid, in.gid = uid, gid
		if in.typ != "dir" && in.typ != "symlink" {
			in.mode &^= 0o6000 // chown clears setuid and setgid on files
		}
	case 12: // setxattr
		p, ok := mr.pick(m, func(_ string, in *inode) bool { return (in.typ == "file" || in.typ == "dir") && !in.linked })
		if !ok {
			return
		}
		k, v := "user."+names[mr.r.IntN(3)], strconv.Itoa(mr.r.IntN(1000))
		mr.logf("setxattr %s %s=%s", p, k, v)
		if err := unix.Lsetxattr(root+p, k, []byte(v), 0); err != nil {
			fail("setxattr", err)
		}
		if m[p].xattrs == nil {
			m[p].xattrs = map[string]string{}
		}
		m[p].xattrs[k] = v
	case 13: // utimes
		p, ok := mr.pick(m, mutable)
		if !ok {
			return
		}
		ns := int64(mr.r.IntN(1<<30))*1e9 + int64(mr.r.IntN(1e9))
		mr.logf("utimes %s %d", p, ns)
		ts := unix.NsecToTimespec(ns)
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, root+p, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			fail("utimes", err)
		}
		m[p].mtime, m[p].ver = ns, m[p].ver+1
	}
	_ = bytes.Equal
}
