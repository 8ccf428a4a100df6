//go:build linux && amd64

#include "textflag.h"

// func Syscall(trap uint32) uint32
TEXT ·Syscall(SB), NOSPLIT, $0-12
	MOVL trap+0(FP), AX
	INT  $0x80
	MOVL AX, ret+8(FP)
	RET
