//go:build linux

package inject

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
)

// A Program is a sequence of system calls a tracee makes on its own, in one
// resume (Batch.Run), instead of one injection, two ptrace stops and two
// thread wake-ups each: a clone's setup is fifteen to twenty calls, which
// cost tens to hundreds of microseconds each that way on a VM.
//
// Its machine code is written over the start of the page of the tracee's
// syscall instruction (executable, and private to the tracee: the write
// makes the kernel copy it) and the page's bytes are put back before Run
// returns; its strings and the calls' results live in scratch memory (see
// Proc.Scratch). A call whose result is an error ends the program there,
// unless it was added with Try.
type Program struct {
	calls []progCall
	data  []byte // strings, NUL-terminated, at the start of scratch memory
	clone int    // index of the Clone call plus one, 0 when none
	err   error  // the first call that used a result not yet made (Run returns it)
}

type progCall struct {
	what  string
	nr    uintptr
	args  [6]Arg
	nargs int
	try   bool // its error does not end the program
}

// Arg is an argument of a Program's system call.
type Arg struct {
	kind argKind
	v    uintptr
}

type argKind uint8

const (
	argValue  argKind = iota
	argResult         // v: the index of an earlier call
	argData           // v: an offset in the program's data
)

// Value is a constant argument.
func Value(v uintptr) Arg { return Arg{kind: argValue, v: v} }

// Result is the result of the program's call i (returned by Call).
func Result(i int) Arg { return Arg{kind: argResult, v: uintptr(i)} }

// String is the address, in the tracee, of s (NUL-terminated).
func (pg *Program) String(s string) Arg {
	off := len(pg.data)
	pg.data = append(append(pg.data, s...), 0)
	return Arg{kind: argData, v: uintptr(off)}
}

// Call adds system call nr with args; what names it in errors. It returns
// the call's index, for Result.
func (pg *Program) Call(what string, nr uintptr, args ...Arg) int {
	return pg.add(what, nr, false, args)
}

// Try is Call for a call whose failure does not matter (a close): the
// program goes on.
func (pg *Program) Try(what string, nr uintptr, args ...Arg) int {
	return pg.add(what, nr, true, args)
}

// Clone adds clone(flags, 0, 0, childTid, 0) (see Proc.Clone): Run returns
// the new process, attached and stopped. A program has at most one.
func (pg *Program) Clone(what string, flags, childTid uintptr) int {
	a := cloneArgs(flags, childTid)
	args := make([]Arg, len(a))
	for i, v := range a {
		args[i] = Value(v)
	}
	i := pg.add(what, unix.SYS_CLONE, false, args)
	pg.clone = i + 1 // stored off by one: a zero Program has none
	return i
}

func (pg *Program) add(what string, nr uintptr, try bool, args []Arg) int {
	c := progCall{what: what, nr: nr, try: try, nargs: min(len(args), 6)}
	copy(c.args[:], args)
	for _, a := range c.args[:c.nargs] {
		if a.kind == argResult && int(a.v) >= len(pg.calls) && pg.err == nil {
			pg.err = fmt.Errorf("call %d (%s) uses the result of call %d: %w", len(pg.calls), what, a.v, errdefs.ErrInvalidArgument)
		}
	}
	pg.calls = append(pg.calls, c)
	return len(pg.calls) - 1
}

// maxCallCode bounds the machine code of one call (six arguments from
// earlier results).
const maxCallCode = 128

// Fits reports whether calls more system calls with data more bytes of
// strings still fit in one program (a page of code, scratch memory for the
// strings and results).
func (pg *Program) Fits(calls, data int) bool {
	n := len(pg.calls) + calls
	return (n+1)*maxCallCode <= pageSize && len(pg.data)+data+8+8*n <= scratchSize
}

// Len is the number of system calls of the program.
func (pg *Program) Len() int { return len(pg.calls) }

// ProgramError is the error of a Program's call.
type ProgramError struct {
	What string // the call's name
	Err  error  // a unix.Errno
}

func (e *ProgramError) Error() string { return e.What + ": " + e.Err.Error() }
func (e *ProgramError) Unwrap() error { return e.Err }

// RunResult is what a Program did.
type RunResult struct {
	// Results are the calls' return values, in order, up to the one that
	// failed (a failed Try's is its negated errno).
	Results []uintptr
	// Child is the process a Clone of the program made, attached and
	// stopped (see Proc.Clone), or nil.
	Child *Proc
}

// Run runs pg in p, whose scratch memory (Proc.Scratch) starts at scratch,
// and leaves p stopped. Signals that arrive meanwhile are swallowed and
// recorded (see Pending); a system call they interrupt is restarted by the
// kernel. On an error of a call, the error is a *ProgramError and the
// result holds what ran before it (and the child, if the Clone ran).
func (b *Batch) Run(p *Proc, pg *Program, scratch uintptr) (RunResult, error) {
	if err := b.check(p); err != nil {
		return RunResult{}, err
	}
	res, err := p.run(pg, scratch)
	if err != nil {
		return res, fmt.Errorf("run a program of %d system calls in %d: %w", len(pg.calls), p.pid, err)
	}
	return res, nil
}

// resultsOffset is where, in scratch memory, the calls' results start:
// after the data, 8-byte aligned.
func (pg *Program) resultsOffset() uintptr { return (uintptr(len(pg.data)) + 7) &^ 7 }

func (p *Proc) run(pg *Program, scratch uintptr) (res RunResult, err error) {
	if pg.err != nil || len(pg.calls) == 0 {
		return res, pg.err
	}
	if pg.resultsOffset()+8*uintptr(len(pg.calls)) > scratchSize {
		return res, fmt.Errorf("program data of %d bytes does not fit in scratch memory: %w", len(pg.data), errdefs.ErrInvalidArgument)
	}
	defer func() {
		// As Batch.Clone: a clone the kernel reported no process for is an
		// error, never a nil child.
		if i := pg.clone - 1; err == nil && i >= 0 && i < len(res.Results) && res.Child == nil {
			err = fmt.Errorf("clone returned %d but reported no new process: %w", res.Results[i], errdefs.ErrInvalidArgument)
		}
	}()
	// The program ends in an int3, whose SIGTRAP the kernel forces through:
	// one the process blocks or ignores would be unblocked and reset to its
	// default action (a bash "trap '' TRAP" lost). Such a process gets the
	// calls one injection each.
	if trapped, err := trapHeld(p.pid); err != nil || trapped {
		if err != nil {
			return res, err
		}
		return p.runStepwise(pg, scratch)
	}
	insn, err := p.syscallInsn()
	if err != nil {
		return res, err
	}
	code, endOff := assemble(pg, scratch)
	at := insn &^ (pageSize - 1)
	end := at + endOff
	if len(code) > pageSize {
		return res, fmt.Errorf("program of %d bytes exceeds a page: %w", len(code), errdefs.ErrInvalidArgument)
	}
	if err := writeMem(p.pid, scratch, pg.data); err != nil {
		return res, err
	}
	mem, err := openMem(p.pid, os.O_RDWR)
	if err != nil {
		return res, err
	}
	defer mem.Close()
	saved := make([]byte, len(code))
	if _, err := mem.ReadAt(saved, int64(at)); err != nil {
		return res, fmt.Errorf("read code: %w", err)
	}
	defer func() {
		// The page's own code back, whatever happened: the tracee (and a
		// child forked from it) would run ours otherwise.
		if _, werr := mem.WriteAt(saved, int64(at)); werr != nil {
			// It would run our code: it must never run again.
			err = errors.Join(err, fmt.Errorf("restore code: %w", werr), p.kill())
			if res.Child != nil {
				err = errors.Join(err, res.Child.kill())
				p.t.released(p.w)
				res.Child = nil
			}
		}
		if res.Child == nil {
			return
		}
		if werr := writeMemForce(res.Child.pid, at, saved); werr != nil {
			err = errors.Join(err, fmt.Errorf("restore code of %d: %w", res.Child.pid, werr), res.Child.kill())
			p.t.released(p.w)
			res.Child = nil
		}
	}()
	if _, err := mem.WriteAt(code, int64(at)); err != nil {
		return res, fmt.Errorf("write code: %w", err)
	}

	r := p.resume
	r.SetPC(at)
	r.SetSyscall(0, [6]uintptr{}) // orig_rax -1, no trap flag; rax is set by the code
	if err := setRegs(p.pid, &r); err != nil {
		return res, p.lost("set registers", err)
	}
	var child int
	defer func() {
		if child == 0 {
			return
		}
		c, aerr := p.adopt(child)
		err = errors.Join(err, aerr)
		res.Child = c
	}()
	for {
		if err := ptrace(unix.PTRACE_CONT, p.pid, 0, 0); err != nil {
			return res, p.lost("ptrace cont", err)
		}
		ws, _, err := wait4(p.pid, 0)
		if err != nil {
			return res, p.lost("wait", err)
		}
		if ws.Exited() || ws.Signaled() {
			p.st = stateGone
			return res, fmt.Errorf("process ended during a program (%s): %w", describe(ws), errdefs.ErrNotFound)
		}
		ev := event(ws)
		switch {
		case ev == unix.PTRACE_EVENT_FORK || ev == unix.PTRACE_EVENT_VFORK || ev == unix.PTRACE_EVENT_CLONE:
			msg, err := unix.PtraceGetEventMsg(p.pid)
			if err != nil {
				return res, p.lost("ptrace geteventmsg", err)
			}
			// Its first stop is collected once the program ended: the
			// two start up side by side.
			child = int(msg)
			continue
		case ev == 0 && ws.StopSignal() == unix.SIGTRAP:
			regs, err := getRegs(p.pid)
			if err != nil {
				return res, p.lost("get registers", err)
			}
			if regs.PC() != end {
				// Not our breakpoint: a SIGTRAP sent to it.
				p.pending = append(p.pending, unix.SIGTRAP)
				continue
			}
			return p.finish(pg, scratch, regs, res)
		case ev == 0:
			p.pending = append(p.pending, ws.StopSignal())
		default:
			// PTRACE_EVENT_STOP: a stray interrupt or group-stop trap.
		}
	}
}

// finish reads the results of a program that reached its breakpoint.
func (p *Proc) finish(pg *Program, scratch uintptr, regs Regs, res RunResult) (RunResult, error) {
	n := progStatus(regs)
	failed := n < len(pg.calls)
	if n < 0 || n > len(pg.calls) {
		return res, fmt.Errorf("program reported call %d of %d: %w", n, len(pg.calls), errdefs.ErrInternal)
	}
	buf := make([]byte, 8*len(pg.calls))
	if err := readMem(p.pid, scratch+pg.resultsOffset(), buf); err != nil {
		return res, err
	}
	upTo := len(pg.calls)
	if failed {
		upTo = n
	}
	for i := 0; i < upTo; i++ {
		res.Results = append(res.Results, uintptr(binary.NativeEndian.Uint64(buf[8*i:])))
	}
	if failed {
		errno := unix.Errno(-int64(regs.Return()))
		return res, &ProgramError{What: pg.calls[n].what, Err: errno}
	}
	return res, nil
}

// openMem opens /proc/pid/mem, through which a tracer reads and writes even
// pages the process itself may not write (code).
func openMem(pid int, flag int) (*os.File, error) {
	return os.OpenFile("/proc/"+strconv.Itoa(pid)+"/mem", flag, 0)
}

// writeMemForce writes b at addr in pid through /proc/pid/mem.
func writeMemForce(pid int, addr uintptr, b []byte) error {
	f, err := openMem(pid, os.O_WRONLY)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = f.WriteAt(b, int64(addr))
	return err
}

// runStepwise runs pg one injection per call (see Proc.inject): for a
// process whose SIGTRAP a program's breakpoint would disturb.
func (p *Proc) runStepwise(pg *Program, scratch uintptr) (res RunResult, err error) {
	if err := writeMem(p.pid, scratch, pg.data); err != nil {
		return res, err
	}
	for _, call := range pg.calls {
		var args [6]uintptr
		for j, a := range call.args[:call.nargs] {
			switch a.kind {
			case argValue:
				args[j] = a.v
			case argData:
				args[j] = scratch + a.v
			case argResult:
				args[j] = res.Results[a.v]
			}
		}
		ret, child, ierr := p.inject(call.nr, args[:call.nargs]...)
		if child != 0 {
			c, aerr := p.adopt(child)
			if aerr != nil {
				return res, errors.Join(ierr, aerr)
			}
			res.Child = c
		}
		var errno unix.Errno
		switch {
		case errors.As(ierr, &errno) && call.try:
			ret = uintptr(-int64(errno))
		case errors.As(ierr, &errno):
			return res, &ProgramError{What: call.what, Err: errno}
		case ierr != nil:
			return res, ierr
		}
		res.Results = append(res.Results, ret)
	}
	return res, nil
}

// trapHeld reports whether pid blocks or ignores SIGTRAP.
func trapHeld(pid int) (bool, error) {
	const bit = 1 << (unix.SIGTRAP - 1)
	v, err := statusFields(pid, "SigBlk", "SigIgn")
	if err != nil {
		return false, fmt.Errorf("signal state of %d: %w", pid, err)
	}
	for _, m := range v {
		mask, err := strconv.ParseUint(m, 16, 64)
		if err != nil {
			return false, fmt.Errorf("signal state of %d: %q: %w", pid, m, err)
		}
		if mask&bit != 0 {
			return true, nil
		}
	}
	return false, nil
}
