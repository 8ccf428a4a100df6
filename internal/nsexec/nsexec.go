//go:build linux && cgo

// Package nsexec links the small single-threaded C part of DeltaBox into any
// binary that imports it. A constructor runs before the Go runtime starts; it
// acts only when the binary is re-executed with EnvMode set (see nsexec.c for
// the modes) and otherwise returns at once.
//
// Why C: a holder must not pay for a Go runtime start, and the checkpoint work
// that follows (joining a tree's user and mount namespaces) needs a
// single-threaded caller, which a Go process never is.
package nsexec

// #cgo CFLAGS: -Wall -O2
import "C"

// EnvMode selects the constructor's mode; unset, it does nothing.
const EnvMode = "_DELTABOX_NSEXEC"

// ModeHold blocks until stdin reaches end of file, then exits 0.
const ModeHold = "hold"
