//go:build linux

package statemgr

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/sandbox"
)

// heldTemplates are one checkpoint's process templates, as the manager keeps
// them in memory: they die with the daemon (their checkpoint then falls back
// to its session data).
type heldTemplates struct {
	ts       *sandbox.Templates
	retired  string // the sandbox's writable layer at the checkpoint: the templates' root, removed with the last of them once no sandbox has it
	lastUsed time.Time
	bytes    int64 // private memory, as enforceBudget last measured it
}

// templatesOf returns a checkpoint's live templates, or nil and why they
// are unusable.
func (m *Manager) templatesOf(ck *ckRecord) (*sandbox.Templates, string) {
	if !ck.Templates {
		return nil, ""
	}
	m.mu.Lock()
	h := m.tpl[ck.ID]
	why := m.tplGone[ck.ID]
	m.mu.Unlock()
	if h == nil {
		if why == "" {
			why = "its process templates are gone (the daemon restarted)"
		}
		return nil, why
	}
	if !h.ts.Alive() {
		m.dropTemplates(ck.ID, "a process template was killed or resumed")
		return nil, "a process template was killed or resumed"
	}
	m.mu.Lock()
	h.lastUsed = time.Now()
	m.mu.Unlock()
	return h.ts, ""
}

// keepTemplates registers a checkpoint's templates and has the least
// recently used ones evicted past the memory budget, in the background:
// measuring them walks every template's page tables (milliseconds, growing
// with the checkpoints kept), which the checkpoint's answer does not wait
// for. (New templates hold almost nothing alone: their pages are shared
// with the clones that went on.)
func (m *Manager) keepTemplates(ckID string, ts *sandbox.Templates, retired string) {
	h := &heldTemplates{ts: ts, retired: retired, lastUsed: time.Now()}
	m.mu.Lock()
	m.tpl[ckID] = h
	m.mu.Unlock()
	m.enforceBudgetLater()
}

// enforceBudgetLater runs enforceBudget in the background, once at a time
// (a call meanwhile has it run once more).
func (m *Manager) enforceBudgetLater() {
	m.mu.Lock()
	if m.budgeting {
		m.budgetAgain = true
		m.mu.Unlock()
		return
	}
	m.budgeting = true
	m.mu.Unlock()
	m.bg.Add(1)
	go func() {
		defer m.bg.Done()
		for {
			m.enforceBudget()
			m.mu.Lock()
			again := m.budgetAgain
			m.budgeting, m.budgetAgain = again, false
			m.mu.Unlock()
			if !again {
				return
			}
		}
	}()
}

// enforceBudget evicts templates, least recently used first, until their
// private memory fits the budget.
func (m *Manager) enforceBudget() {
	m.mu.Lock()
	type entry struct {
		id string
		h  *heldTemplates
	}
	var all []entry
	for id, h := range m.tpl {
		all = append(all, entry{id, h})
	}
	m.mu.Unlock()
	// Private memory grows as the clones write (their pages stop being
	// shared with the templates): measure it again.
	var total int64
	for _, e := range all {
		b := e.h.ts.PrivateMemory()
		m.mu.Lock()
		e.h.bytes = b
		m.mu.Unlock()
		total += b
	}
	if total <= m.tplBudget {
		return
	}
	sort.Slice(all, func(i, j int) bool { return all[i].h.lastUsed.Before(all[j].h.lastUsed) })
	for _, e := range all {
		if total <= m.tplBudget {
			break
		}
		m.log.Info("evicting process templates past the memory budget", "checkpoint", e.id, "bytes", e.h.bytes, "budget", m.tplBudget)
		m.dropTemplates(e.id, "its process templates were evicted (memory budget)")
		total -= e.h.bytes
	}
}

// dropTemplates kills a checkpoint's templates and records why, for its
// process states. Its checkpoint keeps its filesystem and session data.
func (m *Manager) dropTemplates(ckID, why string) {
	m.mu.Lock()
	h := m.tpl[ckID]
	delete(m.tpl, ckID)
	if why != "" {
		m.tplGone[ckID] = why
	}
	m.mu.Unlock()
	if h == nil {
		return
	}
	m.releasePreps(ckID) // their clones and generation hold the templates' memory and generation
	h.ts.Release()
	if h.retired != "" && !m.layerPinned(h.retired) {
		if err := m.layers.Remove(context.Background(), h.retired); err != nil {
			m.log.Warn("templates: root layer kept for GC", "layer", h.retired, "err", err)
		}
	}
}

// adoptTemplates takes back the templates a previous daemon left running
// (see sandbox.AdoptTemplates); those that did not survive are cleaned up
// and their checkpoints say why. It runs before the recovery's gc, which
// keeps the adopted templates' root layers.
func (m *Manager) adoptTemplates(ctx context.Context) {
	cks, err := m.checkpoints()
	if err != nil {
		m.log.Warn("re-adopt templates", "err", err)
		return
	}
	for _, ck := range cks {
		if !ck.Templates {
			continue
		}
		var ts *sandbox.Templates
		err := fmt.Errorf("no record of them")
		if ck.Tpl != nil {
			ts, err = m.rt.AdoptTemplates(ctx, *ck.Tpl)
		}
		if err != nil {
			m.log.Warn("checkpoint's process templates did not survive the daemon restart", "checkpoint", ck.ID, "err", err)
			m.mu.Lock()
			m.tplGone[ck.ID] = "its process templates did not survive the daemon restart: " + err.Error()
			m.mu.Unlock()
			if ck.Tpl != nil {
				m.rt.DropTemplates(ctx, *ck.Tpl)
			}
			continue
		}
		m.log.Info("re-adopted a checkpoint's process templates", "checkpoint", ck.ID)
		h := &heldTemplates{ts: ts, retired: ck.Retired, lastUsed: time.Now(), bytes: ts.PrivateMemory()}
		m.mu.Lock()
		m.tpl[ck.ID] = h
		m.mu.Unlock()
	}
	for _, g := range m.rt.KillOrphanGenerations() {
		m.log.Warn("killed an orphan template generation of a previous daemon", "generation", g)
	}
	keep := map[string]bool{}
	for _, ck := range cks {
		if ck.Tpl != nil {
			m.mu.Lock()
			_, held := m.tpl[ck.ID]
			m.mu.Unlock()
			if held {
				keep[ck.Tpl.Cgroup] = true
			}
		}
	}
	for _, cg := range m.rt.RemoveOrphanTemplateCgroups(ctx, keep) {
		m.log.Warn("removed an orphan templates' cgroup of a previous daemon", "cgroup", cg)
	}
}

// layerPinned reports whether layer l is still a sandbox's writable layer or
// the root of live templates: removing it must wait for the last of them.
func (m *Manager) layerPinned(l string) bool {
	if slices.Contains(m.retiredLayers(), l) {
		return true
	}
	recs, err := m.records()
	if err != nil {
		return true // unknown: keep it, gc decides later
	}
	for _, r := range recs {
		if r.Layer == l {
			return true
		}
	}
	return false
}

// retiredLayers are the layers held by live templates (gc keeps them).
func (m *Manager) retiredLayers() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for _, h := range m.tpl {
		if h.retired != "" {
			out = append(out, h.retired)
		}
	}
	return out
}

// Templates reports how many checkpoints hold live templates and their
// private memory.
func (m *Manager) Templates() (count int, bytes, budget int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, h := range m.tpl {
		count++
		bytes += h.bytes
	}
	return count, bytes, m.tplBudget
}

// ckProcesses is a checkpoint's process states as of now: a template path
// whose templates are gone reads as the fallback (session data replayed for
// the shell, a fresh session otherwise) with the reason.
func (m *Manager) ckProcesses(ck *ckRecord) []daemon.ProcessState {
	out := append([]daemon.ProcessState(nil), ck.Processes...)
	if !ck.Templates {
		return out
	}
	if _, why := m.templatesOf(ck); why != "" {
		for i := range out {
			if out[i].Path != daemon.PathTemplate {
				continue
			}
			if out[i].Name == "shell session" && ck.HasShell {
				out[i].Path = daemon.PathReplay
			} else {
				out[i].Path = daemon.PathNone
			}
			out[i].Reason = why
		}
	}
	return out
}

func templateProcesses(ts *sandbox.Templates) []daemon.ProcessState {
	var out []daemon.ProcessState
	for _, k := range ts.Kinds() {
		out = append(out, daemon.ProcessState{Name: k.String() + " session", Path: daemon.PathTemplate})
	}
	return out
}

// layerCopier copies a live sandbox's writable layer ahead of its next
// checkpoint (sandbox.LayerCopier), for stores that are layer.Preparers.
type layerCopier struct {
	m  *Manager
	id string
}

// CopyLayer copies the sandbox's active layer, if live is its view (a
// restore may have replaced it meanwhile).
func (c layerCopier) CopyLayer(ctx context.Context, live layer.View) (layer.Prepared, error) {
	r, err := c.m.get(c.id)
	if err != nil {
		return layer.Prepared{}, err
	}
	v, err := c.m.layers.Mounts(ctx, r.Layer)
	if err != nil {
		return layer.Prepared{}, err
	}
	if v.Upper != live.Upper {
		return layer.Prepared{}, fmt.Errorf("copy the layer of sandbox %q: it runs on another layer than %q: %w", c.id, r.Layer, errdefs.ErrFailedPrecondition)
	}
	return c.m.layers.(layer.Preparer).PrepareCommit(ctx, r.Layer)
}

func (c layerCopier) DiscardCopy(ctx context.Context, p layer.Prepared) error {
	return c.m.layers.(layer.Preparer).DiscardPrepared(ctx, p)
}
