//go:build linux

package main

import "github.com/deltabox/deltabox/internal/sandbox/initproc"

// maybeRunSandboxInit runs the sandbox init (and never returns) when the
// daemon re-executed this binary as one.
func maybeRunSandboxInit() {
	if initproc.IsInit() {
		initproc.Run()
	}
}
