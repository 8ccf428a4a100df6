//go:build linux

package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/internal/inject"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/procfs"
	"github.com/deltabox/deltabox/internal/sandbox/cgroup"
)

// Clones made ahead of the next checkpoint.
//
// A checkpoint's pause (CheckpointTemplates) holds the stop of the sessions,
// the filesystem capture and the clones the sandbox goes on in. A clone is
// a fork of its session (page tables copied: milliseconds on this kind of
// VM), made while the session is stopped. Between an agent's steps the
// sessions are idle, blocked reading their next snippet, and do not change:
// a clone made then, while the agent thinks, is the clone the checkpoint
// would make, as long as the session has not run since. The checkpoint then
// only checks that and lets the clone made ahead go on instead of forking
// in its pause, which is left with the stop and the capture.
//
// That a session did not run is read from the kernel, not assumed: seen
// asleep after the clone was made, it must be found in the same sleep
// (state S, the same count of voluntary context switches: falling asleep
// again after running would have added one) by the look before the stop,
// and stopped inside the same system call with the same registers after
// exactly one more sleep (the stop itself). What the counts cannot tell is
// a signal handler that ran and re-entered the read in the instant before
// the stop landed. Nothing in the sandbox can send an idle session a
// signal then (a process that would is no idle session: the checkpoint
// refuses), but a timer can: sessions with a POSIX timer, and python
// sessions that catch SIGALRM (alarm, setitimer) or SIGIO, are not cloned
// ahead. Bash arms no timer of its own (5.2's read -t waits in pselect):
// its handler for SIGALRM, one of the terminating signals it catches, runs
// only on a signal someone sends.
//
// A clone made ahead costs its session a write fault per page it writes on
// its next call if no checkpoint came first (the fork write-protected its
// memory): clones are made ahead only of small sessions (aheadMaxMemory),
// and only after the first session call that follows a checkpoint or
// restore: an agent's step between two of them.

// runState is what /proc/pid/status says of how a process runs.
type runState struct {
	state  string // "S" (asleep), "T" (stopped), ...
	sleeps uint64 // voluntary context switches
	sigCgt uint64 // caught signals (bit n-1 for signal n)
	// pending: a signal is pending for the thread or the process (or its
	// mask cannot be read).
	pending bool
}

// parseStatus reads a /proc/pid/status and returns its run state and its
// thread count.
func parseStatus(b []byte) (st runState, threads string) {
	for _, line := range strings.Split(string(b), "\n") {
		k, v, _ := strings.Cut(line, ":")
		v = strings.TrimSpace(v)
		switch k {
		case "Threads":
			threads = v
		case "State":
			st.state, _, _ = strings.Cut(v, " ")
		case "SigCgt":
			st.sigCgt, _ = strconv.ParseUint(v, 16, 64)
		case "voluntary_ctxt_switches":
			st.sleeps, _ = strconv.ParseUint(v, 10, 64)
		case "SigPnd", "ShdPnd":
			if n, err := strconv.ParseUint(v, 16, 64); err != nil || n != 0 {
				st.pending = true
			}
		}
	}
	return st, threads
}

func readRunState(pid int) (runState, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return runState{}, err
	}
	st, _ := parseStatus(b)
	return st, nil
}

// aheadTimed are the caught signals that could come to an idle python
// session by themselves: one that catches them is not cloned ahead.
const aheadTimed = 1<<(unix.SIGALRM-1) | 1<<(unix.SIGIO-1)

// hasTimers reports whether process pid has POSIX timers (or that cannot
// be read).
func hasTimers(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/timers")
	return err != nil || len(b) > 0
}

// aheadMaxMemory bounds the private memory of a session cloned ahead.
const aheadMaxMemory = 64 << 20

// LayerCopier copies a sandbox's writable layer ahead of its next
// checkpoint; the owner of the layers (the layer.Preparer's) implements it.
// The clones made ahead then go on in the copy: the checkpoint commits the
// live layer as it is and switches to the copy (layer.Preparer), with no
// filesystem work in its pause at all.
type LayerCopier interface {
	// CopyLayer copies the layer whose view is live; nothing writes it
	// meanwhile.
	CopyLayer(ctx context.Context, live layer.View) (layer.Prepared, error)
	DiscardCopy(ctx context.Context, p layer.Prepared) error
}

// SetLayerCopier has the clones made ahead go on in copies c makes.
func (s *Sandbox) SetLayerCopier(c LayerCopier) {
	s.mu.Lock()
	s.copier = c
	s.mu.Unlock()
}

// aheadClones are the next checkpoint's clones, made ahead in generation g
// (the spare, theirs from then on), on root, and left in group-stop. root is
// the live root, or with copy, where the copy of the live layer made with
// them is mounted.
type aheadClones struct {
	g        *generation
	root     string
	copy     *layer.Prepared
	sessions map[SessionKind]*session // the clones', as CheckpointTemplates would make them
	cgs      map[string]cgroup.Cgroup // their session cgroups, by name
	pids     []int                    // their host pids
	starts   []string                 // and start times (see endAhead)
	from     map[int]aheadFrom        // by the host pid of the session each was made from
}

// aheadFrom is a session as it was cloned ahead.
type aheadFrom struct {
	look   *template   // its look before the stop
	regs   inject.Regs // its stop registers
	sleeps uint64      // its voluntary context switches, once asleep again
}

// asleepAsCloned reports whether the looks before a checkpoint's stop find
// every session in the sleep it was cloned in.
func (ah *aheadClones) asleepAsCloned(looked map[int]*template) bool {
	if len(looked) != len(ah.from) {
		return false
	}
	for pid, t := range looked {
		f, ok := ah.from[pid]
		if !ok || t.run.state != "S" || t.run.sleeps != f.sleeps || t.start != f.look.start || t.cloneKey() != f.look.cloneKey() {
			return false
		}
	}
	return true
}

// stoppedAsCloned says why not, unless every stopped session stopped
// inside the system call it was cloned in, with the same registers, after
// exactly one more sleep (the stop), and every clone is still stopped.
func (ah *aheadClones) stoppedAsCloned(stopped []*inject.Proc) string {
	for _, p := range stopped {
		f, ok := ah.from[p.Pid()]
		if !ok {
			return fmt.Sprintf("session %d was not cloned ahead", p.Pid())
		}
		if p.StopRegs() != f.regs {
			return fmt.Sprintf("session %d stopped at %#x, cloned at %#x", p.Pid(), p.StopRegs().PC(), f.regs.PC())
		}
		st, err := readRunState(p.Pid())
		if err != nil {
			return err.Error()
		}
		if st.sleeps != f.sleeps+1 {
			return fmt.Sprintf("session %d slept %d times since its clone, want 1", p.Pid(), st.sleeps-f.sleeps)
		}
	}
	for _, pid := range ah.pids {
		if st := procfs.State(pid); st != "T" {
			return fmt.Sprintf("clone %d is in state %q", pid, st)
		}
	}
	return ""
}

// copied is the copy of the layer they were made on, nil when none (or
// when ah is nil).
func (ah *aheadClones) copied() *layer.Prepared {
	if ah == nil {
		return nil
	}
	return ah.copy
}

// start lets the clones run.
func (ah *aheadClones) start() error {
	var errs []error
	for _, pid := range ah.pids {
		errs = append(errs, unix.Kill(pid, unix.SIGCONT))
	}
	return errors.Join(errs...)
}

// markStep records that the sandbox was checkpointed or restored: the next
// session call is a step towards the next checkpoint (see wantAhead).
func (s *Sandbox) markStep() {
	s.mu.Lock()
	s.stepping = true
	s.mu.Unlock()
}

// callStarts drops the clones made ahead (a session of kind is about to
// run) and the shell state read ahead if it is the shell, and reports
// whether this call is the first since a checkpoint or restore. The caller
// holds the session's lock.
func (s *Sandbox) callStarts(kind SessionKind) bool {
	s.mu.Lock()
	first := s.stepping
	s.stepping = false
	if first {
		s.aheadTries = 0
	}
	if kind == SessionShell {
		s.shellOf = nil
	}
	s.mu.Unlock()
	s.dropAhead()
	return first
}

// wantAhead asks for clones made ahead, in the background: at once when
// the spare is ready (a few milliseconds of work, which must be done
// before the agent's next checkpoint: it does not queue behind other
// background work), else once prepareNext made it.
func (s *Sandbox) wantAhead() {
	s.mu.Lock()
	s.aheadWanted = true
	now := !s.destroyed && !s.nexting && s.spareReady()
	if now {
		s.nexting = true // prepareNext's job waits for this one
		s.bg.Add(1)
	}
	s.mu.Unlock()
	if !now {
		s.prepareNext()
		return
	}
	go func() {
		defer s.bg.Done()
		ctx, done := s.startPrep(context.Background(), false)
		s.switchMu.RLock()
		s.cloneAhead(ctx)
		s.switchMu.RUnlock()
		done()
		s.nextDone(false)
	}()
}

// aheadMaxTries bounds the clones made again after transient failures,
// per step.
const aheadMaxTries = 4

// aheadRetry asks for clones made ahead again, a little later each time.
func (s *Sandbox) aheadRetry() {
	s.mu.Lock()
	if s.destroyed || s.aheadTries >= aheadMaxTries {
		s.mu.Unlock()
		return
	}
	s.aheadTries++
	wait := time.Duration(25<<s.aheadTries) * time.Millisecond // 50 ms to 400 ms
	s.mu.Unlock()
	time.AfterFunc(wait, s.wantAhead)
}

// dropAhead discards the clones made ahead, if any (the sandbox is about
// to change), and reports whether there were. Their generation becomes the
// spare again (see recycleAhead).
func (s *Sandbox) dropAhead() bool {
	s.mu.Lock()
	ah := s.ahead
	s.ahead = nil
	s.mu.Unlock()
	if ah != nil {
		s.recycleAhead(ah)
	}
	return ah != nil
}

// recycleAhead discards clones made ahead but keeps their generation as
// the spare (see endAhead).
func (s *Sandbox) recycleAhead(ah *aheadClones) { s.endAhead(ah, true) }

// discardAhead discards clones made ahead with their generation.
func (s *Sandbox) discardAhead(ah *aheadClones) { s.endAhead(ah, false) }

// endAhead kills clones made ahead and, in the background, removes their
// cgroups and the copy of the layer. Their generation is released, or with
// keep set up on the live root again (a pivot) and kept as the spare: the
// next checkpoint, or the next clones made ahead, need one, and booting an
// init costs tens of milliseconds (prepareNext's job waits for it
// meanwhile: nexting). Until they are gone their processes count as the
// sandbox's own, not as workload.
func (s *Sandbox) endAhead(ah *aheadClones, keep bool) {
	s.mu.Lock()
	s.leavingAhead(ah)
	claimed := keep && !s.nexting
	if claimed {
		s.nexting = true
	}
	copier := s.copier
	s.mu.Unlock()
	for i, pid := range ah.pids {
		// Only while its pid still names it: one that died by itself may
		// have left its pid to another process.
		if i < len(ah.starts) && procfs.StartTime(pid) != ah.starts[i] {
			continue
		}
		// Dying takes CPU (their page tables): at the lowest priority, not
		// against the sessions'.
		_ = unix.Setpriority(unix.PRIO_PROCESS, pid, 19)
		_ = unix.Kill(pid, unix.SIGKILL)
	}
	for _, ss := range ah.sessions {
		ss.closePipes()
	}
	s.tearDown(func() {
		g, kept := ah.g, false
		if keep {
			// The live root stays while g is set up on it.
			s.switchMu.RLock()
			root := s.Rootfs()
			ok := ah.copy == nil && ah.root == root
			if !ok && g.alive() {
				ok = s.rt.rootInit(context.Background(), s, g, root) == nil
			}
			s.mu.Lock()
			if kept = ok && !s.destroyed && s.spare == nil && s.spareFits(g, root); kept {
				s.spare, s.spareRoot = g, root
				delete(s.leaving, g.hostPid)
			}
			s.mu.Unlock()
			s.switchMu.RUnlock()
		}
		if !kept {
			g.release() // the death of its init takes the clones
			s.mu.Lock()
			delete(s.leaving, g.hostPid)
			s.mu.Unlock()
		}
		for _, cg := range ah.cgs {
			_ = cg.Delete(context.Background())
		}
		if ah.copy != nil {
			s.dropCopy(copier, ah.root, *ah.copy)
		}
		s.mu.Lock()
		for _, cg := range ah.cgs {
			delete(s.leavingCgs, cg)
		}
		s.mu.Unlock()
		if claimed {
			s.nextDone(false)
		}
	})
}

// CopiedAhead reports whether the next checkpoint will likely switch to a
// copy of the layer made ahead (see cloneAhead) rather than snapshot it in
// its pause.
func (s *Sandbox) CopiedAhead() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ahead != nil && s.ahead.copy != nil
}

// takeAhead hands the clones made ahead, with their generation, to a
// checkpoint of the live generation, or discards them when they were made
// for another.
func (s *Sandbox) takeAhead() *aheadClones {
	s.mu.Lock()
	ah := s.ahead
	s.ahead = nil
	cur, root := s.g, s.rootfs
	s.mu.Unlock()
	if ah != nil && (ah.g.parent != cur || !ah.g.alive() || (ah.copy == nil && ah.root != root)) {
		s.log.Debug("checkpoint: the clones made ahead are for another generation")
		s.discardAhead(ah)
		ah = nil
	}
	return ah
}

// leavingAhead marks the processes of clones made ahead, their generation's
// init and their cgroups', as none of the workload while they are torn
// down. s.mu must be held.
func (s *Sandbox) leavingAhead(ah *aheadClones) {
	for _, cg := range ah.cgs {
		s.leavingCgs[cg] = true
	}
	s.leaving[ah.g.hostPid] = true
}

// dropCopy unmounts (from root, unless "") and discards a copy of the
// layer that no generation is set up on any more.
func (s *Sandbox) dropCopy(copier LayerCopier, root string, p layer.Prepared) {
	if root != "" {
		if err := unix.Unmount(root, unix.MNT_DETACH); err != nil {
			s.log.Warn("clones made ahead: unmount the copy of the layer", "err", err)
		}
		_ = os.Remove(root)
	}
	if err := copier.DiscardCopy(context.Background(), p); err != nil {
		s.log.Warn("clones made ahead: discard the copy of the layer", "err", err)
	}
}

// copyAhead copies the live layer (view) for the clones made ahead of ah,
// mounts it and sets their generation up on it (ah.copy, ah.root). A copy
// that cannot be made or mounted leaves them on the live root (nil);
// failing after that, the generation is spent (an error).
func (s *Sandbox) copyAhead(ctx context.Context, ah *aheadClones, copier LayerCopier, view layer.View) error {
	p, err := copier.CopyLayer(ctx, view)
	if err != nil {
		s.log.Debug("clones made ahead: on the live root", "why", err)
		return nil
	}
	root, err := s.mountRoot(p.View)
	if err != nil {
		s.dropCopy(copier, "", p)
		s.log.Debug("clones made ahead: on the live root", "why", err)
		return nil
	}
	ah.copy, ah.root = &p, root
	return s.rt.rootInit(ctx, s, ah.g, root)
}

// cloneAhead makes the next checkpoint's clones in the spare generation
// (see the top of this file) if they are wanted, the spare is set up on
// the live root, and the sandbox's processes are only idle, small
// sessions. prepareNext's job calls it, holding the switch lock for
// reading; a session that is busy makes it give up.
func (s *Sandbox) cloneAhead(ctx context.Context) {
	s.mu.Lock()
	g, root := s.spare, s.spareRoot
	ok := s.aheadWanted && !s.destroyed && s.ahead == nil && s.spareReady() && s.writing == 0
	s.aheadWanted = false
	old, epoch, copier, view, liveRoot := s.g, s.epoch, s.copier, s.view, s.rootfs
	sessions := make([]*session, 0, len(s.sess))
	for _, ss := range s.sess {
		sessions = append(sessions, ss)
	}
	s.mu.Unlock()
	if !ok || len(sessions) == 0 {
		return
	}
	// A failure that a moment may cure (a session not back asleep yet on
	// a loaded machine, a signal in flight) has them made again a little
	// later; one that the sessions' nature causes (timers, memory) not.
	retry := false
	defer func() {
		if retry && ctx.Err() == nil {
			s.aheadRetry()
		}
	}()
	why := func(reason string) {
		s.log.Debug("clones made ahead: not now", "why", reason)
		retry = true
	}
	for _, ss := range sessions {
		if !ss.mu.TryLock() {
			why("a session is busy")
			return
		}
		defer ss.mu.Unlock()
	}
	// Preparations running alongside (a restore made ready: they too hold
	// the switch lock for reading) register their processes only once they
	// are made: here a process outside the live generation's pid namespace
	// whose parent is outside it too is taken for one of theirs (they
	// descend from templates' generations). A workload's own pid namespace
	// is not: its init's parent is in the live one.
	inits := s.initPids()
	nsOf := func(pid int) string {
		ns, _ := os.Readlink("/proc/" + strconv.Itoa(pid) + "/ns/pid")
		return ns
	}
	if liveNS := nsOf(old.hostPid); liveNS != "" {
		pids, _ := s.cg.Procs()
		for _, p := range pids {
			if ns := nsOf(p); ns != "" && ns != liveNS {
				if pns := nsOf(procfs.Parent(p)); pns != "" && pns != liveNS {
					inits[p] = true
				}
			}
		}
	}
	byPid, reasons, err := s.idleSessions(sessions, inits)
	if err != nil || len(reasons) > 0 {
		why(fmt.Sprint("not only idle sessions: ", reasons, err))
		return
	}
	// The checkpoint reads the shell's state as data (ShellState): read
	// now, while the session may still run, and kept for it.
	s.mu.Lock()
	shell := s.sess[SessionShell]
	read := shell == nil || s.shellOf == shell
	s.mu.Unlock()
	if !read {
		// Not cancelled midway: a call cut short kills its session.
		if _, err := s.captureShell(context.WithoutCancel(ctx), shell); err != nil {
			why(err.Error())
			return
		}
	}
	if ctx.Err() != nil {
		return // a restore or reroot waits for the switch lock
	}
	looked := map[int]*template{}
	for pid, ss := range byPid {
		// Just done with a call, it may still be on its way to its read.
		_, _ = asleepAgain(ctx, pid)
		t, reason := inspect(pid, ss, nil)
		lasting := true // a reason a moment will not change
		switch {
		case reason != "":
			lasting = false
		case t.run.state != "S":
			reason, lasting = "not asleep", false
		case ss.kind == SessionPython && t.run.sigCgt&aheadTimed != 0:
			reason = fmt.Sprintf("it catches timer signals (%#x)", t.run.sigCgt)
		case hasTimers(pid):
			reason = "it has timers"
		}
		if n, err := procfs.PrivateMemory(pid); reason == "" && (err != nil || n > aheadMaxMemory) {
			reason = fmt.Sprintf("%d bytes of private memory (%v)", n, err)
		}
		if reason != "" {
			why(fmt.Sprintf("%s session: %s", ss.kind, reason))
			retry = !lasting
			return
		}
		looked[pid] = t
	}
	if ctx.Err() != nil {
		return
	}
	tr := s.rt.tracerThread()
	var stopped []*inject.Proc
	defer func() {
		for _, p := range stopped {
			_ = p.Detach(false)
		}
	}()
	tpls := make([]*template, 0, len(byPid))
	for pid, ss := range byPid {
		p, err := tr.Seize(ctx, pid, seizeTimeout)
		if err != nil {
			why(err.Error())
			return
		}
		stopped = append(stopped, p)
		t := looked[pid]
		if t.tidOff, err = s.rt.tidOffset(ctx, p); err != nil {
			why(err.Error())
			return
		}
		t.pc, t.sp = p.Regs().PC(), p.Regs().SP()
		if t.origin = ss.p.origin; t.origin == nil {
			t.origin = old
		}
		tpls = append(tpls, t)
	}
	if ctx.Err() != nil {
		return
	}
	// The spare is theirs from here: every failure discards it with them.
	s.mu.Lock()
	took := s.spare == g && !s.destroyed
	if took {
		s.spare, s.spareRoot = nil, ""
	}
	s.mu.Unlock()
	if !took {
		return
	}
	ah := &aheadClones{g: g, root: root, cgs: map[string]cgroup.Cgroup{}, from: map[int]aheadFrom{}}
	if copier != nil {
		// The layer as the sessions left it: while they are stopped.
		if err := s.copyAhead(ctx, ah, copier, view); err != nil {
			why(err.Error())
			s.discardAhead(ah)
			return
		}
	}
	ts := &Templates{g: old, tracer: tr, procs: tpls, rt: s.rt, quit: make(chan struct{}), reopen: ah.copy != nil}
	var clones []*inject.Proc
	ah.sessions, clones, err = ts.cloneAll(ctx, stopped, g, s, ah.cgs)
	for _, c := range clones {
		ah.pids = append(ah.pids, c.Pid())
		ah.starts = append(ah.starts, procfs.StartTime(c.Pid()))
	}
	// The clone left the sessions' children to be born in g: back to their
	// own namespace, or they cannot go on.
	for _, p := range stopped {
		if rerr := resetPidNS(p); rerr != nil {
			err = errors.Join(err, rerr)
			_ = p.Kill()
		}
	}
	if err != nil {
		why(err.Error())
		stopClones(s.log, clones)
		s.recycleAhead(ah)
		return
	}
	stopClones(s.log, clones)
	// A signal that came while they were stopped would run its handler
	// once they go on, before their sleeps are counted: unseen.
	for _, p := range stopped {
		if st, err := readRunState(p.Pid()); err != nil || st.pending {
			why(fmt.Sprintf("a signal is pending for %d", p.Pid()))
			s.recycleAhead(ah)
			return
		}
	}
	for _, p := range stopped {
		ah.from[p.Pid()] = aheadFrom{look: looked[p.Pid()], regs: p.StopRegs()}
		_ = p.Detach(false) // reading again
	}
	stopped = nil
	// Their sleeps are counted once they are asleep again (their locks are
	// still held: no call can come in meanwhile).
	for pid, f := range ah.from {
		st, err := asleepAgain(ctx, pid)
		if err != nil {
			why(err.Error())
			s.recycleAhead(ah)
			return
		}
		f.sleeps = st.sleeps
		ah.from[pid] = f
	}
	// Kept unless something that could change the sandbox started
	// meanwhile (see changing).
	s.mu.Lock()
	keep := !s.destroyed && s.ahead == nil && s.epoch == epoch && s.g == old && s.rootfs == liveRoot
	if keep {
		s.ahead = ah
	}
	s.mu.Unlock()
	if !keep {
		s.log.Debug("clones made ahead: the sandbox changed meanwhile")
		s.recycleAhead(ah)
	}
}

// asleepAgain waits (a little) for a session just let go or just done with
// a call to be asleep again.
func asleepAgain(ctx context.Context, pid int) (runState, error) {
	for i := 0; ; i++ {
		st, err := readRunState(pid)
		if err != nil {
			return st, err
		}
		if st.state == "S" {
			return st, nil
		}
		if i == 200 || ctx.Err() != nil {
			return st, errors.New("the session did not go back to sleep")
		}
		time.Sleep(250 * time.Microsecond)
	}
}
