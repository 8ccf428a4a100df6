//go:build linux

package inject

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/procfs"
)

// pageSize is the smallest page size: the alignment of Scratch memory and
// the unit in which an address is known to share the protection of another.
const pageSize = 4096

// ptrace issues a raw ptrace request; x/sys/unix has no PTRACE_SEIZE with
// options.
func ptrace(req, pid int, addr, data uintptr) error {
	_, _, e := unix.Syscall6(unix.SYS_PTRACE, uintptr(req), uintptr(pid), addr, data, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

// wait4 waits for pid with __WALL (tracees that are clones, and children
// of other threads of this process) and the given extra options, retrying
// on EINTR. It never waits for "any" process: that would steal the exits
// of children other code waits for.
func wait4(pid, options int) (unix.WaitStatus, int, error) {
	var ws unix.WaitStatus
	for {
		wpid, err := unix.Wait4(pid, &ws, unix.WALL|options, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return ws, wpid, err
	}
}

// event is the PTRACE_EVENT_* of a ptrace-stop, 0 for a signal-delivery-
// or syscall-stop.
func event(ws unix.WaitStatus) int { return int(uint32(ws) >> 16) }

// describe renders an exit status for an error message.
func describe(ws unix.WaitStatus) string {
	switch {
	case ws.Exited():
		return fmt.Sprintf("exit status %d", ws.ExitStatus())
	case ws.Signaled():
		return "killed by " + unix.SignalName(ws.Signal())
	default:
		return fmt.Sprintf("status %#x", uint32(ws))
	}
}

func isStopSignal(s unix.Signal) bool {
	return s == unix.SIGSTOP || s == unix.SIGTSTP || s == unix.SIGTTIN || s == unix.SIGTTOU
}

// mapping is one line of /proc/pid/maps.
type mapping struct {
	start, end uintptr
	perms      string
	name       string
}

func readMaps(pid int) ([]mapping, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/maps")
	if err != nil {
		return nil, fmt.Errorf("read memory map: %w", err)
	}
	defer f.Close()
	var out []mapping
	s := bufio.NewScanner(f)
	for s.Scan() {
		// start-end perms offset dev inode [name]
		fields := strings.Fields(s.Text())
		if len(fields) < 5 {
			continue
		}
		lo, hi, ok := strings.Cut(fields[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil {
			continue
		}
		m := mapping{start: uintptr(start), end: uintptr(end), perms: fields[1]}
		if len(fields) > 5 {
			m.name = fields[5]
		}
		out = append(out, m)
	}
	if err := s.Err(); err != nil {
		return nil, fmt.Errorf("read memory map: %w", err)
	}
	return out, nil
}

// readMemUpTo reads from addr in pid into b and returns how much it could
// read before the first unreadable page.
func readMemUpTo(pid int, addr uintptr, b []byte) (int, error) {
	done := 0
	for done < len(b) {
		n, err := unix.ProcessVMReadv(pid,
			[]unix.Iovec{{Base: &b[done], Len: uint64(len(b) - done)}},
			[]unix.RemoteIovec{{Base: addr + uintptr(done), Len: len(b) - done}}, 0)
		if err != nil {
			if done > 0 && errors.Is(err, unix.EFAULT) {
				break
			}
			return done, fmt.Errorf("process_vm_readv: %w", err)
		}
		if n == 0 {
			break
		}
		done += n
	}
	return done, nil
}

// readMem fills b from addr in pid.
func readMem(pid int, addr uintptr, b []byte) error {
	if len(b) == 0 {
		return nil
	}
	n, err := readMemUpTo(pid, addr, b)
	if err != nil {
		return err
	}
	if n < len(b) {
		return fmt.Errorf("read %d of %d bytes: %w", n, len(b), io.ErrUnexpectedEOF)
	}
	return nil
}

// writeMem writes b at addr in pid. process_vm_writev honours page
// protection, which suits scratch memory: it never writes code.
func writeMem(pid int, addr uintptr, b []byte) error {
	done := 0
	for done < len(b) {
		n, err := unix.ProcessVMWritev(pid,
			[]unix.Iovec{{Base: &b[done], Len: uint64(len(b) - done)}},
			[]unix.RemoteIovec{{Base: addr + uintptr(done), Len: len(b) - done}}, 0)
		if err != nil {
			return fmt.Errorf("process_vm_writev: %w", err)
		}
		if n == 0 {
			return fmt.Errorf("wrote %d of %d bytes: %w", done, len(b), io.ErrShortWrite)
		}
		done += n
	}
	return nil
}

// statusField returns a field of /proc/pid/status.
func statusField(pid int, name string) (string, error) {
	v, err := statusFields(pid, name)
	return v[0], err
}

// statusFields returns fields of /proc/pid/status, in the order asked, from
// one read.
func statusFields(pid int, names ...string) ([]string, error) {
	out := make([]string, len(names))
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return out, err
	}
	found := 0
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if i := slices.Index(names, k); ok && i >= 0 {
			out[i] = strings.TrimSpace(v)
			found++
		}
	}
	if found != len(names) {
		return out, fmt.Errorf("not all of %v in /proc/%d/status: %w", names, pid, errdefs.ErrNotFound)
	}
	return out, nil
}

// nsPid is pid's pid in its own pid namespace.
func nsPid(pid int) (int, error) {
	ns, err := procfs.NSpids(pid)
	if err != nil {
		return 0, err
	}
	if len(ns) == 0 {
		return 0, fmt.Errorf("empty NSpid of %d: %w", pid, errdefs.ErrNotFound)
	}
	return ns[len(ns)-1], nil
}

// deliverable reports whether one of sigs is not blocked by pid, so that
// it will be handled as the process next returns to user mode.
func deliverable(pid int, sigs []unix.Signal) bool {
	v, err := statusField(pid, "SigBlk")
	if err != nil {
		return false
	}
	blocked, err := strconv.ParseUint(v, 16, 64)
	if err != nil {
		return false
	}
	for _, s := range sigs {
		if s == unix.SIGKILL || s == unix.SIGSTOP || blocked&(1<<(uint(s)-1)) == 0 {
			return true
		}
	}
	return false
}

// findInt32 returns the offset of the first 8-byte aligned little-endian
// int32 equal to v in b.
func findInt32(b []byte, v int32) (uintptr, bool) {
	all := findAllInt32(b, v)
	if len(all) == 0 {
		return 0, false
	}
	return all[0], true
}

// findAllInt32 returns every 8-byte aligned offset of v in b.
func findAllInt32(b []byte, v int32) []uintptr {
	var want [4]byte
	binary.LittleEndian.PutUint32(want[:], uint32(v))
	var out []uintptr
	for off := 0; off+4 <= len(b); off += 8 {
		if bytes.Equal(b[off:off+4], want[:]) {
			out = append(out, uintptr(off))
		}
	}
	return out
}
