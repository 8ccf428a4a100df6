//go:build linux

package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/deltabox/deltabox/bench/internal/stat"
	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/sandbox"
	"github.com/deltabox/deltabox/internal/statemgr"
)

// warmCompare measures the async warm (statemgr.Options.WarmRestores): the
// agent's first step after a rollback, which writes every page of a mib MiB
// heap again, with and without the restore made ready ahead pre-faulting
// the heap; the same step once the pages are the session's own is the
// floor. Both managers run in this process, side by side, runs times each.
func warmCompare(ctx context.Context, root string, mib, runs int, think time.Duration) error {
	// It prints the page faults it took (copy-on-write breaks, or zero
	// when warmed).
	const step = "import resource\nf0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\nfor i in range(0, len(heap), 4096):\n    heap[i] = 2\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)"
	type result struct {
		first, again []time.Duration
		faults       []string
	}
	results := map[bool]*result{false: {}, true: {}}
	for i := 0; i < runs; i++ {
		for _, warm := range []bool{false, true} {
			first, again, faults, err := warmRun(ctx, filepath.Join(root, fmt.Sprintf("warm-%v-%d", warm, i)), mib, warm, step, think)
			if err != nil {
				return err
			}
			results[warm].faults = append(results[warm].faults, faults)
			results[warm].first = append(results[warm].first, first)
			results[warm].again = append(results[warm].again, again)
		}
	}
	cold, warm := summarize(results[false].first), summarize(results[true].first)
	floor := summarize(append(results[false].again, results[true].again...))
	fmt.Printf("\nasync warm: the first step after a rollback writes every page of a %d MiB heap (%d runs each)\n", mib, runs)
	fmt.Printf("%-34s %s  page faults %v\n", "  first step, not warmed", cold, results[false].faults)
	fmt.Printf("%-34s %s  page faults %v\n", "  first step, warmed ahead", warm, results[true].faults)
	fmt.Printf("%-34s %s\n", "  the same step again (floor)", floor)
	fmt.Printf("  warm / cold (medians): %.2f\n", float64(stat.Summarize(results[true].first).Median)/float64(stat.Summarize(results[false].first).Median))
	return nil
}

func warmRun(ctx context.Context, root string, mib int, warm bool, step string, think time.Duration) (first, again time.Duration, faults string, err error) {
	opts := statemgr.Options{Root: root, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if warm {
		opts.WarmRestores = int64(mib+64) << 20
	}
	m, err := statemgr.New(ctx, opts)
	if err != nil {
		return 0, 0, "", err
	}
	defer os.RemoveAll(root)
	defer m.Close()
	var out bytes.Buffer
	py := func(id, code string) (time.Duration, error) {
		var errb bytes.Buffer
		out.Reset()
		began := time.Now()
		res, err := m.Session(ctx, id, sandbox.SessionRequest{Kind: sandbox.SessionPython, Code: code, Stdout: &out, Stderr: &errb, Timeout: 5 * time.Minute})
		if err == nil && res.ExitCode != 0 {
			err = fmt.Errorf("python exited %d: %s", res.ExitCode, errb.String())
		}
		return time.Since(began), err
	}
	in, err := m.CreateSandbox(ctx, sandbox.Config{})
	if err != nil {
		return 0, 0, "", err
	}
	defer m.DeleteSandbox(context.Background(), in.ID, true)
	if _, err := py(in.ID, heapCode(mib, false)); err != nil {
		return 0, 0, "", err
	}
	ck, err := m.Checkpoint(ctx, in.ID, daemon.CheckpointOptions{})
	if err != nil {
		return 0, 0, "", err
	}
	if len(ck.Processes) == 0 || ck.Processes[0].Path != daemon.PathTemplate {
		return 0, 0, "", fmt.Errorf("checkpoint took the slow path: %+v", ck.Processes)
	}
	time.Sleep(think) // the agent thinks; the rollback is made ready (and warmed)
	if _, err := m.Restore(ctx, in.ID, ck.ID); err != nil {
		return 0, 0, "", err
	}
	if first, err = py(in.ID, step); err != nil {
		return 0, 0, "", err
	}
	faults = strings.TrimSpace(out.String())
	again, err = py(in.ID, step)
	return first, again, faults, err
}
