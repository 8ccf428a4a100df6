//go:build linux

package inject

import "encoding/binary"

// argRegs are the system call argument registers, by number (rdi, rsi,
// rdx, r10, r8, r9).
var argRegs = [6]byte{7, 6, 2, 10, 8, 9}

// assemble encodes pg as x86-64 code that runs from scratch's program:
// for each call i,
//
//	mov r15, i            ; which call, for the tracer
//	mov <arg>, imm64      ; or: mov rax, [result k]; mov <arg>, rax
//	mov eax, nr
//	syscall
//	mov [result i], rax
//	cmp rax, -4095        ; unless Try: an error ends the program
//	jae end
//
// then mov r15, len(calls) and, at end, int3. It returns the code and the
// offset just past the int3, where the tracee stops. Results are 8-byte
// slots in scratch memory after the data.
func assemble(pg *Program, scratch uintptr) ([]byte, uintptr) {
	var c []byte
	imm64 := func(v uint64) { c = binary.LittleEndian.AppendUint64(c, v) }
	imm32 := func(v uint32) { c = binary.LittleEndian.AppendUint32(c, v) }
	slot := func(i int) uint64 { return uint64(scratch + pg.resultsOffset() + 8*uintptr(i)) }
	var jumps []int // offsets of the rel32 of each jae
	for i, call := range pg.calls {
		c = append(c, 0x49, 0xC7, 0xC7) // mov r15, imm32
		imm32(uint32(i))
		for j, a := range call.args[:call.nargs] {
			reg := argRegs[j]
			switch a.kind {
			case argValue, argData:
				v := uint64(a.v)
				if a.kind == argData {
					v = uint64(scratch + a.v)
				}
				c = append(c, 0x48|reg>>3, 0xB8+reg&7) // mov reg, imm64
				imm64(v)
			case argResult: // an earlier call's (Program.add checks)
				c = append(c, 0x48, 0xA1) // mov rax, [moffs64]
				imm64(slot(int(a.v)))
				c = append(c, 0x48|reg>>3, 0x89, 0xC0|reg&7) // mov reg, rax
			}
		}
		c = append(c, 0xB8) // mov eax, imm32 (zero-extended)
		imm32(uint32(call.nr))
		c = append(c, 0x0F, 0x05) // syscall
		c = append(c, 0x48, 0xA3) // mov [moffs64], rax
		imm64(slot(i))
		if !call.try {
			c = append(c, 0x48, 0x3D) // cmp rax, imm32 (sign-extended)
			imm32(uint32(0xFFFFF001)) // -4095
			c = append(c, 0x0F, 0x83) // jae rel32
			jumps = append(jumps, len(c))
			imm32(0)
		}
	}
	c = append(c, 0x49, 0xC7, 0xC7) // mov r15, len(calls)
	imm32(uint32(len(pg.calls)))
	end := len(c)
	c = append(c, 0xCC) // int3
	for _, at := range jumps {
		binary.LittleEndian.PutUint32(c[at:], uint32(int32(end-(at+4))))
	}
	return c, uintptr(end + 1)
}

// progStatus is the call a program stopped at (see assemble): its index
// when it failed, len(calls) when all ran.
func progStatus(r Regs) int { return int(int32(r.R15)) }
