//go:build linux

package main

import (
	"bytes"
	"context"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/deltabox/deltabox/internal/testutil"
)

// TestDemo runs the demo in-process as root, on a private daemon of its
// own, and checks that it prints the tree, finds the fix, reports the
// latencies and leaves nothing behind.
func TestDemo(t *testing.T) {
	testutil.RequiresRoot(t)
	testutil.CheckLeaks(t)
	root := t.TempDir()
	var out bytes.Buffer
	err := runDemo(context.Background(), &out, demoConfig{Root: root, CgroupParent: testutil.CgroupParent()})
	t.Logf("demo output:\n%s", out.String())
	if err != nil {
		t.Fatalf("runDemo: %v", err)
	}
	got := out.String()
	for _, want := range []*regexp.Regexp{
		regexp.MustCompile(`(?m)^ck-[0-9a-f]+ best-of-n root `),
		regexp.MustCompile(`(?m)^└── ck-[0-9a-f]+ mcts root \[0\.33\]`),
		regexp.MustCompile(`(?m)[├└]── ck-[0-9a-f]+ [a-z]+: .* \[1\.00\] .*◀ sb-`),
		regexp.MustCompile(`(?m)^winning path: add: a \+ b  →  (mean: / len|clamp: max\(lo, min\(hi, x\)\))  →  (mean: / len|clamp: max\(lo, min\(hi, x\)\))$`),
		regexp.MustCompile(`(?m)^fix found: 6/6 tests pass`),
		regexp.MustCompile(`(?m)^  \+    return sum\(xs\) / len\(xs\)$`),
		regexp.MustCompile(`(?m)^  checkpoint pause_ms +n=\d+ +median +[0-9.]+ ms +p95 +[0-9.]+ ms$`),
		regexp.MustCompile(`(?m)^  restore_ms +n=[1-9]`),
		regexp.MustCompile(`(?m)^  fork_ms \(4 at once\) +n=1 `),
		regexp.MustCompile(`(?m)^  share of search time in checkpoint\+restore\+fork calls: [0-9.]+%`),
		regexp.MustCompile(`(?m)^cleaned up: `),
	} {
		if !want.MatchString(got) {
			t.Errorf("the output lacks %s", want)
		}
	}
	if strings.Count(got, "6/6 tests pass") < 1 {
		t.Errorf("no complete fix in the output")
	}
	// The private daemon's state directory is gone.
	if ents, _ := os.ReadDir(root); len(ents) != 0 {
		t.Errorf("left in %s: %v", root, ents)
	}
}
