package harness

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/deltabox/deltabox/internal/testutil"
)

// TestUnittestEvaluatorSession scores a suite from the job's shell session
// as from a command of its own, keeps the session's state across the run,
// and stops a suite that runs past its time without losing the session.
func TestUnittestEvaluatorSession(t *testing.T) {
	testutil.RequiresBinary(t, "python3")
	t.Parallel()
	ctx := context.Background()
	ex := newLocal(t)
	suite := "import unittest\nclass T(unittest.TestCase):\n    def test_ok(self): pass\n    def test_bad(self): self.assertEqual(1, 2)\n"
	if err := ex.WriteFile(ctx, "proj/test_x.py", []byte(suite), 0); err != nil {
		t.Fatal(err)
	}
	tools := NewTools(ex, Limits{})
	if _, err := ex.Shell(ctx, "MARK=kept", SessionOptions{Timeout: 5 * time.Second}); err != nil {
		t.Fatal(err)
	}
	for _, session := range []bool{false, true} {
		got, err := UnittestEvaluator{Dir: "proj", Session: session}.Evaluate(ctx, tools)
		if err != nil || got != 0.5 {
			t.Errorf("session=%v: score %v, %v, want 0.5", session, got, err)
		}
	}
	slow := "import time, unittest\nclass T(unittest.TestCase):\n    def test_slow(self): time.sleep(60)\n"
	if err := ex.WriteFile(ctx, "slow/test_s.py", []byte(slow), 0); err != nil {
		t.Fatal(err)
	}
	got, err := UnittestEvaluator{Dir: ex.Workspace() + "/slow", Session: true, Timeout: time.Second}.Evaluate(ctx, tools)
	if err != nil || got != 0 {
		t.Errorf("a suite past its time: score %v, %v, want 0", got, err)
	}
	var out strings.Builder
	if _, err := ex.Shell(ctx, "echo $MARK", SessionOptions{Stdout: &out, Timeout: 5 * time.Second}); err != nil || strings.TrimSpace(out.String()) != "kept" {
		t.Errorf("the session after the evaluations: %q, %v, want its variable kept", out.String(), err)
	}
}
