//go:build linux

package statemgr_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/sandbox"
	"github.com/deltabox/deltabox/internal/statemgr"
	"github.com/deltabox/deltabox/internal/testutil"
	"github.com/deltabox/deltabox/internal/testutil/sandboxtest"
)

// manifest describes every file under the sandbox's /work and /etc/deltabox-t
// by path, type, mode, owner, size, mtime, link target and content hash: the
// "copy taken at checkpoint time" that a restore must reproduce exactly.
const manifest = `cd / && find work etc/deltabox-t -xdev 2>/dev/null | LC_ALL=C sort | while IFS= read -r f; do
  printf '%s %s\n' "$(stat -c '%n|%F|%a|%u:%g|%s|%Y|%N' "$f")" "$( [ -f "$f" ] && sha256sum < "$f" | cut -c1-16 )"
done`

func checkpoint(t *testing.T, m *statemgr.Manager, id, name string) daemon.Checkpoint {
	t.Helper()
	ck, err := m.Checkpoint(context.Background(), id, daemon.CheckpointOptions{Name: name})
	if err != nil {
		t.Fatalf("checkpoint %s: %v", id, err)
	}
	return ck
}

func restore(t *testing.T, m *statemgr.Manager, id, ck string) daemon.RestoreResult {
	t.Helper()
	res, err := m.Restore(context.Background(), id, ck)
	if err != nil {
		t.Fatalf("restore %s to %s: %v", id, ck, err)
	}
	return res
}

func TestRestoreIsByteAndMetadataExact(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	setup := `set -e
mkdir -p /work/src/deep/er /work/gone/sub /etc/deltabox-t
echo main > /work/src/main.py
printf 'a\0b' > /work/src/bin.dat
head -c 3000000 /dev/urandom > /work/src/large.bin
truncate -s 1G /work/src/sparse.img && echo tail >> /work/src/sparse.img
ln -s main.py /work/src/link && ln /work/src/main.py /work/src/hard
mkfifo /work/src/fifo
chmod 4755 /work/src/main.py; chmod 700 /work/src/deep
touch -d '2001-02-03 04:05:06' /work/src/deep/er
echo x > /work/gone/sub/f
echo etc > /etc/deltabox-t/conf
`
	if r := sh(t, m, id, setup); r.ExitCode != 0 {
		t.Fatalf("setup: %s", r.stderr)
	}
	want := sh(t, m, id, manifest).stdout
	ck := checkpoint(t, m, id, "base")
	if ck.PauseMs <= 0 || ck.Parent != "" {
		t.Errorf("checkpoint: %+v", ck)
	}
	change := `set -e
rm -rf /work/gone; mv /work/src/deep /work/moved; chmod 600 /work/src/bin.dat
echo changed >> /work/src/main.py; rm /work/src/link; ln -s /etc /work/src/link
head -c 100 /dev/urandom | dd of=/work/src/large.bin bs=1 seek=5000 conv=notrunc 2>/dev/null
truncate -s 10 /work/src/sparse.img; touch /work/new; rm /etc/deltabox-t/conf
`
	if r := sh(t, m, id, change); r.ExitCode != 0 {
		t.Fatalf("change: %s", r.stderr)
	}
	if got := sh(t, m, id, manifest).stdout; got == want {
		t.Fatalf("the changes changed nothing: the test cannot tell")
	}
	for i := 0; i < 2; i++ { // restoring one checkpoint twice gives the same state
		res := restore(t, m, id, ck.ID)
		if res.RestoreMs <= 0 {
			t.Errorf("restore_ms %v", res.RestoreMs)
		}
		if got := sh(t, m, id, manifest).stdout; got != want {
			t.Fatalf("restore %d: tree differs\ngot:\n%s\nwant:\n%s", i+1, got, want)
		}
		sh(t, m, id, "rm -rf /work/src; echo dirty > /work/dirty")
	}
	in, err := m.GetSandbox(context.Background(), id)
	if err != nil || in.Head != ck.ID || in.ID != id {
		t.Errorf("after restore: %+v %v, want same id with head %s", in, err, ck.ID)
	}
	// Diff between the checkpoint and the sandbox's live layer.
	changes, err := m.Diff(context.Background(), ck.ID, id)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]layer.ChangeKind{}
	for _, c := range changes {
		got[c.Path] = c.Kind
	}
	if got["/work/dirty"] != layer.ChangeAdd || got["/work/src"] != layer.ChangeDelete {
		t.Errorf("diff: %v", changes)
	}
}

// TestSessionStateReplayedWithoutTemplates covers the fallback of a
// checkpoint whose process templates are gone (here: evicted at once by a
// tiny memory budget): the shell state, kept as data, is replayed into a
// fresh session; python starts fresh.
func TestSessionStateReplayedWithoutTemplates(t *testing.T) {
	m := sandboxtest.NewManager(t, func(o *statemgr.Options) { o.TemplateBudget = 1 })
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionShell, `mkdir -p /work/d && cd /work/d; export E=exported; V="two words"; declare -a ARR=(1 "2 3"); f() { echo "f:$1"; }; alias hi='echo hi'; set -o noclobber; trap 'echo bye' USR1; umask 027`)
	session(t, m, id, sandbox.SessionPython, "x = 1")
	ck := templatesEvicted(t, m, checkpoint(t, m, id, "").ID)
	paths := map[string]daemon.ProcessPath{}
	for _, p := range ck.Processes {
		paths[p.Name] = p.Path
	}
	if paths["shell session"] != daemon.PathReplay || paths["python session"] != daemon.PathNone {
		t.Errorf("checkpoint processes: %+v", ck.Processes)
	}
	session(t, m, id, sandbox.SessionShell, `cd /; unset E V ARR; unset -f f; unalias hi; set +o noclobber; trap - USR1; umask 022`)

	res := restore(t, m, id, ck.ID)
	// The old sessions (idle: killed without a freeze) are gone, and the
	// replay is lazy: no session runs until the next call.
	if r := sh(t, m, id, "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done | grep -c -e '^bash --noprofile --norc $' -e '^python3 -u -q -c' || true"); strings.TrimSpace(r.stdout) != "0" {
		t.Errorf("sessions alive right after restore: %q", r.stdout)
	}
	paths = map[string]daemon.ProcessPath{}
	for _, p := range res.Processes {
		paths[p.Name] = p.Path
	}
	if paths["shell session"] != daemon.PathReplay || paths["python session"] != daemon.PathNone {
		t.Errorf("restore processes: %+v", res.Processes)
	}
	r := session(t, m, id, sandbox.SessionShell, `pwd; echo "$E|$V|${ARR[1]}|$(f x)"; hi; set -o | grep noclobber | tr -s ' \t' ' '; trap -p USR1; umask`)
	want := "/work/d\nexported|two words|2 3|f:x\nhi\nnoclobber on\ntrap -- 'echo bye' SIGUSR1\n0027\n"
	if r.stdout != want {
		t.Errorf("shell state after restore:\n%q\nwant\n%q\n(stderr %q)", r.stdout, want, r.stderr)
	}
	if r := session(t, m, id, sandbox.SessionPython, "'x' in globals()"); r.stdout != "False\n" {
		t.Errorf("python after restore: %q (a fresh session was promised)", r.stdout)
	}
}

func TestForksAreIsolated(t *testing.T) {
	m := newManager(t)
	ctx := context.Background()
	src := create(t, m, sandbox.Config{Labels: map[string]string{"role": "src"}, Env: []string{"FROM=src"}})
	sh(t, m, src, "echo base > /work/base")
	session(t, m, src, sandbox.SessionShell, "cd /work; COUNT=7")
	ck := checkpoint(t, m, src, "fork-point")
	sh(t, m, src, "echo after > /work/after") // not in the forks

	const n = 16
	res, err := m.Fork(ctx, ck.ID, n)
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	if len(res.IDs) != n || res.ForkMs <= 0 {
		t.Fatalf("fork result %+v", res)
	}
	t.Cleanup(func() {
		for _, id := range res.IDs {
			_ = m.DeleteSandbox(ctx, id, true)
		}
	})
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i, id := range res.IDs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			script := fmt.Sprintf(`set -e
test "$(cat /work/base)" = base; test ! -e /work/after; test "$FROM" = src
echo %d > /work/mine
python3 -c 'import socket,time; s=socket.socket(); s.bind(("127.0.0.1",8000)); s.listen(); time.sleep(3)' fork-marker-%d &
sleep 1
test "$(ls /work/mine*)" = /work/mine && test "$(cat /work/mine)" = %d
for p in /proc/[0-9]*; do tr '\0' ' ' < $p/cmdline; echo; done > /tmp/ps.txt
grep -o 'fork-marker-[0-9][0-9]*' /tmp/ps.txt | sort -u
wait`, i, i, i)
			var out strings.Builder
			r, err := m.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"bash", "-c", script}, Stdout: &out, Stderr: &out, Timeout: 60 * time.Second})
			if err != nil || r.ExitCode != 0 {
				errs <- fmt.Errorf("fork %d (%s): exit %d %v: %s", i, id, r.ExitCode, err, out.String())
				return
			}
			if strings.TrimSpace(out.String()) != fmt.Sprintf("fork-marker-%d", i) {
				errs <- fmt.Errorf("fork %d sees other forks' processes: %q", i, out.String())
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	// Each fork has its own shell session state and head; the source is
	// unaffected.
	r := session(t, m, res.IDs[0], sandbox.SessionShell, "echo $PWD $COUNT")
	if r.stdout != "/work 7\n" {
		t.Errorf("fork's shell: %q", r.stdout)
	}
	if r := sh(t, m, src, "cat /work/after; ls /work/mine 2>&1 || true"); !strings.HasPrefix(r.stdout, "after\n") || strings.Contains(r.stdout, "/work/mine\n") {
		t.Errorf("source changed by forks: %q", r.stdout)
	}
	tree, err := m.Tree(ctx, src)
	if err != nil {
		t.Fatal(err)
	}
	if len(tree.Checkpoints) != 1 || len(tree.Checkpoints[0].Heads) != n+1 || len(tree.Sandboxes) != n+1 {
		t.Errorf("tree: %d checkpoints, heads %v, %d sandboxes", len(tree.Checkpoints), tree.Checkpoints[0].Heads, len(tree.Sandboxes))
	}
	// Deleting the source keeps the checkpoint the forks depend on.
	if err := m.DeleteSandbox(ctx, src, true); err != nil {
		t.Fatal(err)
	}
	if _, err := m.GetCheckpoint(ctx, ck.ID); err != nil {
		t.Errorf("checkpoint gone with its source: %v", err)
	}
	if r := sh(t, m, res.IDs[3], "cat /work/base"); r.stdout != "base\n" {
		t.Errorf("fork after source deleted: %q", r.stdout)
	}
}

func TestTreeAndDeletion(t *testing.T) {
	m := newManager(t)
	ctx := context.Background()
	id := create(t, m, sandbox.Config{})
	a := checkpoint(t, m, id, "a")
	sh(t, m, id, "echo b > /work/b")
	b := checkpoint(t, m, id, "b")
	restore(t, m, id, a.ID)
	sh(t, m, id, "echo c > /work/c")
	c := checkpoint(t, m, id, "c") // a sibling of b
	if b.Parent != a.ID || c.Parent != a.ID {
		t.Fatalf("parents: b->%s c->%s, want both %s", b.Parent, c.Parent, a.ID)
	}
	tree, err := m.Tree(ctx, a.ID)
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	for _, n := range tree.Checkpoints {
		order = append(order, n.Name)
		if n.ID == c.ID && (len(n.Heads) != 1 || n.Heads[0] != id) {
			t.Errorf("c's heads: %v", n.Heads)
		}
	}
	if strings.Join(order, ",") != "a,b,c" {
		t.Errorf("tree order %v", order)
	}
	// Another tree does not show up.
	other := create(t, m, sandbox.Config{})
	checkpoint(t, m, other, "other")
	if tree, _ := m.Tree(ctx, id); len(tree.Checkpoints) != 3 || len(tree.Sandboxes) != 1 {
		t.Errorf("tree of %s: %d checkpoints, %d sandboxes", id, len(tree.Checkpoints), len(tree.Sandboxes))
	}
	// A checkpoint of another tree cannot be restored in place.
	if _, err := m.Restore(ctx, other, a.ID); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("cross-tree restore: %v", err)
	}
	// Diff between siblings.
	changes, err := m.Diff(ctx, b.ID, c.ID)
	if err != nil {
		t.Fatal(err)
	}
	var ds []string
	for _, ch := range changes {
		ds = append(ds, ch.Kind.String()+" "+ch.Path)
	}
	sort.Strings(ds)
	if strings.Join(ds, ";") != "added /work/c;removed /work/b" {
		t.Errorf("diff b c: %v", ds)
	}
	// a has children: refused without recursive; b goes alone.
	if err := m.DeleteCheckpoint(ctx, a.ID, false); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("delete a with children: %v", err)
	}
	if err := m.DeleteCheckpoint(ctx, b.ID, false); err != nil {
		t.Fatal(err)
	}
	if err := m.DeleteCheckpoint(ctx, a.ID, true); err != nil {
		t.Fatal(err)
	}
	if _, err := m.GetCheckpoint(ctx, c.ID); !errdefs.IsNotFound(err) {
		t.Errorf("c survived a recursive delete of its parent: %v", err)
	}
	in, _ := m.GetSandbox(ctx, id)
	if in.Head != "" {
		t.Errorf("head after its checkpoint was deleted: %q", in.Head)
	}
	// The sandbox still works on its own layer.
	if r := sh(t, m, id, "cat /work/c"); r.stdout != "c\n" {
		t.Errorf("sandbox after deleting its checkpoints: %q", r.stdout)
	}
	for _, bad := range []string{"ck-zz", "nope"} {
		if _, err := m.GetCheckpoint(ctx, bad); !errdefs.IsInvalidArgument(err) {
			t.Errorf("GetCheckpoint(%q) = %v, want invalid argument", bad, err)
		}
	}
	if _, err := m.Fork(ctx, "ck-00000000", 1); !errdefs.IsNotFound(err) {
		t.Errorf("fork unknown: %v", err)
	}
	if _, err := m.Fork(ctx, c.ID, 0); !errdefs.IsInvalidArgument(err) {
		t.Errorf("fork 0: %v", err)
	}
}

func TestCheckpointWhileCommandRuns(t *testing.T) {
	m := newManager(t)
	ctx := context.Background()
	id := create(t, m, sandbox.Config{})
	// A command that counts; the checkpoint freezes it for the instant of
	// the capture, and it goes on afterwards (documented behaviour). Each
	// count replaces the file whole: a freeze between the truncation and
	// the write of "echo > file" would capture an empty file, rightly.
	done := make(chan sandbox.ExecResult, 1)
	go func() {
		r, _ := m.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"bash", "-c", "for i in $(seq 1 30); do echo $i > /work/count.new; mv /work/count.new /work/count; sleep 0.05; done"}})
		done <- r
	}()
	time.Sleep(300 * time.Millisecond)
	ck := checkpoint(t, m, id, "mid")
	var running bool
	for _, p := range ck.Processes {
		if strings.Contains(p.Name, "seq 1 30") || strings.Contains(p.Name, "bash -c for") {
			running = p.Path == daemon.PathNone
		}
	}
	if !running {
		t.Errorf("the running command is not listed as not captured: %+v", ck.Processes)
	}
	if r := <-done; r.ExitCode != 0 {
		t.Errorf("the command did not survive the checkpoint: %+v", r)
	}
	final := sh(t, m, id, "cat /work/count").stdout
	if final != "30\n" {
		t.Errorf("count after the command: %q", final)
	}
	restore(t, m, id, ck.ID)
	got := sh(t, m, id, "cat /work/count").stdout
	if got == "30\n" || got == "" {
		t.Errorf("restored count %q, want the value at the checkpoint (between 1 and 29)", got)
	}
}

func TestCheckpointsSurviveRestart(t *testing.T) {
	testutil.RequiresRoot(t)
	testutil.CheckLeaks(t)
	root := t.TempDir()
	ctx := context.Background()
	opts := statemgr.Options{Root: root, CgroupParent: testutil.CgroupParent()}
	m, err := statemgr.New(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	in, err := m.CreateSandbox(ctx, sandbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	sh(t, m, in.ID, "echo one > /work/f")
	ck := checkpoint(t, m, in.ID, "one")
	sh(t, m, in.ID, "echo two > /work/f")
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	m, err = statemgr.New(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := m.Fsck(ctx); err != nil {
			t.Errorf("fsck: %v", err)
		}
		m.Close()
	}()
	res, err := m.Fork(ctx, ck.ID, 2)
	if err != nil {
		t.Fatalf("fork after restart: %v", err)
	}
	for _, id := range res.IDs {
		if r := sh(t, m, id, "cat /work/f"); r.stdout != "one\n" {
			t.Errorf("fork after restart: %q", r.stdout)
		}
		m.DeleteSandbox(ctx, id, true)
	}
	restore(t, m, in.ID, ck.ID)
	if r := sh(t, m, in.ID, "cat /work/f"); r.stdout != "one\n" {
		t.Errorf("restore after restart: %q", r.stdout)
	}
	if err := m.DeleteSandbox(ctx, in.ID, true); err != nil {
		t.Fatal(err)
	}
	if err := m.DeleteCheckpoint(ctx, ck.ID, false); err != nil {
		t.Fatal(err)
	}
}
