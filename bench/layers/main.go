//go:build linux

// Command layers benchmarks the layer stores (DeltaFS): Commit and Branch
// latency per backend at 1k, 10k and 100k files in the workspace and at
// 1 MB, 100 MB and 1 GB changed since the previous commit, next to `cp -a`
// and `cp -a --reflink=always` of the same tree. It prints a table and CSV.
//
//	go run ./bench/layers                       # full run (minutes)
//	go run ./bench/layers -files 1000 -changes 1MB -reps 3   # quick (< 1 min)
//
// It must run as root (the btrfs backend loop-mounts an image). Latencies
// include the fsync of the store's metadata.
package main

import (
	"context"
	"encoding/csv"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/deltabox/deltabox/bench/internal/stat"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/layer/probe"
)

type result struct {
	backend, scenario, op string
	samples               []time.Duration
}

func (r result) median() time.Duration { return stat.Percentile(r.samples, 50) }
func (r result) p95() time.Duration    { return stat.Percentile(r.samples, 95) }

func main() {
	var (
		dir      = flag.String("dir", "/var/tmp/deltabox-bench", "work directory (removed at the end)")
		backends = flag.String("backends", "btrfs,overlay,copy", "backends to measure")
		files    = flag.String("files", "1000,10000,100000", "workspace sizes in files (empty: skip)")
		changes  = flag.String("changes", "1MB,100MB,1GB", "bytes changed since the previous commit (empty: skip)")
		reps     = flag.Int("reps", 5, "measurements per point")
		csvPath  = flag.String("csv", "", "also write CSV here")
	)
	flag.Parse()
	if err := run(*dir, split(*backends), split(*files), split(*changes), *reps, *csvPath); err != nil {
		fmt.Fprintln(os.Stderr, "layers:", err)
		os.Exit(1)
	}
}

func split(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func parseSize(s string) (int64, error) {
	mult := int64(1)
	u := strings.ToUpper(s)
	for _, x := range []struct {
		suf string
		m   int64
	}{{"GB", 1 << 30}, {"MB", 1 << 20}, {"KB", 1 << 10}} {
		if strings.HasSuffix(u, x.suf) {
			mult, u = x.m, strings.TrimSuffix(u, x.suf)
			break
		}
	}
	n, err := strconv.ParseInt(u, 10, 64)
	return n * mult, err
}

func run(dir string, backends, files, changes []string, reps int, csvPath string) error {
	ctx := context.Background()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	var results []result
	var reflinkDir string // a directory on btrfs, for the reflink baseline
	for _, kind := range backends {
		root := filepath.Join(dir, kind)
		s, err := probe.Open(ctx, kind, root)
		if err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "== %s\n", kind)
		rs, err := measure(ctx, s, kind, files, changes, reps)
		if kind == "btrfs" && err == nil {
			if mnt := filepath.Join(root, kind, "mnt"); isDir(mnt) {
				reflinkDir = mnt
			}
			rb, err2 := baselines(reflinkDir, "btrfs", files, changes, reps)
			rs = append(rs, rb...)
			err = err2
		}
		results = append(results, rs...)
		if cerr := s.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("%s: %w", kind, err)
		}
	}
	rb, err := baselines(filepath.Join(dir, "cp"), "statedir", files, changes, reps)
	if err != nil {
		return err
	}
	results = append(results, rb...)
	print(results, reps, csvPath)
	return nil
}

func isDir(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.IsDir()
}

// measure times Commit and Branch on one store.
func measure(ctx context.Context, s layer.Store, kind string, files, changes []string, reps int) ([]result, error) {
	var out []result
	for _, f := range files {
		n, err := strconv.Atoi(f)
		if err != nil {
			return nil, err
		}
		scen := fmt.Sprintf("%d files", n)
		fmt.Fprintf(os.Stderr, "   %s\n", scen)
		c, b, err := point(ctx, s, n, 0, reps)
		if err != nil {
			return nil, err
		}
		out = append(out, result{kind, scen, "commit", c}, result{kind, scen, "branch", b})
	}
	for _, ch := range changes {
		size, err := parseSize(ch)
		if err != nil {
			return nil, err
		}
		scen := ch + " changed"
		fmt.Fprintf(os.Stderr, "   %s\n", scen)
		r := reps
		if size >= 1<<30 {
			r = min(reps, 3)
		}
		c, b, err := point(ctx, s, 1000, size, r)
		if err != nil {
			return nil, err
		}
		out = append(out, result{kind, scen, "commit", c}, result{kind, scen, "branch", b})
	}
	return out, nil
}

// point builds a workspace of n files (1 KiB each, 100 per directory),
// commits it, then reps times: changes one small file (or writes changed
// bytes into a fresh file), times Commit, times Branch of the committed
// layer, and removes the branch.
func point(ctx context.Context, s layer.Store, n int, changed int64, reps int) (commits, branches []time.Duration, err error) {
	a, err := s.Branch(ctx, "")
	if err != nil {
		return nil, nil, err
	}
	v, err := s.Mounts(ctx, a.ID)
	if err != nil {
		return nil, nil, err
	}
	if err := populate(v.Upper, n); err != nil {
		return nil, nil, err
	}
	var made []string // committed layers, oldest first
	c, next, err := s.Commit(ctx, a.ID)
	if err != nil {
		return nil, nil, err
	}
	made = append(made, c.ID)
	active := next.ID
	for i := 0; i < reps; i++ {
		v, err := s.Mounts(ctx, active)
		if err != nil {
			return nil, nil, err
		}
		if changed == 0 {
			err = os.WriteFile(filepath.Join(v.Upper, "changed"), []byte(strconv.Itoa(i)), 0o644)
		} else {
			os.Remove(filepath.Join(v.Upper, fmt.Sprint("big", i-1)))
			err = writeBig(filepath.Join(v.Upper, fmt.Sprint("big", i)), changed)
		}
		if err != nil {
			return nil, nil, err
		}
		t0 := time.Now()
		c, next, err := s.Commit(ctx, active)
		if err != nil {
			return nil, nil, err
		}
		commits = append(commits, time.Since(t0))
		made = append(made, c.ID)
		active = next.ID
		t0 = time.Now()
		b, err := s.Branch(ctx, c.ID)
		if err != nil {
			return nil, nil, err
		}
		branches = append(branches, time.Since(t0))
		if err := s.Remove(ctx, b.ID); err != nil {
			return nil, nil, err
		}
	}
	if err := s.Remove(ctx, active); err != nil {
		return nil, nil, err
	}
	for i := len(made) - 1; i >= 0; i-- {
		if err := s.Remove(ctx, made[i]); err != nil {
			return nil, nil, err
		}
	}
	return commits, branches, nil
}

func populate(dir string, n int) error {
	data := make([]byte, 1024)
	for i := 0; i < n; i++ {
		d := filepath.Join(dir, fmt.Sprintf("d%04d", i/100))
		if i%100 == 0 {
			if err := os.MkdirAll(d, 0o755); err != nil {
				return err
			}
		}
		data[0] = byte(i)
		if err := os.WriteFile(filepath.Join(d, fmt.Sprintf("f%d", i)), data, 0o644); err != nil {
			return err
		}
	}
	return nil
}

func writeBig(p string, size int64) error {
	f, err := os.Create(p)
	if err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	r := rand.New(rand.NewPCG(uint64(size), 7))
	for i := range buf {
		buf[i] = byte(r.Uint32())
	}
	for w := int64(0); w < size; w += int64(len(buf)) {
		buf[0]++ // distinct blocks
		if _, err := f.Write(buf[:min(int64(len(buf)), size-w)]); err != nil {
			f.Close()
			return err
		}
	}
	return f.Close()
}

// baselines times cp -a and cp -a --reflink=always of the same trees, in
// dir (on the filesystem named fs).
func baselines(dir, fs string, files, changes []string, reps int) ([]result, error) {
	if dir == "" {
		return nil, nil
	}
	work := filepath.Join(dir, "bench-cp")
	if err := os.MkdirAll(work, 0o755); err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	var out []result
	type tree struct {
		scen   string
		n      int
		bigger int64
	}
	var trees []tree
	for _, f := range files {
		n, _ := strconv.Atoi(f)
		trees = append(trees, tree{fmt.Sprintf("%d files", n), n, 0})
	}
	for _, ch := range changes {
		size, err := parseSize(ch)
		if err != nil {
			return nil, err
		}
		trees = append(trees, tree{ch + " changed", 1000, size})
	}
	for _, tr := range trees {
		src := filepath.Join(work, "src")
		if err := os.MkdirAll(src, 0o755); err != nil {
			return nil, err
		}
		if err := populate(src, tr.n); err != nil {
			return nil, err
		}
		if tr.bigger > 0 {
			if err := writeBig(filepath.Join(src, "big"), tr.bigger); err != nil {
				return nil, err
			}
		}
		exec.Command("sync").Run()
		for _, mode := range []struct {
			name string
			args []string
		}{
			{"cp -a", []string{"-a"}},
			{"cp -a --reflink=always", []string{"-a", "--reflink=always"}},
		} {
			var ss []time.Duration
			r := reps
			if tr.bigger >= 1<<30 {
				r = min(reps, 3)
			}
			for i := 0; i < r; i++ {
				dst := filepath.Join(work, "dst")
				t0 := time.Now()
				err := exec.Command("cp", append(mode.args, src, dst)...).Run()
				d := time.Since(t0)
				os.RemoveAll(dst)
				if err != nil {
					ss = nil // unsupported here (no reflink)
					break
				}
				ss = append(ss, d)
			}
			if ss != nil {
				out = append(out, result{mode.name + " (" + fs + ")", tr.scen, "copy", ss})
			}
		}
		os.RemoveAll(src)
	}
	return out, nil
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f", float64(d)/float64(time.Millisecond)) }

func print(results []result, reps int, csvPath string) {
	host, _ := os.Hostname()
	fmt.Printf("DeltaFS layer benchmark, %s, %s, up to %d reps per point (ms)\n\n", host, time.Now().UTC().Format(time.RFC3339), reps)
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "backend\tscenario\top\tmedian\tp95\tn\t")
	for _, r := range results {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t\n", r.backend, r.scenario, r.op, ms(r.median()), ms(r.p95()), len(r.samples))
	}
	tw.Flush()
	fmt.Println("\nCSV:")
	write := func(w *csv.Writer) {
		w.Write([]string{"backend", "scenario", "op", "median_ms", "p95_ms", "n"})
		for _, r := range results {
			w.Write([]string{r.backend, r.scenario, r.op, ms(r.median()), ms(r.p95()), strconv.Itoa(len(r.samples))})
		}
		w.Flush()
	}
	write(csv.NewWriter(os.Stdout))
	if csvPath != "" {
		if f, err := os.Create(csvPath); err == nil {
			write(csv.NewWriter(f))
			f.Close()
		}
	}
}
