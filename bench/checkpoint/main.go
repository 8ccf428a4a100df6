//go:build linux

// Command checkpoint benchmarks coupled checkpoints on this machine: the
// pause of a checkpoint and the latency of a restore in place, for an idle
// sandbox whose workspace holds 1k, 10k and 100k files, next to `cp -a` and
// a tar of the sandbox's writable layer measured in the same run (what a
// copytree or docker-commit style snapshot pays), and the time until N forks
// of one checkpoint are ready, for N = 1, 8, 32, 64. It drives the state
// manager in-process (what the daemon's handlers call).
//
//	go run ./bench/checkpoint [-files 1000,10000,100000] [-runs 20] [-forks 1,8,32,64] [-csv FILE]
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

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
	files := flag.String("files", "1000,10000,100000", "workspace sizes, in files")
	runs := flag.Int("runs", 20, "checkpoints and restores per size")
	forks := flag.String("forks", "1,8,32,64", "fork counts")
	csvPath := flag.String("csv", "", "also write the rows as CSV to this file")
	storage := flag.String("storage", "", "layer store backend (default: probe)")
	flag.Parse()
	if err := run(ints(*files), *runs, ints(*forks), *csvPath, *storage); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type row struct {
	what string
	n    int
	stat.Summary
	comparison string
}

func run(sizes []int, runs int, forks []int, csvPath, storage string) error {
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
	m, err := statemgr.New(ctx, statemgr.Options{Root: root, Storage: storage, Logger: slog.New(slog.NewTextHandler(logOut, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		return err
	}
	defer m.Close()
	info, _ := m.SystemInfo(ctx)
	fmt.Printf("deltabox checkpoint benchmark: storage=%s kernel=%s, %d runs per size\n\n", info.Storage, info.Kernel, runs)

	var rows []row
	for _, n := range sizes {
		in, err := m.CreateSandbox(ctx, sandbox.Config{})
		if err != nil {
			return err
		}
		// The workspace: n files of 1 KiB in 100 directories, written once.
		script := fmt.Sprintf(`cd /work && python3 - <<'EOF'
import os
for i in range(%d):
    d = 'd%%03d' %% (i %% 100)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, 'f%%d' %% i), 'wb') as f:
        f.write(os.urandom(1024))
EOF
sync`, n)
		if r, err := m.Exec(ctx, in.ID, sandbox.ExecRequest{Argv: []string{"bash", "-c", script}}); err != nil || r.ExitCode != 0 {
			return fmt.Errorf("populate %d files: exit %d %v", n, r.ExitCode, err)
		}
		// No session: this measures the filesystem path (a session would
		// put the checkpoints on the template path, which bench/templates
		// measures, and 40 of them in a row would nest generations past
		// the kernel's limit).
		var pause, ckTotal, restore []time.Duration
		var cks []string
		for i := 0; i < runs; i++ {
			// One small change per step, as between agent steps.
			_, _ = m.Exec(ctx, in.ID, sandbox.ExecRequest{Argv: []string{"sh", "-c", "echo " + strconv.Itoa(i) + " > /work/step"}})
			t0 := time.Now()
			ck, err := m.Checkpoint(ctx, in.ID, daemon.CheckpointOptions{})
			if err != nil {
				return err
			}
			ckTotal = append(ckTotal, time.Since(t0))
			pause = append(pause, time.Duration(ck.PauseMs*float64(time.Millisecond)))
			cks = append(cks, ck.ID)
		}
		// Restore to another (older) checkpoint each time: a walk of the tree.
		for i := 0; i < runs; i++ {
			t0 := time.Now()
			if _, err := m.Restore(ctx, in.ID, cks[i%len(cks)]); err != nil {
				return err
			}
			restore = append(restore, time.Since(t0))
		}
		// Roll back a failed step: checkpoint, change, restore to it (the
		// agent's common case), with the pause an agent step leaves.
		var rollback []time.Duration
		for i := 0; i < runs; i++ {
			ck, err := m.Checkpoint(ctx, in.ID, daemon.CheckpointOptions{})
			if err != nil {
				return err
			}
			cks = append(cks, ck.ID)
			_, _ = m.Exec(ctx, in.ID, sandbox.ExecRequest{Argv: []string{"sh", "-c", "echo bad > /work/step"}})
			time.Sleep(20 * time.Millisecond)
			t0 := time.Now()
			if _, err := m.Restore(ctx, in.ID, ck.ID); err != nil {
				return err
			}
			rollback = append(rollback, time.Since(t0))
		}
		// Baselines on the same bytes: the sandbox's writable layer (its
		// root as the host sees it, /work only).
		rootfs := findRootfs(root, in.ID)
		cp, tarT := baseline(filepath.Join(rootfs, "work"), 3)
		rows = append(rows,
			mk("checkpoint pause", n, pause, ""),
			mk("checkpoint call", n, ckTotal, "client view"),
			mk("restore, tree walk", n, restore, "to an older checkpoint"),
			mk("rollback to head", n, rollback, "checkpoint, change, restore"),
			mk("cp -a workspace", n, cp, "baseline"),
			mk("tar workspace", n, tarT, "baseline"),
		)
		_ = m.DeleteSandbox(ctx, in.ID, true)
		for i := len(cks) - 1; i >= 0; i-- {
			_ = m.DeleteCheckpoint(ctx, cks[i], true)
		}
	}

	// Fork to N ready (each fork runs a command).
	src, err := m.CreateSandbox(ctx, sandbox.Config{})
	if err != nil {
		return err
	}
	_, _ = m.Exec(ctx, src.ID, sandbox.ExecRequest{Argv: []string{"sh", "-c", "echo base > /work/base"}})
	ck, err := m.Checkpoint(ctx, src.ID, daemon.CheckpointOptions{})
	if err != nil {
		return err
	}
	for _, n := range forks {
		t0 := time.Now()
		res, err := m.Fork(ctx, ck.ID, n)
		if err != nil {
			return err
		}
		d := time.Since(t0)
		rows = append(rows, mk("fork to N ready", n, []time.Duration{d}, fmt.Sprintf("%.1f ms per fork", float64(d.Microseconds())/1000/float64(n))))
		for _, id := range res.IDs {
			_ = m.DeleteSandbox(ctx, id, true)
		}
	}
	_ = m.DeleteSandbox(ctx, src.ID, true)
	_ = m.DeleteCheckpoint(ctx, ck.ID, true)

	fmt.Printf("%-20s %8s %10s %10s %10s %10s %5s  %s\n", "operation", "N", "median", "p95", "min", "max", "runs", "note")
	for _, r := range rows {
		fmt.Printf("%-20s %8d %10s %10s %10s %10s %5d  %s\n", r.what, r.n, ms(r.Median), ms(r.P95), ms(r.Min), ms(r.Max), r.N, r.comparison)
	}
	fmt.Println("\ngoals: checkpoint <= 3 ms, restore <= 1 ms (p95 <= 2 ms), flat (<= 1.2x) from 1k to 100k files; 64 forks <= 100 ms")
	fmt.Println("published: DeltaBox paper v2 checkpoint 10.83 ms, rollback 1.86 ms (v1: 14 ms, 5 ms)")
	if csvPath != "" {
		var b strings.Builder
		b.WriteString("operation,n,median_ms,p95_ms,min_ms,max_ms,runs\n")
		for _, r := range rows {
			fmt.Fprintf(&b, "%s,%d,%s,%s,%s,%s,%d\n", r.what, r.n, msn(r.Median), msn(r.P95), msn(r.Min), msn(r.Max), r.N)
		}
		if err := os.WriteFile(csvPath, []byte(b.String()), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// findRootfs finds the host mount point of a sandbox's root (the newest
// after restores).
func findRootfs(root, id string) string {
	matches, _ := filepath.Glob(filepath.Join(root, "run", id, "rootfs*"))
	sort.Slice(matches, func(i, j int) bool { return gen(matches[i]) < gen(matches[j]) })
	if len(matches) == 0 {
		return ""
	}
	return matches[len(matches)-1]
}

func gen(p string) int {
	_, s, ok := strings.Cut(filepath.Base(p), ".")
	if !ok {
		return 0
	}
	n, _ := strconv.Atoi(s)
	return n
}

// baseline times `cp -a` and `tar -c` of dir, runs times each.
func baseline(dir string, runs int) (cp, tarT []time.Duration) {
	for i := 0; i < runs; i++ {
		dst, _ := os.MkdirTemp("", "deltabox-bench-cp-")
		t0 := time.Now()
		_ = exec.Command("cp", "-a", dir, dst+"/w").Run()
		cp = append(cp, time.Since(t0))
		os.RemoveAll(dst)
		t0 = time.Now()
		c := exec.Command("tar", "-C", dir, "-cf", "-", ".")
		c.Stdout = io.Discard
		_ = c.Run()
		tarT = append(tarT, time.Since(t0))
	}
	return cp, tarT
}

func mk(what string, n int, d []time.Duration, note string) row {
	return row{what: what, n: n, Summary: stat.Summarize(d), comparison: note}
}

func ints(s string) []int {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if n, err := strconv.Atoi(strings.TrimSpace(f)); err == nil && n > 0 {
			out = append(out, n)
		}
	}
	return out
}

func ms(d time.Duration) string  { return msn(d) + "ms" }
func msn(d time.Duration) string { return fmt.Sprintf("%.2f", float64(d.Microseconds())/1000) }
