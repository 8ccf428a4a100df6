//go:build linux

package procfs

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Range is a range of a process's address space, [Start, End).
type Range struct{ Start, End uintptr }

const (
	pageSize      = 4096
	pmPresent     = 1 << 63
	pmExclusive   = 1 << 56
	maxPagemapBuf = 64 << 10 // entries read at once: 64 KiB = 32 MiB of address space
)

// Touched returns the present pages of pid's private writable anonymous
// mappings (heap, stack, anonymous maps): the memory it wrote, which a
// clone of it is likely to write again. (Soft-dirty bits would narrow this
// to what it wrote recently; this kernel is built without them.) Pages
// closer than gap bytes are merged into one range; ranges stop once they
// cover max bytes.
func Touched(pid int, gap uintptr, max int64) ([]Range, error) {
	return scanPages(pid, gap, max, func(e uint64) bool { return e&pmPresent != 0 })
}

// Exclusive returns the pages of pid's private writable anonymous mappings
// that are mapped by it alone: for a clone, those it no longer shares with
// its template (written, or pre-faulted for writing). Tests use it.
func Exclusive(pid int) ([]Range, error) {
	return scanPages(pid, 0, 1<<62, func(e uint64) bool { return e&pmPresent != 0 && e&pmExclusive != 0 })
}

func scanPages(pid int, gap uintptr, max int64, want func(uint64) bool) ([]Range, error) {
	maps, err := os.Open("/proc/" + strconv.Itoa(pid) + "/maps")
	if err != nil {
		return nil, err
	}
	defer maps.Close()
	pm, err := os.Open("/proc/" + strconv.Itoa(pid) + "/pagemap")
	if err != nil {
		return nil, err
	}
	defer pm.Close()
	var out []Range
	var total int64
	fresh := true // a new mapping: never merged with the last one's pages
	add := func(start, end uintptr) bool {
		if n := len(out); n > 0 && !fresh && start-out[n-1].End <= gap {
			total += int64(end - out[n-1].End)
			out[n-1].End = end
		} else {
			total += int64(end - start)
			out = append(out, Range{start, end})
		}
		fresh = false
		return total < max
	}
	buf := make([]byte, maxPagemapBuf)
	sc := bufio.NewScanner(maps)
	for sc.Scan() {
		// start-end perms offset dev inode [path]
		f := strings.Fields(sc.Text())
		if len(f) < 5 || f[1] != "rw-p" || f[4] != "0" {
			continue // not private, writable and anonymous
		}
		if len(f) > 5 && f[5] != "[heap]" && f[5] != "[stack]" {
			continue
		}
		se := strings.SplitN(f[0], "-", 2)
		start, err1 := strconv.ParseUint(se[0], 16, 64)
		end, err2 := strconv.ParseUint(se[1], 16, 64)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("pid %d: malformed maps line %q", pid, sc.Text())
		}
		fresh = true
		for a := uintptr(start); a < uintptr(end); {
			n := min(int(uintptr(end)-a)/pageSize*8, len(buf))
			got, err := pm.ReadAt(buf[:n], int64(a/pageSize*8))
			if got == 0 && err != nil {
				return nil, fmt.Errorf("pid %d: read pagemap: %w", pid, err)
			}
			for i := 0; i+8 <= got; i += 8 {
				if want(binary.LittleEndian.Uint64(buf[i:])) {
					p := a + uintptr(i/8)*pageSize
					if !add(p, p+pageSize) {
						return out, nil
					}
				}
			}
			a += uintptr(got/8) * pageSize
		}
	}
	return out, sc.Err()
}
