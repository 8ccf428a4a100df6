//go:build linux && amd64

package seccomp

import "github.com/deltabox/deltabox/internal/sandbox/seccomp/internal/int80"

func int80Getpid() uint32 { return int80.Syscall(int80.Getpid) }
