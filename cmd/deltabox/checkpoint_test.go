//go:build linux

package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/deltabox/deltabox/internal/daemon/daemontest"
)

// ageRe hides the ages in tree's drawing, which depend on the clock.
var ageRe = regexp.MustCompile(`\((just now|[0-9]+[a-z]+ ago)\)`)

// TestCheckpointCommands builds a fixed tree on the fake and pins the --json
// shapes and the drawing:
//
//	ck-0001 base
//	├── ck-0002  ◀ sb-0003         (sb-0002 and sb-0003 are its forks)
//	│   └── ck-0004 fix  ◀ sb-0002
//	└── ck-0003  ◀ sb-0001         (taken after a restore to ck-0001)
//
//	no head: sb-0005
func TestCheckpointCommands(t *testing.T) {
	t.Parallel()
	sock, fake := daemontest.ServeFake(t)
	ok := func(args ...string) string {
		t.Helper()
		r := cli(t, sock, "", args...)
		if r.code != 0 {
			t.Fatalf("%q: exit %d, stderr %q", args, r.code, r.stderr)
		}
		return r.stdout
	}
	file := func(sb string) string { return filepath.Join(fake.Dir, sb, "work", "f") }
	write := func(sb, content string) {
		t.Helper()
		if err := os.WriteFile(file(sb), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	read := func(sb string) string {
		t.Helper()
		b, _ := os.ReadFile(file(sb))
		return string(b)
	}

	sb := mustCreate(t, sock)
	ok("sh", sb, "--", "cd /work")
	write(sb, "1")
	out := ok("checkpoint", sb, "--json", "--name", "base", "--label", "step=0")
	golden(t, "checkpoint.json", out)
	var ck map[string]any
	if err := json.Unmarshal([]byte(out), &ck); err != nil || ck["id"] != "ck-0001" || ck["pause_ms"] != 2.1 {
		t.Fatalf("checkpoint --json = %s (%v)", out, err)
	}
	if out := ok("checkpoint", sb); out != "ck-0002 (paused 2.1ms)\n" {
		t.Fatalf("checkpoint = %q", out)
	}

	write(sb, "2")
	out = ok("restore", "--json", sb, "ck-0001")
	golden(t, "restore.json", out)
	if got := read(sb); got != "1" {
		t.Fatalf("file after restore = %q, want 1", got)
	}
	out = ok("restore", sb, "ck-0001")
	if want := "restored sb-0001 to ck-0001 in 3.5ms\nPROCESS        PATH    REASON\nshell session  replay  -\n"; out != want {
		t.Fatalf("restore =\n%s\nwant\n%s", out, want)
	}
	if out := ok("checkpoint", sb); out != "ck-0003 (paused 2.1ms)\n" {
		t.Fatalf("checkpoint after restore = %q", out)
	}

	out = ok("fork", "--json", "ck-0002", "-n", "2")
	golden(t, "fork.json", out)
	if out := ok("fork", "ck-0002"); out != "sb-0004\n" {
		t.Fatalf("fork = %q, want the id", out)
	}
	ok("rm", "sb-0004")
	mustCreate(t, sock) // sb-0005, no head

	write("sb-0002", "changed")
	os.WriteFile(filepath.Join(fake.Dir, "sb-0002", "work", "new"), []byte("n"), 0o644)
	out = ok("diff", "--json", "ck-0002", "sb-0002")
	golden(t, "diff.json", out)
	if out := ok("diff", "sb-0002", "ck-0002"); out != "M /work/f\nD /work/new\n" {
		t.Fatalf("diff = %q", out)
	}
	if out := ok("diff", "--json", "ck-0001", "ck-0003"); out != "[]\n" {
		t.Fatalf("diff of equal checkpoints = %q, want []", out)
	}

	ok("checkpoint", "sb-0002", "--name", "fix") // ck-0004, below a fork's head

	out = ok("tree", "--json")
	golden(t, "tree.json", out)
	golden(t, "tree.txt", ageRe.ReplaceAllString(ok("tree"), "(AGE)"))
	if out := ok("tree", "sb-0002"); !strings.Contains(out, "└── ck-0003 (") {
		t.Fatalf("tree sb-0002 =\n%s", out)
	}

	var list []map[string]any
	out = ok("checkpoint", "ls", "--json")
	if err := json.Unmarshal([]byte(out), &list); err != nil || len(list) != 4 || list[2]["parent"] != "ck-0001" || list[3]["parent"] != "ck-0002" {
		t.Fatalf("checkpoint ls --json = %s (%v)", out, err)
	}
	if out := ok("checkpoint", "ls"); !strings.HasPrefix(out, "ID") || !regexp.MustCompile(`(?m)^ck-0004 +fix +ck-0002 +sb-0002 `).MatchString(out) {
		t.Fatalf("checkpoint ls =\n%s", out)
	}

	// Refusals: the edge's and the tree's.
	for _, tc := range []struct {
		args []string
		msg  string
	}{
		{[]string{"fork", "ck-0001", "-n", "0"}, "invalid argument"},
		{[]string{"fork", "ck-0001", "-n", "257"}, "invalid argument"},
		{[]string{"checkpoint", sb, "--label", "nokey"}, "bad label"},
		{[]string{"restore", sb, "ck-9999"}, "not found"},
		{[]string{"checkpoint", "rm", "ck-0001"}, "children"},
	} {
		r := cli(t, sock, "", tc.args...)
		if r.code != 1 || !strings.Contains(r.stderr, tc.msg) {
			t.Errorf("%q = %+v, want exit 1 and %q", tc.args, r, tc.msg)
		}
	}
	if out := ok("checkpoint", "rm", "ck-0003"); out != "ck-0003\n" {
		t.Fatalf("checkpoint rm = %q", out)
	}
	if out := ok("inspect", "--json", sb); !strings.Contains(out, `"head": "ck-0001"`) {
		t.Fatalf("head after rm of its checkpoint: %s", out)
	}
	out = ok("checkpoint", "rm", "--json", "--recursive", "ck-0001")
	if out != "[\n  {\n    \"id\": \"ck-0001\"\n  }\n]\n" {
		t.Fatalf("checkpoint rm --recursive --json = %q", out)
	}
	if out := ok("tree"); out != "no checkpoints\n\nno head: sb-0001 sb-0002 sb-0003 sb-0005\n" {
		t.Fatalf("tree with no checkpoints = %q", out)
	}
}
