//go:build linux && amd64

// Package int80 enters the kernel through the 32-bit int 0x80 gate, so that
// the seccomp tests can check that the filter kills calls of a foreign ABI.
package int80

// Syscall makes the i386 system call trap with no arguments and returns eax.
func Syscall(trap uint32) uint32

// Getpid is the i386 number of getpid.
const Getpid = 20
