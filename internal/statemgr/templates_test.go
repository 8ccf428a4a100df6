//go:build linux

package statemgr_test

import (
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/layer/btrfs"
	"github.com/deltabox/deltabox/internal/procfs"
	"github.com/deltabox/deltabox/internal/sandbox"
	"github.com/deltabox/deltabox/internal/statemgr"
	"github.com/deltabox/deltabox/internal/testutil"
	"github.com/deltabox/deltabox/internal/testutil/sandboxtest"
)

// paths maps each process of a checkpoint or restore to its path.
func paths(ps []daemon.ProcessState) map[string]daemon.ProcessPath {
	out := map[string]daemon.ProcessPath{}
	for _, p := range ps {
		out[p.Name] = p.Path
	}
	return out
}

func wantTemplates(t *testing.T, what string, ps []daemon.ProcessState, kinds ...string) {
	t.Helper()
	got := paths(ps)
	for _, k := range kinds {
		if got[k+" session"] != daemon.PathTemplate {
			t.Fatalf("%s: %s session path %q, want template (%+v)", what, k, got[k+" session"], ps)
		}
	}
}

// pyState is a python snippet that prints a hash of the session's state:
// the heap, rich objects, a generator mid-iteration and a half-read file
// with its offset. It advances the generator and the file, so it is run
// once per state to compare.
const pyState = `import hashlib
h = hashlib.sha256()
h.update(bytes(big[::4096]))
h.update(repr(sorted(objs.items())).encode())
h.update(repr(next(gen)).encode())
h.update(f.read(5).encode())
h.update(repr(f.tell()).encode())
print(h.hexdigest(), len(big))`

func TestTemplatePythonHeapRestoredExactly(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	sh(t, m, id, `seq 1 100000 > /work/numbers`)
	setup := `import collections, fractions
big = bytearray(200 << 20)
for i in range(0, len(big), 4096):
    big[i] = i // 4096 % 251
class Point:
    def __init__(s, x, y): s.x, s.y = x, y
    def __repr__(s): return "Point(%r, %r)" % (s.x, s.y)
objs = {"p": Point(1, 2.5), "q": collections.deque([1, "two", (3,)]), "fr": fractions.Fraction(22, 7), "nested": {"a": [1, {2, 3}]}}
gen = (i * i for i in range(10**6))
next(gen); next(gen)
f = open("/work/numbers")
f.read(17)
None`
	if r := session(t, m, id, sandbox.SessionPython, setup); r.ExitCode != 0 {
		t.Fatalf("setup: %s", r.stderr)
	}
	ck := checkpoint(t, m, id, "heap")
	wantTemplates(t, "checkpoint", ck.Processes, "python")
	want := session(t, m, id, sandbox.SessionPython, pyState).stdout

	// Change all of it, then come back.
	session(t, m, id, sandbox.SessionPython, `big[0:4096*10:4096] = b"\xff"*10; objs["p"].x = 99; objs.clear(); [next(gen) for _ in range(5)]; f.seek(0)`)
	if got := session(t, m, id, sandbox.SessionPython, pyState).stdout; got == want {
		t.Fatalf("the changes changed nothing: the test cannot tell")
	}
	for i := 0; i < 3; i++ {
		res := restore(t, m, id, ck.ID)
		wantTemplates(t, "restore", res.Processes, "python")
		if got := session(t, m, id, sandbox.SessionPython, pyState).stdout; got != want {
			t.Fatalf("restore %d: state %q, want %q", i+1, got, want)
		}
	}
	// The file descriptor was opened again in the new root, at its offset,
	// and writes to the restored file go to the sandbox's own layer.
	if r := session(t, m, id, sandbox.SessionPython, `import os; print(os.readlink("/proc/self/fd/%d" % f.fileno()))`); r.stdout != "/work/numbers\n" {
		t.Errorf("file after restore: %q %q", r.stdout, r.stderr)
	}
}

func TestTemplateShellStateRestored(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionShell, `mkdir -p /work/d && cd /work/d; export E=exported; V="two words"; declare -a ARR=(1 "2 3"); f() { echo "f:$1"; }; alias hi='echo hi'; set -o noclobber; trap 'echo bye' USR1; umask 027; NOT_EXPORTED=$RANDOM$RANDOM`)
	before := session(t, m, id, sandbox.SessionShell, `echo $NOT_EXPORTED $$ $BASHPID`).stdout
	ck := checkpoint(t, m, id, "")
	wantTemplates(t, "checkpoint", ck.Processes, "shell")
	session(t, m, id, sandbox.SessionShell, `cd /; unset E V ARR NOT_EXPORTED; unset -f f; unalias hi; set +o noclobber; trap - USR1; umask 022`)

	res := restore(t, m, id, ck.ID)
	wantTemplates(t, "restore", res.Processes, "shell")
	r := session(t, m, id, sandbox.SessionShell, `pwd; echo "$E|$V|${ARR[1]}|$(f x)"; hi; set -o | grep noclobber | tr -s ' \t' ' '; trap -p USR1; umask`)
	want := "/work/d\nexported|two words|2 3|f:x\nhi\nnoclobber on\ntrap -- 'echo bye' SIGUSR1\n0027\n"
	if r.stdout != want {
		t.Errorf("shell state after restore:\n%q\nwant\n%q\n(stderr %q)", r.stdout, want, r.stderr)
	}
	// The same process memory, not a replay: a variable nobody exported or
	// recorded is back. Only the pid differs ($$ is bash's cached pid, so
	// it stays; the kernel's pid is new).
	after := session(t, m, id, sandbox.SessionShell, `echo $NOT_EXPORTED $$ $BASHPID`).stdout
	bf, af := strings.Fields(before), strings.Fields(after)
	if len(bf) != 3 || len(af) != 3 || bf[0] != af[0] || bf[1] != af[1] {
		t.Errorf("shell identity: before %q after %q", before, after)
	}
}

func TestTemplateHundredRestores(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionPython, "n = 0")
	session(t, m, id, sandbox.SessionShell, "n=0")
	ck := checkpoint(t, m, id, "")
	for i := 0; i < 100; i++ {
		session(t, m, id, sandbox.SessionPython, "n += 1")
		session(t, m, id, sandbox.SessionShell, "n=$((n+1)); echo x > /work/f"+strconv.Itoa(i))
		res := restore(t, m, id, ck.ID)
		wantTemplates(t, "restore "+strconv.Itoa(i), res.Processes, "python", "shell")
		if r := session(t, m, id, sandbox.SessionPython, "n"); r.stdout != "0\n" {
			t.Fatalf("restore %d: python n = %q", i, r.stdout)
		}
		if r := session(t, m, id, sandbox.SessionShell, "echo $n; ls /work | wc -l"); r.stdout != "0\n0\n" {
			t.Fatalf("restore %d: shell %q", i, r.stdout)
		}
	}
	// Nothing piles up: one generation of processes, however many restores
	// (clones made ahead, in the next generation nested below, left out).
	if r := sh(t, m, id, `for p in /proc/[0-9]*; do grep -q '^NSpid:[[:space:]]*[0-9]*$' $p/status 2>/dev/null && { tr '\0' ' ' < $p/cmdline; echo; }; done | grep -c -e '^bash --noprofile --norc $' -e '^python3 -u -q -c'`); strings.TrimSpace(r.stdout) != "2" {
		t.Errorf("session processes in the sandbox after 100 restores: %s", r.stdout)
	}
}

// visible lists the processes a python session sees, itself as 'me', and
// its init as 1. The sandbox's own next generation, in a namespace nested
// below (the spare init for its next checkpoint, the clones made ahead in
// it, which come and go), is left out: templates and other sandboxes are
// never nested below.
const visible = `
def own(p):
    try:
        return len(open("/proc/%d/status" % p).read().split("NSpid:")[1].split("\n")[0].split()) == 1
    except OSError:
        return False # gone meanwhile
print([1 if p == 1 else ('me' if p == os.getpid() else p) for p in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()) if p == 1 or own(p)])`

// signallable lists the pids a python session can signal other than itself,
// the threads of its sandbox's init (pid 1) and its next generation (a
// namespace nested below: the init made ahead for the next checkpoint and
// the clones made ahead in it; it may be booting meanwhile, so it is
// listed again after the probe).
const signallable = `
def ours():
    out = {os.getpid()}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            nspid = [l for l in open("/proc/%s/status" % p).read().split("\n") if l.startswith("NSpid:")][0].split()[1:]
            if nspid[-1] == "1" or len(nspid) > 1:
                out |= {int(t) for t in os.listdir("/proc/%s/task" % p)}
        except (OSError, IndexError):
            pass
    return out
before = ours()
bad = []
for p in range(2, 400):
    if p in before:
        continue
    try:
        os.kill(p, 0); bad.append(p)
    except ProcessLookupError:
        pass
after = ours()
[p for p in bad if p not in after]`

func TestTemplateForksAreIsolated(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionPython, "import os\nx = 'source'")
	ck := checkpoint(t, m, id, "")
	session(t, m, id, sandbox.SessionPython, "x = 'source after'")
	res, err := m.Fork(context.Background(), ck.ID, 16)
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	t.Cleanup(func() {
		for _, f := range res.IDs {
			_ = m.DeleteSandbox(context.Background(), f, true)
		}
	})
	var wg sync.WaitGroup
	errs := make(chan error, 3*len(res.IDs))
	for i, f := range res.IDs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if r := session(t, m, f, sandbox.SessionPython, "x"); r.stdout != "'source'\n" {
				errs <- fmt.Errorf("fork %d: x = %q (%s)", i, r.stdout, r.stderr)
				return
			}
			session(t, m, f, sandbox.SessionPython, fmt.Sprintf("x = 'fork %d'", i))
			// It sees only its own generation: its init and its session.
			r := session(t, m, f, sandbox.SessionPython, visible)
			if r.stdout != "[1, 'me']\n" {
				errs <- fmt.Errorf("fork %d: /proc shows %q", i, r.stdout)
			}
			// Nothing else can be signalled: every pid of its namespace is
			// itself or a thread of its init.
			r = session(t, m, f, sandbox.SessionPython, signallable)
			if r.stdout != "[]\n" {
				errs <- fmt.Errorf("fork %d: can signal %q", i, r.stdout)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for i, f := range res.IDs {
		if r := session(t, m, f, sandbox.SessionPython, "x"); r.stdout != fmt.Sprintf("'fork %d'\n", i) {
			t.Errorf("fork %d after the others ran: %q", i, r.stdout)
		}
	}
	if r := session(t, m, id, sandbox.SessionPython, "x"); r.stdout != "'source after'\n" {
		t.Errorf("source after forks: %q", r.stdout)
	}
	// The source sees neither its templates nor its forks.
	if r := session(t, m, id, sandbox.SessionPython, visible); r.stdout != "[1, 'me']\n" {
		t.Errorf("source /proc: %q", r.stdout)
	}
	if r := session(t, m, id, sandbox.SessionPython, signallable); r.stdout != "[]\n" {
		t.Errorf("source can signal %q", r.stdout)
	}
}

func TestTemplateKilledDowngradesCheckpoint(t *testing.T) {
	for _, how := range []string{"killed", "resumed", "evicted"} {
		t.Run(how, func(t *testing.T) {
			m := sandboxtest.NewManager(t, func(o *statemgr.Options) {
				if how == "evicted" {
					o.TemplateBudget = 1 // any template is past it
				}
			})
			id := create(t, m, sandbox.Config{})
			session(t, m, id, sandbox.SessionShell, "V=kept")
			ck := checkpoint(t, m, id, "")
			if how != "evicted" {
				wantTemplates(t, "checkpoint", ck.Processes, "shell")
				tpl := templatePids(t, m, ck.ID)
				sig := syscall.SIGKILL
				if how == "resumed" {
					sig = syscall.SIGCONT
				}
				for _, p := range tpl {
					if err := syscall.Kill(p, sig); err != nil {
						t.Fatal(err)
					}
				}
			}
			got, err := m.GetCheckpoint(context.Background(), ck.ID)
			if err != nil {
				t.Fatal(err)
			}
			if how == "evicted" {
				got = templatesEvicted(t, m, ck.ID)
			}
			if p := paths(got.Processes)["shell session"]; p != daemon.PathReplay || !strings.Contains(got.Processes[0].Reason, "template") {
				t.Errorf("checkpoint after the template was %s: %+v", how, got.Processes)
			}
			// Dropping the templates leaves the sandbox alone: its live
			// generation nests below theirs.
			if r := session(t, m, id, sandbox.SessionShell, "echo $V"); r.stdout != "kept\n" {
				t.Errorf("the live session after its templates were dropped: V = %q (%s)", r.stdout, r.stderr)
			}
			session(t, m, id, sandbox.SessionShell, "V=changed")
			res := restore(t, m, id, ck.ID)
			if p := paths(res.Processes)["shell session"]; p != daemon.PathReplay {
				t.Errorf("restore: %+v", res.Processes)
			}
			if r := session(t, m, id, sandbox.SessionShell, "echo $V"); r.stdout != "kept\n" {
				t.Errorf("restored V = %q", r.stdout)
			}
			if tr, err := m.Tree(context.Background(), id); err != nil || !strings.Contains(fmt.Sprint(tr.Checkpoints[0].Processes), "template") {
				t.Errorf("tree does not say why: %+v %v", tr.Checkpoints, err)
			}
			// A fork takes the other path too.
			f, err := m.Fork(context.Background(), ck.ID, 1)
			if err != nil {
				t.Fatalf("fork after the template was %s: %v", how, err)
			}
			if r := session(t, m, f.IDs[0], sandbox.SessionShell, "echo $V"); r.stdout != "kept\n" {
				t.Errorf("forked V = %q", r.stdout)
			}
			if err := m.DeleteSandbox(context.Background(), f.IDs[0], true); err != nil {
				t.Error(err)
			}
		})
	}
}

// templatePids finds a checkpoint's template processes: stopped, in the
// checkpoint's templates cgroup.
func templatePids(t *testing.T, m *statemgr.Manager, ckID string) []int {
	t.Helper()
	pids, err := testutil.CgroupProcs("tpl-" + ckID)
	if err != nil {
		t.Fatalf("templates of %s: %v", ckID, err)
	}
	var out []int
	for _, p := range pids {
		if testutil.ProcState(p) == "T" {
			out = append(out, p)
		}
	}
	if len(out) == 0 {
		t.Fatalf("no stopped template in the cgroup of %s (%v)", ckID, pids)
	}
	return out
}

func TestIneligibleSandboxSaysWhy(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionShell, "V=1")
	session(t, m, id, sandbox.SessionPython, "import threading, time\nth = threading.Thread(target=time.sleep, args=(3600,), daemon=True); th.start()")
	ck := checkpoint(t, m, id, "")
	p := paths(ck.Processes)
	if p["shell session"] != daemon.PathReplay || p["python session"] != daemon.PathNone {
		t.Errorf("paths: %+v", ck.Processes)
	}
	if s := fmt.Sprint(ck.Processes); !strings.Contains(s, "python session") || !strings.Contains(s, "2 threads") {
		t.Errorf("the reason does not name the process and its threads: %s", s)
	}
	// Sockets too.
	id2 := create(t, m, sandbox.Config{})
	session(t, m, id2, sandbox.SessionPython, "import socket\ns = socket.socket()")
	ck2 := checkpoint(t, m, id2, "")
	if s := fmt.Sprint(ck2.Processes); !strings.Contains(s, "socket") {
		t.Errorf("a socket is not named: %s", s)
	}
	// Named pipes too: a clone reopens files by path, which for one would
	// block until its other end opened.
	id3 := create(t, m, sandbox.Config{})
	session(t, m, id3, sandbox.SessionPython, "import os\nos.mkfifo('/tmp/fifo')\nfd = os.open('/tmp/fifo', os.O_RDONLY | os.O_NONBLOCK)")
	ck3 := checkpoint(t, m, id3, "")
	if s := fmt.Sprint(ck3.Processes); !strings.Contains(s, "named pipe") {
		t.Errorf("a named pipe is not named: %s", s)
	}
}

func TestTemplateGenerationDepthLimit(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	var cks []string
	for i := 1; ; i++ {
		session(t, m, id, sandbox.SessionShell, "depth="+strconv.Itoa(i))
		ck, err := m.Checkpoint(context.Background(), id, daemon.CheckpointOptions{})
		if err != nil {
			if !errors.Is(err, sandbox.ErrTooDeep) || !strings.Contains(err.Error(), "generations deep") {
				t.Fatalf("checkpoint %d: %v, want a clear depth error", i, err)
			}
			if i <= 30 {
				t.Fatalf("checkpoint %d hit the depth limit; 30 must work: %v", i, err)
			}
			break
		}
		wantTemplates(t, "checkpoint "+strconv.Itoa(i), ck.Processes, "shell")
		cks = append(cks, ck.ID)
		if i > 40 {
			t.Fatalf("no depth limit after %d checkpoints", i)
		}
	}
	// The chain still works: back to the first and the deepest.
	for _, c := range []int{0, len(cks) - 1} {
		res := restore(t, m, id, cks[c])
		wantTemplates(t, "restore", res.Processes, "shell")
		if r := session(t, m, id, sandbox.SessionShell, "echo $depth"); r.stdout != strconv.Itoa(c+1)+"\n" {
			t.Errorf("restore to checkpoint %d: depth=%q", c+1, r.stdout)
		}
	}
}

func TestDaemonRestartReadoptsTemplates(t *testing.T) {
	// The second manager's leak check and tree check cover both.
	var root string
	m2opts := func(o *statemgr.Options) { o.Root = root }
	testutil.RequiresRoot(t)
	root = t.TempDir()
	m1, err := statemgr.New(context.Background(), statemgr.Options{
		Root: root, CgroupParent: testutil.CgroupParent(), KeepTemplates: true,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	in, err := m1.CreateSandbox(context.Background(), sandbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	id := in.ID
	session(t, m1, id, sandbox.SessionPython, "secret = [1, 2, 3]\nimport os")
	session(t, m1, id, sandbox.SessionShell, "V=kept")
	ck := checkpoint(t, m1, id, "")
	wantTemplates(t, "checkpoint", ck.Processes, "python", "shell")
	tpl := templatePids(t, m1, ck.ID)
	if err := m1.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	for _, p := range tpl {
		if testutil.ProcState(p) != "T" {
			t.Fatalf("template %d did not outlive its daemon (state %q)", p, testutil.ProcState(p))
		}
	}

	m := sandboxtest.NewManager(t, m2opts)
	t.Cleanup(func() { _ = m.DeleteSandbox(context.Background(), id, true) })
	got, err := m.GetCheckpoint(context.Background(), ck.ID)
	if err != nil {
		t.Fatal(err)
	}
	wantTemplates(t, "checkpoint after the restart", got.Processes, "python", "shell")
	session(t, m, id, sandbox.SessionPython, "secret = None")
	res := restore(t, m, id, ck.ID)
	wantTemplates(t, "restore after the restart", res.Processes, "python", "shell")
	if r := session(t, m, id, sandbox.SessionPython, "secret"); r.stdout != "[1, 2, 3]\n" {
		t.Errorf("python after re-adoption: %q %q", r.stdout, r.stderr)
	}
	if r := session(t, m, id, sandbox.SessionShell, "echo $V"); r.stdout != "kept\n" {
		t.Errorf("shell after re-adoption: %q", r.stdout)
	}
	fk, err := m.Fork(context.Background(), ck.ID, 2)
	if err != nil {
		t.Fatalf("fork after the restart: %v", err)
	}
	for _, f := range fk.IDs {
		if r := session(t, m, f, sandbox.SessionPython, "secret"); r.stdout != "[1, 2, 3]\n" {
			t.Errorf("fork after re-adoption: %q", r.stdout)
		}
		_ = m.DeleteSandbox(context.Background(), f, true)
	}
	// Deleting the checkpoint kills its templates.
	if err := m.DeleteCheckpoint(context.Background(), ck.ID, true); err != nil {
		t.Fatal(err)
	}
	for _, p := range tpl {
		if s := testutil.ProcState(p); s != "" && s != "Z" {
			t.Errorf("template %d outlived its checkpoint (state %q)", p, s)
		}
	}
}

// failingCommits is a btrfs layer store whose live commits fail on demand.
type failingCommits struct {
	layer.Store
	fail atomic.Bool
}

func (f *failingCommits) CommitLive(ctx context.Context, active string, opts ...layer.Opt) (layer.Info, error) {
	if f.fail.Load() {
		return layer.Info{}, errors.New("injected commit failure")
	}
	return f.Store.(layer.LiveCommitter).CommitLive(ctx, active, opts...)
}

// TestTemplateCheckpointFailureLeavesSessionsAsTheyWere fails the
// filesystem commit of a template checkpoint after the sessions were
// stopped and cloned: the checkpoint fails, the sessions go on in the same
// processes with their state, their children are born in their own pid
// namespace (not the abandoned generation's), and the next checkpoint and
// restore work.
func TestTemplateCheckpointFailureLeavesSessionsAsTheyWere(t *testing.T) {
	var fc *failingCommits
	m := sandboxtest.NewManager(t, func(o *statemgr.Options) {
		st, err := btrfs.New(filepath.Join(o.Root, "layers"), btrfs.WithImageSize(256<<20))
		if err != nil {
			t.Fatal(err)
		}
		fc = &failingCommits{Store: st}
		o.Layers, o.Storage = fc, "btrfs"
	})
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionPython, `import os; x = 41`)
	pid := session(t, m, id, sandbox.SessionPython, `print(os.getpid())`).stdout

	fc.fail.Store(true)
	if _, err := m.Checkpoint(context.Background(), id, daemon.CheckpointOptions{}); err == nil {
		t.Fatal("checkpoint with a failing commit succeeded")
	}
	fc.fail.Store(false)
	if got := session(t, m, id, sandbox.SessionPython, `print(os.getpid())`).stdout; got != pid {
		t.Fatalf("python pid after the failed checkpoint %q, want the same process %q", got, pid)
	}
	// A child's pid as its parent sees it and as it sees itself agree only
	// in one pid namespace.
	fork := `r, w = os.pipe()
child = os.fork()
if child == 0:
    os.write(w, str(os.getpid()).encode()); os._exit(0)
os.waitpid(child, 0)
seen = int(os.read(r, 32)); os.close(r); os.close(w)
print(child == seen, x)`
	if r := session(t, m, id, sandbox.SessionPython, fork); r.stdout != "True 41\n" {
		t.Fatalf("python after the failed checkpoint: %q %q, want its children in its own pid namespace and x = 41", r.stdout, r.stderr)
	}

	ck := checkpoint(t, m, id, "")
	wantTemplates(t, "checkpoint", ck.Processes, "python")
	session(t, m, id, sandbox.SessionPython, `x = 0`)
	wantTemplates(t, "restore", restore(t, m, id, ck.ID).Processes, "python")
	if r := session(t, m, id, sandbox.SessionPython, fork); r.stdout != "True 41\n" {
		t.Fatalf("python after the restore: %q %q", r.stdout, r.stderr)
	}
}

// TestGenerationsBootFromTheInitBinary runs a sandbox's generations from a
// built deltabox-init: the first init, the spare the next checkpoint takes
// (started by the live init re-executing itself), and a restore's and a
// fork's, while templates keep working across them.
func TestGenerationsBootFromTheInitBinary(t *testing.T) {
	goBin := testutil.RequiresBinary(t, "go")
	dir := t.TempDir()
	// The sandbox's root (an unprivileged host uid) execs it.
	for d := dir; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	bin := filepath.Join(dir, sandbox.InitBinaryName)
	build := exec.Command(goBin, "build", "-buildvcs=false", "-o", bin, "github.com/deltabox/deltabox/cmd/deltabox-init")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build deltabox-init: %v\n%s", err, out)
	}
	// A nested generation's init is executed inside the sandbox's root,
	// whose image may have no glibc loader: it must be static, whatever
	// CGO_ENABLED says (it links no package that needs cgo).
	exe, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range exe.Progs {
		if p.Type == elf.PT_INTERP {
			t.Errorf("deltabox-init is dynamically linked (it has an ELF interpreter)")
		}
	}
	exe.Close()
	m := sandboxtest.NewManager(t, func(o *statemgr.Options) { o.InitBinary = bin })
	inits := func(id string) {
		t.Helper()
		pids, err := testutil.CgroupProcs(id)
		if err != nil || len(pids) == 0 {
			t.Fatalf("processes of %s: %v %v", id, pids, err)
		}
		seen := 0
		for _, p := range pids {
			exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", p))
			if errors.Is(err, os.ErrNotExist) {
				continue // a replaced generation on its way out
			}
			if err != nil || exe != bin {
				t.Errorf("sandbox %s: init %d runs %q (%v), want %q", id, p, exe, err, bin)
			}
			seen++
		}
		if seen == 0 {
			t.Errorf("sandbox %s: no init left to look at", id)
		}
	}
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionPython, `x = 7`)
	ck := checkpoint(t, m, id, "")
	wantTemplates(t, "checkpoint", ck.Processes, "python")
	inits(id)
	session(t, m, id, sandbox.SessionPython, `x = 8`)
	wantTemplates(t, "restore", restore(t, m, id, ck.ID).Processes, "python")
	if r := session(t, m, id, sandbox.SessionPython, `print(x)`); r.stdout != "7\n" {
		t.Fatalf("after restore: %q %q", r.stdout, r.stderr)
	}
	inits(id)
	res, err := m.Fork(context.Background(), ck.ID, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.DeleteSandbox(context.Background(), res.IDs[0], true) })
	if r := session(t, m, res.IDs[0], sandbox.SessionPython, `print(x)`); r.stdout != "7\n" {
		t.Fatalf("fork: %q %q", r.stdout, r.stderr)
	}
	inits(res.IDs[0])
}

// stoppedSessions waits for a stopped process in the session cgroups of
// sandbox id that is a sibling of the live generation (rollback: clones a
// restore made ahead, on a branch of its checkpoint) or nested in it
// (onLive: the next checkpoint's clones made ahead, in the spare
// generation), and returns them.
func stoppedSessions(t *testing.T, m *statemgr.Manager, id string, onLive bool) []int {
	t.Helper()
	info, err := m.GetSandbox(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	var stopped []int
	for deadline := time.Now().Add(30 * time.Second); len(stopped) == 0 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		stopped = scanStopped(pidDepth(info.InitPid), id, onLive)
	}
	return stopped
}

// scanStopped is one look of stoppedSessions; live is the depth of the
// live generation's pid namespace.
func scanStopped(live int, id string, onLive bool) []int {
	dirs, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup/freezer", testutil.CgroupParent(), id, "session-*"))
	if len(dirs) == 0 {
		dirs, _ = filepath.Glob(filepath.Join("/sys/fs/cgroup", testutil.CgroupParent(), id, "session-*"))
	}
	var stopped []int
	for _, d := range dirs {
		pids, _ := testutil.CgroupProcs(id + "/" + filepath.Base(d))
		for _, p := range pids {
			if testutil.ProcState(p) == "T" && (pidDepth(p) > live) == onLive {
				stopped = append(stopped, p)
			}
		}
	}
	return stopped
}

// pidDepth is the depth of process pid's pid namespace (the host's is 1),
// or 0 when it is gone.
func pidDepth(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			return len(strings.Fields(v))
		}
	}
	return 0
}

// cloneMadeAhead waits for the one clone a restore of sandbox id to its
// head made ahead, stopped, and returns its pid.
func cloneMadeAhead(t *testing.T, m *statemgr.Manager, id string) int {
	t.Helper()
	stopped := stoppedSessions(t, m, id, false)
	if len(stopped) != 1 {
		t.Fatalf("clones made ahead for the rollback of %s: %v, want one stopped session", id, stopped)
	}
	return stopped[0]
}

// upperOf returns the overlay upper directory of process pid's root, or "".
func upperOf(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 || f[4] != "/" {
			continue
		}
		_, super, _ := strings.Cut(line, " - ")
		for _, o := range strings.Split(super, ",") {
			if u, ok := strings.CutPrefix(o, "upperdir="); ok {
				return u
			}
		}
	}
	return ""
}

// TestPreparedRestoreClonesMadeAhead checks that a rollback to the head
// checkpoint finds its clones made ahead, stopped, and that a restore whose
// clone made ahead was killed meanwhile clones on the spot, exactly.
func TestPreparedRestoreClonesMadeAhead(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionPython, `x = [1, 2, 3]`)
	ck := checkpoint(t, m, id, "")
	wantTemplates(t, "checkpoint", ck.Processes, "python")
	session(t, m, id, sandbox.SessionPython, `x = None`)
	ahead := cloneMadeAhead(t, m, id)
	wantTemplates(t, "restore", restore(t, m, id, ck.ID).Processes, "python")
	if r := session(t, m, id, sandbox.SessionPython, `import os; print(x, os.getpid())`); !strings.HasPrefix(r.stdout, "[1, 2, 3] ") {
		t.Fatalf("after the prepared restore: %q %q", r.stdout, r.stderr)
	}
	if st := testutil.ProcState(ahead); st == "T" || st == "" {
		t.Errorf("the clone made ahead is %q after the restore, want running", st)
	}

	// Killed while it waits: the restore clones again.
	session(t, m, id, sandbox.SessionPython, `x = None`)
	if err := syscall.Kill(cloneMadeAhead(t, m, id), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	wantTemplates(t, "restore", restore(t, m, id, ck.ID).Processes, "python")
	if r := session(t, m, id, sandbox.SessionPython, `print(x)`); r.stdout != "[1, 2, 3]\n" {
		t.Fatalf("after the restore whose clone made ahead was killed: %q %q", r.stdout, r.stderr)
	}
}

// TestWarmRestoresPreFaultTheHeap checks the async warm: with it, the
// clone a prepared restore makes ahead no longer shares the memory its
// template wrote (its first writes after the restore take no copy-on-write
// fault); without it, it shares nearly all of it. Both restore exactly.
func TestWarmRestoresPreFaultTheHeap(t *testing.T) {
	exclusive := func(t *testing.T, pid int) int64 {
		t.Helper()
		rs, err := procfs.Exclusive(pid)
		if err != nil {
			t.Fatal(err)
		}
		var n int64
		for _, r := range rs {
			n += int64(r.End - r.Start)
		}
		return n
	}
	const heap = 32 << 20
	for _, warm := range []bool{false, true} {
		t.Run(fmt.Sprintf("warm=%v", warm), func(t *testing.T) {
			m := sandboxtest.NewManager(t, func(o *statemgr.Options) {
				if warm {
					o.WarmRestores = 256 << 20
				}
			})
			id := create(t, m, sandbox.Config{})
			session(t, m, id, sandbox.SessionPython, fmt.Sprintf("big = bytearray(b'x' * %d)", heap))
			ck := checkpoint(t, m, id, "")
			wantTemplates(t, "checkpoint", ck.Processes, "python")
			session(t, m, id, sandbox.SessionPython, `big = None`)
			got := exclusive(t, cloneMadeAhead(t, m, id))
			if warm && got < heap {
				t.Errorf("warm: the clone made ahead owns %d bytes of its own, want at least the %d its template wrote", got, heap)
			}
			if !warm && got >= heap/2 {
				t.Errorf("not warm: the clone made ahead owns %d bytes already, want nearly all shared", got)
			}
			wantTemplates(t, "restore", restore(t, m, id, ck.ID).Processes, "python")
			if r := session(t, m, id, sandbox.SessionPython, `print(len(big), big.count(b'x'))`); r.stdout != fmt.Sprintf("%d %d\n", heap, heap) {
				t.Fatalf("after the restore: %q %q", r.stdout, r.stderr)
			}
		})
	}
}

// TestSessionCallsDuringCheckpoints makes python calls while template
// checkpoints replace the session's process: a call that waited for a
// checkpoint goes to the clone, and none is lost or kills the session.
func TestSessionCallsDuringCheckpoints(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionPython, `x = 0`)
	const calls = 30
	done := make(chan error, 1)
	go func() {
		for i := 0; i < calls; i++ {
			var out bytes.Buffer
			res, err := m.Session(context.Background(), id, sandbox.SessionRequest{Kind: sandbox.SessionPython, Code: "x += 1", Stdout: &out, Timeout: 30 * time.Second})
			if err == nil && res.ExitCode != 0 {
				err = fmt.Errorf("exit %d", res.ExitCode)
			}
			if err != nil {
				done <- fmt.Errorf("call %d: %w", i, err)
				return
			}
			// Room for a checkpoint to find the session idle, so that the
			// next call arrives while it holds the session.
			time.Sleep(3 * time.Millisecond)
		}
		done <- nil
	}()
	var templates int
	for running := true; running; {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			running = false
		default:
			ck, err := m.Checkpoint(context.Background(), id, daemon.CheckpointOptions{})
			if err != nil {
				t.Fatalf("checkpoint: %v", err)
			}
			if paths(ck.Processes)["python session"] == daemon.PathTemplate {
				templates++
			}
		}
	}
	if r := session(t, m, id, sandbox.SessionPython, `print(x)`); r.stdout != fmt.Sprintf("%d\n", calls) {
		t.Fatalf("x = %q after %d calls and %d template checkpoints, want %d", r.stdout, calls, templates, calls)
	}
	if templates == 0 {
		t.Log("no checkpoint found the session idle; the race was not exercised")
	}
}

// rootOf is the source of the root mount of pid's mount namespace, as its
// mountinfo gives it (the directory bound there).
func rootOf(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == "/" {
			return f[3]
		}
	}
	return ""
}

// TestTemplatesSpareSetUpAhead checks that the spare generation a
// checkpoint's templates keep for a restore or fork that comes unprepared
// is booted and set up ahead (on the runtime's stand-in root), and that a
// restore to that checkpoint in a sandbox that is elsewhere (a fork of a
// later checkpoint) re-roots it into the sandbox's root and runs the
// checkpoint's session there.
func TestTemplatesSpareSetUpAhead(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionPython, `x = 1`)
	ck1 := checkpoint(t, m, id, "")
	wantTemplates(t, "checkpoint", ck1.Processes, "python")
	session(t, m, id, sandbox.SessionPython, `x = 2`)
	ck2 := checkpoint(t, m, id, "")
	wantTemplates(t, "checkpoint", ck2.Processes, "python")

	ahead := map[int]bool{}
	for deadline := time.Now().Add(30 * time.Second); len(ahead) == 0 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		pids, _ := testutil.CgroupProcs("tpl-" + ck1.ID)
		for _, p := range pids {
			if strings.HasSuffix(rootOf(t, p), "/.stand-in") {
				ahead[p] = true
			}
		}
	}
	if len(ahead) == 0 {
		t.Fatalf("no generation of the templates of %s was set up ahead on the stand-in root", ck1.ID)
	}
	// The restore comes unprepared in a fork of the sandbox (the sandbox
	// itself may have a restore to ck1 made ready since ck1).
	fk, err := m.Fork(context.Background(), ck2.ID, 1)
	if err != nil {
		t.Fatal(err)
	}
	id = fk.IDs[0]
	t.Cleanup(func() { _ = m.DeleteSandbox(context.Background(), id, true) })
	wantTemplates(t, "restore", restore(t, m, id, ck1.ID).Processes, "python")
	if r := session(t, m, id, sandbox.SessionPython, `print(x)`); r.stdout != "1\n" {
		t.Fatalf("after the restore: %q %q", r.stdout, r.stderr)
	}
	info, err := m.GetSandbox(context.Background(), id)
	if err != nil || !ahead[info.InitPid] {
		t.Fatalf("the sandbox's init after the restore: %d (%v), want one set up ahead, of %v", info.InitPid, err, ahead)
	}
	if root := rootOf(t, info.InitPid); root == "" || strings.HasSuffix(root, "/.stand-in") {
		t.Errorf("the sandbox's init %d after the restore: root %q, want the sandbox's", info.InitPid, root)
	}
}

// TestForkFanOutsFindGenerationsReady forks a checkpoint three times, then
// again: after the first fan-out its templates keep three generations set
// up ahead, and the second fan-out's sandboxes run in them, each with the
// checkpoint's session.
func TestForkFanOutsFindGenerationsReady(t *testing.T) {
	m := newManager(t)
	ctx := context.Background()
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionPython, `x = 41`)
	ck := checkpoint(t, m, id, "")
	wantTemplates(t, "checkpoint", ck.Processes, "python")
	fanOut := func() []string {
		t.Helper()
		res, err := m.Fork(ctx, ck.ID, 3)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			for _, f := range res.IDs {
				_ = m.DeleteSandbox(context.Background(), f, true)
			}
		})
		return res.IDs
	}
	fanOut()
	ahead := map[int]bool{}
	for deadline := time.Now().Add(60 * time.Second); len(ahead) < 3 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		pids, _ := testutil.CgroupProcs("tpl-" + ck.ID)
		for _, p := range pids {
			if strings.HasSuffix(rootOf(t, p), "/.stand-in") {
				ahead[p] = true
			}
		}
	}
	if len(ahead) < 3 {
		t.Fatalf("after a fan-out of 3: %d generations set up ahead, want 3", len(ahead))
	}
	for _, f := range fanOut() {
		info, err := m.GetSandbox(ctx, f)
		if err != nil || !ahead[info.InitPid] {
			t.Errorf("fork %s runs in init %d (%v), want one of those set up ahead %v", f, info.InitPid, err, ahead)
		}
		if r := session(t, m, f, sandbox.SessionPython, `print(x + 1)`); r.stdout != "42\n" {
			t.Errorf("fork %s: %q %q", f, r.stdout, r.stderr)
		}
	}

	// A fan-out from another checkpoint: the first one's templates go back
	// to one spare (idle inits cost memory).
	ck2 := checkpoint(t, m, id, "")
	res, err := m.Fork(ctx, ck2.ID, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.DeleteSandbox(context.Background(), res.IDs[0], true) })
	standIns := func() int {
		n := 0
		pids, _ := testutil.CgroupProcs("tpl-" + ck.ID)
		for _, p := range pids {
			if strings.HasSuffix(rootOf(t, p), "/.stand-in") {
				n++
			}
		}
		return n
	}
	n := standIns()
	for deadline := time.Now().Add(30 * time.Second); n > 1 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		n = standIns()
	}
	if n > 1 {
		t.Errorf("after a fan-out from another checkpoint, %s keeps %d generations set up ahead, want at most 1", ck.ID, n)
	}
}

// templatesEvicted waits for checkpoint ck's templates to be evicted past
// the memory budget (in the background, after the checkpoint) and returns
// the checkpoint then.
func templatesEvicted(t *testing.T, m *statemgr.Manager, ck string) daemon.Checkpoint {
	t.Helper()
	var got daemon.Checkpoint
	waitFor(t, "the templates of "+ck+" evicted", func() bool {
		var err error
		if got, err = m.GetCheckpoint(context.Background(), ck); err != nil {
			t.Fatal(err)
		}
		return !slices.ContainsFunc(got.Processes, func(p daemon.ProcessState) bool { return p.Path == daemon.PathTemplate })
	})
	return got
}

// stepAhead runs a step (the first session call since a checkpoint or
// restore) and returns the one clone made ahead after it.
func stepAhead(t *testing.T, m *statemgr.Manager, id string, kind sandbox.SessionKind, code string) int {
	t.Helper()
	session(t, m, id, kind, code)
	ahead := stoppedSessions(t, m, id, true)
	if len(ahead) != 1 {
		t.Fatalf("clones made ahead after the step %q: %v, want one", code, ahead)
	}
	return ahead[0]
}

// sessionPids returns the running (not stopped) processes of sandbox id's
// session cgroup of kind.
func sessionPids(t *testing.T, id string, kind sandbox.SessionKind) []int {
	t.Helper()
	dirs, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup/freezer", testutil.CgroupParent(), id, "session-"+kind.String()+"*"))
	if len(dirs) == 0 {
		dirs, _ = filepath.Glob(filepath.Join("/sys/fs/cgroup", testutil.CgroupParent(), id, "session-"+kind.String()+"*"))
	}
	var out []int
	for _, d := range dirs {
		pids, _ := testutil.CgroupProcs(id + "/" + filepath.Base(d))
		for _, p := range pids {
			if st := testutil.ProcState(p); st != "T" && st != "" {
				out = append(out, p)
			}
		}
	}
	return out
}

// TestCheckpointTakesClonesMadeAhead checks the next checkpoint's clones
// made ahead: after the first session call that follows a checkpoint, the
// session is cloned, stopped, in the spare generation on the live root;
// the next checkpoint lets that clone go on as the live session instead of
// cloning in its pause, and both the live state and the checkpoint's are
// exact. A session call that comes first discards the clone.
func TestCheckpointTakesClonesMadeAhead(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionPython, `x = [1]; gen = iter(range(100)); next(gen); log = open('/work/log', 'a')`)
	ck1 := checkpoint(t, m, id, "")
	wantTemplates(t, "checkpoint", ck1.Processes, "python")

	// A call that is not followed by a checkpoint: its clone is dropped.
	dropped := stepAhead(t, m, id, sandbox.SessionPython, `x.append(2)`)
	if r := session(t, m, id, sandbox.SessionPython, `x.append(3); print(x, next(gen))`); r.stdout != "[1, 2, 3] 1\n" {
		t.Fatalf("session after its clone was made ahead: %q %q", r.stdout, r.stderr)
	}
	waitFor(t, "the dropped clone to go", func() bool { st := testutil.ProcState(dropped); return st == "" || st == "Z" })

	// A checkpoint, a step, and the next checkpoint takes the clone made
	// after the step.
	ck2 := checkpoint(t, m, id, "")
	wantTemplates(t, "checkpoint", ck2.Processes, "python")
	ahead := stepAhead(t, m, id, sandbox.SessionPython, `x.append(4); open('/work/step', 'w').write('4'); log.write('4'); log.flush()`)
	before := sessionPids(t, id, sandbox.SessionPython)
	// Made on a copy of the live layer (the default store can), which the
	// checkpoint switches to instead of snapshotting the layer.
	live := upperOf(before[0])
	if up := upperOf(ahead); up == "" || up == live {
		t.Errorf("the clone made ahead is on %q, want a copy of the live layer %q", up, live)
	}
	ck3 := checkpoint(t, m, id, "")
	wantTemplates(t, "checkpoint", ck3.Processes, "python")
	if live := sessionPids(t, id, sandbox.SessionPython); len(live) != 1 || live[0] != ahead {
		t.Fatalf("python session after the checkpoint: %v, want the clone made ahead %d (it was %v)", live, ahead, before)
	}
	if st := testutil.ProcState(before[0]); st != "T" {
		t.Errorf("the session the clone was made from is %q after the checkpoint, want a stopped template", st)
	}
	if up := upperOf(before[0]); up != live {
		t.Errorf("the template's root is on %q after the checkpoint, want %q as before", up, live)
	}
	const show = `import os; print(x, next(gen), open('/work/step').read() if os.path.exists('/work/step') else '-')`
	if r := session(t, m, id, sandbox.SessionPython, show); r.stdout != "[1, 2, 3, 4] 2 4\n" {
		t.Fatalf("live session after the checkpoint: %q %q", r.stdout, r.stderr)
	}
	// The sandbox writes on in the copy, through files it held open too;
	// the checkpoint keeps what it had.
	session(t, m, id, sandbox.SessionPython, `open('/work/step', 'w').write('5'); log.write('5'); log.flush()`)
	if got := readFile(t, m, id, "/work/step"); got != "5" {
		t.Errorf("the file from the host after the checkpoint: %q, want the sandbox's write", got)
	}
	if got := readFile(t, m, id, "/work/log"); got != "45" {
		t.Errorf("a file the session held open, from the host after the checkpoint: %q, want %q", got, "45")
	}
	for _, c := range []struct {
		ck   string
		want string
	}{{ck3.ID, "[1, 2, 3, 4] 2 4\n"}, {ck2.ID, "[1, 2, 3] 2 -\n"}, {ck3.ID, "[1, 2, 3, 4] 2 4\n"}} {
		wantTemplates(t, "restore", restore(t, m, id, c.ck).Processes, "python")
		if r := session(t, m, id, sandbox.SessionPython, show); r.stdout != c.want {
			t.Fatalf("after the restore to %s: %q %q, want %q", c.ck, r.stdout, r.stderr, c.want)
		}
	}
	if got := readFile(t, m, id, "/work/log"); got != "4" {
		t.Errorf("the held file after the restore to %s: %q, want %q", ck3.ID, got, "4")
	}
}

// readFile reads a file of sandbox id from the host.
func readFile(t *testing.T, m *statemgr.Manager, id, path string) string {
	t.Helper()
	files, release, err := m.Files(context.Background(), id, false)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	var b strings.Builder
	if _, err := files.ReadFile(context.Background(), path, &b, 0); err != nil && !errdefs.IsNotFound(err) {
		t.Fatalf("read %s: %v", path, err)
	}
	return b.String()
}

// writeFile writes a file of sandbox id from the host.
func writeFile(t *testing.T, m *statemgr.Manager, id, path, content string) {
	t.Helper()
	files, release, err := m.Files(context.Background(), id, true)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	if err := files.WriteFile(context.Background(), path, strings.NewReader(content), 0o644, 0); err != nil {
		t.Fatalf("write %s: %v", path, err)
	}
}

// TestChangesVoidClonesMadeAhead changes a sandbox between the clones made
// ahead of its next checkpoint (with a copy of its layer) and the
// checkpoint, without a session call: a file written from the host, a
// command. Each voids them (they and the copy are older than the change)
// and has them made again; the checkpoint holds the change.
func TestChangesVoidClonesMadeAhead(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionShell, `N=1`)
	checkpoint(t, m, id, "")
	first := stepAhead(t, m, id, sandbox.SessionShell, `N=2`)
	for i, change := range []func(){
		func() { writeFile(t, m, id, "/work/host", "h") },
		func() { sh(t, m, id, "echo e > /work/cmd") },
	} {
		change()
		waitFor(t, "the void clone to go", func() bool { st := testutil.ProcState(first); return st == "" || st == "Z" })
		again := stoppedSessions(t, m, id, true)
		if len(again) != 1 || again[0] == first {
			t.Fatalf("change %d: clones made ahead again: %v, want one other than %d", i, again, first)
		}
		first = again[0]
	}
	ck := checkpoint(t, m, id, "")
	wantTemplates(t, "checkpoint", ck.Processes, "shell")
	if live := sessionPids(t, id, sandbox.SessionShell); len(live) != 1 || live[0] != first {
		t.Errorf("shell session after the checkpoint: %v, want the clone made ahead last, %d", live, first)
	}
	writeFile(t, m, id, "/work/host", "after")
	restore(t, m, id, ck.ID)
	if r := sh(t, m, id, "cat /work/host /work/cmd"); r.stdout != "he\n" {
		t.Errorf("files after the restore: %q %q, want the changes made before the checkpoint", r.stdout, r.stderr)
	}
	if r := session(t, m, id, sandbox.SessionShell, `echo $N`); r.stdout != "2\n" {
		t.Errorf("shell after the restore: %q %q", r.stdout, r.stderr)
	}
}

// TestCheckpointDropsClonesMadeAheadOfASessionThatRan wakes a shell
// session after its clone was made ahead (a SIGCHLD, which bash catches):
// it ran, so the checkpoint must not take the clone, and clones on the
// spot instead; the state is exact either way. A session that catches a
// timer's signal is never cloned ahead.
func TestCheckpointDropsClonesMadeAheadOfASessionThatRan(t *testing.T) {
	log := &logRecorder{}
	m := sandboxtest.NewManager(t, func(o *statemgr.Options) { recordLogs(o, log) })
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionShell, `N=1; f() { echo "f$N"; }`)
	ck1 := checkpoint(t, m, id, "")
	wantTemplates(t, "checkpoint", ck1.Processes, "shell")
	ahead := stepAhead(t, m, id, sandbox.SessionShell, `N=2`)
	live := sessionPids(t, id, sandbox.SessionShell)
	if len(live) != 1 {
		t.Fatalf("shell sessions %v, want one", live)
	}
	woke := voluntarySwitches(t, live[0])
	if err := syscall.Kill(live[0], syscall.SIGCHLD); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the shell to wake and sleep again", func() bool {
		return voluntarySwitches(t, live[0]) > woke && testutil.ProcState(live[0]) == "S"
	})
	ck2 := checkpoint(t, m, id, "")
	wantTemplates(t, "checkpoint", ck2.Processes, "shell")
	if now := sessionPids(t, id, sandbox.SessionShell); len(now) != 1 || now[0] == ahead {
		t.Fatalf("shell session after the checkpoint: %v, want a fresh clone, not the stale one %d", now, ahead)
	}
	if r := session(t, m, id, sandbox.SessionShell, `f`); r.stdout != "f2\n" {
		t.Fatalf("live session after the checkpoint: %q %q", r.stdout, r.stderr)
	}
	wantTemplates(t, "restore", restore(t, m, id, ck2.ID).Processes, "shell")
	if r := session(t, m, id, sandbox.SessionShell, `f`); r.stdout != "f2\n" {
		t.Fatalf("after the restore: %q %q", r.stdout, r.stderr)
	}

	// A python handler for a timer's signal: no clone ahead (it could run
	// unseen in the instant before a checkpoint's stop).
	session(t, m, id, sandbox.SessionPython, `import signal; signal.signal(signal.SIGALRM, lambda *a: None)`)
	wantTemplates(t, "checkpoint", checkpoint(t, m, id, "").Processes, "shell", "python")
	session(t, m, id, sandbox.SessionShell, `N=3`) // a step
	log.wait(t, "clones made ahead: not now", "python session: it catches timer signals")
	info, err := m.GetSandbox(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if p := scanStopped(pidDepth(info.InitPid), id, true); len(p) > 0 {
		t.Errorf("a python session with a SIGALRM handler was cloned ahead (%v)", p)
	}
}

// logRecorder is a slog handler that keeps every record's message and
// attributes, for a test to wait for a decision the code only logs.
type logRecorder struct {
	mu    sync.Mutex
	lines []string
}

func recordLogs(o *statemgr.Options, r *logRecorder) {
	o.Logger = slog.New(r)
}

func (r *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (r *logRecorder) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *logRecorder) WithGroup(string) slog.Handler            { return r }
func (r *logRecorder) Handle(_ context.Context, rec slog.Record) error {
	line := rec.Message
	rec.Attrs(func(a slog.Attr) bool { line += " " + a.String(); return true })
	r.mu.Lock()
	r.lines = append(r.lines, line)
	r.mu.Unlock()
	return nil
}

// wait waits (a guard against hangs, nothing is timed) for a record whose
// message is msg and whose text holds sub.
func (r *logRecorder) wait(t *testing.T, msg, sub string) {
	t.Helper()
	waitFor(t, fmt.Sprintf("a log %q holding %q", msg, sub), func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, l := range r.lines {
			if strings.HasPrefix(l, msg+" ") && strings.Contains(l, sub) {
				return true
			}
		}
		return false
	})
}

// waitFor waits for cond (a guard against hangs, nothing is timed).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// voluntarySwitches is how often process pid fell asleep.
func voluntarySwitches(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "voluntary_ctxt_switches:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	t.Fatalf("no voluntary_ctxt_switches in /proc/%d/status", pid)
	return 0
}

// TestNoClonesAheadBesideAWorkloadPidNamespace runs a process of the
// workload in a pid namespace of its own, beside the sessions: the clones
// made ahead must not take it for a preparation's (it could write the
// filesystem after their copy of it was made).
func TestNoClonesAheadBesideAWorkloadPidNamespace(t *testing.T) {
	log := &logRecorder{}
	m := sandboxtest.NewManager(t, func(o *statemgr.Options) { recordLogs(o, log) })
	id := create(t, m, sandbox.Config{})
	session(t, m, id, sandbox.SessionShell, `N=1`)
	checkpoint(t, m, id, "")
	if r := sh(t, m, id, "setsid unshare -p sh -c 'sleep 300 & exit' </dev/null >/dev/null 2>&1; sleep 0.2; pgrep -c sleep"); r.stdout != "1\n" {
		t.Fatalf("a workload in its own pid namespace: %q %q", r.stdout, r.stderr)
	}
	session(t, m, id, sandbox.SessionShell, `N=2`)
	log.wait(t, "clones made ahead: not now", "not only idle sessions")
}
