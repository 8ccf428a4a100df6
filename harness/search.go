package harness

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/deltabox/deltabox/errdefs"
)

// Action is one step an agent can take in a state: an edit, a command.
type Action struct {
	Name string
	// Group names alternatives: once an action of a group is on the path,
	// ScriptedPolicy proposes no other of that group. "" is a group of one.
	Group string
	Apply func(ctx context.Context, t *Tools) error
}

// State is what a Policy sees: the job's tools (positioned at the state)
// and the actions that led there from the search's root.
type State struct {
	Tools  *Tools
	Path   []string
	Branch int // BestOfN's branch index, 0 in MCTS
}

// Policy proposes the actions worth trying in a state, best first. It may
// read the state but must not change it.
type Policy interface {
	Propose(ctx context.Context, s State) ([]Action, error)
}

// Evaluator scores a state: 0 (worthless) to 1 (solved).
type Evaluator interface {
	Evaluate(ctx context.Context, t *Tools) (float64, error)
}

// PolicyFunc is a function as a Policy.
type PolicyFunc func(ctx context.Context, s State) ([]Action, error)

func (f PolicyFunc) Propose(ctx context.Context, s State) ([]Action, error) { return f(ctx, s) }

// EvaluatorFunc is a function as an Evaluator.
type EvaluatorFunc func(ctx context.Context, t *Tools) (float64, error)

func (f EvaluatorFunc) Evaluate(ctx context.Context, t *Tools) (float64, error) { return f(ctx, t) }

// ScriptedPolicy proposes a fixed list of actions, in order, leaving out
// those on the path already and the alternatives of a group that is. It is
// for tests and demos.
type ScriptedPolicy []Action

func (p ScriptedPolicy) Propose(_ context.Context, s State) ([]Action, error) {
	var out []Action
	for _, a := range p {
		if slices.Contains(s.Path, a.Name) {
			continue
		}
		if a.Group != "" && slices.ContainsFunc(p, func(b Action) bool { return b.Group == a.Group && slices.Contains(s.Path, b.Name) }) {
			continue
		}
		out = append(out, a)
	}
	return out, nil
}

// EditAction is an Action that applies Tools.Edit.
func EditAction(name, group, path, old, new string) Action {
	return Action{Name: name, Group: group, Apply: func(ctx context.Context, t *Tools) error {
		return t.Edit(ctx, path, old, new)
	}}
}

// OpStats are the durations of one kind of state-management call.
type OpStats struct {
	// Reported are the daemon's own figures: the checkpoint's pause, the
	// restore's and the fork's duration.
	Reported []time.Duration
	// Wall are the calls as the harness saw them (RPC included).
	Wall []time.Duration
}

func (o *OpStats) add(reported, wall time.Duration) {
	o.Reported = append(o.Reported, reported)
	o.Wall = append(o.Wall, wall)
}

// SearchStats is what a search spent on state management.
type SearchStats struct {
	Checkpoint, Restore, Fork OpStats
	Total                     time.Duration // the search's wall time
}

// StateTime is the wall time of every checkpoint, restore and fork.
func (s SearchStats) StateTime() time.Duration {
	var d time.Duration
	for _, o := range []OpStats{s.Checkpoint, s.Restore, s.Fork} {
		for _, w := range o.Wall {
			d += w
		}
	}
	return d
}

// StateShare is StateTime over Total (0 when Total is).
func (s SearchStats) StateShare() float64 {
	if s.Total <= 0 {
		return 0
	}
	return float64(s.StateTime()) / float64(s.Total)
}

// Merge adds o's samples to s.
func (s *SearchStats) Merge(o SearchStats) {
	for _, p := range []struct{ dst, src *OpStats }{{&s.Checkpoint, &o.Checkpoint}, {&s.Restore, &o.Restore}, {&s.Fork, &o.Fork}} {
		p.dst.Reported = append(p.dst.Reported, p.src.Reported...)
		p.dst.Wall = append(p.dst.Wall, p.src.Wall...)
	}
	s.Total += o.Total
}

// Percentile is the p-th percentile (0-100, nearest rank) of ds; 0 for
// none.
func Percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(math.Ceil(p/100*float64(len(s)))) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// recorder times a search's state-management calls.
type recorder struct {
	mu    sync.Mutex // guards stats
	stats SearchStats
}

func (r *recorder) checkpoint(ctx context.Context, ex Brancher, name string) (Snapshot, error) {
	start := time.Now()
	s, err := ex.Checkpoint(ctx, name)
	if err == nil {
		r.mu.Lock()
		r.stats.Checkpoint.add(s.Pause, time.Since(start))
		r.mu.Unlock()
	}
	return s, err
}

func (r *recorder) restore(ctx context.Context, ex Brancher, id string) error {
	start := time.Now()
	d, err := ex.Restore(ctx, id)
	if err == nil {
		r.mu.Lock()
		r.stats.Restore.add(d, time.Since(start))
		r.mu.Unlock()
	}
	return err
}

func (r *recorder) fork(ctx context.Context, ex Brancher, id string, n int) ([]Brancher, error) {
	start := time.Now()
	bs, d, err := ex.Fork(ctx, id, n)
	if err == nil {
		r.mu.Lock()
		r.stats.Fork.add(d, time.Since(start))
		r.mu.Unlock()
	}
	return bs, err
}

// BestOfNOptions tune BestOfN.
type BestOfNOptions struct {
	N        int // branches; 0 means 4
	MaxSteps int // policy steps per branch; 0 means 1
	Limits   Limits
}

// Branch is one branch of a BestOfN.
type Branch struct {
	Index   int
	Sandbox string   // the branch's sandbox id, when it has one
	Path    []string // the actions it took
	Score   float64
	Err     error
}

// BestOfNResult is what BestOfN found.
type BestOfNResult struct {
	Root     Snapshot // the checkpoint the branches were forked from
	Branches []Branch
	Best     int      // index of the best branch; -1 when every branch failed
	Winner   Brancher // the best branch, still running: the caller closes it
	Stats    SearchStats
}

// BestOfN checkpoints ex once, forks opts.N branches from it, runs the
// policy in each (in parallel, up to opts.MaxSteps steps, taking the first
// proposed action each time, stopping at a score of 1), scores each with the
// evaluator, and keeps the best branch (Winner); the others are closed. ex
// itself is left as it was. The root checkpoint stays for the caller to
// delete (with its tree).
func BestOfN(ctx context.Context, ex Brancher, p Policy, e Evaluator, opts BestOfNOptions) (res BestOfNResult, err error) {
	if opts.N <= 0 {
		opts.N = 4
	}
	if opts.MaxSteps <= 0 {
		opts.MaxSteps = 1
	}
	start := time.Now()
	var rec recorder
	defer func() { rec.stats.Total = time.Since(start); res.Stats = rec.stats }()
	res.Best = -1
	res.Root, err = rec.checkpoint(ctx, ex, "best-of-n root")
	if err != nil {
		return res, err
	}
	branches, err := rec.fork(ctx, ex, res.Root.ID, opts.N)
	if err != nil {
		return res, err
	}
	res.Branches = make([]Branch, len(branches))
	g, gctx := errgroup.WithContext(ctx)
	for i, b := range branches {
		res.Branches[i] = Branch{Index: i, Sandbox: SandboxID(b)}
		g.Go(func() error {
			br := &res.Branches[i]
			t := NewTools(b, opts.Limits)
			for step := 0; step < opts.MaxSteps; step++ {
				acts, err := p.Propose(gctx, State{Tools: t, Path: br.Path, Branch: i})
				if err != nil {
					br.Err = fmt.Errorf("branch %d: propose: %w", i, err)
					return nil
				}
				if len(acts) == 0 {
					break
				}
				a := acts[0]
				br.Path = append(br.Path, a.Name)
				if err := a.Apply(gctx, t); err != nil {
					br.Err = fmt.Errorf("branch %d: %s: %w", i, a.Name, err)
					return nil
				}
				if br.Score, err = e.Evaluate(gctx, t); err != nil {
					br.Err = fmt.Errorf("branch %d: evaluate: %w", i, err)
					return nil
				}
				if br.Score >= 1 {
					break
				}
			}
			return nil
		})
	}
	g.Wait()
	for i, b := range res.Branches {
		if b.Err == nil && (res.Best < 0 || b.Score > res.Branches[res.Best].Score) {
			res.Best = i
		}
	}
	var errs []error
	for i, b := range branches {
		if i == res.Best {
			res.Winner = b
			continue
		}
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		errs = append(errs, b.Close(cctx))
		cancel()
	}
	if err := ctx.Err(); err != nil {
		return res, err
	}
	if res.Best < 0 {
		errs = append(errs, fmt.Errorf("best-of-%d: every branch failed: %w", opts.N, errdefs.ErrFailedPrecondition))
		for _, b := range res.Branches {
			errs = append(errs, b.Err)
		}
	}
	return res, errors.Join(errs...)
}

// Node is a node of an MCTS tree: a state, reached from its parent by
// Action and kept as Checkpoint.
type Node struct {
	Action     string // "" for the root
	Checkpoint string
	Depth      int
	Score      float64 // the evaluator's score of this state
	Err        error   // why Action failed (Score is then 0)
	Visits     int
	Value      float64 // sum of the scores backed up through it
	Parent     *Node
	Children   []*Node

	proposed bool
	untried  []Action
	terminal bool
}

// Path is the actions from the root to n.
func (n *Node) Path() []string {
	var p []string
	for ; n != nil && n.Parent != nil; n = n.Parent {
		p = append(p, n.Action)
	}
	slices.Reverse(p)
	return p
}

// Walk calls f on n and its descendants, depth first.
func (n *Node) Walk(f func(*Node)) {
	f(n)
	for _, c := range n.Children {
		c.Walk(f)
	}
}

// MCTSOptions tune MCTS.
type MCTSOptions struct {
	Iterations int     // expansions; 0 means 32
	MaxDepth   int     // actions from the root; 0 means 4
	C          float64 // UCT exploration constant; 0 means √2
	Limits     Limits
	// OnRestore, if set, is called after each restore with the node the
	// executor now holds (tests check the state).
	OnRestore func(ctx context.Context, n *Node, t *Tools) error
}

// MCTSResult is what MCTS found.
type MCTSResult struct {
	Root  *Node
	Best  *Node // highest score, then shallowest, then first found
	Path  []string
	Stats SearchStats
}

// MCTS runs a Monte Carlo tree search with UCT over ex's states. Each
// iteration selects a node by UCT, restores ex to its checkpoint (when ex is
// elsewhere), expands one untried action of the policy, scores the new state
// with the evaluator (the score is the rollout value), checkpoints it and
// backs the score up. It stops after opts.Iterations, when the tree is
// exhausted, or at a state scoring 1, and leaves ex restored to the best
// state. The checkpoints stay for the caller (delete the root's tree).
func MCTS(ctx context.Context, ex Brancher, p Policy, e Evaluator, opts MCTSOptions) (res MCTSResult, err error) {
	if opts.Iterations <= 0 {
		opts.Iterations = 32
	}
	if opts.MaxDepth <= 0 {
		opts.MaxDepth = 4
	}
	if opts.C <= 0 {
		opts.C = math.Sqrt2
	}
	start := time.Now()
	var rec recorder
	defer func() { rec.stats.Total = time.Since(start); res.Stats = rec.stats }()
	t := NewTools(ex, opts.Limits)

	root := &Node{}
	if root.Score, err = e.Evaluate(ctx, t); err != nil {
		return res, fmt.Errorf("mcts: evaluate the root: %w", err)
	}
	ck, err := rec.checkpoint(ctx, ex, fmt.Sprintf("mcts root [%.2f]", root.Score))
	if err != nil {
		return res, fmt.Errorf("mcts: %w", err)
	}
	root.Checkpoint, root.Visits, root.Value = ck.ID, 1, root.Score
	res.Root, res.Best = root, root
	at := root // the node ex holds
	moveTo := func(n *Node) error {
		if at == n {
			return nil
		}
		if err := rec.restore(ctx, ex, n.Checkpoint); err != nil {
			return fmt.Errorf("mcts: %w", err)
		}
		at = n
		if opts.OnRestore != nil {
			return opts.OnRestore(ctx, n, t)
		}
		return nil
	}
	backup := func(n *Node, v float64) {
		for ; n != nil; n = n.Parent {
			n.Visits++
			n.Value += v
		}
	}

	for it := 0; it < opts.Iterations && res.Best.Score < 1; it++ {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		n := root
		for n.proposed && len(n.untried) == 0 && !n.terminal {
			c := bestUCT(n, opts.C)
			if c == nil {
				n.terminal = true // everything below is explored
				break
			}
			n = c
		}
		if n.terminal {
			if n == root {
				break // the tree is exhausted
			}
			continue // marking n made progress
		}
		if err := moveTo(n); err != nil {
			return res, err
		}
		if !n.proposed {
			acts, err := p.Propose(ctx, State{Tools: t, Path: n.Path()})
			if err != nil {
				return res, fmt.Errorf("mcts: propose at %q: %w", n.Checkpoint, err)
			}
			n.proposed, n.untried = true, acts
			if len(acts) == 0 {
				n.terminal = true
				continue
			}
		}
		a := n.untried[0]
		n.untried = n.untried[1:]
		child := &Node{Action: a.Name, Depth: n.Depth + 1, Parent: n}
		if err := a.Apply(ctx, t); err != nil {
			if ctx.Err() != nil {
				return res, ctx.Err()
			}
			child.Err = err
		} else if child.Score, err = e.Evaluate(ctx, t); err != nil {
			return res, fmt.Errorf("mcts: evaluate %q: %w", child.Path(), err)
		}
		name := fmt.Sprintf("%s [%.2f]", a.Name, child.Score)
		if child.Err != nil {
			name = a.Name + " [failed]"
		}
		ck, err := rec.checkpoint(ctx, ex, name)
		if err != nil {
			return res, fmt.Errorf("mcts: %w", err)
		}
		child.Checkpoint = ck.ID
		child.terminal = child.Err != nil || child.Score >= 1 || child.Depth >= opts.MaxDepth
		n.Children = append(n.Children, child)
		at = child
		backup(child, child.Score)
		if child.Score > res.Best.Score {
			res.Best = child
		}
	}
	res.Path = res.Best.Path()
	if err := moveTo(res.Best); err != nil {
		return res, err
	}
	return res, nil
}

// bestUCT is n's child with the highest UCT value, leaving out the
// explored ones (terminal: failed, solved, or at the depth limit).
func bestUCT(n *Node, c float64) *Node {
	var best *Node
	bestV := math.Inf(-1)
	for _, ch := range n.Children {
		if ch.terminal {
			continue
		}
		v := ch.Value/float64(ch.Visits) + c*math.Sqrt(math.Log(float64(n.Visits))/float64(ch.Visits))
		if v > bestV {
			best, bestV = ch, v
		}
	}
	return best
}
