//go:build linux

package inject

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
)

// ErrTimeout is wrapped by Seize when the process did not stop in time (a
// vfork parent, a frozen cgroup). It is of class errdefs.ErrUnavailable:
// trying again later may work.
var ErrTimeout = fmt.Errorf("process did not stop in time: %w", errdefs.ErrUnavailable)

// ErrClosed is wrapped by every call on a closed Tracer.
var ErrClosed = fmt.Errorf("tracer closed: %w", errdefs.ErrFailedPrecondition)

// Tracer serves all ptrace work from one goroutine locked to its OS thread
// (ptrace requests must come from the thread that attached). Safe for
// concurrent use; calls are serialised.
//
// # Threads
//
// The kernel ties a tracee to the thread that attached it, and the only way
// to let go of a tracee that never stops (PTRACE_DETACH needs a stopped one)
// is for that thread to end. So when Seize times out, the thread it used
// stops taking new processes and ends as soon as it serves no attached Proc
// (at once if it serves none), which detaches the stuck process; the next
// Seize starts a new thread. Until then that thread detaches the stuck
// process itself if it happens to stop.
type Tracer struct {
	// mu serialises every call of the Tracer and of its Procs, and guards
	// the fields below and every Proc's fields.
	mu      sync.Mutex
	head    *worker   // where Seize attaches; nil until needed
	workers []*worker // every worker whose thread still runs, head included
	closed  bool
}

// NewTracer returns a Tracer. Its thread starts with the first Seize.
func NewTracer() *Tracer { return &Tracer{} }

// Close ends the tracer's threads and makes every later call fail with
// ErrClosed. It detaches nothing: Procs must be detached (or killed)
// first. Any still attached are let go by the kernel as they are, possibly
// with injection registers, and Close reports them.
func (t *Tracer) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	attached := 0
	for _, w := range t.workers {
		attached += w.procs
	}
	for len(t.workers) > 0 {
		t.retire(t.workers[0])
	}
	t.head = nil
	if attached > 0 {
		return fmt.Errorf("close tracer: %d processes were still attached: %w", attached, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// worker is one OS thread serving ptrace requests.
type worker struct {
	work  chan func()
	ended chan struct{} // closed when the serving goroutine returns
	tid   int
	// pidfd refers to the thread (PIDFD_THREAD), to wait for it to be
	// gone; -1 on kernels without thread pidfds.
	pidfd int
	procs int   // attached Procs served by this worker
	stuck []int // pids a timed-out Seize left attached
}

// startWorker starts a worker and records it. t.mu must be held.
func (t *Tracer) startWorker() *worker {
	w := &worker{work: make(chan func()), ended: make(chan struct{}), pidfd: -1}
	tid := make(chan int)
	go w.serve(tid)
	w.tid = <-tid
	if fd, err := unix.PidfdOpen(w.tid, unix.PIDFD_THREAD); err == nil {
		w.pidfd = fd
	}
	t.workers = append(t.workers, w)
	return w
}

// serve runs on the worker's locked thread until w.work is closed, then
// returns still locked, which makes the runtime end the thread.
func (w *worker) serve(tid chan<- int) {
	runtime.LockOSThread()
	if unix.Gettid() == unix.Getpid() {
		// The runtime never ends the main thread (it parks it when a
		// locked goroutine exits there), and ending the thread is what
		// releases a stuck tracee. Hand over to a goroutine which, with
		// the main thread held here, must get another thread.
		handed := make(chan int)
		go w.serve(handed)
		id := <-handed
		runtime.UnlockOSThread()
		tid <- id
		return
	}
	tid <- unix.Gettid()
	defer close(w.ended)
	for f := range w.work {
		f()
	}
}

// run runs f on the worker's thread and waits for it. t.mu must be held.
func (w *worker) run(f func()) {
	done := make(chan struct{})
	w.work <- func() {
		defer close(done)
		f()
	}
	<-done
}

// retire ends w's thread and waits until the kernel has let go of every
// process it still traced. t.mu must be held.
func (t *Tracer) retire(w *worker) {
	if t.head == w {
		t.head = nil
	}
	for i, o := range t.workers {
		if o == w {
			t.workers = append(t.workers[:i], t.workers[i+1:]...)
			break
		}
	}
	close(w.work)
	<-w.ended
	// The goroutine has returned; the thread ends right after. The
	// kernel detaches its tracees (exit_ptrace) before it reports the
	// thread gone.
	if w.pidfd >= 0 {
		fds := []unix.PollFd{{Fd: int32(w.pidfd), Events: unix.POLLIN}}
		for {
			if _, err := unix.Poll(fds, -1); !errors.Is(err, unix.EINTR) {
				break
			}
		}
		unix.Close(w.pidfd)
		return
	}
	task := "/proc/self/task/" + strconv.Itoa(w.tid)
	for {
		if _, err := os.Stat(task); err != nil {
			return
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// released is called when a Proc served by w stops being attached. t.mu
// must be held.
func (t *Tracer) released(w *worker) {
	w.procs--
	if w.procs == 0 && t.head != w {
		t.retire(w) // it was only kept for its Procs
	}
}

// releaseStuck detaches the processes a timed-out Seize left attached to
// w if they have stopped since. It runs on w's thread.
func (w *worker) releaseStuck() {
	kept := w.stuck[:0]
	for _, pid := range w.stuck {
		ws, wpid, err := wait4(pid, unix.WNOHANG)
		switch {
		case err != nil || ws.Exited() || ws.Signaled():
			// gone: nothing left to release
		case wpid == 0:
			kept = append(kept, pid)
		case ws.Stopped():
			sig := 0
			if event(ws) == 0 && ws.StopSignal()&0x80 == 0 {
				sig = int(ws.StopSignal()) // a signal-delivery-stop: deliver it
			}
			_ = ptrace(unix.PTRACE_DETACH, pid, 0, uintptr(sig))
		}
	}
	w.stuck = kept
}
