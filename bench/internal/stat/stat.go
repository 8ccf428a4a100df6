// Package stat summarizes benchmark samples, the same way for every
// benchmark program.
package stat

import (
	"slices"
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
