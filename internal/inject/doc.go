//go:build linux

// Package inject owns ptrace-based system call injection: it stops a live
// process without its cooperation, runs system calls inside it, forks it
// (the fork of a "fork template"), and lets it go, running on or frozen in
// group-stop.
//
// # One thread
//
// The kernel accepts ptrace requests for a tracee only from the thread
// that attached it, and reports its stops to that thread. A Tracer
// therefore runs every request on one goroutine locked to its OS thread
// and hands it work as closures; its methods and those of its Procs may be
// called from any goroutine and are serialised. Nothing else in this
// process may wait for a process while it is attached: every thread of a
// process sees the ptrace stops of the others' tracees, so a concurrent
// wait (exec.Cmd.Wait included) steals them. This package itself never
// waits for "any" process.
//
// # Lifecycle
//
// Seize attaches a process and stops it; its registers are read once and
// the kernel's system call restart rule is applied to them, giving the
// registers it resumes with. Syscall injects system calls; Clone forks it
// into a second Proc that resumes where it would; Scratch, WriteMem and
// ReadMem pass arguments through its memory. Detach writes the resume
// registers back, re-queues the signals swallowed meanwhile and lets it go,
// running or stopped (a template, which a later Seize adopts again). Kill
// ends it instead. Close ends the Tracer's thread.
//
// Targets are single-threaded: only the thread whose pid is given is
// stopped, and a fork copies only it.
package inject
