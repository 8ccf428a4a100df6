//go:build linux

// Package procfs reads the few facts about a process that the runtime, the
// tracer and the tests need from /proc: its state (and whether it is on its
// way out), its start time (which, with the pid, names one process for
// good), its pids in each pid namespace, its command line, and which of its
// pages it wrote or owns alone (dirty.go) and how much memory it holds
// alone; and how much of the page cache is dirty.
package procfs

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
)

// stat returns the fields of /proc/pid/stat after the command name.
func stat(pid int) ([]string, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return nil, fmt.Errorf("pid %d: malformed stat", pid)
	}
	return strings.Fields(s[i+1:]), nil
}

// State is the state letter of a process ("S", "T", "Z", …), "" when it is
// gone.
func State(pid int) string {
	f, err := stat(pid)
	if err != nil || len(f) < 1 {
		return ""
	}
	return f[0]
}

// StartTime is the process's start time in clock ticks since boot (field
// 22 of stat), "" when it is gone.
func StartTime(pid int) string {
	f, err := stat(pid)
	if err != nil || len(f) < 20 {
		return ""
	}
	return f[19]
}

// Parent is the process's parent pid, 0 when it is gone.
func Parent(pid int) int {
	f, err := stat(pid)
	if err != nil || len(f) < 2 {
		return 0
	}
	p, _ := strconv.Atoi(f[1])
	return p
}

// NSpids returns the process's pids from the host's pid namespace (first)
// down to its own.
func NSpids(pid int) ([]int, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return nil, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "NSpid:"); ok {
			var out []int
			for _, f := range strings.Fields(rest) {
				n, err := strconv.Atoi(f)
				if err != nil {
					return nil, fmt.Errorf("pid %d: bad NSpid %q", pid, rest)
				}
				out = append(out, n)
			}
			if len(out) == 0 {
				break
			}
			return out, nil
		}
	}
	return nil, fmt.Errorf("pid %d: no NSpid", pid)
}

// Cmdline is the process's command line, arguments joined by spaces.
func Cmdline(pid int) string {
	b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	return strings.TrimSpace(strings.ReplaceAll(string(b), "\x00", " "))
}

// Exiting reports whether the process is gone or on its way out: its main
// thread has the kernel's PF_EXITING and no other thread is left (a process
// whose main thread exited alone still runs the others), so it runs no user
// code any more.
func Exiting(pid int) bool {
	f, err := stat(pid)
	if err != nil || len(f) < 18 {
		return true
	}
	flags, err1 := strconv.ParseUint(f[6], 10, 64)
	threads, err2 := strconv.Atoi(f[17])
	return err1 == nil && err2 == nil && flags&pfExiting != 0 && threads <= 1
}

const pfExiting = 0x4 // PF_EXITING, include/linux/sched.h

// Dirty returns how many bytes of the page cache wait to be written back
// (/proc/meminfo's Dirty plus Writeback), machine-wide.
func Dirty() (int64, error) { return sumKB("/proc/meminfo", "Dirty", "Writeback") }

// PrivateMemory returns what process pid holds alone: its private pages
// (smaps_rollup's Private_Clean plus Private_Dirty), not shared ones. It
// walks the process's page tables.
func PrivateMemory(pid int) (int64, error) {
	return sumKB("/proc/"+strconv.Itoa(pid)+"/smaps_rollup", "Private_Clean", "Private_Dirty")
}

// sumKB sums the "key: N kB" lines of file named by keys, in bytes.
func sumKB(file string, keys ...string) (int64, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return 0, err
	}
	var total int64
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok || !slices.Contains(keys, k) {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%s %s: %w", file, k, err)
		}
		total += kb << 10
	}
	return total, nil
}
