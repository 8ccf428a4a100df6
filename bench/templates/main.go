//go:build linux

// Command templates benchmarks the checkpoint's fast path (process
// templates): the pause of a checkpoint and the latency of a restore in
// place for a python session holding 10 MB, 200 MB and 1 GB of heap, with
// 4 KiB pages and with transparent huge pages, and the time until 64 forks
// of one checkpoint are ready (each answered a python call). The paper's
// published figures are printed beside them. It drives the state manager
// in-process (what the daemon's handlers call).
//
//	go run ./bench/templates [-heaps 10,200,1024] [-runs 10] [-forks 64]
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/deltabox/deltabox/bench/internal/stat"
	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/sandbox"
	"github.com/deltabox/deltabox/internal/sandbox/initproc"
	"github.com/deltabox/deltabox/internal/statemgr"
)

func main() {
	if initproc.IsInit() {
		initproc.Run()
	}
	heaps := flag.String("heaps", "10,200,1024", "python heap sizes, in MiB")
	runs := flag.Int("runs", 10, "checkpoints and restores per heap")
	forks := flag.Int("forks", 64, "forks of one checkpoint")
	think := flag.Duration("think", 300*time.Millisecond, "pause between an agent's steps (an LLM call takes seconds): the daemon prepares the next generation meanwhile")
	warmHeap := flag.Int("warm-heap", 200, "heap of the async-warm comparison, in MiB (0: skip it)")
	flag.Parse()
	err := run(*heaps, *runs, *forks, *think)
	if err == nil && *warmHeap > 0 {
		root, rerr := os.MkdirTemp("", "deltabox-bench-")
		if err = rerr; err == nil {
			defer os.RemoveAll(root)
			// A rollback after a longer think than the other steps: the
			// warm copies the heap while the agent thinks.
			err = warmCompare(context.Background(), root, *warmHeap, *runs, 3**think)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// heapCode allocates mib MiB of private anonymous memory in the session and
// writes every page; huge asks for transparent huge pages (MADV_HUGEPAGE),
// otherwise they are refused (MADV_NOHUGEPAGE).
func heapCode(mib int, huge bool) string {
	adv := "MADV_NOHUGEPAGE"
	if huge {
		adv = "MADV_HUGEPAGE"
	}
	return fmt.Sprintf(`import mmap
heap = mmap.mmap(-1, %d << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
heap.madvise(mmap.%s)
for i in range(0, len(heap), 4096):
    heap[i] = 1
n = 0`, mib, adv)
}

// summarize is a row's numbers: median, p95, min, max in milliseconds.
func summarize(d []time.Duration) string {
	s := stat.Summarize(d)
	return fmt.Sprintf("%8.2f %8.2f %8.2f %8.2f", ms(s.Median), ms(s.P95), ms(s.Min), ms(s.Max))
}

var ms = stat.Ms

// fanOutGap is the pause between the two fan-outs: an RL iteration's
// rollouts and policy update take seconds.
const fanOutGap = 5 * time.Second

func run(heapList string, runs, forks int, think time.Duration) error {
	ctx := context.Background()
	root, err := os.MkdirTemp("", "deltabox-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(root)
	var logOut io.Writer = io.Discard
	if os.Getenv("DELTABOX_TRACE") != "" {
		logOut = os.Stderr
	}
	m, err := statemgr.New(ctx, statemgr.Options{Root: root, Logger: slog.New(slog.NewTextHandler(logOut, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		return err
	}
	defer m.Close()
	info, _ := m.SystemInfo(ctx)
	thp, _ := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	fmt.Printf("deltabox template benchmark: storage=%s kernel=%s thp=%q, %d runs per heap, %v between steps\n\n", info.Storage, info.Kernel, strings.TrimSpace(string(thp)), runs, think)
	fmt.Printf("%-34s %8s %8s %8s %8s  %s\n", "what (ms)", "median", "p95", "min", "max", "published (paper v1 / v2)")

	py := func(id, code string) (string, error) {
		var out, errb bytes.Buffer
		res, err := m.Session(ctx, id, sandbox.SessionRequest{Kind: sandbox.SessionPython, Code: code, Stdout: &out, Stderr: &errb, Timeout: 5 * time.Minute})
		if err == nil && res.ExitCode != 0 {
			err = fmt.Errorf("python exited %d: %s", res.ExitCode, errb.String())
		}
		return out.String(), err
	}
	var keep string // a small session's checkpoint, for the forks
	for _, mibS := range strings.Split(heapList, ",") {
		mib, err := strconv.Atoi(strings.TrimSpace(mibS))
		if err != nil {
			return err
		}
		for _, huge := range []bool{false, true} {
			in, err := m.CreateSandbox(ctx, sandbox.Config{})
			if err != nil {
				return err
			}
			if _, err := py(in.ID, heapCode(mib, huge)); err != nil {
				return err
			}
			var pause, ckCall, restore, restoreCall []time.Duration
			var ckID string
			for i := 0; i < runs; i++ {
				began := time.Now()
				ck, err := m.Checkpoint(ctx, in.ID, daemon.CheckpointOptions{})
				if err != nil {
					return err
				}
				ckCall = append(ckCall, time.Since(began))
				if len(ck.Processes) == 0 || ck.Processes[0].Path != daemon.PathTemplate {
					return fmt.Errorf("checkpoint took the slow path: %+v", ck.Processes)
				}
				pause = append(pause, time.Duration(ck.PauseMs*float64(time.Millisecond)))
				ckID = ck.ID
				if _, err := py(in.ID, "n += 1; heap[0] = 2"); err != nil {
					return err
				}
				time.Sleep(think)
				began = time.Now()
				res, err := m.Restore(ctx, in.ID, ck.ID)
				if err != nil {
					return err
				}
				restoreCall = append(restoreCall, time.Since(began))
				restore = append(restore, time.Duration(res.RestoreMs*float64(time.Millisecond)))
				if out, err := py(in.ID, "n, heap[0]"); err != nil || out != "(0, 1)\n" {
					return fmt.Errorf("restored state %q: %v", out, err)
				}
				time.Sleep(think)
			}
			pages := "4K pages"
			if huge {
				pages = "huge pages"
			}
			label := fmt.Sprintf("python %d MiB, %s", mib, pages)
			fmt.Printf("%-34s %s  %s\n", "checkpoint pause, "+label, summarize(pause), "14 / 10.83")
			fmt.Printf("%-34s %s\n", "  checkpoint call (client view)", summarize(ckCall))
			fmt.Printf("%-34s %s  %s\n", "restore, "+label, summarize(restore), "5 / 1.86")
			fmt.Printf("%-34s %s\n", "  restore call (client view)", summarize(restoreCall))
			if mib == 10 && !huge {
				keep = ckID
			} else if err := m.DeleteSandbox(ctx, in.ID, true); err != nil {
				return err
			}
		}
	}
	if keep == "" || forks <= 0 {
		return nil
	}
	// Forks of the small session's checkpoint: ready when each answered.
	// Then the same fan-out again, as a policy's next batch of rollouts from
	// the same state: the first left its generations to be made ready.
	fanOut := func(what string) error {
		busy0, _ := stat.CPUBusy()
		began := time.Now()
		res, err := m.Fork(ctx, keep, forks)
		if err != nil {
			return err
		}
		forked := time.Since(began)
		busy1, _ := stat.CPUBusy()
		var g errgroup.Group
		g.SetLimit(16)
		var mu sync.Mutex
		var bad []string
		for _, id := range res.IDs {
			g.Go(func() error {
				out, err := py(id, "n")
				if err != nil || out != "0\n" {
					mu.Lock()
					bad = append(bad, fmt.Sprintf("%s: %q %v", id, out, err))
					mu.Unlock()
				}
				return nil
			})
		}
		_ = g.Wait()
		ready := time.Since(began)
		if len(bad) > 0 {
			return errors.New(strings.Join(bad, "; "))
		}
		fmt.Printf("%d forks of a 10 MiB python session, %s: all running %.1f ms, all answered %.1f ms (goal: 64 in 100 ms)\n", forks, what, ms(forked), ms(ready))
		// The machine's CPU the forks took (until all ran): what bounds
		// them on a machine of few cores.
		fmt.Printf("  CPU busy until all ran: %.0f ms, %.1f ms a fork (%d cores)\n", ms(busy1-busy0), ms(busy1-busy0)/float64(forks), runtime.NumCPU())
		for _, id := range res.IDs {
			_ = m.DeleteSandbox(ctx, id, true)
		}
		return nil
	}
	fmt.Println()
	if err := fanOut("first fan-out"); err != nil {
		return err
	}
	time.Sleep(fanOutGap)
	if err := fanOut(fmt.Sprintf("again %v later", fanOutGap)); err != nil {
		return err
	}
	nt, tb, budget := m.Templates()
	fmt.Printf("templates held at the end: %d checkpoints, %d MiB private of a %d MiB budget\n", nt, tb>>20, budget>>20)
	return nil
}
