//go:build linux

package inject

import "golang.org/x/sys/unix"

// Regs is the register file of a tracee in a ptrace-stop. The fields are
// the kernel's (unix.PtraceRegs); the methods are what the
// architecture-independent code of this package needs, so that an arm64
// file can provide the same methods over its own registers.
type Regs struct {
	unix.PtraceRegs
}

// PC is the address the tracee executes next.
func (r Regs) PC() uintptr { return uintptr(r.Rip) }

// SetPC sets the address the tracee executes next.
func (r *Regs) SetPC(pc uintptr) { r.Rip = uint64(pc) }

// SP is the stack pointer.
func (r Regs) SP() uintptr { return uintptr(r.Rsp) }

// TLS is the thread pointer (fs_base): glibc's TCB, struct pthread.
func (r Regs) TLS() uintptr { return uintptr(r.Fs_base) }

// SyscallNr is the number of the system call the tracee stopped in, or -1
// when it did not stop in one (orig_rax).
func (r Regs) SyscallNr() int64 { return int64(r.Orig_rax) }

// Return is the system call return value register (rax).
func (r Regs) Return() uintptr { return uintptr(r.Rax) }

// SetSyscall loads system call nr and its arguments for an injection at the
// current PC, which must address a syscall instruction. orig_rax is -1 so
// that the kernel, when it resumes the tracee from a stop inside a system
// call, finds no system call of its own to restart. The trap flag is
// cleared: a single-stepping debugger's state must not leak into the
// injection.
func (r *Regs) SetSyscall(nr uintptr, args [6]uintptr) {
	r.Rax = uint64(nr)
	r.Orig_rax = ^uint64(0)
	r.Rdi, r.Rsi, r.Rdx = uint64(args[0]), uint64(args[1]), uint64(args[2])
	r.R10, r.R8, r.R9 = uint64(args[3]), uint64(args[4]), uint64(args[5])
	r.Eflags &^= 0x100 // TF
}

// ApplyRestart does to r what the kernel does on the way back to user mode
// when a system call was interrupted and no signal handler runs
// (arch_do_signal_or_restart), and reports the error code it undid (0 when
// there was nothing to restart). An injected system call or a fork
// returns to user mode through the system call exit path, which never looks
// at -ERESTART* again, so without this the tracee would see the kernel's
// internal error codes. epoll_wait and friends return a plain -EINTR when a
// ptrace stop interrupts them (signal(7)): they are restarted as well.
func (r *Regs) ApplyRestart() int {
	if int64(r.Orig_rax) < 0 {
		return 0
	}
	code := -int64(r.Rax)
	switch code {
	case errRestartSys, errRestartNoIntr, errRestartNoHand:
		r.Rax = r.Orig_rax
	case errRestartRestartBlock:
		r.Rax = unix.SYS_RESTART_SYSCALL
	case int64(unix.EINTR):
		switch r.Orig_rax {
		case unix.SYS_EPOLL_WAIT, unix.SYS_EPOLL_PWAIT, unix.SYS_EPOLL_PWAIT2:
			r.Rax = r.Orig_rax
		default:
			return 0
		}
	default:
		return 0
	}
	r.Rip -= syscallInsnLen
	return int(code)
}

const (
	// syscallInsn is the machine code of the system call instruction.
	syscallInsn = "\x0f\x05"
	// syscallInsnLen is its length: how far back the PC goes to restart.
	syscallInsnLen = 2 // len(syscallInsn)
	// redZone is the stack area below SP the ABI lets leaf code use
	// without moving SP: scratch memory starts below it.
	redZone = 128
)

// cloneArgs orders the arguments of the raw clone system call, which
// differs between architectures: x86-64 takes flags, newsp, parent_tid,
// child_tid, tls.
func cloneArgs(flags, childTid uintptr) [6]uintptr {
	return [6]uintptr{flags, 0, 0, childTid, 0, 0}
}

func getRegs(pid int) (Regs, error) {
	var r Regs
	err := unix.PtraceGetRegs(pid, &r.PtraceRegs)
	return r, err
}

func setRegs(pid int, r *Regs) error {
	return unix.PtraceSetRegs(pid, &r.PtraceRegs)
}
