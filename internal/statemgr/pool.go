//go:build linux

package statemgr

import (
	"context"
	"time"

	"github.com/deltabox/deltabox/internal/sandbox"
)

// The warm pool keeps a few prepared sandboxes (sandbox.Runtime.Prepare:
// cgroup, namespaces and a booted init waiting for its root), each with a
// fresh id and id range reserved, so that a create pays only for its layer
// and mounts. A create takes one and a background loop makes another. The
// pool holds only new trees: a fork must share its tree's id range.
type warm struct {
	id   string
	slot int
	sb   *sandbox.Sandbox
}

// takeWarm returns a prepared sandbox, or ok=false when the pool is empty.
func (m *Manager) takeWarm() (w warm, ok bool) {
	if m.pool == nil {
		return warm{}, false
	}
	select {
	case w = <-m.pool:
	default:
		return warm{}, false
	}
	if !w.sb.Alive() {
		m.dropWarm(w)
		return warm{}, false
	}
	return w, true
}

// kickRefill asks the pool to make up for what was taken. Callers do it when
// their create is done: booting a replacement init is tens of milliseconds
// of CPU that would otherwise compete with the create it serves.
func (m *Manager) kickRefill() {
	if m.pool == nil {
		return
	}
	select {
	case m.refill <- struct{}{}:
	default:
	}
}

// fillPool keeps the pool full until the manager closes.
func (m *Manager) fillPool(ctx context.Context, size int) {
	defer m.poolDone.Done()
	for {
		for len(m.pool) < size {
			w, err := m.prepareWarm(ctx)
			if err != nil {
				if ctx.Err() == nil {
					m.log.Warn("warm pool: prepare", "err", err)
				}
				break
			}
			select {
			case m.pool <- w:
			case <-ctx.Done():
				m.dropWarm(w)
				return
			}
		}
		select {
		case <-m.refill:
		case <-time.After(time.Second):
		case <-ctx.Done():
			return
		}
	}
}

func (m *Manager) prepareWarm(ctx context.Context) (warm, error) {
	id, slot, err := m.reserve()
	if err != nil {
		return warm{}, err
	}
	r := record{ID: id, IDSlot: slot}
	sb, err := m.rt.Prepare(ctx, id, r.ids(), defaultLimits())
	if err != nil {
		m.unreserve(slot)
		return warm{}, err
	}
	return warm{id: id, slot: slot, sb: sb}, nil
}

func (m *Manager) dropWarm(w warm) {
	_ = w.sb.Destroy(context.Background())
	m.unreserve(w.slot)
	m.mu.Lock()
	delete(m.inflight, w.id)
	m.mu.Unlock()
}

// drainPool stops the refill loop and destroys what the pool holds.
func (m *Manager) drainPool() {
	if m.pool == nil {
		return
	}
	m.poolCancel()
	m.poolDone.Wait()
	for {
		select {
		case w := <-m.pool:
			m.dropWarm(w)
		default:
			return
		}
	}
}

func defaultLimits() sandbox.Limits {
	return sandbox.Limits{MemoryBytes: DefaultMemory, Pids: DefaultPids}
}
