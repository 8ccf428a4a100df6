//go:build linux

package harness

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/daemon/daemontest"
	"github.com/deltabox/deltabox/internal/testutil/sandboxtest"
	deltabox "github.com/deltabox/deltabox/sdk"
)

// newDaemon starts the real state manager, served by the real daemon on a
// unix socket, and returns a client; at the end it checks that no sandbox
// or checkpoint is left and fscks the tree.
func newDaemon(t *testing.T) *deltabox.Client {
	t.Helper()
	ctx := context.Background()
	sock, _ := daemontest.Serve(t, sandboxtest.NewManager(t))
	c, err := deltabox.New(deltabox.WithSocket(sock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if l, err := c.List(ctx); err != nil || len(l) > 0 {
			t.Errorf("sandboxes left: %+v, %v", l, err)
		}
		if l, err := c.ListCheckpoints(ctx); err != nil || len(l) > 0 {
			t.Errorf("checkpoints left: %d, %v", len(l), err)
		}
		c.Close()
	})
	return c
}

// TestGatherSandboxIsolation: jobs on sandboxes see neither each other's
// files nor each other's processes, all at the same time.
func TestGatherSandboxIsolation(t *testing.T) {
	c := newDaemon(t)
	const n = 4
	var ready sync.WaitGroup
	ready.Add(n)
	type seen struct{ files, procs string }
	jobs := make([]Job[seen], n)
	for i := range jobs {
		jobs[i] = Job[seen]{Name: fmt.Sprint("iso-", i), Run: func(ctx context.Context, ex Executor) (seen, error) {
			if ex.Workspace() != SandboxWorkspace {
				return seen{}, fmt.Errorf("workspace %q", ex.Workspace())
			}
			if err := ex.WriteFile(ctx, fmt.Sprint("job-", i), []byte("x"), 0); err != nil {
				return seen{}, err
			}
			// A process of its own, alive while the others look.
			if r, err := ex.Shell(ctx, fmt.Sprintf("sleep %d &", 3000+i), SessionOptions{}); err != nil || r.ExitCode != 0 {
				return seen{}, fmt.Errorf("start sleeper: %+v, %v", r, err)
			}
			ready.Done()
			ready.Wait()
			var files, procs strings.Builder
			if _, err := ex.Exec(ctx, Cmd{Argv: []string{"ls", "/work"}, Stdout: &files}); err != nil {
				return seen{}, err
			}
			if _, err := ex.Exec(ctx, Cmd{Argv: []string{"sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"}, Stdout: &procs}); err != nil {
				return seen{}, err
			}
			return seen{files.String(), procs.String()}, nil
		}}
	}
	res, err := Gather(context.Background(), jobs, Options{Backend: NewDeltaBox(c, deltabox.CreateOptions{}), MaxParallel: n, PerJobTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		if r.Err != nil {
			t.Fatalf("job %d: %v", i, r.Err)
		}
		if got := strings.Fields(r.Value.files); !slices.Equal(got, []string{fmt.Sprint("job-", i)}) {
			t.Errorf("job %d sees files %q, want only its own", i, got)
		}
		for k := range n {
			mine := strings.Contains(r.Value.procs, fmt.Sprintf("sleep %d", 3000+k))
			if mine != (k == i) {
				t.Errorf("job %d sees job %d's process: %v (procs %q)", i, k, mine, r.Value.procs)
			}
		}
	}
}

// TestGatherSandboxTimeout: a job that overruns is stopped and its sandbox
// removed; the others finish.
func TestGatherSandboxTimeout(t *testing.T) {
	c := newDaemon(t)
	jobs := []Job[int]{
		{Name: "slow", Run: func(ctx context.Context, ex Executor) (int, error) {
			_, err := ex.Exec(ctx, Cmd{Argv: []string{"sleep", "60"}})
			return 0, err
		}},
		{Name: "fast", Run: func(ctx context.Context, ex Executor) (int, error) {
			r, err := ex.Exec(ctx, Cmd{Argv: []string{"true"}})
			return r.ExitCode, err
		}},
	}
	res, err := Gather(context.Background(), jobs, Options{Backend: NewDeltaBox(c, deltabox.CreateOptions{}), MaxParallel: 2, PerJobTimeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("slow job: %v", res[0].Err)
	if !errors.Is(res[0].Err, context.DeadlineExceeded) && !errors.Is(res[0].Err, errdefs.ErrDeadlineExceeded) {
		t.Errorf("slow job: %v, want a deadline error", res[0].Err)
	}
	if res[1].Err != nil {
		t.Errorf("fast job: %v", res[1].Err)
	}
}

// The toy task: three settings to fix; each action sets one; the evaluator
// counts the right ones.
const toyStart = "x=1\ny=1\nz=1\n"

var toyWant = map[string]string{"x": "2", "y": "3", "z": "4"}

func toyAction(k, v string) Action {
	return EditAction("set "+k+"="+v, k, "toy.txt", k+"=1\n", k+"="+v+"\n")
}

var toyActions = []Action{
	toyAction("x", "9"), toyAction("x", "2"), // wrong first: the search must back off
	toyAction("y", "0"), toyAction("y", "3"),
	toyAction("z", "4"),
}

// toyContent is the file after the actions on path.
func toyContent(path []string) string {
	s := toyStart
	for _, a := range path {
		kv := strings.TrimPrefix(a, "set ")
		s = strings.Replace(s, kv[:1]+"=1\n", kv+"\n", 1)
	}
	return s
}

var toyEval = EvaluatorFunc(func(ctx context.Context, t *Tools) (float64, error) {
	var out strings.Builder
	if _, err := t.Executor().Exec(ctx, Cmd{Argv: []string{"cat", "toy.txt"}, Stdout: &out}); err != nil {
		return 0, err
	}
	right := 0
	for k, v := range toyWant {
		if strings.Contains(out.String(), k+"="+v+"\n") {
			right++
		}
	}
	return float64(right) / float64(len(toyWant)), nil
})

func newToy(t *testing.T, c *deltabox.Client) Brancher {
	t.Helper()
	ctx := context.Background()
	ex, err := NewDeltaBox(c, deltabox.CreateOptions{}).NewExecutor(ctx, t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ex.Close(ctx) })
	if err := ex.WriteFile(ctx, "toy.txt", []byte(toyStart), 0); err != nil {
		t.Fatal(err)
	}
	return ex.(Brancher)
}

func TestMCTSFindsToyFix(t *testing.T) {
	c := newDaemon(t)
	ctx := context.Background()
	ex := newToy(t, c)
	restores := 0
	// The policy checks, in every state it is asked about, that the files
	// are those of the path: restores brought back the right state.
	policy := PolicyFunc(func(ctx context.Context, s State) ([]Action, error) {
		b, err := s.Tools.Executor().ReadFile(ctx, "toy.txt")
		if err != nil {
			return nil, err
		}
		if want := toyContent(s.Path); string(b) != want {
			return nil, fmt.Errorf("state at %q holds %q, want %q", s.Path, b, want)
		}
		return ScriptedPolicy(toyActions).Propose(ctx, s)
	})
	res, err := MCTS(ctx, ex, policy, toyEval, MCTSOptions{
		Iterations: 40, MaxDepth: 3,
		OnRestore: func(ctx context.Context, n *Node, t *Tools) error {
			restores++
			b, err := t.Executor().ReadFile(ctx, "toy.txt")
			if err != nil {
				return err
			}
			if want := toyContent(n.Path()); string(b) != want {
				return fmt.Errorf("after restore to %s (%q): %q, want %q", n.Checkpoint, n.Path(), b, want)
			}
			// The checkpoint's own record agrees.
			ck, err := c.GetCheckpoint(ctx, n.Checkpoint)
			if err != nil || !slices.Contains(ck.Heads, SandboxID(t.Executor())) {
				return fmt.Errorf("checkpoint %s after restore: %+v, %v", n.Checkpoint, ck, err)
			}
			return nil
		},
	})
	if res.Root != nil {
		defer c.DeleteCheckpoint(ctx, res.Root.Checkpoint, true)
	}
	if err != nil {
		t.Fatal(err)
	}
	if res.Best.Score != 1 {
		t.Fatalf("best score %v at %q, want 1", res.Best.Score, res.Path)
	}
	slices.Sort(res.Path)
	if !slices.Equal(res.Path, []string{"set x=2", "set y=3", "set z=4"}) {
		t.Errorf("winning path %q", res.Path)
	}
	if b, _ := ex.ReadFile(ctx, "toy.txt"); string(b) != "x=2\ny=3\nz=4\n" {
		t.Errorf("the sandbox holds %q after the search, want the fix", b)
	}
	if restores == 0 || len(res.Stats.Restore.Wall) != restores || len(res.Stats.Checkpoint.Wall) < 4 {
		t.Errorf("stats: %d restores seen, %+v", restores, res.Stats)
	}
	// The tree of checkpoints mirrors the search tree.
	tree, err := c.Tree(ctx, res.Root.Checkpoint)
	if err != nil {
		t.Fatal(err)
	}
	nodes := 0
	res.Root.Walk(func(n *Node) {
		nodes++
		i := slices.IndexFunc(tree.Checkpoints, func(ck deltabox.Checkpoint) bool { return ck.ID == n.Checkpoint })
		if i < 0 {
			t.Errorf("node %q: checkpoint %s not in the tree", n.Path(), n.Checkpoint)
		} else if n.Parent != nil && tree.Checkpoints[i].Parent != n.Parent.Checkpoint {
			t.Errorf("node %q: checkpoint parent %s, want %s", n.Path(), tree.Checkpoints[i].Parent, n.Parent.Checkpoint)
		}
	})
	if nodes != len(tree.Checkpoints) {
		t.Errorf("%d nodes, %d checkpoints", nodes, len(tree.Checkpoints))
	}
}

func TestBestOfNFindsToyFix(t *testing.T) {
	c := newDaemon(t)
	ctx := context.Background()
	ex := newToy(t, c)
	// Branch i tries patch i; patch 2 is the whole fix.
	patches := [][]Action{
		{toyAction("x", "9")},
		{toyAction("x", "2")},
		{toyAction("x", "2"), toyAction("y", "3"), toyAction("z", "4")},
		{toyAction("y", "0"), toyAction("z", "4")},
	}
	policy := PolicyFunc(func(ctx context.Context, s State) ([]Action, error) {
		b, err := s.Tools.Executor().ReadFile(ctx, "toy.txt")
		if err != nil {
			return nil, err
		}
		if want := toyContent(s.Path); string(b) != want {
			return nil, fmt.Errorf("branch %d at %q holds %q, want %q", s.Branch, s.Path, b, want)
		}
		if len(s.Path) == len(patches[s.Branch]) {
			return nil, nil
		}
		return patches[s.Branch][len(s.Path):], nil
	})
	res, err := BestOfN(ctx, ex, policy, toyEval, BestOfNOptions{N: 4, MaxSteps: 3})
	if res.Root.ID != "" {
		defer c.DeleteCheckpoint(ctx, res.Root.ID, true)
	}
	if res.Winner != nil {
		defer res.Winner.Close(ctx)
	}
	if err != nil {
		t.Fatal(err)
	}
	if res.Best != 2 || res.Branches[2].Score != 1 {
		t.Fatalf("best branch %d, branches %+v", res.Best, res.Branches)
	}
	if got := []float64{res.Branches[0].Score, res.Branches[1].Score, res.Branches[3].Score}; !slices.Equal(got, []float64{0, 1.0 / 3, 1.0 / 3}) {
		t.Errorf("other scores %v", got)
	}
	if b, _ := res.Winner.ReadFile(ctx, "toy.txt"); string(b) != "x=2\ny=3\nz=4\n" {
		t.Errorf("winner holds %q", b)
	}
	if b, _ := ex.ReadFile(ctx, "toy.txt"); string(b) != toyStart {
		t.Errorf("the source sandbox changed: %q", b)
	}
	if len(res.Stats.Fork.Wall) != 1 || len(res.Stats.Checkpoint.Wall) != 1 || res.Stats.StateShare() <= 0 {
		t.Errorf("stats %+v", res.Stats)
	}
	list, _ := c.List(ctx)
	if len(list) != 2 {
		t.Errorf("%d sandboxes after BestOfN, want the source and the winner", len(list))
	}
}
