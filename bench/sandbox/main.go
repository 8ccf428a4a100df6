//go:build linux

// Command sandbox benchmarks the sandbox lifecycle on this machine: create,
// first exec round trip and delete latency over N sandboxes, and the round
// trip of the persistent shell and python sessions. It drives the state
// manager in-process (what the daemon's handlers call), so the numbers are
// the runtime's, without RPC.
//
//	go run ./bench/sandbox [-n 100] [-calls 200] [-storage btrfs]
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/deltabox/deltabox/bench/internal/stat"
	"github.com/deltabox/deltabox/internal/sandbox"
	"github.com/deltabox/deltabox/internal/sandbox/initproc"
	"github.com/deltabox/deltabox/internal/statemgr"
)

func main() {
	if initproc.IsInit() {
		initproc.Run()
	}
	n := flag.Int("n", 100, "sandboxes to create, exec in and delete")
	calls := flag.Int("calls", 200, "session round trips per kind")
	storage := flag.String("storage", "", "layer store backend (default: probe)")
	warmPool := flag.Int("warm-pool", 2, "prepared sandboxes kept ready (the daemon's default); the cold path is measured too")
	flag.Parse()
	if err := run(*n, *calls, *storage, *warmPool); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(n, calls int, storage string, warmPool int) error {
	level := slog.LevelInfo
	if os.Getenv("DELTABOX_TRACE") != "" {
		level = slog.LevelDebug
	}
	ctx := context.Background()
	root, err := os.MkdirTemp("", "deltabox-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	m, err := statemgr.New(ctx, statemgr.Options{Root: root, Storage: storage, Logger: logger})
	if err != nil {
		return err
	}
	defer m.Close()
	info, _ := m.SystemInfo(ctx)
	fmt.Printf("deltabox sandbox benchmark: storage=%s kernel=%s cgroups=%s, %d sandboxes, %d session calls\n\n",
		info.Storage, info.Kernel, info.CgroupMode, n, calls)

	// Warm up the image and the page cache once.
	if in, err := m.CreateSandbox(ctx, sandbox.Config{}); err == nil {
		_ = m.DeleteSandbox(ctx, in.ID, true)
	}
	var create, first, del []time.Duration
	var warmCreate []time.Duration
	if warmPool > 0 {
		// The warm path: a second manager with a pool; one create at a time,
		// with the pool given time to refill between (as between an agent's
		// steps).
		wroot, err := os.MkdirTemp("", "deltabox-bench-warm-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(wroot)
		wm, err := statemgr.New(ctx, statemgr.Options{Root: wroot, Storage: storage, Logger: logger, WarmPool: warmPool})
		if err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			time.Sleep(150 * time.Millisecond)
			t0 := time.Now()
			in, err := wm.CreateSandbox(ctx, sandbox.Config{})
			if err != nil {
				wm.Close()
				return err
			}
			warmCreate = append(warmCreate, time.Since(t0))
			_ = wm.DeleteSandbox(ctx, in.ID, true)
		}
		if err := wm.Close(); err != nil {
			return err
		}
	}
	for i := 0; i < n; i++ {
		t0 := time.Now()
		in, err := m.CreateSandbox(ctx, sandbox.Config{})
		if err != nil {
			return err
		}
		t1 := time.Now()
		if _, err := m.Exec(ctx, in.ID, sandbox.ExecRequest{Argv: []string{"true"}}); err != nil {
			return err
		}
		t2 := time.Now()
		if err := m.DeleteSandbox(ctx, in.ID, true); err != nil {
			return err
		}
		t3 := time.Now()
		create, first, del = append(create, t1.Sub(t0)), append(first, t2.Sub(t1)), append(del, t3.Sub(t2))
	}
	in, err := m.CreateSandbox(ctx, sandbox.Config{})
	if err != nil {
		return err
	}
	defer m.DeleteSandbox(ctx, in.ID, true)
	var execRT []time.Duration
	for i := 0; i < calls; i++ {
		t0 := time.Now()
		if _, err := m.Exec(ctx, in.ID, sandbox.ExecRequest{Argv: []string{"true"}}); err != nil {
			return err
		}
		execRT = append(execRT, time.Since(t0))
	}
	sess := map[sandbox.SessionKind][]time.Duration{}
	for _, k := range []sandbox.SessionKind{sandbox.SessionShell, sandbox.SessionPython} {
		code := map[sandbox.SessionKind]string{sandbox.SessionShell: "x=$((x+1))", sandbox.SessionPython: "x = globals().get('x', 0) + 1"}[k]
		// The first call starts the session; measure the steady state.
		if _, err := m.Session(ctx, in.ID, sandbox.SessionRequest{Kind: k, Code: code}); err != nil {
			return err
		}
		for i := 0; i < calls; i++ {
			var out bytes.Buffer
			t0 := time.Now()
			if _, err := m.Session(ctx, in.ID, sandbox.SessionRequest{Kind: k, Code: code, Stdout: &out}); err != nil {
				return err
			}
			sess[k] = append(sess[k], time.Since(t0))
		}
	}

	fmt.Printf("%-28s %10s %10s %10s %10s\n", "operation", "median", "p95", "min", "max")
	row := func(name string, d []time.Duration) {
		st := stat.Summarize(d)
		fmt.Printf("%-28s %10s %10s %10s %10s\n", name, ms(st.Median), ms(st.P95), ms(st.Min), ms(st.Max))
	}
	row("create (cold)", create)
	if len(warmCreate) > 0 {
		row("create (warm pool)", warmCreate)
	}
	row("first exec round trip", first)
	row("delete", del)
	row("exec round trip (warm)", execRT)
	row("shell session round trip", sess[sandbox.SessionShell])
	row("python session round trip", sess[sandbox.SessionPython])
	fmt.Printf("\ngoal: create <= 10 ms median on this 2-core machine\n")
	return nil
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2fms", float64(d.Microseconds())/1000) }
