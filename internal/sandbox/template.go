//go:build linux

package sandbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/inject"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/procfs"
	"github.com/deltabox/deltabox/internal/sandbox/cgroup"
)

// Templates are the frozen processes of one checkpoint (the fast path of
// ../shared/design/ARCHITECTURE.md, "The coupled checkpoint"): the sandbox's
// idle sessions, stopped in place at the instant of the checkpoint, in the
// generation they ran in. They never run again; restores and forks clone
// them into new generations (see generation). Templates are safe for
// concurrent use; clones of one template are serialised on the tracer.
type Templates struct {
	g      *generation   // the generation they ran in; they are the only processes left in it
	cg     cgroup.Cgroup // theirs and their generation's init's
	tracer *inject.Tracer
	procs  []*template
	// Pause is how long the checkpoint stopped the sessions: from the
	// attach to the clones running.
	Pause time.Duration
	// reopen: the clones of seized sessions go on in another root (a copy
	// of the layer, see cloneAhead), so they reopen their files there
	// rather than keep the sessions' (which would write the checkpoint's).
	reopen bool

	rt *Runtime

	mu       sync.Mutex // guards released, spares, want and refilling
	released bool
	// spares are child generations of g made ahead of time, set up on the
	// stand-in root: a restore or fork takes one instead of booting an
	// init. want is how many are kept (see FanOut).
	spares    []*generation
	want      int
	fanning   int            // fan-outs running (see FanOut): no refill meanwhile
	refilling bool           // spares are being made
	bg        sync.WaitGroup // the making of spares
	quit      chan struct{}  // closed by Release: a spare still queued gives up
	users     sync.WaitGroup // restores, forks and preparations using them (see use)
}

// use pins the templates for one restore, fork or preparation: Release
// waits for it. It reports false when they are released already.
func (ts *Templates) use() bool {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if ts.released {
		return false
	}
	ts.users.Add(1)
	return true
}

// takeGeneration returns a child generation of the templates' for a
// sandbox whose cgroup is cg: the spare if there is one (moved into cg),
// else a new one; a new spare is made in the background.
func (ts *Templates) takeGeneration(ctx context.Context, cg cgroup.Cgroup, log *slog.Logger) (*generation, error) {
	ts.mu.Lock()
	if ts.released {
		ts.mu.Unlock()
		return nil, fmt.Errorf("%w (%w)", ErrTemplatesGone, errdefs.ErrFailedPrecondition)
	}
	var g *generation
	if n := len(ts.spares); n > 0 {
		g, ts.spares = ts.spares[n-1], ts.spares[:n-1]
	}
	ts.mu.Unlock()
	defer ts.refill()
	if g != nil && g.alive() {
		if err := cg.Add(g.hostPid); err == nil {
			return g, nil
		}
	}
	if g != nil {
		g.release()
	}
	return ts.rt.spawnGeneration(ctx, ts.g, cg, log)
}

// maxSpares bounds the spare generations kept for one set of templates.
const maxSpares = 64

// FanOut marks the start of a fan-out of n forks from these templates (n
// ForkTemplates calls); the returned func marks its end. Meanwhile the
// spares the forks take are not made again: booting inits would take CPU
// from the fan-out itself. At its end the templates keep n spare
// generations (at least one, at most maxSpares), made in the background,
// so that the next fan-out of n from this checkpoint (a policy's next batch
// of rollouts from the same state) finds them ready. Each costs an idle
// init (about a megabyte), so only the templates of the runtime's latest
// fan-out keep more than one: the previous ones go back to one.
func (ts *Templates) FanOut(n int) (end func()) {
	ts.mu.Lock()
	ts.fanning++
	ts.mu.Unlock()
	return func() {
		ts.rt.fanOutMu.Lock()
		prev := ts.rt.fanOut
		ts.rt.fanOut = ts
		ts.rt.fanOutMu.Unlock()
		if prev != nil && prev != ts {
			prev.keepSpares(1)
		}
		ts.mu.Lock()
		ts.fanning--
		ts.want = min(max(n, 1), maxSpares)
		ts.mu.Unlock()
		ts.refill()
	}
}

// keepSpares lowers the spares kept to n, releasing the extra ones.
func (ts *Templates) keepSpares(n int) {
	ts.mu.Lock()
	ts.want = n
	var extra []*generation
	if len(ts.spares) > n {
		extra = append(extra, ts.spares[n:]...)
		ts.spares = ts.spares[:n]
	}
	ts.mu.Unlock()
	for _, g := range extra {
		g.release()
	}
}

// refill makes spare generations in the background until there are as many
// as wanted (one by default), each set up ahead on the stand-in root (see
// Runtime.setUpAhead).
func (ts *Templates) refill() {
	ts.mu.Lock()
	if ts.released || len(ts.spares) >= max(ts.want, 1) || ts.refilling || ts.fanning > 0 {
		ts.mu.Unlock()
		return
	}
	ts.refilling = true
	ts.bg.Add(1)
	ts.mu.Unlock()
	ts.rt.background(&ts.bg, ts.quit, func(ctx context.Context) {
		defer func() {
			ts.mu.Lock()
			ts.refilling = false
			ts.mu.Unlock()
		}()
		for {
			ts.mu.Lock()
			enough := ts.released || len(ts.spares) >= max(ts.want, 1) || ts.fanning > 0
			ts.mu.Unlock()
			if enough || ctx.Err() != nil {
				return
			}
			g, err := ts.rt.spawnGeneration(ctx, ts.g, ts.cg, ts.rt.log)
			if err != nil {
				return
			}
			if err := ts.rt.setUpAhead(ctx, g); err != nil {
				ts.rt.log.Debug("spare generation of templates: setup failed", "err", err)
				g.release()
				return
			}
			g.prehold(ctx, len(ts.procs)) // the clones' stdio, held ahead too
			ts.mu.Lock()
			if ts.released || len(ts.spares) >= max(ts.want, 1) { // fewer wanted meanwhile
				ts.mu.Unlock()
				g.release()
				return
			}
			ts.spares = append(ts.spares, g)
			ts.mu.Unlock()
		}
	})
}

// template is one frozen process and what a clone needs to continue it in
// another generation.
type template struct {
	// mu serialises the clones of one template (and Alive's look at it):
	// while one is made, the template is ptrace-stopped, not in group-stop
	// (nor between clones that queue: see lock).
	mu      sync.Mutex
	waiting atomic.Int32 // clones waiting for mu
	held    *inject.Proc // the template, attached, between queued clones (under mu)
	pid     int          // host pid
	start   string
	kind    SessionKind
	origin  *generation // its parent's (the init that reaps its clones)
	cwd     string
	fds     []fdRef
	tidOff  uintptr
	pc, sp  uintptr  // where it stopped: a template found elsewhere was resumed
	run     runState // when it was looked at (see inspect)
	// scratch is dead stack memory of the template (and of its clones, at
	// first) for injected arguments, found by its first clone (under mu).
	scratch uintptr
}

// fdRole says what a clone does with one of its template's fds.
type fdRole uint8

const (
	fdReopen fdRole = iota // a file of the sandbox: opened again by path, same flags and offset
	fdStdin                // the session's stdin pipe: the clone's fresh one
	fdStdout
	fdStderr
)

// fdRef is one fd of a template; it is stored with the checkpoint (see
// TemplatesRecord).
type fdRef struct {
	FD    int    `json:"fd"`
	Role  fdRole `json:"role"`
	Path  string `json:"path,omitempty"` // fdReopen: the path inside the sandbox
	Flags int    `json:"flags"`          // open flags, from fdinfo
	Pos   int64  `json:"pos,omitempty"`
}

// IneligibleError says why a sandbox's processes cannot become templates:
// which process and what it holds (threads, children, sockets, shared
// memory). The checkpoint then takes the slow path.
type IneligibleError struct {
	Reasons []string
}

func (e *IneligibleError) Error() string {
	return "not eligible for process templates: " + strings.Join(e.Reasons, "; ")
}

// tracer returns the runtime's ptrace thread, started on first use.
func (r *Runtime) tracerThread() *inject.Tracer {
	r.tracerOnce.Do(func() { r.tracer = inject.NewTracer() })
	return r.tracer
}

// tidOffset finds where the libc of the stopped process p keeps its thread
// id (a clone must have it rewritten: CLONE_CHILD_SETTID). A session's pid
// is small in its namespace, so a scan of its thread control block for the
// value could stop at an unrelated field: the offset is calibrated once on a
// host process, whose pid is large, and checked on p.
func (r *Runtime) tidOffset(ctx context.Context, p *inject.Proc) (uintptr, error) {
	if off, err := r.hostTIDOffset(ctx); err == nil {
		if ok, err := p.HasTID(off); err == nil && ok {
			return off, nil
		}
	}
	// Another libc than the host's: trust a scan only for a pid no other
	// field is likely to equal.
	if ns, err := procfs.NSpids(p.Pid()); err == nil && ns[len(ns)-1] >= 1000 {
		return p.TIDOffset()
	}
	_, herr := r.hostTIDOffset(ctx)
	return 0, fmt.Errorf("cannot locate its libc's thread id (host calibration: %v)", herr)
}

// hostTIDOffset is the thread id's offset calibrated on a host process,
// once per runtime. A sandbox's first spare (prepareNext) asks for it, so
// that the first checkpoint does not pay for a process start and a scan
// (about 10 ms) in its pause.
func (r *Runtime) hostTIDOffset(ctx context.Context) (uintptr, error) {
	// Not the caller's context: the result is kept for the runtime's life,
	// and a cancelled preparation must not leave it an error (seizeTimeout
	// bounds the calibration).
	r.tidOnce.Do(func() { r.hostTID, r.hostTIDErr = r.calibrateTID(context.WithoutCancel(ctx)) })
	return r.hostTID, r.hostTIDErr
}

// calibrateTID finds the thread id's offset in a host process (sleep).
func (r *Runtime) calibrateTID(ctx context.Context) (uintptr, error) {
	path, err := exec.LookPath("sleep")
	if err != nil {
		return 0, err
	}
	cmd := exec.Command(path, "60")
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	// Attached while it still runs the dynamic loader, the thread pointer
	// may not be set up: wait until it sleeps.
	for i := 0; i < 200 && procfs.State(cmd.Process.Pid) != "S"; i++ {
		time.Sleep(time.Millisecond)
	}
	p, err := r.tracerThread().Seize(ctx, cmd.Process.Pid, seizeTimeout)
	if err != nil {
		return 0, err
	}
	defer func() { _ = p.Detach(false) }()
	return p.TIDOffset()
}

// seizeTimeout bounds the attach of one process (a vfork parent never stops).
const seizeTimeout = 2 * time.Second

// CheckpointTemplates is the checkpoint's fast path. When every process of
// the sandbox is an idle session (single-threaded, childless, no socket, no
// writable shared mapping, no call running), it stops them, freezes them in
// place as the templates and moves the sandbox on into a new generation
// nested under the old one: each session is cloned from its template.
// What the sessions see changes only in their pids.
//
// capture commits the filesystem: with copied nil, a snapshot of the
// sandbox's writable layer, which stays the live one; otherwise the switch
// to copied, the copy made with clones ahead (see cloneAhead), which the
// sandbox goes on in (layer.Preparer's CommitPrepared). It must call
// captured at the instant the content is taken (the clones start only
// then) and may go on with its bookkeeping afterwards. A snapshot may be
// taken a second time, whose commit replaces the first (one taken before
// the stop, for clones made ahead, that a session which ran meanwhile
// voided); it runs while the clones are made, so that the pause is the
// longer of the two, not their sum. The switch is taken once, when nothing
// else can fail.
//
// It returns an *IneligibleError, having changed nothing, when the sandbox
// does not qualify, and an error wrapping ErrTooDeep at the nesting limit.
// name names the templates' cgroup. When capture fails before captured,
// nothing changed; after it, the sandbox lives on in the new generation and
// only the templates are gone. A commit capture made stays its own to undo.
func (s *Sandbox) CheckpointTemplates(ctx context.Context, name string, capture func(ctx context.Context, copied *layer.Prepared, captured func()) error) (_ *Templates, err error) {
	s.interruptPreps(false) // a restore made ready is for the previous head; the spare is ours
	s.switchMu.Lock()
	defer s.switchMu.Unlock()
	s.mu.Lock()
	old := s.g
	sessions := make([]*session, 0, len(s.sess))
	for _, ss := range s.sess {
		sessions = append(sessions, ss)
	}
	destroyed := s.destroyed
	s.mu.Unlock()
	if destroyed || !old.alive() {
		return nil, fmt.Errorf("sandbox %q is not running: %w", s.id, errdefs.ErrFailedPrecondition)
	}
	if len(sessions) == 0 {
		return nil, &IneligibleError{Reasons: []string{"no session to keep"}}
	}
	slices.SortFunc(sessions, func(a, b *session) int { return int(a.kind) - int(b.kind) })
	for _, ss := range sessions {
		if !ss.mu.TryLock() {
			return nil, &IneligibleError{Reasons: []string{ss.kind.String() + " session: a call is running"}}
		}
		defer ss.mu.Unlock()
	}
	if old.level+1 > MaxPidNSLevel {
		return nil, fmt.Errorf("checkpoint sandbox %q: it is %d generations deep (pid namespace level %d, the kernel allows %d): %w (%w)",
			s.id, old.level-s.rootLevel(), old.level, MaxPidNSLevel, ErrTooDeep, errdefs.ErrFailedPrecondition)
	}

	// 1. Which processes: exactly one per session, nothing else.
	inits := s.initPids()
	byPid, reasons, err := s.idleSessions(sessions, inits)
	if err != nil {
		return nil, err
	}
	if len(reasons) > 0 {
		return nil, &IneligibleError{Reasons: reasons}
	}

	// 2. The next generation, before anything stops: that of the clones
	//    made ahead (see cloneAhead), used only if the sessions did not run
	//    since, else the spare, its init booted and normally set up on the
	//    root already (prepareNext).
	var next *generation
	var nextRoot string
	switched := false // the sandbox lives in next: nothing to undo
	spent := false    // next's setup failed: it can serve nothing
	ah := s.takeAhead()
	defer func() {
		switch {
		case err == nil || switched: // once switched, the clones made ahead are the live sessions
		case ah != nil:
			s.discardAhead(ah) // and next, theirs
		case next == nil:
		case spent:
			next.release()
		default:
			s.giveBack(next, nextRoot)
		}
	}()
	// stale drops the clones made ahead and takes the spare, or boots a
	// generation, instead.
	stale := func(why string) error {
		s.log.Debug("checkpoint: the clones made ahead are stale", "why", why)
		s.discardAhead(ah)
		ah, next = nil, nil
		g, root, err := s.takeNext(ctx)
		if err != nil {
			return fmt.Errorf("checkpoint sandbox %q: %w", s.id, err)
		}
		next, nextRoot = g, root
		return nil
	}
	if ah == nil {
		if next, nextRoot, err = s.takeNext(ctx); err != nil {
			return nil, fmt.Errorf("checkpoint sandbox %q: %w", s.id, err)
		}
	} else {
		next, nextRoot = ah.g, ah.root
		s.mu.Lock()
		writing := s.writing
		s.mu.Unlock()
		if writing > 0 {
			// Files written from the host, or a command's end: they may
			// have changed what the clones and the copy were made from.
			if err := stale("the sandbox is being written to"); err != nil {
				return nil, err
			}
		}
	}
	// With a copy made ahead (ah.copied), the capture is the switch to it:
	// nothing to capture in the pause but the commit's bookkeeping.
	captureTo := func(p *layer.Prepared) func(context.Context, func()) error {
		return func(ctx context.Context, captured func()) error { return capture(ctx, p, captured) }
	}

	// The templates' cgroup, before anything stops.
	tcg, err := s.rt.templatesCgroup(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("checkpoint sandbox %q: %w", s.id, err)
	}
	defer func() {
		if err != nil && !switched {
			s.rt.deleteTemplatesCgroup(context.Background(), tcg)
		}
	}()

	// 3. Stop the sessions (ptrace: a stopped process cannot fork) and
	//    check them.
	tr := s.rt.tracerThread()
	var stopped []*inject.Proc
	defer func() {
		for _, p := range stopped {
			_ = p.Detach(false) // they go on as they were
		}
	}()
	// A look before anything stops, so that a sandbox that is not eligible
	// costs no capture, and the clones are made from it: the look that
	// counts is taken once they are stopped, alongside the clones (see
	// verify).
	looked := map[int]*template{}
	for pid, ss := range byPid {
		// Just done with a call (the state read as data, say), a session
		// may still be on its way to its next read, its fds not settled.
		_, _ = asleepAgain(ctx, pid)
		t, why := inspect(pid, ss, nil)
		if why != "" {
			return nil, &IneligibleError{Reasons: []string{fmt.Sprintf("%s session (pid %d): %s", ss.kind, pid, why)}}
		}
		looked[pid] = t
	}
	if ah != nil && !ah.asleepAsCloned(looked) {
		if err := stale("a session ran"); err != nil {
			return nil, err
		}
	}
	// 4. The filesystem at this instant: nothing of the sandbox runs. It is
	//    taken while the sessions are verified and cloned; the clones start
	//    only once it is. Every return from here waits for it (the caller
	//    undoes a commit that is not acknowledged). With clones made ahead
	//    it need not even wait for the stop: the sessions have not run
	//    since the clones were made, and the stop is checked to have come
	//    before they could (stoppedAsCloned).
	var cr *captureRun
	defer func() {
		if err != nil && cr != nil {
			_ = cr.wait()
		}
	}()
	began := time.Now()
	if ah != nil && ah.copied() == nil {
		cr = startCapture(ctx, captureTo(nil))
	}
	order := make([]*session, 0, len(byPid))
	for pid, ss := range byPid {
		p, err := tr.Seize(ctx, pid, seizeTimeout)
		if err != nil {
			return nil, &IneligibleError{Reasons: []string{fmt.Sprintf("%s session (pid %d): %v", ss.kind, pid, err)}}
		}
		stopped = append(stopped, p)
		order = append(order, ss)
	}
	if ah != nil {
		if why := ah.stoppedAsCloned(stopped); why != "" {
			// It ran meanwhile (a signal in these milliseconds): what the
			// capture holds may be newer than the session. Taken again,
			// now that it is stopped, and cloned on the spot.
			if cr != nil {
				_ = cr.wait()
				cr = nil
			}
			if err := stale(why); err != nil {
				return nil, err
			}
		}
	}
	if cr == nil && ah.copied() == nil {
		cr = startCapture(ctx, captureTo(nil))
	}
	// The look that counts, off the pause's path: the clones are made from
	// the look before the stop meanwhile and start only if this one agrees.
	// With clones made ahead there are none to make, and it would be the
	// pause's path: the look before the stop is the one that counts, since
	// the stop came in the sleep it saw (stoppedAsCloned: any run since,
	// a handler's included, would have slept once more or stopped
	// elsewhere), and no process can have started (spawns wait for the
	// switch lock; a session's own would have had it run).
	verified := make(chan verdict, 1)
	if ah != nil {
		verified <- verdict{seen: looked}
	} else {
		go func() { verified <- s.verify(order, stopped, looked, next, inits) }()
	}
	tpls := make([]*template, 0, len(order))
	for i, ss := range order {
		p := stopped[i]
		t := looked[p.Pid()]
		if t.tidOff, err = s.rt.tidOffset(ctx, p); err != nil {
			reasons = append(reasons, fmt.Sprintf("%s session (pid %d): %v", ss.kind, p.Pid(), err))
			continue
		}
		t.pc, t.sp = p.Regs().PC(), p.Regs().SP()
		t.origin = ss.p.origin
		if t.origin == nil {
			t.origin = old
		}
		tpls = append(tpls, t)
	}
	if len(reasons) > 0 {
		<-verified
		return nil, &IneligibleError{Reasons: reasons}
	}
	seized := time.Now()
	s.mu.Lock()
	root := s.rootfs
	s.mu.Unlock()
	if ah == nil && nextRoot != root {
		// No spare was ready: its setup joins the pause.
		if err := s.rt.rootInit(ctx, s, next, root); err != nil {
			spent = true
			<-verified
			return nil, fmt.Errorf("checkpoint sandbox %q: %w", s.id, err)
		}
		nextRoot = root
	}
	configured := time.Now()

	// 5. The clones, made but not started; then the instant of capture.
	ts := &Templates{g: old, tracer: tr, procs: tpls, rt: s.rt, quit: make(chan struct{})}
	var fresh map[SessionKind]*session
	var clones []*inject.Proc
	var cerr error
	if ah != nil {
		fresh = ah.sessions
	} else {
		fresh, clones, cerr = ts.cloneAll(ctx, stopped, next, s, nil)
	}
	if v := <-verified; cerr == nil && len(v.reasons) > 0 {
		cerr = &IneligibleError{Reasons: v.reasons}
	} else if cerr == nil {
		for _, t := range tpls { // what the templates hold, for later clones
			t.fds, t.start = v.seen[t.pid].fds, v.seen[t.pid].start
		}
	}
	if cr == nil && cerr == nil {
		// The switch to the copy, once nothing can undo the checkpoint:
		// the layer store cannot take it back.
		cr = startCapture(ctx, captureTo(ah.copied()))
	}
	switch {
	case cerr == nil:
		cerr = cr.instant()
	case cr != nil:
		_ = cr.wait() // the capture ran all the same: the caller undoes it
	}
	if cerr != nil {
		// Back as they were: the clones never ran; the sessions resume
		// with the pid namespace of their children restored.
		for _, c := range clones {
			_ = c.Kill()
		}
		if ah != nil {
			s.discardAhead(ah)
			ah, fresh, next = nil, nil, nil // next was theirs
		}
		for _, p := range stopped {
			if rerr := resetPidNS(p); rerr != nil {
				s.log.Warn("checkpoint undo: a session's children would be born in the new generation; killing it", "pid", p.Pid(), "err", rerr)
				_ = p.Kill()
			}
		}
		for _, ss := range fresh {
			ss.closePipes()
		}
		return nil, fmt.Errorf("checkpoint sandbox %q: %w", s.id, cerr)
	}
	start(s.log, clones)
	if ah != nil {
		if serr := ah.start(); serr != nil {
			s.log.Warn("checkpoint: a clone made ahead did not start", "err", serr)
		}
	}
	switched = true
	cloned := time.Now()
	ts.Pause = cloned.Sub(began)
	for _, p := range stopped {
		_ = p.Detach(true) // the templates, after the clones: not on the pause
	}
	stopped = nil
	var oldCgs []cgroup.Cgroup // the sessions' cgroups, when the clones have their own

	s.mu.Lock()
	s.g = next
	oldRoot := ""
	if p := ah.copied(); p != nil { // the sandbox goes on in the copy
		oldRoot = s.rootfs
		s.rootfs, s.view = ah.root, p.View
	}
	var oldShell *session
	for _, ss := range sessions {
		delete(s.sess, ss.kind)
		if ss.kind == SessionShell {
			oldShell = ss
		}
	}
	for k, ss := range fresh {
		s.sess[k] = ss
	}
	if s.shellOf != nil && s.shellOf == oldShell {
		s.shellOf = fresh[SessionShell] // the same state
	}
	if ah != nil {
		for name, cg := range ah.cgs {
			if o, ok := s.children[name]; ok {
				oldCgs = append(oldCgs, o)
			}
			s.children[name] = cg
		}
	}
	s.stepping = true
	s.mu.Unlock()
	for _, ss := range sessions {
		ss.closePipes()
	}
	if oldRoot != "" {
		s.detachRoot(oldRoot) // the templates' now: their generation holds it
	}
	s.log.Debug("checkpoint templates", "seize_ms", ms(seized.Sub(began)), "root_ms", ms(configured.Sub(seized)),
		"capture_ms", ms(cr.when.Sub(began)), "clone_ms", ms(cloned.Sub(configured)), "pause_ms", ms(ts.Pause), "ahead", ah != nil, "switched", ah.copied() != nil)
	// The templates' home (made before the pause); then, off the pause,
	// the next checkpoint's generation, and the templates' generations
	// outlive the daemon.
	ts.cg = tcg
	err = nil
	for _, t := range tpls {
		err = errors.Join(err, tcg.Add(t.pid))
	}
	if len(oldCgs) > 0 {
		// Emptied by the move of the templates.
		s.tearDown(func() {
			for _, cg := range oldCgs {
				_ = cg.Delete(context.Background())
			}
		})
	}
	if aerr := tcg.Add(old.hostPid); aerr != nil {
		// It stays in the sandbox's cgroup, as the parent generation of
		// the live one: a checkpoint must not take it for workload.
		s.log.Error("checkpoint: the templates' generation could not leave the sandbox's cgroup", "pid", old.hostPid, "err", aerr)
		s.mu.Lock()
		s.ancestors[old.hostPid] = true
		s.mu.Unlock()
		err = errors.Join(err, aerr)
	}
	s.prepareNext()
	err = errors.Join(err, cr.wait()) // and the capture's bookkeeping
	if err != nil {
		ts.Release()
		return nil, fmt.Errorf("checkpoint sandbox %q: the sandbox goes on, its templates are dropped: %w", s.id, err)
	}
	ts.refill()
	if err := s.rt.persist(ctx, old); err != nil {
		s.log.Warn("checkpoint: templates will not survive a daemon restart", "err", err)
	}
	return ts, nil
}

// idleSessions maps the one process of each session (host pid) to it, and
// says why not when the sandbox runs more than that (inits, the processes
// of inits, are none of its workload). The caller holds every session's
// lock.
func (s *Sandbox) idleSessions(sessions []*session, inits map[int]bool) (map[int]*session, []string, error) {
	hostPids, err := s.cg.Procs()
	if err != nil {
		return nil, nil, err
	}
	byPid := map[int]*session{}
	var reasons []string
	for _, ss := range sessions {
		p, err := ss.p.cg.Procs()
		if err != nil || len(p) != 1 {
			reasons = append(reasons, fmt.Sprintf("%s session: %d processes", ss.kind, len(p)))
			continue
		}
		byPid[p[0]] = ss
	}
	for _, pid := range hostPids {
		if byPid[pid] == nil && !s.notWorkload(pid, inits) {
			reasons = append(reasons, fmt.Sprintf("process %d (%s, state %s): not an idle session", pid, procfs.Cmdline(pid), procfs.State(pid)))
		}
	}
	return byPid, reasons, nil
}

// verify is the checkpoint's look at its stopped sessions (order, stopped
// by the tracer as stopped): nothing else may have appeared in the
// sandbox, each must still be eligible, and what a checkpoint's clone takes
// from its template (cwd, stdio) must be what the look before the stop
// (looked, read only) saw, which the clones are made from meanwhile.
func (s *Sandbox) verify(order []*session, stopped []*inject.Proc, looked map[int]*template, next *generation, inits map[int]bool) verdict {
	// A spawn that raced us. Next's init and the clones being made
	// (processes of next's pid namespace) are newcomers of ours.
	nextNS, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", next.hostPid))
	ours := func(p int) bool {
		if p == next.hostPid || s.notWorkload(p, inits) {
			return true
		}
		ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", p))
		return err == nil && nextNS != "" && ns == nextNS
	}
	if now, err := s.cg.Procs(); err != nil || len(slices.DeleteFunc(now, ours)) != len(order) {
		return verdict{reasons: []string{"processes started during the checkpoint"}}
	}
	v := verdict{seen: map[int]*template{}}
	for i, ss := range order {
		pid := stopped[i].Pid()
		// The clone's program holds a pidfd in the template for a moment;
		// one the look before the stop saw would be the workload's.
		transient := func(fd int, link string) bool {
			return link == "anon_inode:[pidfd]" && !slices.ContainsFunc(looked[pid].fds, func(f fdRef) bool { return f.FD == fd })
		}
		t, why := inspect(pid, ss, transient)
		if why == "" && t.cloneKey() != looked[pid].cloneKey() {
			why = "it changed while it was being stopped"
		}
		if why != "" {
			v.reasons = append(v.reasons, fmt.Sprintf("%s session (pid %d): %s", ss.kind, pid, why))
			continue
		}
		v.seen[pid] = t
	}
	return v
}

// verdict is what verify found: why the sessions cannot be templates, or
// what each holds (by pid).
type verdict struct {
	reasons []string
	seen    map[int]*template
}

// cloneKey is what a checkpoint's clone takes from t (it keeps its files):
// its cwd and which fds are its stdio.
func (t *template) cloneKey() string {
	k := t.cwd
	for _, f := range t.fds {
		if f.Role != fdReopen {
			k += fmt.Sprintf("|%d:%d:%d", f.FD, f.Role, f.Flags&unix.O_CLOEXEC)
		}
	}
	return k
}

// captureRun is a filesystem capture of CheckpointTemplates, running.
type captureRun struct {
	at       chan struct{} // closed at the instant of capture
	done     chan error
	when     time.Time // the instant, once at is closed
	finished bool
	err      error
}

func startCapture(ctx context.Context, capture func(context.Context, func()) error) *captureRun {
	c := &captureRun{at: make(chan struct{}), done: make(chan error, 1)}
	var once sync.Once
	go func() {
		c.done <- capture(ctx, func() { once.Do(func() { c.when = time.Now(); close(c.at) }) })
	}()
	return c
}

// instant waits for the instant of capture, or for the capture's failure
// before it.
func (c *captureRun) instant() error {
	select {
	case <-c.at:
		return nil
	case err := <-c.done:
		c.finished, c.err = true, err
		select {
		case <-c.at:
			return nil
		default:
		}
		if err == nil {
			err = errors.New("capture returned without taking the content")
		}
		return err
	}
}

// wait waits for the whole capture (its bookkeeping too) and returns its
// error.
func (c *captureRun) wait() error {
	if !c.finished {
		c.finished, c.err = true, <-c.done
	}
	return c.err
}

// resetPidNS points the pid namespace for the children of a stopped session
// back at its own (a clone moved it to the next generation's).
func resetPidNS(p *inject.Proc) error {
	return p.Batch(func(b *inject.Batch) error {
		pid, err := b.Syscall(p, unix.SYS_GETPID)
		if err != nil {
			return err
		}
		pfd, err := b.Syscall(p, unix.SYS_PIDFD_OPEN, pid, 0)
		if err != nil {
			return err
		}
		defer func() { _, _ = b.Syscall(p, unix.SYS_CLOSE, pfd) }()
		_, err = b.Syscall(p, unix.SYS_SETNS, pfd, unix.CLONE_NEWPID)
		return err
	})
}

// atFDCWD is AT_FDCWD as a syscall argument (sign-extended).
var atFDCWD = func() uintptr { v := unix.AT_FDCWD; return uintptr(v) }()

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// spareFits reports whether g, set up on root ("" while it waits for its
// setup), can serve the live generation's next checkpoint: a spare set up
// on another root (a slow-path restore moved the sandbox) cannot be set up
// again. s.mu must be held.
func (s *Sandbox) spareFits(g *generation, root string) bool {
	return g != nil && g.parent == s.g && g.alive() && (root == "" || root == s.rootfs)
}

// takeNext returns a child generation of the live one, in the sandbox's
// cgroup, and the root its init is set up on ("" when none yet): the spare
// if it fits, else a new one.
func (s *Sandbox) takeNext(ctx context.Context) (*generation, string, error) {
	s.mu.Lock()
	g, root, cur, fits := s.spare, s.spareRoot, s.g, s.spareFits(s.spare, s.spareRoot)
	s.spare, s.spareRoot = nil, ""
	s.mu.Unlock()
	if fits {
		return g, root, nil
	}
	if g != nil {
		g.release()
	}
	g, err := s.rt.spawnGeneration(ctx, cur, s.cg, s.log)
	return g, "", err
}

// giveBack keeps an unused next generation (set up on root, or "") as the
// spare, or releases it.
func (s *Sandbox) giveBack(g *generation, root string) {
	s.mu.Lock()
	if !s.destroyed && s.spare == nil && s.spareFits(g, root) {
		s.spare, s.spareRoot = g, root
		g = nil
	}
	s.mu.Unlock()
	if g != nil {
		g.release()
	}
}

// initPids are the host pids of the sandbox's own inits (the live
// generation's, the spare's, prepared restores') and of the processes of a
// replaced generation on their way out: they are no workload.
func (s *Sandbox) initPids() map[int]bool {
	s.mu.Lock()
	out := map[int]bool{s.g.hostPid: true}
	for p := range s.ancestors {
		out[p] = true
	}
	if s.spare != nil {
		out[s.spare.hostPid] = true
	}
	if s.ahead != nil {
		out[s.ahead.g.hostPid] = true
		for _, pid := range s.ahead.pids {
			out[pid] = true
		}
	}
	for g, p := range s.prepared {
		out[g.hostPid] = true
		for _, pid := range p.pids {
			out[pid] = true
		}
	}
	for p := range s.leaving {
		out[p] = true
	}
	cgs := make([]cgroup.Cgroup, 0, len(s.leavingCgs))
	for cg := range s.leavingCgs {
		cgs = append(cgs, cg)
	}
	s.mu.Unlock()
	// The replaced sessions, by their cgroups (read here, once, rather than
	// listed by the restore that replaced them).
	for _, cg := range cgs {
		if pids, err := cg.Procs(); err == nil {
			for _, p := range pids {
				out[p] = true
			}
		}
	}
	return out
}

// notWorkload reports whether a process of the sandbox's cgroup is none of
// its workload: one of its inits or replaced sessions (inits, from
// initPids), or on its way out.
func (s *Sandbox) notWorkload(pid int, inits map[int]bool) bool {
	return inits[pid] || procfs.Exiting(pid)
}

// prepareNext makes a spare child generation of the live one in the
// background, unless there is one, and sets it up on the live root: the
// next checkpoint's init is then booted and its root ready (the sandbox
// keeps its root across a checkpoint), so that neither competes with the
// checkpoint's pause.
func (s *Sandbox) prepareNext() {
	s.mu.Lock()
	// One at a time: every session call asks, and each would boot an init.
	if s.nexting {
		s.nextAgain = true
		s.mu.Unlock()
		return
	}
	// None while clones made ahead hold the next checkpoint's generation.
	if s.destroyed || s.ahead != nil || (s.spareReady() && !s.aheadWanted) {
		s.mu.Unlock()
		return
	}
	s.nexting = true
	s.bg.Add(1)
	s.mu.Unlock()
	s.rt.background(&s.bg, s.quit, func(ctx context.Context) {
		ctx, done := s.startPrep(ctx, false)
		defer done()
		_, _ = s.rt.hostTIDOffset(ctx) // what the first checkpoint needs, found ahead
		// A checkpoint waits for a spare in the making: until it is
		// registered, its init would look like a workload process. Under
		// the lock, the live generation and root cannot change meanwhile.
		s.switchMu.RLock()
		defer s.switchMu.RUnlock()
		// Before the unlock: whatever replaces the live generation next
		// asks for its own spare, and must not find this one in flight. One
		// interrupted (by what replaced the generation it was for) asks
		// again, for the new one: that operation's own ask found it in
		// flight.
		defer func() { s.nextDone(ctx.Err() != nil) }()
		g, groot, err := s.takeNext(ctx)
		if err != nil {
			return
		}
		s.mu.Lock()
		root := s.rootfs
		s.mu.Unlock()
		if groot != root { // not set up yet
			if err := s.rt.rootInit(ctx, s, g, root); err != nil {
				s.log.Debug("spare generation: setup failed", "err", err)
				g.release()
				return
			}
			s.mu.Lock()
			n := len(s.sess)
			s.mu.Unlock()
			g.prehold(ctx, n)
		}
		s.giveBack(g, root)
		s.cloneAhead(ctx)
	})
}

// spareReady reports whether the spare generation is set up on the live
// root. s.mu must be held.
func (s *Sandbox) spareReady() bool {
	return s.spareRoot != "" && s.spareFits(s.spare, s.spareRoot)
}

// nextDone ends prepareNext's job (or the clones made ahead in its stead:
// see wantAhead), and has it run again if it was asked for meanwhile or
// retry (it was interrupted, for a generation since replaced).
func (s *Sandbox) nextDone(retry bool) {
	s.mu.Lock()
	s.nexting = false
	again := s.nextAgain
	s.nextAgain = false
	s.mu.Unlock()
	if retry || again {
		s.prepareNext()
	}
}

// startPrep registers a preparation for the live generation running with
// ctx (restore: a restore made ready, else the next checkpoint's spare);
// done unregisters it. Preparations hold the switch lock for reading (their
// processes must not look like workload to a checkpoint before they are
// registered), so an operation that replaces the live generation would wait
// for them: it interrupts them instead (interruptPreps).
func (s *Sandbox) startPrep(ctx context.Context, restore bool) (context.Context, func()) {
	ctx, cancel := context.WithCancel(ctx)
	r := &prepRun{restore: restore, cancel: cancel}
	s.mu.Lock()
	s.preps[r] = true
	s.mu.Unlock()
	return ctx, func() {
		s.mu.Lock()
		delete(s.preps, r)
		s.mu.Unlock()
		cancel()
	}
}

// interruptPreps cancels the restores being made ready and, with spares,
// the next checkpoint's spare being made: a restore or reroot makes both
// useless (they belong to the generation it replaces, or to the previous
// head), a checkpoint the former, and neither should wait for them.
func (s *Sandbox) interruptPreps(spares bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for r := range s.preps {
		if r.restore || spares {
			r.cancel()
		}
	}
}

// prepRun is a preparation in flight (see startPrep).
type prepRun struct {
	restore bool
	cancel  context.CancelFunc
}

// rootLevel is the pid namespace level of the sandbox's tree's root
// generation.
func (s *Sandbox) rootLevel() int {
	g := s.cur()
	for g.parent != nil {
		g = g.parent
	}
	return g.level
}

// inspect reads what a clone of the stopped session process pid needs, or
// says why it cannot be a template. ignore, if not nil, names fds that are
// not the process's own (one it reports, or one gone by the time it is
// read, is left out).
func inspect(pid int, ss *session, ignore func(fd int, link string) bool) (*template, string) {
	dir := "/proc/" + strconv.Itoa(pid)
	status, err := os.ReadFile(dir + "/status")
	if err != nil {
		return nil, err.Error()
	}
	st, threads := parseStatus(status)
	if threads != "1" {
		return nil, threads + " threads"
	}
	if b, err := os.ReadFile(dir + "/task/" + strconv.Itoa(pid) + "/children"); err != nil || strings.TrimSpace(string(b)) != "" {
		return nil, "has child processes"
	}
	maps, err := os.ReadFile(dir + "/maps")
	if err != nil {
		return nil, err.Error()
	}
	for _, line := range strings.Split(string(maps), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && len(f[1]) == 4 && f[1][1] == 'w' && f[1][3] == 's' {
			what := "anonymous"
			if len(f) >= 6 {
				what = f[5]
			}
			return nil, "has a writable shared mapping (" + what + ")"
		}
	}
	roles := map[string]fdRole{}
	for role, f := range map[fdRole]*os.File{fdStdin: ss.p.stdin, fdStdout: ss.p.stdout, fdStderr: ss.p.stderr} {
		var st unix.Stat_t
		if f == nil || unix.Fstat(int(f.Fd()), &st) != nil {
			return nil, "its stdio is gone"
		}
		roles["pipe:["+strconv.FormatUint(st.Ino, 10)+"]"] = role
	}
	t := &template{pid: pid, start: procfs.StartTime(pid), kind: ss.kind, run: st}
	if t.cwd, err = os.Readlink(dir + "/cwd"); err != nil {
		return nil, err.Error()
	}
	if strings.HasSuffix(t.cwd, " (deleted)") {
		return nil, "its working directory was deleted"
	}
	ents, err := os.ReadDir(dir + "/fd")
	if err != nil {
		return nil, err.Error()
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		link, err := os.Readlink(dir + "/fd/" + e.Name())
		if errors.Is(err, os.ErrNotExist) && ignore != nil {
			continue // closed meanwhile: a transient fd (see ignore)
		}
		if err != nil {
			return nil, err.Error()
		}
		if ignore != nil && ignore(fd, link) {
			continue
		}
		ref := fdRef{FD: fd}
		if role, ok := roles[link]; ok {
			ref.Role = role
		} else {
			switch {
			case strings.HasPrefix(link, "socket:"):
				return nil, fmt.Sprintf("holds a socket (fd %d)", fd)
			case strings.HasPrefix(link, "pipe:"):
				return nil, fmt.Sprintf("holds a pipe other than its stdio (fd %d)", fd)
			case !strings.HasPrefix(link, "/"):
				return nil, fmt.Sprintf("holds %s (fd %d)", link, fd)
			case strings.HasSuffix(link, " (deleted)"):
				return nil, fmt.Sprintf("holds a deleted file (fd %d)", fd)
			}
			// A clone reopens it by path: a named pipe's open would block
			// until its other end opens (and the tracer with it).
			if st, err := os.Stat(dir + "/fd/" + e.Name()); err == nil && st.Mode()&os.ModeNamedPipe != 0 {
				return nil, fmt.Sprintf("holds a named pipe (fd %d)", fd)
			}
			ref.Path = link
		}
		info, err := os.ReadFile(dir + "/fdinfo/" + e.Name())
		if err != nil {
			return nil, err.Error()
		}
		for _, line := range strings.Split(string(info), "\n") {
			k, v, _ := strings.Cut(line, ":")
			v = strings.TrimSpace(v)
			switch k {
			case "pos":
				ref.Pos, _ = strconv.ParseInt(v, 10, 64)
			case "flags":
				fl, _ := strconv.ParseInt(v, 8, 64)
				ref.Flags = int(fl)
			}
		}
		t.fds = append(t.fds, ref)
	}
	return t, ""
}

// cloneAll clones every template into the generation next, as the sessions
// of sb, and detaches everything: the templates stopped, the clones running.
// seized are the templates, already attached (the checkpoint's own), or nil
// to attach them here. It returns the new sessions.
//
// cgs are the session cgroups the clones go to, by name, guarded by sb.mu:
// one missing is made (nil: the sandbox's own, sb.children).
func (ts *Templates) cloneAll(ctx context.Context, seized []*inject.Proc, next *generation, sb *Sandbox, cgs map[string]cgroup.Cgroup) (map[SessionKind]*session, []*inject.Proc, error) {
	out := map[SessionKind]*session{}
	var clones []*inject.Proc
	var errs []error
	for i, t := range ts.procs {
		var p *inject.Proc
		if seized != nil {
			p = seized[i]
		}
		ss, c, err := ts.clone(ctx, t, p, next, sb, cgs)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s session: %w", t.kind, err))
			continue
		}
		out[t.kind] = ss
		clones = append(clones, c)
	}
	return out, clones, errors.Join(errs...)
}

// start lets clones made by cloneAll run.
func start(log *slog.Logger, clones []*inject.Proc) {
	for _, c := range clones {
		if err := c.Detach(false); err != nil {
			log.Warn("a clone did not start", "pid", c.Pid(), "err", err)
		}
	}
}

// clone makes one clone of t in next: the injection sequence of
// ../shared/design/branch-namespaces.md. The template switches its pid
// namespace for children to next's and clones itself (clone(CLONE_PARENT):
// the clone is its init's child, not the template's); the clone joins next's
// mount, net, uts and ipc namespaces, goes to its cwd, takes fresh stdio
// from next's init (pidfd_getfd) and opens its files again at their offsets.
// The clone is returned stopped, attached: Detach(false) starts it. A
// template tp the caller seized stays attached; one clone seizes itself is
// left in group-stop again.
func (ts *Templates) clone(ctx context.Context, t *template, tp *inject.Proc, next *generation, sb *Sandbox, cgs map[string]cgroup.Cgroup) (_ *session, c *inject.Proc, err error) {
	tr := newTrace(ctx)
	defer tr.done(sb.log, "clone "+t.kind.String())
	// Fresh stdio: the daemon keeps one end, next's init holds the other
	// until the clone took it.
	p := &proc{origin: t.origin, dead: next.deadCh}
	st, err := next.takeStdio(ctx)
	if err != nil {
		return nil, nil, err
	}
	p.stdin, p.stdout, p.stderr = st.ours[0], st.ours[1], st.ours[2]
	defer func() {
		next.letGo(st)
		if err != nil {
			p.closeHostEnds()
		}
	}()
	initPid, err := next.pidAt(ts.g.level)
	if err != nil {
		return nil, nil, fmt.Errorf("pid of the new init in the template's namespace: %w", err)
	}
	tr.step("hold")
	// Only the fork needs the template: the rest is done outside its lock.
	if c, err = ts.fork(ctx, t, tp, initPid, st.fds, tr); err != nil {
		return nil, nil, err
	}
	defer func() {
		if err != nil {
			_ = c.Kill()
		}
	}()
	tr.step("enter")
	// Its cgroups: the sandbox's in every hierarchy, then a session cgroup
	// of its own. A checkpoint's clone is born in both already; a restore
	// or fork makes a new one (the old generation's may still be on its
	// way out).
	sb.mu.Lock()
	if cgs == nil {
		cgs = sb.children
	}
	cg, ok := cgs["session-"+t.kind.String()]
	if !ok {
		if cg, err = sb.cg.Child(sb.uniqueName("session-" + t.kind.String())); err == nil {
			cgs["session-"+t.kind.String()] = cg
		}
	}
	sb.mu.Unlock()
	if err != nil {
		return nil, nil, err
	}
	if !ok {
		// Born in the templates' cgroup: move it.
		if err := sb.cg.Add(c.Pid()); err != nil {
			return nil, nil, err
		}
		if err := cg.Add(c.Pid()); err != nil {
			return nil, nil, err
		}
	}
	p.cg = cg
	cns, err := procfs.NSpids(c.Pid())
	if err != nil || len(cns) <= t.origin.level {
		return nil, nil, fmt.Errorf("clone's pids: %v", err)
	}
	p.pid = cns[len(cns)-1]
	p.status = t.origin.waitChan(cns[t.origin.level]) // before it can exit
	tr.step("cgroup")
	return &session{kind: t.kind, p: p}, c, nil
}

// fork makes the clone of t, attached and stopped: the template's program
// (into the pid namespace of next, whose init is initPid there, and clone)
// and the clone's (enter), on the tracer's thread, under the template's
// lock. tp is the template when the caller seized it (a checkpoint's: the
// clone keeps its files); else the template is seized here, or found
// still attached by the clone before (see template.lock).
func (ts *Templates) fork(ctx context.Context, t *template, tp *inject.Proc, initPid int, stdio []int, tr *trace) (c *inject.Proc, err error) {
	t.lock()
	defer t.unlock()
	// A checkpoint's clone (its template seized by the caller) goes on on
	// the same root: it keeps the template's open files, which the template,
	// never to run again, does not use.
	keepFiles := tp != nil && !ts.reopen
	if tp == nil {
		if tp = t.held; tp == nil {
			if !t.stopped() {
				return nil, fmt.Errorf("template %d: %w", t.pid, ErrTemplatesGone)
			}
			if tp, err = ts.tracer.Seize(ctx, t.pid, seizeTimeout); err != nil {
				return nil, err
			}
			if r := tp.Regs(); r.PC() != t.pc || r.SP() != t.sp {
				_ = tp.Detach(true)
				return nil, fmt.Errorf("template %d is not where it stopped: %w", t.pid, ErrTemplatesGone)
			}
			t.held = tp
		}
	}
	tr.step("seize")
	if t.scratch == 0 { // the template never runs again: its stack stays dead
		if t.scratch, err = tp.Scratch(); err != nil {
			return nil, err
		}
	}
	scratch := t.scratch // the clone's stack is the template's
	tid := tp.FSBase() + t.tidOff
	// One batch on the tracer's thread, two programs (each system calls run
	// by the tracee in one resume): the template clones itself into next's
	// pid namespace, the clone enters next's other namespaces.
	err = tp.Batch(func(b *inject.Batch) error {
		var pg inject.Program
		pfd := pg.Call("template: pidfd_open", unix.SYS_PIDFD_OPEN, inject.Value(uintptr(initPid)), inject.Value(0))
		pg.Call("template: setns pid", unix.SYS_SETNS, inject.Result(pfd), inject.Value(unix.CLONE_NEWPID))
		pg.Clone("template: clone", unix.CLONE_PARENT|unix.CLONE_CHILD_SETTID|uintptr(unix.SIGCHLD), tid)
		pg.Try("template: close", unix.SYS_CLOSE, inject.Result(pfd))
		res, err := b.Run(tp, &pg, scratch)
		c = res.Child
		if err != nil {
			if len(res.Results) > pfd && len(res.Results) < pg.Len() {
				_, _ = b.Syscall(tp, unix.SYS_CLOSE, res.Results[pfd]) // the program ended before its close
			}
			return err
		}
		tr.step("fork")
		return enter(b, c, t, res.Results[pfd], stdio, scratch, keepFiles)
	})
	if err != nil {
		if c != nil {
			_ = c.Kill()
		}
		return nil, err
	}
	return c, nil
}

// lock takes the template's lock. While clones queue for it (a fan-out),
// the template stays attached from one to the next (held) rather than
// going back into group-stop and being seized again for each.
func (t *template) lock() {
	t.waiting.Add(1)
	t.mu.Lock()
	t.waiting.Add(-1)
}

// unlock releases the template's lock, detaching the template into
// group-stop unless another clone waits for it.
func (t *template) unlock() {
	if t.held != nil && t.waiting.Load() == 0 {
		_ = t.held.Detach(true)
		t.held = nil
	}
	t.mu.Unlock()
}

// enter runs the clone's side of the sequence, as one program (more if its
// files need more): into next's namespaces, cwd, stdio, files (unless
// keepFiles). pfd is the clone's pidfd of next's init; scratch is dead
// stack memory for the program's strings and results.
func enter(b *inject.Batch, c *inject.Proc, t *template, pfd uintptr, held []int, scratch uintptr, keepFiles bool) error {
	var pg inject.Program
	run := func() error {
		_, err := b.Run(c, &pg, scratch)
		pg = inject.Program{}
		return err
	}
	pg.Call("clone: setns", unix.SYS_SETNS, inject.Value(pfd), inject.Value(unix.CLONE_NEWNS|unix.CLONE_NEWNET|unix.CLONE_NEWUTS|unix.CLONE_NEWIPC))
	pg.Call(fmt.Sprintf("clone: chdir %q", t.cwd), unix.SYS_CHDIR, pg.String(t.cwd))
	for _, f := range t.fds {
		if keepFiles && f.Role == fdReopen {
			continue
		}
		if !pg.Fits(5, len(f.Path)+1) { // this fd's four, and the final close
			if err := run(); err != nil {
				return err
			}
		}
		what := fmt.Sprintf("clone: reopen fd %d (%s)", f.FD, f.Path)
		var nfd int
		switch f.Role {
		case fdStdin, fdStdout, fdStderr:
			nfd = pg.Call(what, unix.SYS_PIDFD_GETFD, inject.Value(pfd), inject.Value(uintptr(held[f.Role-fdStdin])), inject.Value(0))
		default:
			nfd = pg.Call(what, unix.SYS_OPENAT, inject.Value(atFDCWD), pg.String(f.Path),
				inject.Value(uintptr(f.Flags&^(unix.O_CREAT|unix.O_EXCL|unix.O_TRUNC)|unix.O_CLOEXEC)), inject.Value(0))
		}
		pg.Call(fmt.Sprintf("clone: dup3 fd %d", f.FD), unix.SYS_DUP3, inject.Result(nfd), inject.Value(uintptr(f.FD)), inject.Value(uintptr(f.Flags&unix.O_CLOEXEC)))
		pg.Try("clone: close", unix.SYS_CLOSE, inject.Result(nfd))
		if f.Role == fdReopen && f.Pos > 0 {
			pg.Call(fmt.Sprintf("clone: seek fd %d", f.FD), unix.SYS_LSEEK, inject.Value(uintptr(f.FD)), inject.Value(uintptr(f.Pos)), inject.Value(0))
		}
	}
	pg.Try("clone: close", unix.SYS_CLOSE, inject.Value(pfd))
	return run()
}

// Alive reports whether every template is still there, stopped as it was
// left: a killed or resumed one must never be cloned.
func (ts *Templates) Alive() bool {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if ts.released || !ts.g.alive() {
		return false
	}
	for _, t := range ts.procs {
		t.lock()
		ok := (t.held != nil && procfs.StartTime(t.pid) == t.start) || (t.held == nil && t.stopped())
		t.unlock()
		if !ok {
			return false
		}
	}
	return true
}

// stopped reports whether the template is there and in group-stop. Right
// after its detach it may still be on its way into the stop: it is given a
// moment. The caller holds t.mu.
func (t *template) stopped() bool {
	wait := 50 * time.Microsecond // the stop follows a detach within microseconds
	for deadline := time.Now().Add(200 * time.Millisecond); ; {
		if procfs.StartTime(t.pid) != t.start {
			return false
		}
		if procfs.State(t.pid) == "T" {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(wait)
		wait = min(2*wait, 2*time.Millisecond)
	}
}

// Kinds lists the sessions the templates are of.
func (ts *Templates) Kinds() []SessionKind {
	out := make([]SessionKind, len(ts.procs))
	for i, t := range ts.procs {
		out[i] = t.kind
	}
	return out
}

// PrivateMemory is what the templates hold alone: their private pages
// (smaps_rollup's Private_Clean + Private_Dirty), not shared ones, so that
// pages shared with their clones count once, where they were made.
func (ts *Templates) PrivateMemory() int64 {
	var total int64
	for _, t := range ts.procs {
		n, _ := procfs.PrivateMemory(t.pid)
		total += n
	}
	return total
}

// Release kills the templates and, once nothing else holds it, their
// generation. It is idempotent.
func (ts *Templates) Release() {
	ts.mu.Lock()
	done := ts.released
	ts.released = true
	ts.mu.Unlock()
	if done {
		return
	}
	close(ts.quit)
	ts.rt.fanOutMu.Lock()
	if ts.rt.fanOut == ts {
		ts.rt.fanOut = nil
	}
	ts.rt.fanOutMu.Unlock()
	ts.users.Wait() // restores and forks that pinned them
	ts.bg.Wait()
	ts.mu.Lock()
	spares := ts.spares
	ts.spares = nil
	ts.mu.Unlock()
	for _, g := range spares {
		g.release()
	}
	var dying []int
	for _, t := range ts.procs {
		if procfs.StartTime(t.pid) != t.start {
			continue
		}
		if fd, err := unix.PidfdOpen(t.pid, 0); err == nil {
			dying = append(dying, fd)
		}
		_ = unix.Kill(t.pid, unix.SIGKILL)
	}
	// Gone when Release returns (their generation's init reaps them).
	for _, fd := range dying {
		_, _ = unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 10_000)
		unix.Close(fd)
	}
	// Their cgroup holds their generation's init too, which the sandbox's
	// own generation, nested below, may still need: it goes when that init
	// does (deleting it kills what it holds).
	if cg := ts.cg; cg != nil {
		ts.g.mu.Lock()
		ts.g.onFree = append(ts.g.onFree, func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			ts.rt.deleteTemplatesCgroup(ctx, cg)
		})
		ts.g.mu.Unlock()
	}
	ts.g.release()
}

// RestoreTemplates restores the sandbox in place to a checkpoint's
// templates: a new generation nested under theirs, a root on view (a fresh
// writable branch of the checkpoint's layer), every template cloned into
// it; then the old generation, with everything that ran in it, is killed.
// prep, when not nil, is the generation and root made ready ahead on view
// (PrepareRoot); RestoreTemplates consumes it either way.
// It returns the sessions it cloned: one whose clone failed starts fresh on
// its next call. On error the sandbox is left as it was.
func (s *Sandbox) RestoreTemplates(ctx context.Context, view layer.View, ts *Templates, prep *PreparedRoot) (cloned []SessionKind, err error) {
	s.interruptPreps(true) // made for the generation this one replaces
	s.switchMu.Lock()
	defer s.switchMu.Unlock()
	defer s.markStep()
	if !ts.use() {
		prep.Release()
		return nil, fmt.Errorf("restore sandbox %q: %w (%w)", s.id, ErrTemplatesGone, errdefs.ErrFailedPrecondition)
	}
	defer ts.users.Done()
	tr := newTrace(ctx)
	defer tr.done(s.log, "restore templates")
	// Clones made ahead need their templates no more; otherwise every
	// template must still be there, stopped, or nothing changes.
	ready := prep != nil && prep.clonesReady()
	if !ready && !ts.Alive() {
		prep.Release()
		return nil, fmt.Errorf("restore sandbox %q: %w (%w)", s.id, ErrTemplatesGone, errdefs.ErrFailedPrecondition)
	}
	next, target, prepared := prep.take(s, ts)
	ready = ready && prepared
	if !prepared {
		prep.Release()
		if next, err = ts.takeGeneration(ctx, s.cg, s.log); err != nil {
			return nil, fmt.Errorf("restore sandbox %q: %w", s.id, err)
		}
	}
	defer func() {
		if err != nil {
			next.release()
		}
	}()
	tr.step("generation")
	if !prepared {
		if target, err = s.mountRoot(view); err != nil {
			return nil, err
		}
	}
	defer func() {
		if err != nil {
			_ = layer.Unmount(target)
			os.Remove(target)
		}
	}()
	tr.step("mount")
	if !prepared {
		if err := s.rt.rootInit(ctx, s, next, target); err != nil {
			return nil, fmt.Errorf("restore sandbox %q: %w", s.id, err)
		}
	}
	tr.step("root")
	s.mu.Lock()
	oldG, oldRoot, sessions, children := s.g, s.rootfs, s.sess, s.children
	s.g, s.rootfs, s.view = next, target, view
	s.sess, s.children = map[SessionKind]*session{}, map[string]cgroup.Cgroup{}
	s.replay = map[SessionKind]string{}
	spare, ah := s.spare, s.ahead // ah: made for the sessions this replaces
	s.spare, s.spareRoot, s.ahead = nil, "", nil
	if ah != nil {
		s.leavingAhead(ah) // no workload until they are gone
	}
	s.mu.Unlock()
	tr.step("switch")
	var fresh map[SessionKind]*session
	var cerr error
	if ready {
		// Made ahead: they only have to run.
		fresh = prep.sessions
		s.mu.Lock()
		s.children = prep.cgs
		s.mu.Unlock()
		for _, pid := range prep.pids {
			if err := unix.Kill(pid, unix.SIGCONT); err != nil {
				cerr = errors.Join(cerr, fmt.Errorf("start clone %d: %w", pid, err))
			}
		}
	} else {
		if prepared {
			prep.dropClones()
		}
		var clones []*inject.Proc
		fresh, clones, cerr = ts.cloneAll(ctx, nil, next, s, nil)
		start(s.log, clones)
	}
	tr.step("clones")
	// The old generation and its processes go afterwards, in the
	// background (tearing a process down competes for the CPU with the
	// clones): nothing of it is visible from the new one, and the clones
	// have cgroups of their own (see clone).
	for _, ss := range sessions {
		ss.closePipes()
	}
	// Until they are gone, a checkpoint must not take them for workload:
	// the inits by pid, the sessions by their cgroups (listing them here
	// would cost the restore a read of each).
	leaving := []int{oldG.hostPid}
	if spare != nil {
		leaving = append(leaving, spare.hostPid)
	}
	s.mu.Lock()
	for _, p := range leaving {
		s.leaving[p] = true
	}
	for _, cg := range children {
		s.leavingCgs[cg] = true
	}
	s.mu.Unlock()
	s.tearDown(func() {
		// Dying takes CPU (their page tables): at the lowest priority, not
		// against the restored sessions'.
		lowest := []int{oldG.hostPid}
		for _, cg := range children {
			p, _ := cg.Procs()
			lowest = append(lowest, p...)
		}
		for _, p := range lowest {
			_ = unix.Setpriority(unix.PRIO_PROCESS, p, 19)
		}
		if ah != nil {
			s.discardAhead(ah)
		}
		if spare != nil {
			spare.release()
		}
		oldG.release()
		for _, cg := range children {
			_ = cg.Delete(context.Background())
		}
		s.mu.Lock()
		for _, p := range leaving {
			delete(s.leaving, p)
		}
		for _, cg := range children {
			delete(s.leavingCgs, cg)
		}
		s.mu.Unlock()
	})
	s.detachRoot(oldRoot)
	s.prepareNext()
	s.mu.Lock()
	for k, ss := range fresh {
		s.sess[k] = ss
		cloned = append(cloned, k)
	}
	s.mu.Unlock()
	if cerr != nil {
		s.log.Warn("restore: clone failed; the session starts fresh", "err", cerr)
	}
	return cloned, nil
}

// ForkTemplates starts a new sandbox (as Start does, spec giving its id,
// cgroup limits and root) whose processes are clones of the templates, in
// a new generation nested under theirs. spec.IDs must be the templates'
// tree's.
func (r *Runtime) ForkTemplates(ctx context.Context, spec Spec, ts *Templates) (_ *Sandbox, err error) {
	if !ts.use() {
		return nil, fmt.Errorf("fork into %q: %w (%w)", spec.ID, ErrTemplatesGone, errdefs.ErrFailedPrecondition)
	}
	defer ts.users.Done()
	if !ts.Alive() {
		return nil, fmt.Errorf("fork into %q: %w (%w)", spec.ID, ErrTemplatesGone, errdefs.ErrFailedPrecondition)
	}
	sb, err := r.prepare(ctx, spec.ID, spec.IDs, spec.Limits, ts.takeGeneration)
	if err != nil {
		return nil, err
	}
	if err := r.Finish(ctx, sb, spec); err != nil {
		return nil, err
	}
	sb.switchMu.Lock()
	defer sb.switchMu.Unlock()
	fresh, clones, err := ts.cloneAll(ctx, nil, sb.cur(), sb, nil)
	start(sb.log, clones)
	sb.mu.Lock()
	for k, ss := range fresh {
		sb.sess[k] = ss
	}
	sb.mu.Unlock()
	if err != nil {
		_ = sb.Destroy(context.Background())
		return nil, fmt.Errorf("fork into %q: %w", spec.ID, err)
	}
	// Its next checkpoint's generation is made at its first session call
	// (see Session), not now: a fork of many would make as many more inits.
	sb.markStep()
	return sb, nil
}

// uniqueName is key with a suffix no earlier name of the sandbox had
// (mount points of roots, child cgroups: an old one may still be on its way
// out). s.mu must be held.
func (s *Sandbox) uniqueName(key string) string {
	s.roots++
	return key + "." + strconv.Itoa(s.roots)
}

// mountRoot mounts an overlay of view over the sandbox's image lowers at a
// new mount point of its run directory.
func (s *Sandbox) mountRoot(view layer.View) (string, error) {
	s.mu.Lock()
	target := filepath.Join(s.dir, s.uniqueName("rootfs"))
	s.mu.Unlock()
	if view.Upper != "" {
		for _, d := range []string{view.Upper, view.Work} {
			if err := os.Chown(d, int(s.ids.HostBase), int(s.ids.HostBase)); err != nil {
				return "", fmt.Errorf("chown layer: %w", err)
			}
		}
	}
	if err := os.Mkdir(target, 0o755); err != nil {
		return "", err
	}
	if err := layer.MountOverlay(view, s.lowers, target); err != nil {
		os.Remove(target)
		return "", err
	}
	return target, nil
}

// detachRoot detaches an old root's host mount in the background (the
// processes that still use it keep it alive). Destroy waits for it.
func (s *Sandbox) detachRoot(old string) {
	s.tearDown(func() {
		if err := unix.Unmount(old, unix.MNT_DETACH); err != nil {
			s.log.Warn("detach old root", "err", err)
		}
		_ = os.Remove(old)
	})
}

// PreparedRoot is a restore made ready ahead of time, off the critical path:
// a child generation of a checkpoint's templates, in the sandbox's cgroup,
// set up on a root mounted from a writable branch of the checkpoint, with
// the templates' clones made in it and left stopped. RestoreTemplates then
// only switches to it and lets the clones run. The caller releases it if it
// goes unused.
type PreparedRoot struct {
	ts     *Templates
	sb     *Sandbox
	g      *generation
	target string
	// The clones, in group-stop (a restore sends them SIGCONT), in session
	// cgroups of their own; none when they could not be made (a restore
	// then clones).
	sessions map[SessionKind]*session
	pids     []int // their host pids, guarded by sb.mu
	cgs      map[string]cgroup.Cgroup

	mu   sync.Mutex // guards used
	used bool
}

// PrepareRoot prepares a restore of the sandbox to ts on view (see
// PreparedRoot). A restore, reroot, checkpoint or delete of the sandbox
// that comes meanwhile interrupts it (see interruptPreps): it then fails,
// or returns a preparation without clones (a restore then clones) or whose
// clones were not all warmed.
func (s *Sandbox) PrepareRoot(ctx context.Context, ts *Templates, view layer.View) (*PreparedRoot, error) {
	ctx, done := s.startPrep(ctx, true)
	defer done()
	p, clones, err := s.prepareRoot(ctx, ts, view)
	if err != nil {
		return nil, err
	}
	// The clones, still attached, are registered as the sandbox's own: no
	// lock is needed to keep a checkpoint from taking them for workload.
	// The templates stay pinned while their pages are read.
	if s.rt.warm > 0 && len(clones) > 0 && ts.use() {
		p.warm(ctx, clones)
		ts.users.Done()
	}
	stopClones(s.log, clones)
	return p, nil
}

func (s *Sandbox) prepareRoot(ctx context.Context, ts *Templates, view layer.View) (_ *PreparedRoot, _ []*inject.Proc, err error) {
	// Until it is registered, its init and clones would look like workload
	// processes to a checkpoint (see prepareNext).
	s.switchMu.RLock()
	defer s.switchMu.RUnlock()
	if !ts.use() {
		return nil, nil, fmt.Errorf("prepare a restore: %w (%w)", ErrTemplatesGone, errdefs.ErrFailedPrecondition)
	}
	defer ts.users.Done()
	s.mu.Lock()
	destroyed := s.destroyed
	s.mu.Unlock()
	if destroyed {
		return nil, nil, fmt.Errorf("prepare a restore: sandbox %q is gone: %w", s.id, errdefs.ErrFailedPrecondition)
	}
	// Its own generation, not the templates' spare: that one is for a
	// restore or fork that comes unprepared (a search jumping to another
	// node), which a preparation made in the background must not leave
	// without one.
	g, err := s.rt.spawnGeneration(ctx, ts.g, s.cg, s.log)
	if err != nil {
		return nil, nil, err
	}
	p := &PreparedRoot{ts: ts, g: g, sb: s}
	s.mu.Lock()
	s.prepared[g] = p
	s.mu.Unlock()
	defer func() {
		if err != nil {
			p.Release()
		}
	}()
	target, err := s.mountRoot(view)
	if err != nil {
		return nil, nil, err
	}
	p.mu.Lock() // Release may run meanwhile (a delete)
	p.target = target
	p.mu.Unlock()
	if err := s.rt.rootInit(ctx, s, g, target); err != nil {
		return nil, nil, err
	}
	g.prehold(ctx, len(ts.procs))
	return p, p.prepareClones(ctx), nil
}

// prepareClones makes the templates' clones in p's generation and returns
// them attached (see stopClones). On failure there are none: the restore
// clones then.
func (p *PreparedRoot) prepareClones(ctx context.Context) []*inject.Proc {
	cgs := map[string]cgroup.Cgroup{}
	sessions, clones, err := p.ts.cloneAll(ctx, nil, p.g, p.sb, cgs)
	var pids []int
	for _, c := range clones {
		pids = append(pids, c.Pid())
	}
	p.sb.mu.Lock()
	p.pids, p.cgs = pids, cgs
	if err == nil {
		p.sessions = sessions
	}
	p.sb.mu.Unlock()
	if err != nil {
		p.sb.log.Debug("prepare a restore: clones not made ahead", "err", err)
		stopClones(p.sb.log, clones)
		for _, ss := range sessions {
			ss.closePipes()
		}
		p.dropClones()
		return nil
	}
	return clones
}

// stopClones detaches clones made ahead into group-stop, where a restore
// finds them (clonesReady) and starts them with SIGCONT.
func stopClones(log *slog.Logger, clones []*inject.Proc) {
	for _, c := range clones {
		if err := c.Detach(true); err != nil {
			log.Debug("prepare a restore: detach a clone", "pid", c.Pid(), "err", err)
		}
	}
}

// warm pre-faults, for writing, the memory each clone's template wrote (see
// WithWarm), while the clones wait, attached: the async warm of
// ../shared/design/fork-templates.md, off the critical path. The budget is
// shared by the clones, in template order. Best effort: a clone that cannot
// be warmed just takes its faults later. It stops at the next chunk once
// ctx ends (a restore, reroot or checkpoint came: see interruptPreps).
func (p *PreparedRoot) warm(ctx context.Context, clones []*inject.Proc) {
	budget := p.sb.rt.warm
	// The copies are charged to the sandbox's memory: never more than half
	// of what its limit leaves, so that warming cannot push the sandbox's
	// own processes out of memory.
	if lim := p.sb.limits.MemoryBytes; lim > 0 {
		st, err := p.sb.cg.Stats()
		if err != nil {
			return
		}
		budget = min(budget, (lim-int64(st.MemoryUsage))/2)
	}
	for i, c := range clones {
		if budget <= 0 || i >= len(p.ts.procs) || ctx.Err() != nil {
			return
		}
		ranges, err := procfs.Touched(p.ts.procs[i].pid, 64<<10, budget)
		if err != nil {
			p.sb.log.Debug("warm: read the template's pages", "err", err)
			continue
		}
		err = c.Batch(func(b *inject.Batch) error {
			var errs []error
			for _, r := range ranges {
				for at := r.Start; at < r.End && ctx.Err() == nil; at += warmChunk {
					n := min(warmChunk, r.End-at)
					if _, err := b.Syscall(c, unix.SYS_MADVISE, at, n, unix.MADV_POPULATE_WRITE); err != nil {
						errs = append(errs, fmt.Errorf("%#x-%#x: %w", at, at+n, err))
						break
					}
					budget -= int64(n)
				}
			}
			return errors.Join(errs...)
		})
		if err != nil {
			p.sb.log.Debug("warm: pre-fault the clone's pages", "err", err)
		}
	}
}

// warmChunk is how much memory one injected MADV_POPULATE_WRITE pre-faults:
// an interrupted warm stops within one (tens of milliseconds here).
const warmChunk = 8 << 20

// dropClones kills the clones made ahead (their session cgroups go with
// them).
func (p *PreparedRoot) dropClones() {
	p.sb.mu.Lock()
	cgs, sessions := p.cgs, p.sessions
	p.cgs, p.sessions = nil, nil
	p.sb.mu.Unlock()
	for _, ss := range sessions {
		ss.closePipes()
	}
	for _, cg := range cgs {
		_ = cg.Delete(context.Background())
	}
	// Only once they are gone do they stop counting as ours (a checkpoint
	// would take them for workload).
	p.sb.mu.Lock()
	p.pids = nil
	p.sb.mu.Unlock()
}

// clonesReady reports whether every clone made ahead is still there,
// stopped.
func (p *PreparedRoot) clonesReady() bool {
	p.sb.mu.Lock()
	defer p.sb.mu.Unlock()
	if p.sessions == nil || len(p.pids) != len(p.ts.procs) {
		return false
	}
	for _, pid := range p.pids {
		if procfs.State(pid) != "T" {
			return false
		}
	}
	return true
}

// take hands the prepared generation and root to a restore of ts; false
// when it was prepared for other templates or its init is gone.
func (p *PreparedRoot) take(s *Sandbox, ts *Templates) (*generation, string, bool) {
	if p == nil {
		return nil, "", false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.used || p.ts != ts || p.sb != s || !p.g.alive() {
		return nil, "", false
	}
	p.used = true
	p.sb.mu.Lock()
	delete(p.sb.prepared, p.g)
	p.sb.mu.Unlock()
	return p.g, p.target, true
}

// Release undoes an unused preparation: the root is unmounted and the
// generation released. It is a no-op once a restore took it.
func (p *PreparedRoot) Release() {
	if p == nil {
		return
	}
	p.mu.Lock()
	used, target := p.used, p.target
	p.used = true
	p.mu.Unlock()
	if used {
		return
	}
	p.dropClones()
	if target != "" {
		_ = unix.Unmount(target, unix.MNT_DETACH)
		_ = os.Remove(target)
	}
	if p.g != nil {
		p.g.release() // dead before it stops counting as one of ours
		p.sb.mu.Lock()
		delete(p.sb.prepared, p.g)
		p.sb.mu.Unlock()
	}
}
