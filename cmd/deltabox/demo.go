//go:build linux

package main

import (
	"bytes"
	"context"
	"embed"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/deltabox/deltabox/harness"
	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/statemgr"
	deltabox "github.com/deltabox/deltabox/sdk"
)

// demoTask is the project the demo fixes: a tiny Python package with three
// bugs and its unittest suite.
//
//go:embed all:demo/task
var demoTask embed.FS

// demoRootDir holds the state of the demo's private daemon, one directory
// per run.
const demoRootDir = "/var/lib/deltabox-demo"

func (a *app) demoCmd() *cobra.Command {
	var private bool
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Search for a bug fix over live checkpoints, and show the tree and the latencies",
		Long: `Create a sandbox holding a small Python project with three bugs and a failing
unittest suite, then search for a fix: Best-of-4 (checkpoint once, fork four
sandboxes, try one candidate patch in each, keep the best) and then MCTS (UCT)
from the best branch, with a checkpoint at every expanded node and restores to
walk the tree. Print the checkpoint tree, the winning path and what the
checkpoints, restores and forks cost; then remove everything it made.

It uses the daemon at --socket when one answers there; otherwise (or with
--private) it starts a private one in-process, on the default storage under
` + demoRootDir + `, and stops it afterwards.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg := demoConfig{Root: demoRootDir}
			if !private {
				cfg.Socket = a.socket
			}
			return runDemo(cmd.Context(), a.stdout, cfg)
		},
	}
	cmd.Flags().BoolVar(&private, "private", false, "always start a private daemon")
	return cmd
}

// demoConfig says where the demo's daemon comes from.
type demoConfig struct {
	// Socket is a daemon to use if one answers there; "" always starts a
	// private one.
	Socket string
	// Root is the directory below which the private daemon keeps its state
	// (in a fresh subdirectory, removed afterwards).
	Root string
	// CgroupParent is the private daemon's cgroup parent ("" for the
	// default); tests give theirs.
	CgroupParent string
}

// runDemo runs the whole demo and writes its report to w.
func runDemo(ctx context.Context, w io.Writer, cfg demoConfig) (err error) {
	start := time.Now()
	fmt.Fprintln(w, "DeltaBox demo: a tree search for a bug fix over live checkpoints")
	c, where, stop, err := demoDaemon(ctx, cfg)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, stop()) }()
	defer c.Close()
	info, err := c.Info(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "daemon: %s (storage %s, kernel %s)\n", where, info.Storage, info.Kernel)

	// Everything made is removed at the end, whatever happens.
	var made []harness.Executor
	var rootCk string
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		var errs []error
		for _, ex := range made {
			errs = append(errs, ex.Close(cctx))
		}
		if rootCk != "" {
			errs = append(errs, c.DeleteCheckpoint(cctx, rootCk, true))
		}
		if e := errors.Join(errs...); e != nil {
			err = errors.Join(err, fmt.Errorf("demo: clean up: %w", e))
			return
		}
		fmt.Fprintf(w, "\ncleaned up: every sandbox and checkpoint of the demo removed (%.1f s in all)\n", time.Since(start).Seconds())
	}()

	ex0, err := harness.NewDeltaBox(c, deltabox.CreateOptions{Labels: map[string]string{"deltabox.demo": "1"}}).NewExecutor(ctx, "demo")
	if err != nil {
		return err
	}
	made = append(made, ex0)
	src := ex0.(harness.Brancher)
	original, err := uploadTask(ctx, src)
	if err != nil {
		return err
	}
	eval := harness.UnittestEvaluator{Session: true}
	t0 := harness.NewTools(src, harness.Limits{})
	score, err := eval.Evaluate(ctx, t0)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "sandbox %s: /work holds calc/ (3 bugs) and tests/; python3 -m unittest: %s\n", harness.SandboxID(src), passed(score))

	// Best-of-4: one candidate patch per branch.
	fixes := demoFixes()
	patches := []harness.Action{fixes[0], fixes[4], fixes[1], fixes[2]}
	bon, err := harness.BestOfN(ctx, src, harness.PolicyFunc(func(ctx context.Context, s harness.State) ([]harness.Action, error) {
		return []harness.Action{patches[s.Branch%len(patches)]}, nil
	}), eval, harness.BestOfNOptions{N: len(patches)})
	rootCk = bon.Root.ID
	if bon.Winner != nil {
		made = append(made, bon.Winner)
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "\nBest-of-%d: checkpoint %s, fork %d sandboxes, one candidate patch each\n", len(bon.Branches), bon.Root.ID, len(bon.Branches))
	for i, b := range bon.Branches {
		mark := ""
		if i == bon.Best {
			mark = "  ◀ kept"
		}
		fmt.Fprintf(w, "  %s  %-34s %s%s\n", b.Sandbox, strings.Join(b.Path, ", "), passed(b.Score), mark)
	}

	// MCTS from the best branch, over the fixes that still apply.
	policy := harness.PolicyFunc(func(ctx context.Context, s harness.State) ([]harness.Action, error) {
		text, err := s.Tools.ReadFile(ctx, "calc/ops.py", 0, 0)
		if err != nil {
			return nil, err
		}
		var out []harness.Action
		all, _ := harness.ScriptedPolicy(fixes).Propose(ctx, s)
		for _, f := range all {
			if strings.Contains(text, fixOld[f.Name]) {
				out = append(out, f)
			}
		}
		return out, nil
	})
	mcts, err := harness.MCTS(ctx, bon.Winner, policy, eval, harness.MCTSOptions{Iterations: 24, MaxDepth: 3})
	if err != nil {
		return err
	}
	nodes := 0
	mcts.Root.Walk(func(*harness.Node) { nodes++ })
	fmt.Fprintf(w, "\nMCTS (UCT) in %s from the kept branch: %d nodes, %d checkpoints, %d restores\n",
		harness.SandboxID(bon.Winner), nodes, len(mcts.Stats.Checkpoint.Wall), len(mcts.Stats.Restore.Wall))

	tree, err := c.Tree(ctx, bon.Root.ID)
	if err != nil {
		return err
	}
	fmt.Fprintln(w, "\ncheckpoint tree (name [score: share of tests passing], ◀ sandboxes whose head it is):")
	if err := renderTree(w, tree, time.Now()); err != nil {
		return err
	}

	path := append([]string{bon.Branches[bon.Best].Path[0]}, mcts.Path...)
	fmt.Fprintf(w, "\nwinning path: %s\n", strings.Join(path, "  →  "))
	fixed, err := bon.Winner.ReadFile(ctx, "calc/ops.py")
	if err != nil {
		return err
	}
	if mcts.Best.Score >= 1 {
		fmt.Fprintf(w, "fix found: %s (checkpoint %s)\n", passed(mcts.Best.Score), mcts.Best.Checkpoint)
	} else {
		fmt.Fprintf(w, "no complete fix found: best %s (checkpoint %s)\n", passed(mcts.Best.Score), mcts.Best.Checkpoint)
	}
	fmt.Fprint(w, lineDiff("calc/ops.py", original, string(fixed)))

	stats := bon.Stats
	stats.Merge(mcts.Stats)
	fmt.Fprintln(w, "\nstate management, as the daemon measured it:")
	row := func(what string, d []time.Duration) {
		fmt.Fprintf(w, "  %-20s n=%-3d median %6.2f ms   p95 %6.2f ms\n", what, len(d),
			msf(harness.Percentile(d, 50)), msf(harness.Percentile(d, 95)))
	}
	row("checkpoint pause_ms", stats.Checkpoint.Reported)
	row("restore_ms", stats.Restore.Reported)
	row(fmt.Sprintf("fork_ms (%d at once)", len(bon.Branches)), stats.Fork.Reported)
	fmt.Fprintf(w, "  share of search time in checkpoint+restore+fork calls: %.1f%% (%.0f ms of %.0f ms)\n",
		100*stats.StateShare(), msf(stats.StateTime()), msf(stats.Total))
	if mcts.Best.Score < 1 {
		return fmt.Errorf("demo: the search found no complete fix")
	}
	return nil
}

// The candidate fixes: for each bug a wrong one first, then the right one
// (alternatives share a group).
var fixOld = map[string]string{}

func demoFixes() []harness.Action {
	type fix struct{ name, group, old, new string }
	fs := []fix{
		{"add: b - a", "add", "return a - b", "return b - a"},
		{"add: a + b", "add", "return a - b", "return a + b"},
		{"mean: / (len+1)", "mean", "/ (len(xs) - 1)", "/ (len(xs) + 1)"},
		{"mean: / len", "mean", "/ (len(xs) - 1)", "/ len(xs)"},
		{"clamp: min(lo, max(hi, x))", "clamp", "max(hi, min(lo, x))", "min(lo, max(hi, x))"},
		{"clamp: max(lo, min(hi, x))", "clamp", "max(hi, min(lo, x))", "max(lo, min(hi, x))"},
	}
	var out []harness.Action
	for _, f := range fs {
		fixOld[f.name] = f.old
		out = append(out, harness.EditAction(f.name, f.group, "calc/ops.py", f.old, f.new))
	}
	return out
}

// uploadTask writes the embedded project into the workspace and returns
// calc/ops.py as it starts.
func uploadTask(ctx context.Context, ex harness.Executor) (string, error) {
	var ops string
	err := fs.WalkDir(demoTask, "demo/task", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := demoTask.ReadFile(p)
		if err != nil {
			return err
		}
		rel := strings.TrimPrefix(p, "demo/task/")
		if rel == "calc/ops.py" {
			ops = string(b)
		}
		return ex.WriteFile(ctx, rel, b, 0o644)
	})
	if err != nil {
		return "", fmt.Errorf("demo: upload the task: %w", err)
	}
	return ops, nil
}

// demoDaemon connects to the daemon at cfg.Socket, or starts a private one.
// stop stops what it started.
func demoDaemon(ctx context.Context, cfg demoConfig) (c *deltabox.Client, where string, stop func() error, err error) {
	if cfg.Socket != "" {
		dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		c, err := deltabox.Dial(dctx, deltabox.WithSocket(cfg.Socket), deltabox.WithToken(""))
		cancel()
		if err == nil {
			return c, "the running daemon at " + cfg.Socket, func() error { return nil }, nil
		}
	}
	// Before anything opens a file: fds inherited from whoever started us
	// must not leak into sandboxes.
	if err := markInheritedCloexec(); err != nil {
		return nil, "", nil, err
	}
	if err := os.MkdirAll(cfg.Root, 0o700); err != nil {
		return nil, "", nil, fmt.Errorf("demo: state directory: %w", err)
	}
	root, err := os.MkdirTemp(cfg.Root, "run-")
	if err != nil {
		return nil, "", nil, fmt.Errorf("demo: state directory: %w", err)
	}
	var cleanup []func() error
	stop = func() error {
		var errs []error
		for i := len(cleanup) - 1; i >= 0; i-- {
			errs = append(errs, cleanup[i]())
		}
		return errors.Join(errs...)
	}
	defer func() {
		if err != nil {
			stop()
		}
	}()
	cleanup = append(cleanup, func() error { return os.RemoveAll(root) })
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	m, err := statemgr.New(ctx, statemgr.Options{Root: root, CgroupParent: cfg.CgroupParent, Logger: log, WarmRestores: statemgr.DefaultWarmRestores})
	if err != nil {
		return nil, "", nil, fmt.Errorf("demo: start the daemon: %w", err)
	}
	cleanup = append(cleanup, m.Close)
	// Socket paths are short (108 bytes): keep it in the state directory
	// only when that fits.
	sock := filepath.Join(root, "d.sock")
	if len(sock) > 100 {
		dir, err := os.MkdirTemp("", "dbxdemo")
		if err != nil {
			return nil, "", nil, err
		}
		cleanup = append(cleanup, func() error { return os.RemoveAll(dir) })
		sock = filepath.Join(dir, "d.sock")
	}
	srv, err := daemon.New(m, daemon.WithSocket(sock), daemon.WithLogger(log))
	if err != nil {
		return nil, "", nil, err
	}
	if err := srv.Listen(); err != nil {
		return nil, "", nil, err
	}
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan error, 1)
	go func() { done <- srv.Serve(sctx) }()
	cleanup = append(cleanup, func() error { cancel(); return <-done })
	c, err = deltabox.New(deltabox.WithSocket(sock), deltabox.WithToken(""))
	if err != nil {
		return nil, "", nil, err
	}
	return c, "private, in-process, state in " + root, stop, nil
}

func passed(score float64) string {
	return fmt.Sprintf("%d/6 tests pass", int(score*6+0.5))
}

// lineDiff shows the lines that differ between two versions of a file with
// the same line count (the fixes replace within lines).
func lineDiff(name, a, b string) string {
	al, bl := strings.Split(a, "\n"), strings.Split(b, "\n")
	var out bytes.Buffer
	fmt.Fprintf(&out, "--- %s (before)\n+++ %s (after)\n", name, name)
	for i := range min(len(al), len(bl)) {
		if al[i] != bl[i] {
			fmt.Fprintf(&out, "  -%s\n  +%s\n", al[i], bl[i])
		}
	}
	return out.String()
}

func msf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
