//go:build linux

// Package core is the machinery the layer stores share: layer records in
// bbolt, locking, crash recovery, views, Diff, Usage, compaction and the
// invariant check. A backend supplies how a layer directory is made,
// snapshotted and destroyed (Backend); the layout of a layer directory is the
// same everywhere: upper/ (the delta) and work/ (overlay's work directory,
// active layers only).
package core

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/layer"
	bolt "go.etcd.io/bbolt"
)

// Backend is what distinguishes one store from another.
type Backend struct {
	// Flat: a committed layer holds its whole content (a snapshot of the
	// active layer's upper), so every view has at most one store layer, and
	// Commit keeps the active layer (next.ID == active). Otherwise Commit is
	// the overlay layer switch.
	Flat bool
	// Make creates dir, an empty layer directory with upper/ and work/.
	Make func(dir string) error
	// Snapshot creates dst, a layer directory whose upper/ holds src's upper/
	// content at one instant (and an empty work/ unless readonly).
	Snapshot func(src, dst string, readonly bool) error
	// Destroy removes a layer directory; a missing one is not an error.
	Destroy func(dir string) error
	// MaxDepth > 0 compacts chains deeper than it in the background.
	MaxDepth int
	// Close runs when the store closes (e.g. unmounts an image).
	Close func() error
}

// HardDepth is the deepest chain Mounts returns: the kernel stacks at most
// 500 lowers and the caller's image needs some of them.
const HardDepth = 400

type record struct {
	ID      string            `json:"id"`
	Kind    layer.Kind        `json:"kind"`
	Parent  string            `json:"parent,omitempty"`
	Created time.Time         `json:"created"`
	Labels  map[string]string `json:"labels,omitempty"`
	Dir     string            `json:"dir"`            // directory name under the data dir
	Flat    bool              `json:"flat,omitempty"` // upper/ holds the whole content
	Garbage []string          `json:"garbage,omitempty"`
}

func (r *record) info() layer.Info {
	return layer.Info{ID: r.ID, Kind: r.Kind, Parent: r.Parent, Created: r.Created, Labels: maps(r.Labels)}
}

func maps(m map[string]string) map[string]string {
	if m == nil {
		return nil
	}
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

var bucket = []byte("layers")

// Store implements layer.Store over a Backend. It is safe for concurrent use.
// Lock order: a layer's lock (lockOf), then mu.
type Store struct {
	root, data string
	b          Backend
	db         *bolt.DB
	compact    chan string
	stop       context.CancelFunc
	wg         sync.WaitGroup

	// mu guards recs, locks and unsaved.
	mu    sync.Mutex
	recs  map[string]*record
	locks map[string]*sync.RWMutex
	// unsaved are records in effect whose write failed (see CommitFlat):
	// every save writes them too until one succeeds.
	unsaved map[string]*record
	// saveMu orders saves, so that one carrying unsaved records cannot
	// write them after a later save wrote newer ones.
	saveMu sync.Mutex
}

// Open opens (creating if needed) the store whose metadata lives in root and
// whose layer directories live in data, and cleans what a crash left
// half-made: layer directories no record refers to.
func Open(root, data string, b Backend) (*Store, error) {
	if err := os.MkdirAll(data, 0o700); err != nil {
		return nil, fmt.Errorf("open layer store %q: %w", root, err)
	}
	db, err := bolt.Open(filepath.Join(root, "layers.db"), 0o600, &bolt.Options{Timeout: 5 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("open layer store %q: %w", root, err)
	}
	s := &Store{root: root, data: data, b: b, db: db, recs: map[string]*record{}, locks: map[string]*sync.RWMutex{}, unsaved: map[string]*record{}}
	err = db.Update(func(tx *bolt.Tx) error {
		bk, err := tx.CreateBucketIfNotExists(bucket)
		if err != nil {
			return err
		}
		return bk.ForEach(func(k, v []byte) error {
			var r record
			if err := json.Unmarshal(v, &r); err != nil {
				return fmt.Errorf("layer %q: %w", k, err)
			}
			s.recs[r.ID] = &r
			return nil
		})
	})
	if err == nil {
		err = s.recover()
	}
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("open layer store %q: %w", root, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.stop = cancel
	if b.MaxDepth > 0 {
		s.compact = make(chan string, 64)
		s.wg.Add(1)
		go s.compactor(ctx)
	}
	return s, nil
}

// recover destroys the layer directories no record refers to: what an
// operation interrupted by a crash had made but not acknowledged.
func (s *Store) recover() error {
	used := s.usedDirs()
	ents, err := os.ReadDir(s.data)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if !used[e.Name()] {
			if err := s.b.Destroy(filepath.Join(s.data, e.Name())); err != nil {
				return fmt.Errorf("clean half-made layer %q: %w", e.Name(), err)
			}
		}
	}
	return nil
}

func (s *Store) usedDirs() map[string]bool {
	used := map[string]bool{}
	for _, r := range s.recs {
		used[r.Dir] = true
		for _, g := range r.Garbage {
			used[g] = true
		}
	}
	return used
}

// Close stops background compaction and closes the store, writing the
// records a failed save left unwritten first.
func (s *Store) Close() error {
	s.stop()
	s.wg.Wait()
	s.mu.Lock()
	unsaved := len(s.unsaved) > 0
	s.mu.Unlock()
	var err error
	if unsaved {
		err = s.save(nil, nil)
	}
	err = errors.Join(err, s.db.Close())
	if s.b.Close != nil {
		err = errors.Join(err, s.b.Close())
	}
	return err
}

var idRE = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]{0,127}$`)

func checkID(op, id string) error {
	if !idRE.MatchString(id) {
		return fmt.Errorf("%s layer %q: bad id: %w", op, id, errdefs.ErrInvalidArgument)
	}
	return nil
}

func newID() string {
	b := make([]byte, 10)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func (s *Store) lockOf(id string) *sync.RWMutex {
	s.mu.Lock()
	defer s.mu.Unlock()
	l, ok := s.locks[id]
	if !ok {
		l = &sync.RWMutex{}
		s.locks[id] = l
	}
	return l
}

// lockActive checks id, locks the layer for writing and returns its record,
// which must be active; unlock releases the lock (a no-op on error).
func (s *Store) lockActive(op, id string) (a record, unlock func(), err error) {
	if err := checkID(op, id); err != nil {
		return record{}, func() {}, err
	}
	l := s.lockOf(id)
	l.Lock()
	a, err = s.get(op, id, layer.KindActive)
	if err != nil {
		l.Unlock()
		return record{}, func() {}, err
	}
	return a, l.Unlock, nil
}

// get returns a copy of id's record, checking its kind when want is not
// KindUnknown.
func (s *Store) get(op, id string, want layer.Kind) (record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.recs[id]
	if !ok {
		return record{}, fmt.Errorf("%s layer %q: %w", op, id, errdefs.ErrNotFound)
	}
	if want != layer.KindUnknown && r.Kind != want {
		return record{}, fmt.Errorf("%s layer %q: is %s, want %s: %w", op, id, r.Kind, want, errdefs.ErrFailedPrecondition)
	}
	return *r, nil
}

// save writes puts and deletes in one transaction (fsynced), then updates the
// in-memory records. This is the point where an operation takes effect.
func (s *Store) save(puts []*record, deletes []string) error {
	s.saveMu.Lock()
	defer s.saveMu.Unlock()
	own := len(puts) // the unsaved go to the disk only: they are in effect
	s.mu.Lock()
	var late []string
	for id, r := range s.unsaved {
		if !slices.Contains(deletes, id) && !slices.ContainsFunc(puts, func(p *record) bool { return p.ID == id }) {
			c := *r
			puts = append(puts, &c)
		}
		late = append(late, id)
	}
	s.mu.Unlock()
	err := s.db.Update(func(tx *bolt.Tx) error {
		bk := tx.Bucket(bucket)
		for _, r := range puts {
			v, err := json.Marshal(r)
			if err != nil {
				return err
			}
			if err := bk.Put([]byte(r.ID), v); err != nil {
				return err
			}
		}
		for _, id := range deletes {
			if err := bk.Delete([]byte(id)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("save layer records: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range puts[:own] {
		c := *r
		s.recs[r.ID] = &c
	}
	for _, id := range deletes {
		delete(s.recs, id)
		delete(s.locks, id)
	}
	for _, id := range late {
		delete(s.unsaved, id)
	}
	return nil
}

func (s *Store) dir(name string) string { return filepath.Join(s.data, name) }

// Branch implements layer.Store.
func (s *Store) Branch(ctx context.Context, parent string, opts ...layer.Opt) (layer.Info, error) {
	cfg, err := layer.ApplyOpts(opts...)
	if err != nil {
		return layer.Info{}, err
	}
	r := &record{ID: newID(), Kind: layer.KindActive, Parent: parent, Created: time.Now().UTC(), Labels: cfg.Labels}
	r.Dir = r.ID
	if parent == "" {
		r.Flat = s.b.Flat
		err = s.b.Make(s.dir(r.Dir))
	} else {
		if err := checkID("branch", parent); err != nil {
			return layer.Info{}, err
		}
		l := s.lockOf(parent)
		l.RLock()
		defer l.RUnlock()
		p, err2 := s.get("branch from", parent, layer.KindCommitted)
		if err2 != nil {
			return layer.Info{}, err2
		}
		if s.b.Flat {
			r.Flat = true
			err = s.b.Snapshot(s.dir(p.Dir), s.dir(r.Dir), false)
		} else {
			err = s.b.Make(s.dir(r.Dir))
		}
	}
	if err != nil {
		_ = s.b.Destroy(s.dir(r.Dir))
		return layer.Info{}, fmt.Errorf("branch from %q: %w", parent, err)
	}
	if err := s.save([]*record{r}, nil); err != nil {
		_ = s.b.Destroy(s.dir(r.Dir))
		return layer.Info{}, err
	}
	return r.info(), nil
}

// Commit implements layer.Store.
func (s *Store) Commit(ctx context.Context, active string, opts ...layer.Opt) (committed, next layer.Info, err error) {
	cfg, err := layer.ApplyOpts(opts...)
	if err != nil {
		return committed, next, err
	}
	a, unlock, err := s.lockActive("commit", active)
	defer unlock()
	if err != nil {
		return committed, next, err
	}
	c := &record{ID: newID(), Kind: layer.KindCommitted, Parent: a.Parent, Created: time.Now().UTC(), Labels: cfg.Labels}
	if s.b.Flat {
		c.Dir, c.Flat = c.ID, true
		if err := s.b.Snapshot(s.dir(a.Dir), s.dir(c.Dir), true); err != nil {
			_ = s.b.Destroy(s.dir(c.Dir))
			return committed, next, fmt.Errorf("commit layer %q: %w", active, err)
		}
		a.Parent = c.ID
		if err := s.save([]*record{c, &a}, nil); err != nil {
			_ = s.b.Destroy(s.dir(c.Dir))
			return committed, next, fmt.Errorf("commit layer %q: %w", active, err)
		}
		return c.info(), a.info(), nil
	}
	// The layer switch: the active upper becomes the committed layer as it
	// is; a fresh active layer goes on top.
	c.Dir = a.Dir
	n := &record{ID: newID(), Kind: layer.KindActive, Parent: c.ID, Created: c.Created, Labels: a.Labels}
	n.Dir = n.ID
	if err := s.b.Make(s.dir(n.Dir)); err != nil {
		_ = s.b.Destroy(s.dir(n.Dir))
		return committed, next, fmt.Errorf("commit layer %q: %w", active, err)
	}
	if err := s.save([]*record{c, n}, []string{active}); err != nil {
		_ = s.b.Destroy(s.dir(n.Dir))
		return committed, next, fmt.Errorf("commit layer %q: %w", active, err)
	}
	if s.compact != nil && s.depth(c.ID) > s.b.MaxDepth {
		select {
		case s.compact <- c.ID:
		default: // busy: a later commit asks again
		}
	}
	return c.info(), n.info(), nil
}

// LiveCommit commits a snapshot of the active layer while it stays mounted
// and written to; the active layer is unchanged (its parent too, since its
// mounted view still has the old lowers). Backend.Snapshot must be atomic.
func (s *Store) LiveCommit(ctx context.Context, active string, opts ...layer.Opt) (layer.Info, error) {
	cfg, err := layer.ApplyOpts(opts...)
	if err != nil {
		return layer.Info{}, err
	}
	a, unlock, err := s.lockActive("commit", active)
	defer unlock()
	if err != nil {
		return layer.Info{}, err
	}
	c := &record{ID: newID(), Kind: layer.KindCommitted, Parent: a.Parent, Created: time.Now().UTC(), Labels: cfg.Labels, Flat: a.Flat}
	c.Dir = c.ID
	if err := s.b.Snapshot(s.dir(a.Dir), s.dir(c.Dir), true); err != nil {
		_ = s.b.Destroy(s.dir(c.Dir))
		return layer.Info{}, fmt.Errorf("commit layer %q live: %w", active, err)
	}
	if cfg.Captured != nil {
		cfg.Captured()
	}
	if err := s.save([]*record{c}, nil); err != nil {
		_ = s.b.Destroy(s.dir(c.Dir))
		return layer.Info{}, fmt.Errorf("commit layer %q live: %w", active, err)
	}
	return c.info(), nil
}

// preparedPrefix names the directories of prepared copies: no record names
// one until it is committed, so the next Open removes those left behind.
const preparedPrefix = "prep-"

// PrepareFlat is layer.Preparer's PrepareCommit for flat backends: a
// writable snapshot of the active layer.
func (s *Store) PrepareFlat(ctx context.Context, active string) (layer.Prepared, error) {
	if !s.b.Flat {
		return layer.Prepared{}, fmt.Errorf("prepare a commit of layer %q: the store's layers are not flat: %w", active, errdefs.ErrFailedPrecondition)
	}
	a, unlock, err := s.lockActive("prepare a commit of", active)
	defer unlock()
	if err != nil {
		return layer.Prepared{}, err
	}
	dir := preparedPrefix + newID()
	if err := s.b.Snapshot(s.dir(a.Dir), s.dir(dir), false); err != nil {
		_ = s.b.Destroy(s.dir(dir))
		return layer.Prepared{}, fmt.Errorf("prepare a commit of layer %q: %w", active, err)
	}
	return layer.Prepared{Active: active, Dir: dir, View: layer.View{Upper: s.dir(dir) + "/upper", Work: s.dir(dir) + "/work"}}, nil
}

// CommitFlat is layer.Preparer's CommitPrepared: the active layer's directory
// becomes the committed layer's, the copy the active layer's. One fsynced
// record write, after the WithCaptured hook.
func (s *Store) CommitFlat(ctx context.Context, p layer.Prepared, opts ...layer.Opt) (layer.Info, error) {
	cfg, err := layer.ApplyOpts(opts...)
	if err != nil {
		return layer.Info{}, err
	}
	if err := s.checkPrepared("commit", p); err != nil {
		return layer.Info{}, err
	}
	a, unlock, err := s.lockActive("commit", p.Active)
	defer unlock()
	if err != nil {
		return layer.Info{}, err
	}
	c := &record{ID: newID(), Kind: layer.KindCommitted, Parent: a.Parent, Created: time.Now().UTC(), Labels: cfg.Labels, Dir: a.Dir, Flat: true}
	a.Dir, a.Parent = p.Dir, c.ID
	if cfg.Captured != nil {
		cfg.Captured()
	}
	if err := s.save([]*record{c, &a}, nil); err != nil {
		// The writers are on the copy already: nothing can be undone. The
		// records take effect all the same, and reach the disk with the
		// next save that succeeds (or Close); until then a crash would
		// bring the active layer back to the committed content. (The
		// caller's removal of the committed layer is refused: the active
		// layer is its child.)
		s.saveMu.Lock()
		defer s.saveMu.Unlock()
		s.mu.Lock()
		for _, r := range []*record{c, &a} {
			mem, disk := *r, *r
			s.recs[r.ID], s.unsaved[r.ID] = &mem, &disk
		}
		s.mu.Unlock()
		return c.info(), fmt.Errorf("commit layer %q: the records are not on disk yet: %w (%w)", p.Active, err, errdefs.ErrInternal)
	}
	return c.info(), nil
}

// DiscardFlat is layer.Preparer's DiscardPrepared.
func (s *Store) DiscardFlat(ctx context.Context, p layer.Prepared) error {
	if err := s.checkPrepared("discard", p); err != nil {
		return err
	}
	if err := s.b.Destroy(s.dir(p.Dir)); err != nil {
		return fmt.Errorf("discard a prepared commit of layer %q: %w", p.Active, err)
	}
	return nil
}

// checkPrepared checks that p names a copy no layer records.
func (s *Store) checkPrepared(op string, p layer.Prepared) error {
	if err := checkID(op+" a prepared commit of", p.Active); err != nil {
		return err
	}
	if !strings.HasPrefix(p.Dir, preparedPrefix) || checkID(op, p.Dir) != nil {
		return fmt.Errorf("%s a prepared commit of layer %q: %q is no prepared copy: %w", op, p.Active, p.Dir, errdefs.ErrInvalidArgument)
	}
	s.mu.Lock()
	used := s.usedDirs()[p.Dir]
	s.mu.Unlock()
	if used {
		return fmt.Errorf("%s a prepared commit of layer %q: %q was committed already: %w", op, p.Active, p.Dir, errdefs.ErrFailedPrecondition)
	}
	if _, err := os.Stat(s.dir(p.Dir)); err != nil {
		return fmt.Errorf("%s a prepared commit of layer %q: %w", op, p.Active, errdefs.ErrNotFound)
	}
	return nil
}

// chain returns the lowers (top first) of committed layer id's content.
func (s *Store) chain(id string) ([]string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for id != "" {
		r, ok := s.recs[id]
		if !ok {
			return nil, fmt.Errorf("layer %q: missing parent: %w", id, errdefs.ErrInternal)
		}
		out = append(out, filepath.Join(s.data, r.Dir, "upper"))
		if r.Flat {
			break
		}
		id = r.Parent
	}
	return out, nil
}

func (s *Store) depth(id string) int {
	l, _ := s.chain(id)
	return len(l)
}

func (s *Store) view(r record) (layer.View, error) {
	var v layer.View
	if r.Kind == layer.KindActive {
		v.Upper, v.Work = s.dir(r.Dir)+"/upper", s.dir(r.Dir)+"/work"
		if !r.Flat {
			l, err := s.chain(r.Parent)
			if err != nil {
				return v, err
			}
			v.Lowers = l
		}
		return v, nil
	}
	l, err := s.chain(r.ID)
	v.Lowers = l
	return v, err
}

// Mounts implements layer.Store. A chain too deep to mount is compacted
// first.
func (s *Store) Mounts(ctx context.Context, id string) (layer.View, error) {
	if err := checkID("mount", id); err != nil {
		return layer.View{}, err
	}
	r, err := s.get("mount", id, layer.KindUnknown)
	if err != nil {
		return layer.View{}, err
	}
	v, err := s.view(r)
	if err == nil && len(v.Lowers) > HardDepth {
		top := r.ID
		if r.Kind == layer.KindActive {
			top = r.Parent
		}
		if err := s.CompactChain(ctx, top); err != nil {
			return v, err
		}
		r, err = s.get("mount", id, layer.KindUnknown)
		if err != nil {
			return layer.View{}, err
		}
		v, err = s.view(r)
	}
	return v, err
}

// Stat implements layer.Store.
func (s *Store) Stat(ctx context.Context, id string) (layer.Info, error) {
	if err := checkID("stat", id); err != nil {
		return layer.Info{}, err
	}
	r, err := s.get("stat", id, layer.KindUnknown)
	return r.info(), err
}

// Walk implements layer.Store: layers in creation order.
func (s *Store) Walk(ctx context.Context, fn func(layer.Info) error) error {
	s.mu.Lock()
	infos := make([]layer.Info, 0, len(s.recs))
	for _, r := range s.recs {
		infos = append(infos, r.info())
	}
	s.mu.Unlock()
	sort.Slice(infos, func(i, j int) bool {
		if !infos[i].Created.Equal(infos[j].Created) {
			return infos[i].Created.Before(infos[j].Created)
		}
		return infos[i].ID < infos[j].ID
	})
	for _, in := range infos {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := fn(in); err != nil {
			return err
		}
	}
	return nil
}

// Usage implements layer.Store. An overlay layer holds its upper/
// exclusively; a flat layer holds what differs from its parent.
func (s *Store) Usage(ctx context.Context, id string) (layer.Usage, error) {
	if err := checkID("usage", id); err != nil {
		return layer.Usage{}, err
	}
	l := s.lockOf(id)
	l.RLock()
	defer l.RUnlock()
	r, err := s.get("usage", id, layer.KindUnknown)
	if err != nil {
		return layer.Usage{}, err
	}
	if !r.Flat || r.Parent == "" {
		size, inodes, err := CountTree(s.dir(r.Dir) + "/upper")
		if err != nil {
			return layer.Usage{}, fmt.Errorf("usage of layer %q: %w", id, err)
		}
		return layer.Usage{Size: size, Inodes: inodes}, nil
	}
	a, err := s.merged(r.Parent)
	if err != nil {
		return layer.Usage{}, err
	}
	b, err := s.merged(id)
	if err != nil {
		return layer.Usage{}, err
	}
	changes, err := DiffTrees(a, b)
	if err != nil {
		return layer.Usage{}, fmt.Errorf("usage of layer %q: %w", id, err)
	}
	var u layer.Usage
	for _, c := range changes {
		if c.Kind == 'D' {
			continue
		}
		n := b.lookup(c.Path)
		if n == nil {
			continue
		}
		u.Inodes++
		if m := n.st.Mode & 0o170000; m == 0o100000 || m == 0o120000 {
			u.Size += n.st.Size
		}
	}
	return u, nil
}

func (n *node) lookup(p string) *node {
	for _, part := range strings.Split(strings.Trim(p, "/"), "/") {
		if part == "" {
			continue
		}
		if n = n.children[part]; n == nil {
			return nil
		}
	}
	return n
}

func (s *Store) merged(id string) (*node, error) {
	if id == "" {
		return Merge(nil)
	}
	if err := checkID("diff", id); err != nil {
		return nil, err
	}
	r, err := s.get("diff", id, layer.KindUnknown)
	if err != nil {
		return nil, err
	}
	v, err := s.view(r)
	if err != nil {
		return nil, err
	}
	lowers := v.Lowers
	if v.Upper != "" {
		lowers = append([]string{v.Upper}, lowers...)
	}
	return Merge(lowers)
}

// Diff implements layer.Store. Whiteouts count as removals (of the image's
// file) even against a layer without that path: the store cannot see the
// image, so a path created and removed again in an overlay chain may be
// reported as removed.
func (s *Store) Diff(ctx context.Context, a, b string) ([]layer.Change, error) {
	ids := []string{a, b}
	sort.Strings(ids)
	ids = slices.Compact(ids)
	for _, id := range ids {
		if id == "" {
			continue
		}
		if err := checkID("diff", id); err != nil {
			return nil, err
		}
		l := s.lockOf(id)
		l.RLock()
		defer l.RUnlock()
	}
	ta, err := s.merged(a)
	if err != nil {
		return nil, err
	}
	tb, err := s.merged(b)
	if err != nil {
		return nil, err
	}
	cs, err := DiffTrees(ta, tb)
	if err != nil {
		return nil, fmt.Errorf("diff layers %q and %q: %w", a, b, err)
	}
	out := make([]layer.Change, len(cs))
	for i, c := range cs {
		k := layer.ChangeModify
		switch c.Kind {
		case 'A':
			k = layer.ChangeAdd
		case 'D':
			k = layer.ChangeDelete
		}
		out[i] = layer.Change{Path: c.Path, Kind: k}
	}
	return out, nil
}

// Remove implements layer.Store.
func (s *Store) Remove(ctx context.Context, id string) error {
	if err := checkID("remove", id); err != nil {
		return err
	}
	l := s.lockOf(id)
	l.Lock()
	defer l.Unlock()
	r, err := s.get("remove", id, layer.KindUnknown)
	if err != nil {
		return err
	}
	s.mu.Lock()
	var children []string
	for _, c := range s.recs {
		if c.Parent == id {
			children = append(children, c.ID)
		}
	}
	s.mu.Unlock()
	if len(children) > 0 {
		sort.Strings(children)
		return fmt.Errorf("remove layer %q: has children %q: %w", id, children, errdefs.ErrFailedPrecondition)
	}
	if err := s.save(nil, []string{id}); err != nil {
		return fmt.Errorf("remove layer %q: %w", id, err)
	}
	// From here the layer is gone; what is left on disk is garbage that
	// the next Open cleans if this fails.
	var errs []error
	for _, d := range append([]string{r.Dir}, r.Garbage...) {
		errs = append(errs, s.b.Destroy(s.dir(d)))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("remove layer %q: %w", id, err)
	}
	return nil
}

// CompactChain merges the chain of committed layer id into one directory, so that
// id's view (and its descendants') has a single store layer below them. The
// old directory stays until id is removed: mounted children may use it.
func (s *Store) CompactChain(ctx context.Context, id string) error {
	if err := checkID("compact", id); err != nil {
		return err
	}
	l := s.lockOf(id)
	l.RLock()
	defer l.RUnlock()
	r, err := s.get("compact", id, layer.KindCommitted)
	if err != nil {
		return err
	}
	lowers, err := s.chain(id)
	if err != nil || len(lowers) <= 1 {
		return err
	}
	dir := r.ID + "-" + newID()[:8]
	if err := s.b.Make(s.dir(dir)); err != nil {
		_ = s.b.Destroy(s.dir(dir))
		return fmt.Errorf("compact layer %q: %w", id, err)
	}
	_ = os.Remove(s.dir(dir) + "/upper")
	if err := Flatten(lowers, s.dir(dir)+"/upper"); err != nil {
		_ = s.b.Destroy(s.dir(dir))
		return fmt.Errorf("compact layer %q: %w", id, err)
	}
	// Only the directory changes, and only this method changes it for a
	// committed layer; the read lock keeps Remove out.
	r2, err := s.get("compact", id, layer.KindCommitted)
	if err == nil && r2.Dir != r.Dir {
		err = fmt.Errorf("compact layer %q: compacted concurrently: %w", id, errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		_ = s.b.Destroy(s.dir(dir))
		return err
	}
	r2.Garbage = append(r2.Garbage, r2.Dir)
	r2.Dir, r2.Flat = dir, true
	if err := s.save([]*record{&r2}, nil); err != nil {
		_ = s.b.Destroy(s.dir(dir))
		return fmt.Errorf("compact layer %q: %w", id, err)
	}
	return nil
}

func (s *Store) compactor(ctx context.Context) {
	defer s.wg.Done()
	for {
		select {
		case <-ctx.Done():
			return
		case id := <-s.compact:
			if s.depth(id) > s.b.MaxDepth {
				_ = s.CompactChain(ctx, id) // best effort: Mounts compacts when it must
			}
		}
	}
}

// Check is the invariant check (fsck) of the layer tree: every parent exists
// and is committed, kinds are known, every record's directory exists with the
// parts its kind needs, and no layer directory is left that no record uses.
func (s *Store) Check(ctx context.Context) error {
	s.mu.Lock()
	recs := make([]record, 0, len(s.recs))
	for _, r := range s.recs {
		recs = append(recs, *r)
	}
	used := s.usedDirs()
	byID := map[string]record{}
	for _, r := range recs {
		byID[r.ID] = r
	}
	s.mu.Unlock()
	var errs []error
	for _, r := range recs {
		if r.Kind != layer.KindActive && r.Kind != layer.KindCommitted {
			errs = append(errs, fmt.Errorf("layer %q: kind %d", r.ID, r.Kind))
		}
		if r.Parent != "" {
			p, ok := byID[r.Parent]
			if !ok {
				errs = append(errs, fmt.Errorf("layer %q: parent %q missing", r.ID, r.Parent))
			} else if p.Kind != layer.KindCommitted {
				errs = append(errs, fmt.Errorf("layer %q: parent %q is %s", r.ID, r.Parent, p.Kind))
			}
		}
		parts := []string{"upper"}
		if r.Kind == layer.KindActive {
			parts = append(parts, "work")
		}
		for _, p := range parts {
			if fi, err := os.Stat(filepath.Join(s.data, r.Dir, p)); err != nil || !fi.IsDir() {
				errs = append(errs, fmt.Errorf("layer %q: %s missing: %v", r.ID, p, err))
			}
		}
		seen := map[string]bool{}
		for id := r.ID; id != ""; id = byID[id].Parent {
			if seen[id] {
				errs = append(errs, fmt.Errorf("layer %q: parent cycle", r.ID))
				break
			}
			seen[id] = true
		}
	}
	ents, err := os.ReadDir(s.data)
	if err != nil {
		errs = append(errs, err)
	}
	for _, e := range ents {
		if !used[e.Name()] {
			errs = append(errs, fmt.Errorf("dangling layer directory %q", e.Name()))
		}
	}
	return errors.Join(errs...)
}
