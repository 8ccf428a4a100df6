package stat

import (
	"testing"
	"time"
)

func TestSummarize(t *testing.T) {
	var d []time.Duration
	for i := 20; i >= 1; i-- { // unsorted on purpose
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	got := Summarize(d)
	want := Summary{Median: 11 * time.Millisecond, P95: 19 * time.Millisecond, Min: time.Millisecond, Max: 20 * time.Millisecond, N: 20}
	if got != want {
		t.Errorf("Summarize(1..20 ms) = %+v, want %+v", got, want)
	}
	if d[0] != 20*time.Millisecond {
		t.Errorf("Summarize sorted its argument")
	}
	if p := Percentile(d, 50); p != 10*time.Millisecond {
		t.Errorf("Percentile(1..20 ms, 50) = %v, want 10ms (nearest rank)", p)
	}
	if (Summarize(nil) != Summary{}) || Percentile(nil, 95) != 0 {
		t.Errorf("empty samples must summarize to zero")
	}
}
