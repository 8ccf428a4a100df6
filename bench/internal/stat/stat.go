// Package stat summarizes benchmark samples, the same way for every
// benchmark program.
package stat

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Percentile is the nearest-rank p-th percentile of d (0 when empty); d is
// not changed.
func Percentile(d []time.Duration, p int) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[rank(len(s), p)]
}

// rank is the index of the nearest-rank p-th percentile of n sorted samples.
func rank(n, p int) int { return max(0, min(n-1, (n*p+99)/100-1)) }

// Summary is what the benchmarks print of a series of samples.
type Summary struct {
	Median, P95, Min, Max time.Duration
	N                     int
}

// Summarize summarizes d (which is not changed): the median is the upper
// one for an even count, the 95th percentile the nearest rank.
func Summarize(d []time.Duration) Summary {
	if len(d) == 0 {
		return Summary{}
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return Summary{Median: s[len(s)/2], P95: s[rank(len(s), 95)], Min: s[0], Max: s[len(s)-1], N: len(s)}
}

// Ms is d in milliseconds.
func Ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// CPUBusy returns the machine's CPU time spent busy (all cores: user,
// system and interrupts; not idle, I/O wait or stolen) since boot, from /proc/stat: the difference of two
// readings is what a stretch of work cost the machine, whichever processes
// did it.
func CPUBusy() (time.Duration, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
	if len(f) < 8 || f[0] != "cpu" {
		return 0, fmt.Errorf("/proc/stat: unexpected %q", line)
	}
	var busy int64
	for _, i := range []int{1, 2, 3, 6, 7} { // user nice system, irq softirq
		n, err := strconv.ParseInt(f[i], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/stat: %w", err)
		}
		busy += n
	}
	// USER_HZ is 100 on Linux (sysconf(_SC_CLK_TCK)).
	return time.Duration(busy) * 10 * time.Millisecond, nil
}
