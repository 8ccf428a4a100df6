//go:build linux

package statemgr

import (
	"context"

	"github.com/deltabox/deltabox/internal/layer"
)

// Spare branches: after a sandbox takes or restores a checkpoint, a writable
// branch of that checkpoint (its head) is made in the background, so that
// the next restore to it (the common rollback of a failed step) takes the
// branch instead of making one on its critical path. One spare per sandbox,
// for its head; a newer one replaces it. Spares are referenced in memory
// only: gc and Fsck count them, and a restart's gc removes any left behind.
type spare struct {
	checkpoint string
	layer      string
}

// makeSpare prepares a spare branch of checkpoint ck (committed layer
// ckLayer) for sandbox id, in the background.
func (m *Manager) makeSpare(id, ck, ckLayer string) {
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
		old, had := m.spares[id]
		_, live := m.live[id]
		if live {
			m.spares[id] = spare{checkpoint: ck, layer: in.ID}
		}
		m.mu.Unlock()
		if had {
			_ = m.layers.Remove(context.Background(), old.layer)
		}
		if !live {
			_ = m.layers.Remove(context.Background(), in.ID)
		}
	}()
}

// takeSpare returns the spare branch of checkpoint ck for sandbox id, if
// there is one; it is the caller's from then on.
func (m *Manager) takeSpare(id, ck string) (string, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	sp, ok := m.spares[id]
	if !ok || sp.checkpoint != ck {
		return "", false
	}
	delete(m.spares, id)
	return sp.layer, true
}

// dropSpares removes the spares of the sandboxes ids (all when ids is nil)
// or of the checkpoints in cks.
func (m *Manager) dropSpares(ctx context.Context, match func(sandbox string, sp spare) bool) {
	m.mu.Lock()
	var doomed []string
	for sb, sp := range m.spares {
		if match(sb, sp) {
			doomed = append(doomed, sp.layer)
			delete(m.spares, sb)
		}
	}
	m.mu.Unlock()
	for _, l := range doomed {
		_ = m.layers.Remove(ctx, l)
	}
}

// spareLayers lists the spare layers, for gc and Fsck.
func (m *Manager) spareLayers() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]string, 0, len(m.spares))
	for _, sp := range m.spares {
		out = append(out, sp.layer)
	}
	return out
}
