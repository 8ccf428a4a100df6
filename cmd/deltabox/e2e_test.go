//go:build linux

package main

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/deltabox/deltabox/internal/daemon/daemontest"
	"github.com/deltabox/deltabox/internal/testutil/sandboxtest"
)

// TestEndToEndCheckpoint drives the real state manager, served by the real
// daemon on a unix socket, through the CLI: checkpoint, restore in place,
// fork, tree, diff and checkpoint rm.
func TestEndToEndCheckpoint(t *testing.T) {
	m := sandboxtest.NewManager(t)
	sock, _ := daemontest.Serve(t, m)

	ok := func(args ...string) string {
		t.Helper()
		r := cli(t, sock, "", args...)
		if r.code != 0 {
			t.Fatalf("deltabox %q: exit %d, stdout %q, stderr %q", args, r.code, r.stdout, r.stderr)
		}
		return r.stdout
	}
	decode := func(out string, v any) {
		t.Helper()
		if err := json.Unmarshal([]byte(out), v); err != nil {
			t.Fatalf("decode %q: %v", out, err)
		}
	}
	cat := func(sb string) string {
		t.Helper()
		return ok("exec", sb, "--", "cat", "/work/f")
	}

	sb := mustCreate(t, sock)
	var sandboxes []string // every sandbox made, removed at the end
	sandboxes = append(sandboxes, sb)
	t.Cleanup(func() {
		for _, id := range sandboxes {
			cli(t, sock, "", "rm", "--force", id)
		}
	})
	ok("exec", sb, "--", "sh", "-c", "echo 1 > /work/f")
	ok("sh", sb, "--", "cd /work && X=kept")

	var ck struct {
		ID        string  `json:"id"`
		PauseMs   float64 `json:"pause_ms"`
		Heads     []string
		Processes []struct{ Name, Path, Reason string }
	}
	decode(ok("checkpoint", "--json", "--name", "one", sb), &ck)
	if !strings.HasPrefix(ck.ID, "ck-") || ck.PauseMs <= 0 || !slices.Equal(ck.Heads, []string{sb}) {
		t.Fatalf("checkpoint --json = %+v", ck)
	}

	ok("exec", sb, "--", "sh", "-c", "echo 2 > /work/f")
	var rs struct {
		RestoreMs float64 `json:"restore_ms"`
		Processes []struct{ Name, Path, Reason string }
	}
	decode(ok("restore", "--json", sb, ck.ID), &rs)
	if rs.RestoreMs <= 0 || len(rs.Processes) == 0 {
		t.Fatalf("restore --json = %+v, want a time and the processes", rs)
	}
	for _, p := range rs.Processes {
		if !slices.Contains([]string{"template", "criu", "replay", "none"}, p.Path) || p.Name == "" {
			t.Errorf("restored process %+v: bad path or no name", p)
		}
		if p.Path == "none" && p.Reason == "" {
			t.Errorf("restored process %+v: not captured and no reason", p)
		}
	}
	if got := cat(sb); got != "1\n" {
		t.Fatalf("/work/f after restore = %q, want 1", got)
	}

	var fork struct {
		IDs    []string `json:"ids"`
		ForkMs float64  `json:"fork_ms"`
	}
	decode(ok("fork", "--json", ck.ID, "-n", "3"), &fork)
	sandboxes = append(sandboxes, fork.IDs...)
	if len(fork.IDs) != 3 || fork.ForkMs <= 0 {
		t.Fatalf("fork --json = %+v", fork)
	}
	for _, id := range fork.IDs {
		if got := cat(id); got != "1\n" {
			t.Errorf("fork %s: /work/f = %q, want 1", id, got)
		}
	}

	var tree struct {
		Checkpoints []struct {
			ID    string   `json:"id"`
			Heads []string `json:"heads"`
		} `json:"checkpoints"`
		Sandboxes []struct {
			ID   string `json:"id"`
			Head string `json:"head"`
		} `json:"sandboxes"`
	}
	decode(ok("tree", "--json", sb), &tree)
	wantHeads := slices.Sorted(slices.Values(append([]string{sb}, fork.IDs...)))
	if len(tree.Checkpoints) != 1 || tree.Checkpoints[0].ID != ck.ID ||
		!slices.Equal(slices.Sorted(slices.Values(tree.Checkpoints[0].Heads)), wantHeads) || len(tree.Sandboxes) != 4 {
		t.Fatalf("tree --json = %+v, want %s with heads %q", tree, ck.ID, wantHeads)
	}
	for _, s := range tree.Sandboxes {
		if s.Head != ck.ID {
			t.Errorf("tree: sandbox %s has head %q, want %s", s.ID, s.Head, ck.ID)
		}
	}
	if out := ok("tree", ck.ID); !strings.Contains(out, ck.ID+" one (") || !strings.Contains(out, "◀ ") {
		t.Errorf("tree drawing =\n%s", out)
	}

	ok("exec", fork.IDs[0], "--", "sh", "-c", "echo 3 > /work/f; echo new > /work/g")
	var changes []struct{ Path, Change string }
	decode(ok("diff", "--json", ck.ID, fork.IDs[0]), &changes)
	has := func(path, change string) bool {
		return slices.ContainsFunc(changes, func(c struct{ Path, Change string }) bool { return c.Path == path && c.Change == change })
	}
	if !has("/work/f", "modified") || !has("/work/g", "added") {
		t.Errorf("diff --json %s %s = %+v, want /work/f modified and /work/g added", ck.ID, fork.IDs[0], changes)
	}
	if got := cat(fork.IDs[1]); got != "1\n" {
		t.Errorf("a sibling fork sees %q after another fork wrote, want 1", got)
	}

	// A leaf goes; its parent, which now has a child, needs --recursive.
	var leaf struct{ ID, Parent string }
	decode(ok("checkpoint", "--json", fork.IDs[1]), &leaf)
	if leaf.Parent != ck.ID {
		t.Fatalf("checkpoint of a fork: parent %q, want %s", leaf.Parent, ck.ID)
	}
	if r := cli(t, sock, "", "checkpoint", "rm", ck.ID); r.code != 1 || !strings.Contains(r.stderr, "children") {
		t.Errorf("checkpoint rm of a parent = %+v, want a refusal", r)
	}
	if out := ok("checkpoint", "rm", leaf.ID); out != leaf.ID+"\n" {
		t.Errorf("checkpoint rm %s = %q", leaf.ID, out)
	}

	// Everything goes.
	ok(append([]string{"rm", "--force"}, sandboxes...)...)
	ok("checkpoint", "rm", "--recursive", ck.ID)
	if out := ok("checkpoint", "ls", "--json"); out != "[]\n" {
		t.Errorf("checkpoint ls after rm = %q", out)
	}
	if out := ok("ls", "--json"); out != "[]\n" {
		t.Errorf("ls after rm = %q", out)
	}
}
