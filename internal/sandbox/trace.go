//go:build linux

package sandbox

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"
)

// trace times the steps of one operation and logs them at debug level, for
// finding where the time of a slow operation goes.
type trace struct {
	ctx   context.Context
	start time.Time
	last  time.Time
	steps []string
}

func newTrace(ctx context.Context) *trace {
	now := time.Now()
	return &trace{ctx: ctx, start: now, last: now}
}

func (t *trace) step(name string) {
	now := time.Now()
	t.steps = append(t.steps, fmt.Sprintf("%s=%.2fms", name, float64(now.Sub(t.last).Microseconds())/1000))
	t.last = now
}

func (t *trace) done(log *slog.Logger, what string) {
	log.DebugContext(t.ctx, what, "total_ms", float64(time.Since(t.start).Microseconds())/1000, "steps", strings.Join(t.steps, " "))
}
