//go:build linux

package inject

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
)

// The kernel's internal "restart this system call" error codes
// (include/linux/errno.h). They reach a tracer in rax but never user space.
const (
	errRestartSys          = 512
	errRestartNoIntr       = 513
	errRestartNoHand       = 514
	errRestartRestartBlock = 516
)

const (
	// seizeOptions: no PTRACE_O_EXITKILL, so that a template frozen in
	// group-stop survives a crash of its supervisor and can be adopted
	// again from its pid.
	seizeOptions = unix.PTRACE_O_TRACESYSGOOD | unix.PTRACE_O_TRACECLONE |
		unix.PTRACE_O_TRACEFORK | unix.PTRACE_O_TRACEVFORK

	eventStop = 128 // PTRACE_EVENT_STOP

	sysGood = unix.SIGTRAP | 0x80 // a syscall-stop under PTRACE_O_TRACESYSGOOD

	// maxRestarts bounds how often an injected system call is issued
	// again after a signal made it return a restart code.
	maxRestarts = 16

	// tcbScan is how much of glibc's TCB TIDOffset searches.
	tcbScan = 4096
	// scratchGap is how far below the red zone Scratch memory starts, so
	// that it is dead stack however deep the tracee's frames go meanwhile.
	scratchGap = 64 << 10
	// scratchSize is how much memory Scratch returns.
	scratchSize = 4096
)

// state is where a Proc is in its life.
type state uint8

const (
	stateAttached state = iota
	stateDetached
	stateGone // killed, or died while attached
)

// Proc is a tracee in a ptrace-stop, attached by this tracer.
//
// Its registers come in three sets: those it stopped with (StopRegs); those
// it will resume with (Regs: the stop registers with the kernel's system
// call restart applied once); and whatever the last injection left in the
// hardware, which nothing keeps. Only Detach writes the resume registers
// back.
//
// Every method is safe for concurrent use and serialised with all other
// calls of the Tracer.
type Proc struct {
	t   *Tracer
	w   *worker // the thread that attached it
	pid int

	// Guarded by t.mu.
	st      state
	stop    Regs
	resume  Regs
	resumed bool          // SetResumeRegs replaced resume
	insn    uintptr       // address of a syscall instruction; 0 until found
	pending []unix.Signal // swallowed signals, re-queued at Detach
}

// Pid returns the host pid.
func (p *Proc) Pid() int { return p.pid }

// Regs returns the registers it will resume with (syscall restart already
// applied).
func (p *Proc) Regs() Regs {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	return p.resume
}

// StopRegs returns the registers it stopped with, before the restart fix:
// rax holds the kernel's -ERESTART* code when it stopped inside a blocking
// system call.
func (p *Proc) StopRegs() Regs {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	return p.stop
}

// SetResumeRegs replaces the registers it will resume with. They are used
// as given: Detach no longer lets the kernel decide about restarting an
// interrupted system call when it re-queues signals.
func (p *Proc) SetResumeRegs(r Regs) {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	p.resume, p.resumed = r, true
}

// Pending returns the signals swallowed while attached; Detach re-queues
// them. Their siginfo is lost.
func (p *Proc) Pending() []unix.Signal {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	return append([]unix.Signal(nil), p.pending...)
}

// FSBase returns the tracee's fs_base (TLS pointer).
func (p *Proc) FSBase() uintptr {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	return p.resume.TLS()
}

// Seize attaches pid and brings it into a ptrace-stop.
//
// It uses PTRACE_SEIZE (options TRACESYSGOOD, TRACECLONE, TRACEFORK,
// TRACEVFORK, not EXITKILL) and PTRACE_INTERRUPT and waits for the
// PTRACE_EVENT_STOP. Signals delivered meanwhile are swallowed and recorded
// (see Pending). A process already in group-stop is fine. It then reads
// the registers and applies the kernel's system call restart rule once
// (see Regs.ApplyRestart).
//
// A vfork parent or a frozen process does not stop: after timeout (or when
// ctx ends) Seize fails with an error wrapping ErrTimeout (or ctx.Err())
// and the process goes on untraced. If other Procs are attached through the
// same thread, the kernel lets go of the process only when they are
// detached; see Tracer. timeout <= 0 waits as long as ctx allows.
func (t *Tracer) Seize(ctx context.Context, pid int, timeout time.Duration) (*Proc, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, fmt.Errorf("seize %d: %w", pid, ErrClosed)
	}
	if t.head == nil {
		t.head = t.startWorker()
	}
	w := t.head
	var deadline time.Time
	if timeout > 0 {
		deadline = time.Now().Add(timeout)
	}
	p := &Proc{t: t, w: w, pid: pid}
	var stuck bool
	var err error
	w.run(func() {
		w.releaseStuck()
		stuck, err = p.seize(ctx, deadline)
	})
	if stuck {
		// Only this thread's end lets go of the process: take no more
		// work here.
		w.stuck = append(w.stuck, pid)
		t.head = nil
		if w.procs == 0 {
			t.retire(w)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("seize %d: %w", pid, err)
	}
	w.procs++
	return p, nil
}

// seize runs on the worker thread. stuck reports that pid stays attached
// without having stopped.
func (p *Proc) seize(ctx context.Context, deadline time.Time) (stuck bool, err error) {
	if err := ptrace(unix.PTRACE_SEIZE, p.pid, 0, seizeOptions); err != nil {
		return false, fmt.Errorf("ptrace seize: %w", err)
	}
	// From here on a failure must let go of the process.
	stopped := false
	defer func() {
		if err != nil && stopped {
			_ = ptrace(unix.PTRACE_DETACH, p.pid, 0, 0)
			p.requeue(p.pending)
		}
	}()
	// For a process in group-stop, SEIZE itself schedules the stop;
	// the interrupt may then show up later as an extra PTRACE_EVENT_STOP,
	// which every wait below skips.
	if err := ptrace(unix.PTRACE_INTERRUPT, p.pid, 0, 0); err != nil {
		return true, fmt.Errorf("ptrace interrupt: %w", err)
	}
	backoff := 20 * time.Microsecond
	for {
		ws, wpid, err := wait4(p.pid, unix.WNOHANG)
		if err != nil {
			return true, err
		}
		if wpid == 0 {
			if err := ctx.Err(); err != nil {
				return true, err
			}
			if !deadline.IsZero() && time.Now().After(deadline) {
				return true, ErrTimeout
			}
			time.Sleep(backoff)
			backoff = min(2*backoff, 2*time.Millisecond)
			continue
		}
		if ws.Exited() || ws.Signaled() {
			return false, fmt.Errorf("process ended (%s): %w", describe(ws), errdefs.ErrNotFound)
		}
		stopped = true
		ev := event(ws)
		if ev == eventStop {
			break
		}
		switch ev {
		case unix.PTRACE_EVENT_FORK, unix.PTRACE_EVENT_VFORK, unix.PTRACE_EVENT_CLONE:
			// It forked as we attached: let the new process go.
			msg, err := unix.PtraceGetEventMsg(p.pid)
			if err != nil {
				return false, fmt.Errorf("ptrace geteventmsg: %w", err)
			}
			if err := releaseChild(int(msg)); err != nil {
				return false, err
			}
		case 0:
			p.pending = append(p.pending, ws.StopSignal())
		}
		if err := ptrace(unix.PTRACE_CONT, p.pid, 0, 0); err != nil {
			return false, fmt.Errorf("ptrace cont: %w", err)
		}
		stopped = false
	}
	if p.stop, err = getRegs(p.pid); err != nil {
		return false, fmt.Errorf("get registers: %w", err)
	}
	p.resume = p.stop
	p.resume.ApplyRestart()
	return false, nil
}

// releaseChild lets go of a process a tracee forked (the kernel attached
// it to us): it waits for its first stop and detaches it.
func releaseChild(child int) error {
	var sigs []unix.Signal
	if err := waitNewChild(child, &sigs); err != nil {
		return err
	}
	if err := ptrace(unix.PTRACE_DETACH, child, 0, 0); err != nil {
		return fmt.Errorf("detach new process %d: %w", child, err)
	}
	requeue(child, sigs)
	return nil
}

// waitNewChild waits for the first stop of a process auto-attached at a
// fork, recording in sigs the signals it swallows on the way.
func waitNewChild(child int, sigs *[]unix.Signal) error {
	for {
		ws, _, err := wait4(child, 0)
		if err != nil {
			return fmt.Errorf("wait for new process %d: %w", child, err)
		}
		if ws.Exited() || ws.Signaled() {
			return fmt.Errorf("new process %d ended (%s): %w", child, describe(ws), errdefs.ErrNotFound)
		}
		if event(ws) == eventStop {
			return nil
		}
		if event(ws) == 0 {
			*sigs = append(*sigs, ws.StopSignal())
		}
		if err := ptrace(unix.PTRACE_CONT, child, 0, 0); err != nil {
			return fmt.Errorf("ptrace cont new process %d: %w", child, err)
		}
	}
}

// call runs f on p's worker thread if p is attached, and lets the worker
// know when f ended the attachment. t.mu must be held.
func (p *Proc) call(what string, f func() error) error {
	if p.t.closed {
		return fmt.Errorf("%s %d: %w", what, p.pid, ErrClosed)
	}
	if p.st != stateAttached {
		return fmt.Errorf("%s %d: process is not attached: %w", what, p.pid, errdefs.ErrFailedPrecondition)
	}
	var err error
	p.w.run(func() {
		p.w.releaseStuck()
		err = f()
	})
	if p.st != stateAttached {
		p.t.released(p.w)
	}
	if err != nil {
		return fmt.Errorf("%s %d: %w", what, p.pid, err)
	}
	return nil
}

// Syscall injects one system call into p and returns its result; a
// negative return is returned as an error wrapping unix.Errno.
//
// The tracee executes a syscall instruction (the one it stopped after, else
// one in its vDSO) with the given arguments. Registers are not restored
// between injections; only Detach writes the resume registers back. Signals
// arriving meanwhile are swallowed and recorded (see Pending); a system call
// they interrupt is issued again. A process the injected system call forks
// is let go at once: use Clone to keep it.
func (p *Proc) Syscall(nr uintptr, args ...uintptr) (uintptr, error) {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	var ret uintptr
	err := p.call(fmt.Sprintf("inject system call %d into", nr), func() error {
		r, child, err := p.inject(nr, args...)
		if child != 0 {
			if err := releaseChild(child); err != nil {
				return err
			}
		}
		ret = r
		return err
	})
	return ret, err
}

// Clone injects clone(flags, 0, 0, childTid, 0) into p, waits for the new
// process's first stop and returns it, attached by this tracer and stopped
// until Detach. Its resume registers are p's resume registers: detached, it
// continues exactly where p would.
//
// The flags must make the kernel report the new process to a tracer
// (PTRACE_EVENT_FORK, VFORK or CLONE; not CLONE_UNTRACED). Callers use
// CLONE_PARENT|CLONE_CHILD_SETTID|SIGCHLD with childTid = FSBase() +
// TIDOffset(): without CLONE_CHILD_SETTID the thread id glibc caches in the
// new process is p's.
func (p *Proc) Clone(flags uintptr, childTid uintptr) (*Proc, error) {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	var c *Proc
	err := p.call("clone", func() error {
		args := cloneArgs(flags, childTid)
		ret, child, err := p.inject(unix.SYS_CLONE, args[:]...)
		if err == nil && child == 0 {
			err = fmt.Errorf("clone returned %d but reported no new process (flags %#x): %w", ret, flags, errdefs.ErrInvalidArgument)
		}
		if err == nil {
			c, err = p.adopt(child)
		} else if child != 0 {
			undoFork(child)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	return c, nil
}

// adopt takes over child, a process p's injected system call created
// (traced from birth): it waits for its first stop and returns it attached
// on p's thread, with p's resume registers. On failure the child is killed
// and collected.
func (p *Proc) adopt(child int) (*Proc, error) {
	c := &Proc{t: p.t, w: p.w, pid: child, stop: p.resume, resume: p.resume, insn: p.insn}
	if err := waitNewChild(child, &c.pending); err != nil {
		undoFork(child)
		return nil, fmt.Errorf("clone %d: %w", p.pid, err)
	}
	p.w.procs++
	return c, nil
}

// undoFork kills and collects a new process that never ran a user
// instruction.
func undoFork(child int) {
	_ = unix.Kill(child, unix.SIGKILL)
	_, _, _ = wait4(child, 0)
}

// inject runs one system call in the tracee, on the worker thread, and
// leaves it in the syscall-exit-stop. child is the host pid of a process
// the system call created (PTRACE_EVENT_FORK/VFORK/CLONE), else 0.
func (p *Proc) inject(nr uintptr, args ...uintptr) (ret uintptr, child int, err error) {
	if len(args) > 6 {
		return 0, 0, fmt.Errorf("%d arguments, at most 6: %w", len(args), errdefs.ErrInvalidArgument)
	}
	insn, err := p.syscallInsn()
	if err != nil {
		return 0, 0, err
	}
	var a [6]uintptr
	copy(a[:], args)
	r := p.resume
	r.SetPC(insn)
	r.SetSyscall(nr, a)
	for range maxRestarts {
		if err := setRegs(p.pid, &r); err != nil {
			return 0, child, p.lost("set registers", err)
		}
		got, c, err := p.step(nr)
		if c != 0 {
			child = c
		}
		if err != nil {
			return 0, child, err
		}
		switch e := -int64(got.Return()); e {
		case errRestartSys, errRestartNoIntr, errRestartNoHand:
			continue // a signal interrupted it: issue it again
		}
		if v := int64(got.Return()); v < 0 && v >= -4095 {
			return 0, child, unix.Errno(-v)
		}
		return got.Return(), child, nil
	}
	return 0, child, fmt.Errorf("system call %d interrupted %d times: %w", nr, maxRestarts, errdefs.ErrUnavailable)
}

// step resumes the tracee until the exit of system call nr and returns the
// registers there.
func (p *Proc) step(nr uintptr) (Regs, int, error) {
	entered, child := false, 0
	for {
		if err := ptrace(unix.PTRACE_SYSCALL, p.pid, 0, 0); err != nil {
			return Regs{}, child, p.lost("ptrace syscall", err)
		}
		ws, _, err := wait4(p.pid, 0)
		if err != nil {
			return Regs{}, child, p.lost("wait", err)
		}
		if ws.Exited() || ws.Signaled() {
			p.st = stateGone
			return Regs{}, child, fmt.Errorf("process ended during injection (%s): %w", describe(ws), errdefs.ErrNotFound)
		}
		switch ev := event(ws); {
		case ev == 0 && ws.StopSignal() == sysGood:
			r, err := getRegs(p.pid)
			if err != nil {
				return Regs{}, child, p.lost("get registers", err)
			}
			if entered {
				return r, child, nil
			}
			if r.SyscallNr() != int64(nr) {
				return Regs{}, child, fmt.Errorf("tracee entered system call %d, want %d: %w", r.SyscallNr(), nr, errdefs.ErrInternal)
			}
			entered = true
		case ev == unix.PTRACE_EVENT_FORK || ev == unix.PTRACE_EVENT_VFORK || ev == unix.PTRACE_EVENT_CLONE:
			msg, err := unix.PtraceGetEventMsg(p.pid)
			if err != nil {
				return Regs{}, child, p.lost("ptrace geteventmsg", err)
			}
			child = int(msg)
		case ev == 0:
			p.pending = append(p.pending, ws.StopSignal())
		default:
			// PTRACE_EVENT_STOP: a stray interrupt or group-stop trap.
		}
	}
}

// lost wraps the error of a ptrace request. A tracee between our calls is
// always in a ptrace-stop, so ESRCH means it was killed: its exit is
// collected, so that no traced zombie stays.
func (p *Proc) lost(what string, err error) error {
	if errors.Is(err, unix.ESRCH) {
		for {
			ws, _, werr := wait4(p.pid, 0)
			if werr != nil || ws.Exited() || ws.Signaled() {
				break
			}
		}
		p.st = stateGone
		return fmt.Errorf("%s: process ended: %w", what, errdefs.ErrNotFound)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// syscallInsn finds the address of a syscall instruction in the tracee:
// the one it stopped right after, else one in its vDSO.
func (p *Proc) syscallInsn() (uintptr, error) {
	if p.insn != 0 {
		return p.insn, nil
	}
	pc := p.stop.PC()
	if at := pc - syscallInsnLen; at/pageSize == pc/pageSize {
		// Same page as the PC, so executable.
		b := make([]byte, syscallInsnLen)
		if err := readMem(p.pid, at, b); err == nil && string(b) == syscallInsn {
			p.insn = at
			return at, nil
		}
	}
	maps, err := readMaps(p.pid)
	if err != nil {
		return 0, err
	}
	for _, m := range maps {
		if m.name != "[vdso]" {
			continue
		}
		b := make([]byte, m.end-m.start)
		n, err := readMemUpTo(p.pid, m.start, b)
		if err != nil {
			return 0, fmt.Errorf("read vdso: %w", err)
		}
		if i := strings.Index(string(b[:n]), syscallInsn); i >= 0 {
			p.insn = m.start + uintptr(i)
			return p.insn, nil
		}
	}
	return 0, fmt.Errorf("no syscall instruction at the stop or in the vdso: %w", errdefs.ErrNotFound)
}

// Detach writes the resume registers back, re-queues the swallowed signals
// (tgkill) and detaches.
//
// With stopped false the process runs on. When signals are re-queued and
// SetResumeRegs was not called, it resumes with the registers it stopped
// with, so that the kernel itself decides, as it delivers them, whether an
// interrupted system call restarts or fails with EINTR (a handler without
// SA_RESTART must see EINTR, as it would have without us).
//
// With stopped true the process is left in group-stop, state T: a
// template. A later Seize of it works and Detach(true) puts it back. Signals
// are re-queued once it is stopped, so they stay pending until SIGCONT, as
// for any stopped process; SIGCONT and the stop signals are not re-queued.
func (p *Proc) Detach(stopped bool) error {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	return p.call("detach", func() error {
		if err := p.detach(stopped); err != nil {
			return err
		}
		p.st = stateDetached
		return nil
	})
}

func (p *Proc) detach(stopped bool) error {
	sigs := p.pending
	if stopped {
		sigs = nil
		for _, s := range p.pending {
			if s != unix.SIGCONT && !isStopSignal(s) {
				sigs = append(sigs, s)
			}
		}
	}
	regs := p.resume
	if len(sigs) > 0 && !p.resumed && deliverable(p.pid, sigs) {
		regs = p.stop
	}
	if err := setRegs(p.pid, &regs); err != nil {
		return p.lost("set registers", err)
	}
	if stopped {
		if err := p.groupStop(len(sigs) > 0, &sigs); err != nil {
			return err
		}
	}
	p.requeue(sigs)
	if err := ptrace(unix.PTRACE_DETACH, p.pid, 0, 0); err != nil {
		return p.lost("ptrace detach", err)
	}
	return nil
}

// groupStop makes the tracee stop with SIGSTOP. Without signals to re-queue
// it is enough to queue SIGSTOP before detaching: the process stops before
// it runs a user instruction. With some, it has to be in group-stop before
// they are queued, or the lower-numbered among them would be delivered
// first; so it is let run into the stop while still attached. Signals it
// swallows on the way are added to sigs.
func (p *Proc) groupStop(settle bool, sigs *[]unix.Signal) error {
	if err := unix.Tgkill(p.pid, p.pid, unix.SIGSTOP); err != nil {
		return p.lost("tgkill SIGSTOP", err)
	}
	if !settle {
		return nil
	}
	deliver := 0
	for {
		if err := ptrace(unix.PTRACE_CONT, p.pid, 0, uintptr(deliver)); err != nil {
			return p.lost("ptrace cont", err)
		}
		deliver = 0
		ws, _, err := wait4(p.pid, 0)
		if err != nil {
			return p.lost("wait", err)
		}
		if ws.Exited() || ws.Signaled() {
			p.st = stateGone
			return fmt.Errorf("process ended on the way to group-stop (%s): %w", describe(ws), errdefs.ErrNotFound)
		}
		sig := ws.StopSignal()
		switch ev := event(ws); {
		case ev == eventStop && sig != unix.SIGTRAP:
			return nil // in group-stop
		case ev != 0:
			// a stray interrupt trap
		case sig == unix.SIGSTOP:
			deliver = int(sig)
		case sig == unix.SIGCONT:
			// SIGCONT discarded our SIGSTOP: the template wins.
			if err := unix.Tgkill(p.pid, p.pid, unix.SIGSTOP); err != nil {
				return p.lost("tgkill SIGSTOP", err)
			}
		case isStopSignal(sig):
		default:
			*sigs = append(*sigs, sig)
		}
	}
}

// requeue sends sigs to the tracee again.
func (p *Proc) requeue(sigs []unix.Signal) { requeue(p.pid, sigs) }

func requeue(pid int, sigs []unix.Signal) {
	for _, s := range sigs {
		_ = unix.Tgkill(pid, pid, s)
	}
}

// Kill SIGKILLs the tracee and waits for the exit notification owed to its
// tracer, so that no traced zombie is left. The process is reaped only if
// it is a child of this process; otherwise its parent reaps it.
func (p *Proc) Kill() error {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	return p.call("kill", p.kill)
}

// kill is Kill on the worker's thread, t.mu held; the caller accounts for
// the attachment's end (call does).
func (p *Proc) kill() error {
	if err := unix.Kill(p.pid, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("send SIGKILL: %w", err)
	}
	p.st = stateGone
	for {
		ws, _, err := wait4(p.pid, 0)
		if errors.Is(err, unix.ECHILD) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("wait: %w", err)
		}
		if ws.Exited() || ws.Signaled() {
			return nil
		}
	}
}

// Scratch returns the address of scratchSize (4 KiB) bytes of writable
// memory in p usable for injected system call arguments: dead stack well
// below the red zone, which nothing uses until the process runs again.
// Memory written there is garbage once it does.
func (p *Proc) Scratch() (uintptr, error) {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	if p.st != stateAttached {
		return 0, fmt.Errorf("scratch memory of %d: process is not attached: %w", p.pid, errdefs.ErrFailedPrecondition)
	}
	sp := p.resume.SP()
	if sp < redZone+scratchGap+scratchSize {
		return 0, fmt.Errorf("scratch memory of %d: stack pointer %#x too low: %w", p.pid, sp, errdefs.ErrFailedPrecondition)
	}
	at := (sp - redZone - scratchGap - scratchSize) &^ (pageSize - 1)
	maps, err := readMaps(p.pid)
	if err != nil {
		return 0, fmt.Errorf("scratch memory of %d: %w", p.pid, err)
	}
	for _, m := range maps {
		if m.start <= at && at+scratchSize <= m.end && strings.HasPrefix(m.perms, "rw") {
			return at, nil
		}
	}
	return 0, fmt.Errorf("scratch memory of %d: %#x is not mapped writable (stack pointer %#x): %w", p.pid, at, sp, errdefs.ErrFailedPrecondition)
}

// WriteMem writes b at addr in p.
func (p *Proc) WriteMem(addr uintptr, b []byte) error {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	if p.st != stateAttached {
		return fmt.Errorf("write memory of %d: process is not attached: %w", p.pid, errdefs.ErrFailedPrecondition)
	}
	if err := writeMem(p.pid, addr, b); err != nil {
		return fmt.Errorf("write memory of %d at %#x: %w", p.pid, addr, err)
	}
	return nil
}

// ReadMem fills b from addr in p.
func (p *Proc) ReadMem(addr uintptr, b []byte) error {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	if p.st != stateAttached {
		return fmt.Errorf("read memory of %d: process is not attached: %w", p.pid, errdefs.ErrFailedPrecondition)
	}
	if err := readMem(p.pid, addr, b); err != nil {
		return fmt.Errorf("read memory of %d at %#x: %w", p.pid, addr, err)
	}
	return nil
}

// TIDOffset finds where glibc keeps the thread id in p's TCB: the offset
// from FSBase of the first 8-byte aligned int32, in the first 4 KiB, that
// equals p's thread id as seen in its own pid namespace (glibc 2.36 on
// x86-64: 0x2d0). It caches nothing. In a nested pid namespace that id is a
// small number, which an unrelated field could equal before the real one;
// callers that can should compare with the offset found in a host process.
func (p *Proc) TIDOffset() (uintptr, error) {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	if p.st != stateAttached {
		return 0, fmt.Errorf("tid offset of %d: process is not attached: %w", p.pid, errdefs.ErrFailedPrecondition)
	}
	base := p.resume.TLS()
	if base == 0 {
		return 0, fmt.Errorf("tid offset of %d: no thread pointer: %w", p.pid, errdefs.ErrFailedPrecondition)
	}
	tid, err := nsPid(p.pid)
	if err != nil {
		return 0, fmt.Errorf("tid offset of %d: %w", p.pid, err)
	}
	b := make([]byte, tcbScan)
	n, err := readMemUpTo(p.pid, base, b)
	if err != nil {
		return 0, fmt.Errorf("tid offset of %d: read TCB at %#x: %w", p.pid, base, err)
	}
	if off, ok := findInt32(b[:n], int32(tid)); ok {
		return off, nil
	}
	return 0, fmt.Errorf("tid offset of %d: tid %d not in the %d bytes after %#x: %w", p.pid, tid, n, base, errdefs.ErrNotFound)
}

// HasTID reports whether the int32 at off in the tracee's TCB is its thread
// id (as its own pid namespace numbers it). A caller that calibrated the
// offset on a process with a large pid checks it here on a process with a
// small one, where a scan could stop at an unrelated field of equal value.
func (p *Proc) HasTID(off uintptr) (bool, error) {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	if p.st != stateAttached {
		return false, fmt.Errorf("tid of %d: process is not attached: %w", p.pid, errdefs.ErrFailedPrecondition)
	}
	tid, err := nsPid(p.pid)
	if err != nil {
		return false, err
	}
	var b [4]byte
	if err := readMem(p.pid, p.resume.TLS()+off, b[:]); err != nil {
		return false, err
	}
	return int32(binary.LittleEndian.Uint32(b[:])) == int32(tid), nil
}

// Batch is a run of ptrace work on the tracer's thread (see Proc.Batch).
// Its methods may be called only from the function Batch runs, and only on
// Procs of the same Tracer.
type Batch struct {
	w *worker
}

// Batch runs f on the tracer's thread with p attached. Each Proc method
// hands its work to that thread and waits: two thread wake-ups per call,
// which on a VM can cost more than the ptrace requests themselves. A
// sequence of injections (a clone and the clone's setup) runs in one Batch
// with one hand-off.
func (p *Proc) Batch(f func(b *Batch) error) error {
	p.t.mu.Lock()
	defer p.t.mu.Unlock()
	return p.call("batch", func() error { return f(&Batch{w: p.w}) })
}

func (b *Batch) check(p *Proc) error {
	if p.w != b.w || p.st != stateAttached {
		return fmt.Errorf("batch on %d: process is not attached on this thread: %w", p.pid, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// Syscall is Proc.Syscall inside a batch.
func (b *Batch) Syscall(p *Proc, nr uintptr, args ...uintptr) (uintptr, error) {
	if err := b.check(p); err != nil {
		return 0, err
	}
	r, child, err := p.inject(nr, args...)
	if child != 0 {
		if rerr := releaseChild(child); rerr != nil && err == nil {
			err = rerr
		}
	}
	if err != nil {
		return 0, fmt.Errorf("inject system call %d into %d: %w", nr, p.pid, err)
	}
	return r, nil
}
