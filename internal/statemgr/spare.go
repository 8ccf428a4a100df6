//go:build linux

package statemgr

import (
	"context"
	"time"

	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/sandbox"
)

// Spare branches: after a sandbox takes or restores a checkpoint, a writable
// branch of that checkpoint (its head) is made in the background, so that
// the next restore to it (the common rollback of a failed step) takes the
// branch instead of making one on its critical path. The head's spare also
// holds the restore made ready (prep); when the head moves on, the spare of
// the previous one keeps its branch and drops the rest, so that a search
// jumping back to a node it checkpointed earlier finds a branch too (up to
// maxSpares per sandbox, the oldest dropped first). Spares are referenced
// in memory only: gc and Fsck count them, and a restart's gc removes any
// left behind.
type spare struct {
	checkpoint string
	layer      string
	// prep is, for a checkpoint with process templates, the restore made
	// ready on the layer (see sandbox.PreparedRoot): it holds the layer's
	// mount, so it is released before the layer is removed.
	prep *sandbox.PreparedRoot
	made uint64 // order of making, for dropping the oldest
}

// maxSpares bounds the spare branches kept per sandbox: each is a layer (a
// btrfs snapshot or an empty upper: cheap, but not free).
const maxSpares = 32

// drop releases a spare that will not be used and removes its layer.
func (m *Manager) drop(sp spare) {
	sp.prep.Release()
	_ = m.layers.Remove(context.Background(), sp.layer)
}

// makeSpare prepares a spare branch of checkpoint ck (committed layer
// ckLayer) for sandbox id, in the background.
func (m *Manager) makeSpare(id, ck, ckLayer string) {
	m.mu.Lock()
	m.spareHead[id] = ck // the latest call's: spares finish out of order
	m.mu.Unlock()
	m.bg.Add(1)
	go func() {
		defer m.bg.Done()
		m.layersMu.RLock()
		defer m.layersMu.RUnlock()
		in, err := m.layers.Branch(context.Background(), ckLayer, layer.WithLabels(map[string]string{"sandbox": id, "spare": ck}))
		if err != nil {
			m.log.Debug("spare branch", "sandbox", id, "checkpoint", ck, "err", err)
			return
		}
		m.mu.Lock()
		m.spareSeq++
		sp := spare{checkpoint: ck, layer: in.ID, made: m.spareSeq}
		sb := m.live[id]
		head := m.spareHead[id] == ck
		m.mu.Unlock()
		if sb != nil && head {
			sp.prep = m.prepareRoot(sb, ck, in.ID)
		}
		var doomed []spare
		var demoted []*sandbox.PreparedRoot
		m.mu.Lock()
		_, live := m.live[id]
		if live {
			if m.spares[id] == nil {
				m.spares[id] = map[string]spare{}
			}
			mine := m.spares[id]
			if old, had := mine[ck]; had {
				doomed = append(doomed, old)
			}
			// The restore made ready is for the head only: the others'
			// go, or this one's if the head moved on meanwhile.
			if m.spareHead[id] != ck && sp.prep != nil {
				demoted = append(demoted, sp.prep)
				sp.prep = nil
			}
			for c, o := range mine {
				if o.prep != nil && c != m.spareHead[id] {
					demoted = append(demoted, o.prep)
					o.prep = nil
					mine[c] = o
				}
			}
			mine[ck] = sp
			for len(mine) > maxSpares {
				oldest := ""
				for c, o := range mine {
					if oldest == "" || o.made < mine[oldest].made {
						oldest = c
					}
				}
				doomed = append(doomed, mine[oldest])
				delete(mine, oldest)
			}
		} else {
			doomed = append(doomed, sp)
		}
		m.mu.Unlock()
		for _, p := range demoted {
			p.Release()
		}
		for _, d := range doomed {
			m.drop(d)
		}
	}()
}

// prepareRoot makes a restore of sandbox sb to checkpoint ck ready on the
// spare layer, when ck has live templates (nil otherwise, or on failure).
func (m *Manager) prepareRoot(sb *sandbox.Sandbox, ck, layerID string) *sandbox.PreparedRoot {
	rec, err := m.getCk(ck)
	if err != nil {
		return nil
	}
	ts, _ := m.templatesOf(rec)
	if ts == nil {
		return nil
	}
	view, err := m.layers.Mounts(context.Background(), layerID)
	if err != nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	prep, err := sb.PrepareRoot(ctx, ts, view)
	if err != nil {
		m.log.Debug("prepare restore", "sandbox", sb.ID(), "checkpoint", ck, "err", err)
		return nil
	}
	return prep
}

// takeSpare returns the spare branch of checkpoint ck for sandbox id, and
// the restore made ready on it, if there is one; they are the caller's
// from then on.
func (m *Manager) takeSpare(id, ck string) (string, *sandbox.PreparedRoot, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	sp, ok := m.spares[id][ck]
	if !ok {
		return "", nil, false
	}
	delete(m.spares[id], ck)
	return sp.layer, sp.prep, true
}

// dropSpares removes the spares that match (by sandbox and spare).
func (m *Manager) dropSpares(ctx context.Context, match func(sandbox string, sp spare) bool) {
	m.mu.Lock()
	var doomed []spare
	for sb, mine := range m.spares {
		for ck, sp := range mine {
			if match(sb, sp) {
				doomed = append(doomed, sp)
				delete(mine, ck)
			}
		}
		if len(mine) == 0 {
			delete(m.spares, sb)
		}
	}
	m.mu.Unlock()
	for _, sp := range doomed {
		m.drop(sp)
	}
}

// releasePreps releases the restores made ready for checkpoint ck (its
// templates are going): their clones, generation and mount. The spare
// layers stay, for a restore on the replay path.
func (m *Manager) releasePreps(ck string) {
	m.mu.Lock()
	var preps []*sandbox.PreparedRoot
	for _, mine := range m.spares {
		if sp, ok := mine[ck]; ok && sp.prep != nil {
			preps = append(preps, sp.prep)
			sp.prep = nil
			mine[ck] = sp
		}
	}
	m.mu.Unlock()
	for _, p := range preps {
		p.Release()
	}
}

// spareLayers lists the spare layers, for gc and Fsck.
func (m *Manager) spareLayers() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for _, mine := range m.spares {
		for _, sp := range mine {
			out = append(out, sp.layer)
		}
	}
	return out
}
