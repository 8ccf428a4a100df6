package harness

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/deltabox/deltabox/errdefs"
)

func newLocal(t *testing.T) Executor {
	t.Helper()
	ex, err := NewLocal(t.TempDir()).NewExecutor(context.Background(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ex.Close(context.Background()) })
	return ex
}

func TestLocalExec(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ex := newLocal(t)
	var out bytes.Buffer
	r, err := ex.Exec(ctx, Cmd{Argv: []string{"sh", "-c", "pwd; echo err >&2; exit 3"}, Stdout: &out})
	if err != nil || r.ExitCode != 3 || strings.TrimSpace(out.String()) != ex.Workspace() {
		t.Fatalf("exec = %+v, %v, stdout %q; want exit 3 in %q", r, err, out.String(), ex.Workspace())
	}
	r, err = ex.Exec(ctx, Cmd{Argv: []string{"sh", "-c", "sleep 30 & sleep 30"}, Timeout: 200 * time.Millisecond})
	if err != nil || !r.TimedOut || r.ExitCode != 124 {
		t.Fatalf("exec with timeout = %+v, %v; want a timeout (124)", r, err)
	}
	if _, err := ex.Exec(ctx, Cmd{Argv: []string{"true"}, Cwd: "../.."}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("exec with cwd outside = %v, want ErrInvalidArgument", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	go func() { time.Sleep(100 * time.Millisecond); cancel() }()
	if _, err := ex.Exec(cctx, Cmd{Argv: []string{"sleep", "30"}}); !errors.Is(err, context.Canceled) {
		t.Fatalf("exec cancelled = %v, want context.Canceled", err)
	}
}

func TestLocalShellSession(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ex := newLocal(t)
	run := func(code string) (string, string, ExecResult) {
		t.Helper()
		var out, errb bytes.Buffer
		r, err := ex.Shell(ctx, code, SessionOptions{Stdout: &out, Stderr: &errb, Timeout: 5 * time.Second})
		if err != nil {
			t.Fatalf("shell %q: %v", code, err)
		}
		return out.String(), errb.String(), r
	}
	run("mkdir -p sub && cd sub && X='it'\"'\"'s kept'; f() { echo fn; }")
	if out, _, r := run(`pwd; echo "$X"; f; printf 'no newline'`); out != filepath.Join(ex.Workspace(), "sub")+"\nit's kept\nfn\nno newline" || r.ExitCode != 0 {
		t.Fatalf("session state: stdout %q, %+v", out, r)
	}
	if _, errs, r := run("echo oops >&2; false"); errs != "oops\n" || r.ExitCode != 1 {
		t.Fatalf("stderr %q exit %d, want oops and 1", errs, r.ExitCode)
	}
	if _, _, r := run("exit 7"); r.ExitCode != 7 {
		t.Fatalf("exit 7 = %+v", r)
	}
	if out, _, _ := run("echo ${X:-fresh}"); out != "fresh\n" {
		t.Fatalf("after exit, X = %q, want a fresh session", out)
	}
	r, err := ex.Shell(ctx, "sleep 30", SessionOptions{Timeout: 100 * time.Millisecond})
	if err != nil || !r.TimedOut {
		t.Fatalf("timeout: %+v, %v", r, err)
	}
	if out, _, _ := run("echo again"); out != "again\n" {
		t.Fatalf("after timeout: %q", out)
	}
}

func TestLocalConfinement(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ex := newLocal(t)
	outside := t.TempDir()
	os.WriteFile(filepath.Join(outside, "secret"), []byte("s"), 0o644)
	if err := os.Symlink(outside, filepath.Join(ex.Workspace(), "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(outside, "secret"), filepath.Join(ex.Workspace(), "flink")); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"../x", "/etc/passwd", filepath.Join(outside, "secret"), "link/secret", "flink", "a/../../x"} {
		if _, err := ex.ReadFile(ctx, p); !errors.Is(err, errdefs.ErrInvalidArgument) && !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("ReadFile(%q) = %v, want a refusal", p, err)
		} else if err == nil {
			t.Errorf("ReadFile(%q) succeeded", p)
		}
		// Writing over the in-workspace link "flink" replaces the link,
		// never its target.
		if err := ex.WriteFile(ctx, p, []byte("x"), 0); err == nil && p != "flink" {
			t.Errorf("WriteFile(%q) succeeded", p)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(outside, "secret")); string(b) != "s" {
		t.Fatalf("the file outside changed: %q", b)
	}
	if err := ex.WriteFile(ctx, filepath.Join(ex.Workspace(), "d/in.txt"), []byte("ok"), 0); err != nil {
		t.Fatalf("absolute path inside: %v", err)
	}
	if b, err := ex.ReadFile(ctx, "d/../d/in.txt"); err != nil || string(b) != "ok" {
		t.Fatalf("ReadFile = %q, %v", b, err)
	}
	if err := ex.Remove(ctx, ".", true); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("Remove(.) = %v", err)
	}
	if _, err := ex.Stat(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Stat(nope) = %v, want ErrNotFound", err)
	}
	dir := ex.Workspace()
	ex.Close(ctx)
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("workspace after Close: %v", err)
	}
	if _, err := ex.ReadFile(ctx, "d/in.txt"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("after Close: %v", err)
	}
}

// TestGatherMaxParallel observes the concurrency: never above MaxParallel,
// and reaching it.
func TestGatherMaxParallel(t *testing.T) {
	t.Parallel()
	var running, peak atomic.Int32
	jobs := make([]Job[int], 24)
	for i := range jobs {
		jobs[i] = Job[int]{Name: "j", Run: func(ctx context.Context, ex Executor) (int, error) {
			n := running.Add(1)
			defer running.Add(-1)
			for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
			}
			time.Sleep(30 * time.Millisecond)
			return i, nil
		}}
	}
	res, err := Gather(context.Background(), jobs, Options{Backend: NewLocal(t.TempDir()), MaxParallel: 4})
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		if r.Err != nil || r.Value != i {
			t.Errorf("result %d = %+v", i, r)
		}
	}
	if p := peak.Load(); p != 4 {
		t.Errorf("peak concurrency %d, want 4", p)
	}
}

// TestGatherIsolation: each job has its own workspace, sees only its own
// files, and the workspace is gone afterwards.
func TestGatherIsolation(t *testing.T) {
	t.Parallel()
	base := t.TempDir()
	jobs := make([]Job[[]string], 8)
	for i := range jobs {
		jobs[i] = Job[[]string]{Name: "iso", Run: func(ctx context.Context, ex Executor) ([]string, error) {
			if err := ex.WriteFile(ctx, "mine", []byte{byte(i)}, 0); err != nil {
				return nil, err
			}
			time.Sleep(20 * time.Millisecond)
			ents, err := ex.ListDir(ctx, ".")
			var names []string
			for _, e := range ents {
				names = append(names, e.Name)
			}
			b, _ := ex.ReadFile(ctx, "mine")
			if len(b) != 1 || b[0] != byte(i) {
				return nil, errors.New("someone else's file")
			}
			return names, err
		}}
	}
	res, err := Gather(context.Background(), jobs, Options{Backend: NewLocal(base), MaxParallel: 8})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, r := range res {
		if r.Err != nil || strings.Join(r.Value, ",") != "mine" {
			t.Errorf("job sees %q, %v; want only its own file", r.Value, r.Err)
		}
		if seen[r.Workspace] {
			t.Errorf("workspace %q shared", r.Workspace)
		}
		seen[r.Workspace] = true
		if _, err := os.Stat(r.Workspace); !os.IsNotExist(err) {
			t.Errorf("workspace %q left behind", r.Workspace)
		}
	}
}

func sleeper(d time.Duration) func(context.Context, Executor) (int, error) {
	return func(ctx context.Context, ex Executor) (int, error) {
		_, err := ex.Exec(ctx, Cmd{Argv: []string{"sleep", d.String()[:len(d.String())-1]}})
		return 1, err
	}
}

func TestGatherTimeoutAndFailures(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	jobs := []Job[int]{
		{Name: "ok", Run: func(context.Context, Executor) (int, error) { return 1, nil }},
		{Name: "slow", Run: sleeper(30 * time.Second)},
		{Name: "fails", Run: func(context.Context, Executor) (int, error) { return 0, boom }},
		{Name: "panics", Run: func(context.Context, Executor) (int, error) { panic("oh") }},
		{Name: "ok2", Run: func(context.Context, Executor) (int, error) { time.Sleep(50 * time.Millisecond); return 2, nil }},
	}
	res, err := Gather(context.Background(), jobs, Options{Backend: NewLocal(t.TempDir()), MaxParallel: 2, PerJobTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatalf("Gather = %v, want nil without FailFast", err)
	}
	if res[0].Err != nil || res[0].Value != 1 || res[4].Err != nil || res[4].Value != 2 {
		t.Errorf("healthy jobs: %+v %+v", res[0], res[4])
	}
	if !errors.Is(res[1].Err, context.DeadlineExceeded) {
		t.Errorf("slow job: %v, want DeadlineExceeded", res[1].Err)
	}
	if !errors.Is(res[2].Err, boom) || !strings.Contains(res[2].Err.Error(), `"fails"`) {
		t.Errorf("failing job: %v", res[2].Err)
	}
	if res[3].Err == nil || !strings.Contains(res[3].Err.Error(), "panicked") {
		t.Errorf("panicking job: %v", res[3].Err)
	}
}

func TestGatherFailFast(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	jobs := []Job[int]{
		{Name: "slow", Run: sleeper(30 * time.Second)},
		{Name: "fails", Run: func(context.Context, Executor) (int, error) { time.Sleep(50 * time.Millisecond); return 0, boom }},
	}
	for range 6 {
		jobs = append(jobs, Job[int]{Name: "later", Run: sleeper(30 * time.Second)})
	}
	res, err := Gather(context.Background(), jobs, Options{Backend: NewLocal(t.TempDir()), MaxParallel: 2, FailFast: true})
	if !errors.Is(err, boom) {
		t.Fatalf("Gather = %v, want boom", err)
	}
	if !errors.Is(res[0].Err, context.Canceled) {
		t.Errorf("running job: %v, want Canceled", res[0].Err)
	}
	for _, r := range res[2:] {
		if r.Err == nil {
			t.Errorf("job after the failure ran to success")
		}
	}
}

func TestGatherCancel(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var started atomic.Int32
	jobs := make([]Job[int], 10)
	for i := range jobs {
		jobs[i] = Job[int]{Name: "c", Run: func(ctx context.Context, ex Executor) (int, error) {
			if started.Add(1) == 2 {
				cancel()
			}
			return sleeper(30*time.Second)(ctx, ex)
		}}
	}
	res, err := Gather(ctx, jobs, Options{Backend: NewLocal(t.TempDir()), MaxParallel: 2})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Gather = %v, want Canceled", err)
	}
	for i, r := range res {
		if !errors.Is(r.Err, context.Canceled) {
			t.Errorf("job %d: %v, want Canceled", i, r.Err)
		}
	}
	if n := started.Load(); n > 3 {
		t.Errorf("%d jobs started after the cancel", n)
	}
}
