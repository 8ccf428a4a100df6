package harness

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sync/semaphore"
	"golang.org/x/term"
)

// Job is one unit of work: Run gets a fresh executor of its own, closed
// after Run returns.
type Job[T any] struct {
	Name string
	Run  func(ctx context.Context, ex Executor) (T, error)
}

// Result is one job's outcome, at the job's index in Gather's input.
type Result[T any] struct {
	Name      string
	Value     T
	Err       error // the job's own error, a timeout, or why it never ran
	Workspace string
	Duration  time.Duration // from getting a slot to the end of cleanup
}

// Options tune Gather.
type Options struct {
	// Backend makes each job's executor; nil means NewLocal("").
	Backend Backend
	// MaxParallel bounds the jobs running at once; 0 means 8.
	MaxParallel int
	// PerJobTimeout bounds each job (its executor's creation and Run); 0
	// means none. A job that times out fails with context.DeadlineExceeded
	// without affecting the others.
	PerJobTimeout time.Duration
	// FailFast cancels the jobs still running or waiting when one fails,
	// and makes Gather return that error.
	FailFast bool
	// Progress receives a progress bar; nil means standard error when it is
	// a terminal, nothing otherwise. Set Quiet to never draw one.
	Progress io.Writer
	Quiet    bool
}

// Gather runs jobs, each with its own executor from opts.Backend, at most
// opts.MaxParallel at once, and returns every job's Result in input order.
// One job's failure stays in its Result unless opts.FailFast. Cancelling ctx
// stops the jobs (their Results say so). The error is ctx's if it ended, the
// first failure with FailFast, and nil otherwise: check each Result.
func Gather[T any](ctx context.Context, jobs []Job[T], opts Options) ([]Result[T], error) {
	if opts.Backend == nil {
		opts.Backend = NewLocal("")
	}
	if opts.MaxParallel <= 0 {
		opts.MaxParallel = 8
	}
	results := make([]Result[T], len(jobs))
	for i, j := range jobs {
		results[i].Name = j.Name
	}
	bar := newBar(opts, len(jobs))

	// Without FailFast the group's goroutines never return an error, so
	// its context only ends with ctx.
	g, gctx := errgroup.WithContext(ctx)
	sem := semaphore.NewWeighted(int64(opts.MaxParallel))
	for i := range jobs {
		if err := sem.Acquire(gctx, 1); err != nil {
			for k := i; k < len(jobs); k++ {
				results[k].Err = fmt.Errorf("job %q not started: %w", jobs[k].Name, err)
			}
			break
		}
		g.Go(func() error {
			defer sem.Release(1)
			results[i] = runJob(gctx, jobs[i], opts)
			bar.add()
			if opts.FailFast {
				return results[i].Err
			}
			return nil
		})
	}
	err := g.Wait()
	bar.finish()
	if ctx.Err() != nil {
		return results, ctx.Err()
	}
	return results, err
}

// runJob makes the job's executor, runs the job, and always cleans up.
func runJob[T any](ctx context.Context, j Job[T], opts Options) (r Result[T]) {
	r.Name = j.Name
	start := time.Now()
	defer func() { r.Duration = time.Since(start) }()
	defer func() {
		if p := recover(); p != nil {
			r.Err = errors.Join(r.Err, fmt.Errorf("job %q panicked: %v", j.Name, p))
		}
	}()
	jctx := ctx
	if opts.PerJobTimeout > 0 {
		var cancel context.CancelFunc
		jctx, cancel = context.WithTimeout(ctx, opts.PerJobTimeout)
		defer cancel()
	}
	ex, err := opts.Backend.NewExecutor(jctx, j.Name)
	if err != nil {
		r.Err = err
		return r
	}
	r.Workspace = ex.Workspace()
	defer func() {
		// Clean up even when the job's context has ended.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if err := ex.Close(cctx); err != nil {
			r.Err = errors.Join(r.Err, fmt.Errorf("job %q: clean up: %w", j.Name, err))
		}
	}()
	r.Value, r.Err = j.Run(jctx, ex)
	if r.Err == nil && jctx.Err() != nil {
		// The job ignored its context: its result is still late.
		r.Err = fmt.Errorf("job %q: %w", j.Name, jctx.Err())
	} else if r.Err != nil {
		r.Err = fmt.Errorf("job %q: %w", j.Name, r.Err)
	}
	return r
}

// bar is a progress bar, or nothing.
type bar struct {
	mu sync.Mutex // guards pb
	pb *progressbar.ProgressBar
}

func newBar(opts Options, n int) *bar {
	w := opts.Progress
	if w == nil && !opts.Quiet && term.IsTerminal(int(os.Stderr.Fd())) {
		w = os.Stderr
	}
	if w == nil || opts.Quiet || n == 0 {
		return &bar{}
	}
	return &bar{pb: progressbar.NewOptions(n,
		progressbar.OptionSetWriter(w), progressbar.OptionSetDescription("jobs"),
		progressbar.OptionShowCount(), progressbar.OptionClearOnFinish(),
		progressbar.OptionThrottle(100*time.Millisecond))}
}

func (b *bar) add() {
	if b.pb == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.pb.Add(1)
}

func (b *bar) finish() {
	if b.pb == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.pb.Finish()
}
