//go:build linux

package seccomp

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/internal/testutil"
)

// childEnv selects what the re-executed test binary does instead of running
// tests: "probe" (apply the filter, then try system calls and print one
// "name=result" line each), "probe-nofilter" (the same without the filter:
// the control), "int80" and "int80-nofilter" (a 32-bit getpid).
const childEnv = "DELTABOX_SECCOMP_CHILD"

func TestMain(m *testing.M) {
	if mode := os.Getenv(childEnv); mode != "" {
		os.Exit(child(mode))
	}
	os.Exit(m.Run())
}

func child(mode string) int {
	filtered := !strings.HasSuffix(mode, "-nofilter")
	if filtered {
		f, err := Compile(Default())
		if err == nil {
			err = f.Process()
		}
		if err != nil {
			fmt.Printf("apply=%v\n", err)
			return 1
		}
	}
	if strings.HasPrefix(mode, "int80") {
		fmt.Printf("int80=%d\n", int32(int80Getpid()))
		return 0
	}
	for _, p := range probes() {
		res := "ok"
		if err := p.fn(); err != nil {
			var errno syscall.Errno
			if errors.As(err, &errno) {
				res = unix.ErrnoName(errno)
			} else {
				res = strings.ReplaceAll(err.Error(), "\n", " ")
			}
		}
		fmt.Printf("%s=%s\n", p.name, res)
	}
	return 0
}

// addrNoRandomize is personality(2)'s ADDR_NO_RANDOMIZE.
const addrNoRandomize = 0x0040000

const nowhere = "/nonexistent-deltabox-seccomp-test"

type probe struct {
	name string
	fn   func() error
}

func errnoOf(_, _ uintptr, e syscall.Errno) error {
	if e != 0 {
		return e
	}
	return nil
}

func probes() []probe {
	return []probe{
		// Denied: the target does not exist, so without the filter these
		// fail with something other than EPERM (and change nothing).
		{"mount", func() error { return unix.Mount("none", nowhere, "tmpfs", 0, "") }},
		{"umount2", func() error { return unix.Unmount(nowhere, 0) }},
		{"pivot_root", func() error { return unix.PivotRoot(nowhere, nowhere) }},
		{"keyctl", func() error {
			_, err := unix.KeyctlInt(unix.KEYCTL_GET_KEYRING_ID, unix.KEY_SPEC_SESSION_KEYRING, 0, 0, 0)
			return err
		}},
		{"bpf", func() error { return errnoOf(unix.Syscall(unix.SYS_BPF, 0, 0, 0)) }},
		{"open_by_handle_at", func() error { return errnoOf(unix.Syscall(unix.SYS_OPEN_BY_HANDLE_AT, ^uintptr(0), 0, 0)) }},
		{"personality_aslr_off", func() error { return errnoOf(unix.Syscall(unix.SYS_PERSONALITY, addrNoRandomize, 0, 0)) }},
		// Allowed.
		{"personality_query", func() error { return errnoOf(unix.Syscall(unix.SYS_PERSONALITY, 0xffffffff, 0, 0)) }},
		{"personality_linux", func() error { return errnoOf(unix.Syscall(unix.SYS_PERSONALITY, 0, 0, 0)) }},
		{"file_io", fileIO},
		{"fork_exec", func() error { return exec.Command("/bin/sh", "-c", "exit 0").Run() }},
		{"clone_newuser", func() error {
			cmd := exec.Command("/bin/true")
			cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER}
			return cmd.Run()
		}},
		{"clone3", func() error { return errnoOf(unix.Syscall(unix.SYS_CLONE3, 0, 0, 0)) }}, // EINVAL: size 0
		{"setns", func() error { return unix.Setns(-1, 0) }},                                // EBADF
		{"pidfd_open", func() error {
			fd, err := unix.PidfdOpen(os.Getpid(), 0)
			if err == nil {
				unix.Close(fd)
			}
			return err
		}},
		{"process_vm_readv", func() error {
			var src, dst [8]byte
			src[0] = 42
			local := []unix.Iovec{{Base: &dst[0], Len: 8}}
			remote := []unix.RemoteIovec{{Base: uintptr(unsafe.Pointer(&src[0])), Len: 8}}
			_, err := unix.ProcessVMReadv(os.Getpid(), local, remote, 0)
			if err == nil && dst[0] != 42 {
				return errors.New("read wrong bytes")
			}
			return err
		}},
		{"mmap", func() error {
			b, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
			if err != nil {
				return err
			}
			return unix.Munmap(b)
		}},
		{"dup3_lseek_chdir", func() error {
			fd, err := unix.Open("/proc/self/status", unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			if err := unix.Dup3(fd, 100, unix.O_CLOEXEC); err != nil {
				return err
			}
			defer unix.Close(100)
			if _, err := unix.Seek(100, 1, 0); err != nil {
				return err
			}
			return unix.Chdir("/")
		}},
		// The state the filter leaves: every thread filtered (TSYNC) with
		// no_new_privs, and children inherit it.
		{"threads", func() error {
			tasks, _ := filepath.Glob("/proc/self/task/*/status")
			for _, s := range tasks {
				b, err := os.ReadFile(s)
				if err != nil {
					return err
				}
				if !bytes.Contains(b, []byte("\nSeccomp:\t2\n")) || !bytes.Contains(b, []byte("\nNoNewPrivs:\t1\n")) {
					return fmt.Errorf("%s: not filtered", s)
				}
			}
			return nil
		}},
		{"child_filtered", func() error {
			out, err := exec.Command("/bin/grep", "-E", "^(Seccomp|NoNewPrivs):", "/proc/self/status").Output()
			if err != nil {
				return err
			}
			if !bytes.Contains(out, []byte("Seccomp:\t2")) || !bytes.Contains(out, []byte("NoNewPrivs:\t1")) {
				return fmt.Errorf("child: %q", out)
			}
			return nil
		}},
	}
}

func fileIO() error {
	f, err := os.CreateTemp("", "seccomp-*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	if _, err := f.WriteString("hello"); err != nil {
		return err
	}
	b, err := os.ReadFile(f.Name())
	if err == nil && string(b) != "hello" {
		err = fmt.Errorf("read %q", b)
	}
	return err
}

// runChild re-executes the test binary in mode and returns its results.
func runChild(t *testing.T, mode string) (map[string]string, *exec.ExitError) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+mode)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("run child %s: %v", mode, err)
	}
	res := map[string]string{}
	s := bufio.NewScanner(bytes.NewReader(out))
	for s.Scan() {
		if k, v, ok := strings.Cut(s.Text(), "="); ok {
			res[k] = v
		}
	}
	if exit != nil && exit.Exited() {
		t.Fatalf("child %s exited %d:\n%s%s", mode, exit.ExitCode(), out, stderr.Bytes())
	}
	return res, exit
}

func TestFilterInChild(t *testing.T) {
	// No testutil.CheckLeaks: its mount and cgroup checks are machine-wide
	// and would report other packages' tests running alongside; the children
	// here are all waited for by exec.
	if !Supported() {
		testutil.Skip(t, "kernel without seccomp")
	}
	got, _ := runChild(t, "probe")
	want := map[string]string{
		"mount": "EPERM", "umount2": "EPERM", "pivot_root": "EPERM", "keyctl": "EPERM", "bpf": "EPERM",
		"open_by_handle_at": "EPERM", "personality_aslr_off": "EPERM",
		"personality_query": "ok", "personality_linux": "ok", "file_io": "ok", "fork_exec": "ok",
		"clone_newuser": "ok", "clone3": "EINVAL", "setns": "EBADF", "pidfd_open": "ok",
		"process_vm_readv": "ok", "mmap": "ok", "dup3_lseek_chdir": "ok", "threads": "ok", "child_filtered": "ok",
	}
	for k, w := range want {
		if got[k] != w {
			t.Errorf("with the filter, %s = %q, want %q", k, got[k], w)
		}
	}

	// The control: without the filter the denied calls fail otherwise (or
	// succeed), so EPERM above is the filter's doing.
	ctl, _ := runChild(t, "probe-nofilter")
	denied := []string{"keyctl", "bpf", "open_by_handle_at", "personality_aslr_off"}
	if os.Geteuid() == 0 {
		denied = append(denied, "mount", "umount2", "pivot_root")
	}
	for _, k := range denied {
		if ctl[k] == "EPERM" || ctl[k] == "" {
			t.Errorf("without the filter, %s = %q: the test cannot tell the filter's EPERM apart", k, ctl[k])
		}
	}
}

func TestForeignABIKilled(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skip("the 32-bit gate is x86-64's")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=int80-nofilter")
	out, err := cmd.Output()
	pid, perr := strconv.Atoi(strings.TrimPrefix(strings.TrimSpace(string(out)), "int80="))
	if err != nil || perr != nil || pid <= 0 {
		// A kernel without ia32 emulation (or a hypervisor without the gate)
		// faults int 0x80: there is no 32-bit entry to close.
		t.Skipf("int 0x80 does not work here even without a filter (%v, %q): no 32-bit entry", err, out)
	}
	got, exit := runChild(t, "int80")
	if exit == nil {
		t.Fatalf("a 32-bit getpid under the filter returned %q, want the process killed", got["int80"])
	}
	if ws, ok := exit.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGSYS {
		t.Errorf("a 32-bit getpid under the filter ended %v, want killed by SIGSYS", exit)
	}
}

// The policy logic, without applying it: run the program in a BPF VM on
// seccomp_data records. The VM loads words big-endian, the kernel natively,
// so each 32-bit word is stored big-endian at the offset the native load
// reads.
func runFilter(t *testing.T, prog []bpf.Instruction, auditArch uint32, nr int, args ...uint64) uint32 {
	t.Helper()
	vm, err := bpf.NewVM(prog)
	if err != nil {
		t.Fatalf("NewVM: %v", err)
	}
	data := make([]byte, 64)
	binary.BigEndian.PutUint32(data[0:], uint32(nr))
	binary.BigEndian.PutUint32(data[4:], auditArch)
	for i, a := range args {
		off := 16 + 8*i
		lo, hi := off, off+4 // x86-64 is little-endian: the low word comes first
		binary.BigEndian.PutUint32(data[lo:], uint32(a))
		binary.BigEndian.PutUint32(data[hi:], uint32(a>>32))
	}
	v, err := vm.Run(data)
	if err != nil {
		t.Fatalf("run filter: %v", err)
	}
	return uint32(v)
}

const (
	retAllow = unix.SECCOMP_RET_ALLOW
	retEPERM = unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)
	retKill  = unix.SECCOMP_RET_KILL_PROCESS
)

func TestPolicyLogic(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skip("the table below is x86-64's")
	}
	prog, err := Default().Assemble()
	if err != nil {
		t.Fatal(err)
	}
	native := uint32(arch.X86_64.ID)
	nr := func(name string) int {
		n, ok := arch.X86_64.SyscallNames[name]
		if !ok {
			t.Fatalf("no syscall %q", name)
		}
		return n
	}
	for _, r := range DefaultTable() {
		if _, ok := arch.X86_64.SyscallNames[r.Name]; !ok {
			continue
		}
		if got := runFilter(t, prog, native, nr(r.Name)); got != retEPERM {
			t.Errorf("filter(%s) = %#x, want EPERM", r.Name, got)
		}
	}
	for _, name := range append(MustAllow(), "read", "write", "execve", "exit_group", "getpid") {
		if got := runFilter(t, prog, native, nr(name), uint64(unix.CLONE_NEWUSER)); got != retAllow {
			t.Errorf("filter(%s) = %#x, want allow", name, got)
		}
	}
	for _, tc := range []struct {
		arg  uint64
		want uint32
	}{
		{0, retAllow}, {8, retAllow}, {0x20000, retAllow}, {0x20008, retAllow}, {0xffffffff, retAllow},
		{addrNoRandomize, retEPERM}, {0x0400000, retEPERM}, {1 << 32, retEPERM}, {0xffffffff_ffffffff, retEPERM},
	} {
		if got := runFilter(t, prog, native, nr("personality"), tc.arg); got != tc.want {
			t.Errorf("filter(personality(%#x)) = %#x, want %#x", tc.arg, got, tc.want)
		}
	}
	// Another ABI is killed whatever the call: i386's getpid (20) and mount (21).
	for _, n := range []int{20, 21} {
		if got := runFilter(t, prog, uint32(arch.I386.ID), n); got != retKill {
			t.Errorf("filter(i386 %d) = %#x, want kill", n, got)
		}
	}
	// x32 calls (same audit arch, bit 30 set) are refused by the library.
	if got := runFilter(t, prog, native, 0x40000000|nr("getpid")); got&unix.SECCOMP_RET_ACTION_FULL != unix.SECCOMP_RET_ERRNO {
		t.Errorf("filter(x32 getpid) = %#x, want an errno", got)
	}
}

func TestTable(t *testing.T) {
	seen := map[string]bool{}
	var skipped []string
	for _, r := range DefaultTable() {
		if seen[r.Name] {
			t.Errorf("%q is listed twice", r.Name)
		}
		seen[r.Name] = true
		if r.Why == "" {
			t.Errorf("%q has no reason", r.Name)
		}
		if slices.Contains(MustAllow(), r.Name) {
			t.Errorf("%q is denied but injection needs it", r.Name)
		}
		_, native := arch.X86_64.SyscallNames[r.Name]
		_, i386 := arch.I386.SyscallNames[r.Name]
		if !native && !i386 {
			t.Errorf("%q is no system call", r.Name)
		}
		if !native {
			skipped = append(skipped, r.Name)
		}
	}
	slices.Sort(skipped)
	if want := []string{"vm86", "vm86old"}; !slices.Equal(skipped, want) {
		t.Errorf("names not on x86-64 = %v, want %v", skipped, want)
	}
	bad := Policy{Table: []Rule{{"setns", "oops"}}}
	if _, err := bad.Assemble(); err == nil {
		t.Errorf("Assemble of a policy denying setns succeeded")
	}
}
