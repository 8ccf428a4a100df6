//go:build linux && !amd64

package seccomp

func int80Getpid() uint32 { return 0 }
