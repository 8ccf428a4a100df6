//go:build linux

// Command harness benchmarks the harness's Gather: N short jobs (write a
// file, run a command that reads it, read its output back), each in a fresh
// executor of its own, at several MaxParallel, on DeltaBox sandboxes (a real
// daemon started in-process, on the default storage) and on the local
// executor (a directory on the host, no isolation). A job's latency counts
// its executor's creation and removal.
//
//	go run ./bench/harness [-jobs 256] [-parallel 8,32,64] [-storage btrfs|overlay|copy]
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/deltabox/deltabox/harness"
	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/sandbox/initproc"
	"github.com/deltabox/deltabox/internal/statemgr"
	deltabox "github.com/deltabox/deltabox/sdk"
)

func main() {
	if initproc.IsInit() {
		initproc.Run()
	}
	jobs := flag.Int("jobs", 256, "jobs per run")
	parallel := flag.String("parallel", "8,32,64", "MaxParallel values")
	storage := flag.String("storage", "", "layer store backend (default: probe)")
	flag.Parse()
	if err := run(*jobs, ints(*parallel), *storage); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(n int, parallel []int, storage string) error {
	ctx := context.Background()
	root, err := os.MkdirTemp("", "deltabox-bench-harness-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	log := slog.New(slog.DiscardHandler)
	m, err := statemgr.New(ctx, statemgr.Options{Root: root, Storage: storage, Logger: log})
	if err != nil {
		return err
	}
	defer m.Close()
	sock := filepath.Join(root, "d.sock")
	srv, err := daemon.New(m, daemon.WithSocket(sock), daemon.WithLogger(log))
	if err != nil {
		return err
	}
	if err := srv.Listen(); err != nil {
		return err
	}
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(sctx) }()
	defer func() { cancel(); <-done }()
	c, err := deltabox.New(deltabox.WithSocket(sock), deltabox.WithToken(""))
	if err != nil {
		return err
	}
	defer c.Close()
	info, _ := c.Info(ctx)
	fmt.Printf("harness Gather benchmark: %d jobs per run, storage=%s kernel=%s\n", n, info.Storage, info.Kernel)
	fmt.Println("job: write a file, `sh -c 'wc -c < f'`, check the output; in a fresh executor, removed after")
	fmt.Println()
	fmt.Printf("%-9s %12s %12s %12s %12s %8s\n", "executor", "MaxParallel", "jobs/s", "p50 job ms", "p95 job ms", "errors")

	localDir, err := os.MkdirTemp("", "deltabox-bench-local-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(localDir)
	backends := []struct {
		name string
		b    harness.Backend
	}{
		{"deltabox", harness.NewDeltaBox(c, deltabox.CreateOptions{})},
		{"local", harness.NewLocal(localDir)},
	}
	for _, p := range parallel {
		for _, be := range backends {
			if err := bench(ctx, be.name, be.b, n, p); err != nil {
				return err
			}
		}
	}
	if l, err := c.List(ctx); err == nil && len(l) > 0 {
		return fmt.Errorf("%d sandboxes left behind", len(l))
	}
	return nil
}

func bench(ctx context.Context, name string, b harness.Backend, n, p int) error {
	jobs := make([]harness.Job[bool], n)
	for i := range jobs {
		jobs[i] = harness.Job[bool]{Name: fmt.Sprint("bench-", i), Run: func(ctx context.Context, ex harness.Executor) (bool, error) {
			payload := strings.Repeat("x", i+1)
			if err := ex.WriteFile(ctx, "f", []byte(payload), 0); err != nil {
				return false, err
			}
			var out strings.Builder
			r, err := ex.Exec(ctx, harness.Cmd{Argv: []string{"sh", "-c", "wc -c < f"}, Stdout: &out, Timeout: 30 * time.Second})
			if err != nil {
				return false, err
			}
			if r.ExitCode != 0 || strings.TrimSpace(out.String()) != strconv.Itoa(i+1) {
				return false, fmt.Errorf("job %d: exit %d, output %q", i, r.ExitCode, out.String())
			}
			return true, nil
		}}
	}
	start := time.Now()
	res, err := harness.Gather(ctx, jobs, harness.Options{Backend: b, MaxParallel: p, PerJobTimeout: 2 * time.Minute})
	wall := time.Since(start)
	if err != nil {
		return err
	}
	var lat []time.Duration
	errs := 0
	for _, r := range res {
		if r.Err != nil {
			if errs == 0 {
				fmt.Fprintln(os.Stderr, "first error:", r.Err)
			}
			errs++
			continue
		}
		lat = append(lat, r.Duration)
	}
	fmt.Printf("%-9s %12d %12.1f %12.1f %12.1f %8d\n", name, p, float64(n)/wall.Seconds(),
		ms(harness.Percentile(lat, 50)), ms(harness.Percentile(lat, 95)), errs)
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func ints(s string) []int {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if v, err := strconv.Atoi(strings.TrimSpace(f)); err == nil && v > 0 {
			out = append(out, v)
		}
	}
	return out
}
