//go:build !linux

package main

// maybeRunSandboxInit does nothing: sandboxes run on Linux only.
func maybeRunSandboxInit() {}
