//go:build linux

// Package seccomp owns the default seccomp filter of sandboxes: a
// default-allow filter that denies, with EPERM, the system calls Docker's
// default profile blocks for an unprivileged container, and kills any
// process that enters the kernel through another ABI (32-bit int 0x80).
//
// # Policy
//
// The policy is data: [DefaultTable] lists each denied call with the reason.
// Unlike Docker it allows unshare and clone with CLONE_NEWUSER (nested
// sandboxes and tools such as bwrap need them; the user namespace holds the
// capabilities they yield), and it must keep allowing what checkpoint
// injection makes the workload execute: clone, clone3, setns, mmap, munmap,
// openat, dup3, lseek, chdir, close, pidfd_open, pidfd_getfd, ptrace,
// process_vm_readv/writev. [MustAllow] lists them and the tests hold the
// table to it. personality(2) is allowed only for the personas Docker allows
// (Linux, 32-bit address space, UNAME26 and their query).
//
// # Applying
//
// The daemon compiles the policy once ([Compile]) and hands the filter to
// every sandbox's init, which installs it (package filter) on the thread
// that forks each process it starts: the workload is filtered, the init
// stays free to change its own mounts. A filter can never be removed.
//
// The filter is assembled by github.com/elastic/go-seccomp-bpf, behind an
// architecture check of our own: the library's own check lets calls of a
// foreign ABI fall through to the default action (allow), which on x86-64
// would let a 32-bit int 0x80 call bypass every deny.
package seccomp

import (
	"fmt"
	"slices"
	"unsafe"

	libseccomp "github.com/elastic/go-seccomp-bpf"
	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/sandbox/seccomp/filter"
)

// Rule is one row of the policy table: a denied system call and why.
type Rule struct {
	Name string
	Why  string
}

// DefaultTable is the deny list: Docker's default profile's blocked set for
// a container without extra capabilities, minus the namespace calls, plus
// io_uring (Docker blocks it since 25.0). Names the running architecture
// does not have (vm86 on x86-64) are skipped when the filter is built.
func DefaultTable() []Rule {
	return []Rule{
		// The running kernel and its modules.
		{"kexec_load", "load a new kernel"},
		{"kexec_file_load", "load a new kernel"},
		{"init_module", "load a kernel module"},
		{"finit_module", "load a kernel module"},
		{"delete_module", "unload a kernel module"},
		{"create_module", "obsolete module call"},
		{"get_kernel_syms", "obsolete module call"},
		{"query_module", "obsolete module call"},
		{"reboot", "reboot the host"},
		{"_sysctl", "obsolete sysctl interface"},
		{"nfsservctl", "obsolete NFS server control"},
		// Host-wide state.
		{"swapon", "host swap"},
		{"swapoff", "host swap"},
		{"acct", "process accounting"},
		{"settimeofday", "host clock"},
		{"clock_settime", "host clock"},
		{"clock_adjtime", "host clock"},
		{"adjtimex", "host clock"},
		{"syslog", "kernel log: leaks addresses"},
		{"quotactl", "filesystem quotas"},
		{"quotactl_fd", "filesystem quotas"},
		{"lookup_dcookie", "profiling"},
		// Kernel attack surface without a namespace.
		{"bpf", "eBPF programs"},
		{"perf_event_open", "performance counters: side channels"},
		{"keyctl", "keyrings are not namespaced"},
		{"add_key", "keyrings are not namespaced"},
		{"request_key", "keyrings are not namespaced"},
		{"userfaultfd", "used to win kernel races"},
		{"fanotify_init", "filesystem-wide notification"},
		{"io_uring_setup", "io_uring: large attack surface"},
		{"io_uring_enter", "io_uring: large attack surface"},
		{"io_uring_register", "io_uring: large attack surface"},
		// Hardware.
		{"iopl", "I/O port access"},
		{"ioperm", "I/O port access"},
		{"vm86", "virtual 8086 mode"},
		{"vm86old", "virtual 8086 mode"},
		{"uselib", "obsolete shared library loading"},
		// Escaping the mount setup or the root through handles.
		{"open_by_handle_at", "open any file on a filesystem by handle (shocker)"},
		{"name_to_handle_at", "file handles"},
		{"mount", "the sandbox's mounts are fixed by init"},
		{"umount2", "the sandbox's mounts are fixed by init"},
		{"pivot_root", "the sandbox's mounts are fixed by init"},
		{"move_mount", "new mount API"},
		{"open_tree", "new mount API"},
		{"fsopen", "new mount API"},
		{"fsmount", "new mount API"},
		{"fsconfig", "new mount API"},
		{"fspick", "new mount API"},
		{"mount_setattr", "new mount API"},
	}
}

// AllowedPersonalities are the personality(2) arguments allowed, as in
// Docker: PER_LINUX, PER_LINUX32, UNAME26, PER_LINUX32|UNAME26 and 0xffffffff
// (query). Others (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC …) are denied.
func AllowedPersonalities() []uint64 {
	return []uint64{0x0, 0x8, 0x20000, 0x20008, 0xffffffff}
}

// MustAllow are the system calls checkpoint injection runs inside the
// workload (and CRIU's parasite code needs): the filter must never deny
// them.
func MustAllow() []string {
	return []string{
		"clone", "clone3", "setns", "unshare", "mmap", "munmap", "mprotect", "openat",
		"dup3", "lseek", "chdir", "fchdir", "close", "pidfd_open", "pidfd_getfd", "ptrace",
		"process_vm_readv", "process_vm_writev", "rt_sigreturn", "wait4",
	}
}

// Policy is a filter to build: deny Table with EPERM, allow personality only
// for Personalities (nil allows all), allow everything else.
type Policy struct {
	Table         []Rule
	Personalities []uint64
}

// Default is the default policy of sandboxes.
func Default() Policy {
	return Policy{Table: DefaultTable(), Personalities: AllowedPersonalities()}
}

// Assemble builds p into a BPF program for the running architecture.
func (p Policy) Assemble() ([]bpf.Instruction, error) {
	info, err := arch.GetInfo("")
	if err != nil {
		return nil, fmt.Errorf("seccomp: %w: %w", err, errdefs.ErrUnimplemented)
	}
	var deny []string
	for _, r := range p.Table {
		if slices.Contains(MustAllow(), r.Name) {
			return nil, fmt.Errorf("seccomp: policy denies %q, which injection needs: %w", r.Name, errdefs.ErrInvalidArgument)
		}
		if _, ok := info.SyscallNames[r.Name]; ok && !slices.Contains(deny, r.Name) {
			deny = append(deny, r.Name)
		}
	}
	lib := libseccomp.Policy{DefaultAction: libseccomp.ActionAllow}
	if len(deny) > 0 {
		lib.Syscalls = append(lib.Syscalls, libseccomp.SyscallGroup{Names: deny, Action: libseccomp.ActionErrno | libseccomp.Action(unix.EPERM)})
	}
	body := []bpf.Instruction{bpf.RetConstant{Val: uint32(libseccomp.ActionAllow)}}
	if len(lib.Syscalls) > 0 {
		if body, err = lib.Assemble(); err != nil {
			return nil, fmt.Errorf("seccomp: assemble: %w: %w", err, errdefs.ErrInvalidArgument)
		}
	}
	// Our arch check first: any ABI but the native one is killed. (The
	// library's own check that follows jumps to "allow" on a mismatch.)
	prog := []bpf.Instruction{
		bpf.LoadAbsolute{Off: 4, Size: 4}, // seccomp_data.arch
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(info.ID), SkipTrue: 1},
		bpf.RetConstant{Val: uint32(libseccomp.ActionKillProcess)},
	}
	if p.Personalities != nil {
		if len(p.Personalities) > 60 { // the block's jumps must fit in 8 bits
			return nil, fmt.Errorf("seccomp: %d personalities: %w", len(p.Personalities), errdefs.ErrInvalidArgument)
		}
		prog = append(prog, personalityBlock(uint32(info.SyscallNames["personality"]), p.Personalities)...)
	}
	return append(prog, body...), nil
}

// personalityBlock allows personality(2) for the given first arguments and
// denies it otherwise; other calls fall through to the next instruction.
//
// It is written by hand because go-seccomp-bpf v1.6.0 mis-assembles argument
// conditions: after a failed argument check it goes on to the next group
// with the argument, not the syscall number, in the accumulator, so a
// personality call that no condition allows was compared against the deny
// list's numbers and, matching none, allowed. The block runs before the
// library's program, which loads the arch and number again itself.
func personalityBlock(nr uint32, allowed []uint64) []bpf.Instruction {
	lo, hi := uint32(16), uint32(20) // seccomp_data.args[0], little-endian
	if !littleEndian() {
		lo, hi = hi, lo
	}
	n := len(allowed)
	out := []bpf.Instruction{
		bpf.LoadAbsolute{Off: 0, Size: 4}, // seccomp_data.nr
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: nr, SkipFalse: uint8(4*n + 2)},
	}
	for i, v := range allowed {
		out = append(out,
			bpf.LoadAbsolute{Off: hi, Size: 4},
			bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(v >> 32), SkipFalse: 2},
			bpf.LoadAbsolute{Off: lo, Size: 4},
			bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(v), SkipTrue: uint8(4*n - 4*i - 3)},
		)
	}
	return append(out,
		bpf.RetConstant{Val: uint32(libseccomp.ActionErrno) | uint32(unix.EPERM)},
		bpf.RetConstant{Val: uint32(libseccomp.ActionAllow)},
	)
}

func littleEndian() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}

// Compile assembles p into a filter, once, for loading many times (by
// sandboxes' inits, which receive it from the daemon).
func Compile(p Policy) (filter.Filter, error) {
	insts, err := p.Assemble()
	if err != nil {
		return nil, err
	}
	raw, err := bpf.Assemble(insts)
	if err != nil {
		return nil, fmt.Errorf("seccomp: assemble: %w: %w", err, errdefs.ErrInternal)
	}
	f := make(filter.Filter, len(raw))
	for i, r := range raw {
		f[i] = unix.SockFilter{Code: r.Op, Jt: r.Jt, Jf: r.Jf, K: r.K}
	}
	return f, nil
}

// Supported reports whether the kernel can filter system calls.
func Supported() bool { return libseccomp.Supported() }
