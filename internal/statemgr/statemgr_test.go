//go:build linux

package statemgr_test

import (
	"archive/tar"
	"bytes"
	"context"
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
	"testing"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/layer/btrfs"
	"github.com/deltabox/deltabox/internal/safefs"
	"github.com/deltabox/deltabox/internal/sandbox"
	"github.com/deltabox/deltabox/internal/statemgr"
	"github.com/deltabox/deltabox/internal/testutil"
	"github.com/deltabox/deltabox/internal/testutil/sandboxtest"
)

func TestMain(m *testing.M) { sandboxtest.Main(m) }

// newManager opens a manager on a fresh state dir, checked and closed when
// the test ends.
func newManager(t *testing.T) *statemgr.Manager { return sandboxtest.NewManager(t) }

func create(t *testing.T, m *statemgr.Manager, cfg sandbox.Config) string {
	t.Helper()
	in, err := m.CreateSandbox(context.Background(), cfg)
	if err != nil {
		t.Fatalf("create sandbox: %v", err)
	}
	t.Cleanup(func() {
		if err := m.DeleteSandbox(context.Background(), in.ID, true); err != nil && !errdefs.IsNotFound(err) {
			t.Errorf("delete sandbox %s: %v", in.ID, err)
		}
	})
	return in.ID
}

type result struct {
	sandbox.ExecResult
	stdout, stderr string
}

func run(t *testing.T, m *statemgr.Manager, id string, timeout time.Duration, argv ...string) result {
	t.Helper()
	var out, errb bytes.Buffer
	res, err := m.Exec(context.Background(), id, sandbox.ExecRequest{Argv: argv, Stdout: &out, Stderr: &errb, Timeout: timeout})
	if err != nil {
		t.Fatalf("exec %q: %v", argv, err)
	}
	return result{res, out.String(), errb.String()}
}

func sh(t *testing.T, m *statemgr.Manager, id, script string) result {
	t.Helper()
	return run(t, m, id, 30*time.Second, "bash", "-c", script)
}

func session(t *testing.T, m *statemgr.Manager, id string, kind sandbox.SessionKind, code string) result {
	t.Helper()
	var out, errb bytes.Buffer
	res, err := m.Session(context.Background(), id, sandbox.SessionRequest{Kind: kind, Code: code, Stdout: &out, Stderr: &errb, Timeout: 30 * time.Second})
	if err != nil {
		t.Fatalf("%s session %q: %v", kind, code, err)
	}
	return result{res, out.String(), errb.String()}
}

func TestSandboxSeesOnlyItsRoot(t *testing.T) {
	m := newManager(t)
	// A file created on the host, outside the image, must be invisible.
	secret, err := os.CreateTemp("/tmp", "deltabox-host-secret-")
	if err != nil {
		t.Fatal(err)
	}
	secret.Close()
	t.Cleanup(func() { os.Remove(secret.Name()) })
	id := create(t, m, sandbox.Config{})

	for _, tc := range []struct{ name, script string }{
		{"host tmp file", "test ! -e " + secret.Name()},
		{"host /etc/shadow", "test ! -e /etc/shadow && ! cat /etc/shadow"},
		{"host /root", "test -z \"$(ls -A /root)\""},
		{"host /work", "test -z \"$(ls -A /work)\""},
		{"uid 0 inside", "test \"$(id -u)\" = 0"},
		{"image files owned by root", "test \"$(stat -c %U /usr/bin/bash)\" = root"},
		{"tools", "bash --version >/dev/null && echo a | awk '{print}' | sed s/a/b/ | grep -q b && python3 -c 'print(1)' >/dev/null && perl -e 1 && prove --version >/dev/null && git --version >/dev/null"},
		{"can install files as root", "echo x > /usr/local/bin/mine && chmod +x /usr/local/bin/mine && echo hi > /etc/motd.d && cat /etc/motd.d"},
		{"loopback up", "python3 -c 'import socket; s=socket.socket(); s.bind((\"127.0.0.1\",0)); s.listen()'"},
		{"no network but loopback", "test \"$(ls /sys/class/net)\" = lo"},
		{"hostname is the id", "test \"$(hostname)\" = " + id},
		{"kcore masked", "test ! -s /proc/kcore"},
		{"proc sys read-only", "! echo 1 > /proc/sys/kernel/domainname"},
		{"mount denied", "! mount -t tmpfs x /mnt 2>/dev/null"},
		{"workload filtered by seccomp", "grep -q '^Seccomp:[[:space:]]*2' /proc/self/status && grep -q '^NoNewPrivs:[[:space:]]*1' /proc/self/status"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := sh(t, m, id, tc.script)
			if r.ExitCode != 0 {
				t.Errorf("%s: exit %d, stdout %q, stderr %q", tc.script, r.ExitCode, r.stdout, r.stderr)
			}
		})
	}
	// What the sandbox wrote did not reach the host.
	if _, err := os.Stat("/usr/local/bin/mine"); err == nil {
		t.Errorf("a sandbox's write reached the host's /usr/local/bin")
	}
}

func TestSandboxesAreIsolatedFromEachOther(t *testing.T) {
	m := newManager(t)
	a := create(t, m, sandbox.Config{})
	b := create(t, m, sandbox.Config{})

	// Both bind 127.0.0.1:8000 at the same time (the sockets live in the
	// python sessions).
	for _, id := range []string{a, b} {
		r := session(t, m, id, sandbox.SessionPython, "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 8000))\ns.listen()\n'bound'")
		if r.ExitCode != 0 || strings.TrimSpace(r.stdout) != "'bound'" {
			t.Fatalf("bind in %s: exit %d, %q %q", id, r.ExitCode, r.stdout, r.stderr)
		}
	}

	// a runs a long process; b sees nothing of it and cannot signal it.
	r := sh(t, m, a, "setsid sleep 1000 >/dev/null 2>&1 & echo $!")
	pidInA := strings.TrimSpace(r.stdout)
	if _, err := strconv.Atoi(pidInA); err != nil {
		t.Fatalf("background pid %q", pidInA)
	}
	r = sh(t, m, b, "for p in /proc/[0-9]*; do cat $p/cmdline 2>/dev/null | tr '\\0' ' '; echo; done")
	if strings.Contains(r.stdout, "sleep 1000") {
		t.Errorf("sandbox b sees a's process: %q", r.stdout)
	}
	sh(t, m, b, "kill -9 -1 2>/dev/null; kill -9 "+pidInA+" 2>/dev/null; true")
	r = sh(t, m, a, "kill -0 "+pidInA+" && echo alive")
	if strings.TrimSpace(r.stdout) != "alive" {
		t.Errorf("a's process died after b tried to kill it: %q %q", r.stdout, r.stderr)
	}

	// Files: a's writes are invisible to b.
	sh(t, m, a, "echo secret > /work/a.txt")
	if r := sh(t, m, b, "test ! -e /work/a.txt"); r.ExitCode != 0 {
		t.Errorf("b sees a's file")
	}
}

func TestLimits(t *testing.T) {
	m := newManager(t)
	bystander := create(t, m, sandbox.Config{})
	t.Run("fork bomb held by pids limit", func(t *testing.T) {
		id := create(t, m, sandbox.Config{Limits: sandbox.Limits{Pids: 64}})
		r := run(t, m, id, 5*time.Second, "bash", "-c", "bomb() { bomb | bomb & }; bomb; sleep 60")
		if !r.TimedOut {
			t.Errorf("fork bomb: want the timeout to stop it, got exit %d", r.ExitCode)
		}
		if r := sh(t, m, id, "echo alive"); strings.TrimSpace(r.stdout) != "alive" {
			t.Errorf("sandbox unusable after the fork bomb: %+v", r)
		}
	})
	t.Run("memory hog OOM-killed", func(t *testing.T) {
		id := create(t, m, sandbox.Config{Limits: sandbox.Limits{MemoryBytes: 64 << 20}})
		r := run(t, m, id, 60*time.Second, "python3", "-c", "a = bytearray(512 * 1024 * 1024); a[::4096] = b'x' * len(a[::4096])")
		if r.ExitCode != 128+9 {
			t.Errorf("memory hog: exit %d (stderr %q), want 137 (SIGKILL by the OOM killer)", r.ExitCode, r.stderr)
		}
		if r := sh(t, m, id, "echo alive"); strings.TrimSpace(r.stdout) != "alive" {
			t.Errorf("sandbox unusable after the OOM kill: %+v", r)
		}
	})
	if r := sh(t, m, bystander, "echo fine"); strings.TrimSpace(r.stdout) != "fine" {
		t.Errorf("another sandbox was affected: %+v", r)
	}
}

func TestTimeoutKillsWholeTree(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	r := run(t, m, id, time.Second, "bash", "-c", "sleep 300 & setsid sleep 301 & (sleep 302 &) ; wait")
	if !r.TimedOut || r.ExitCode != 124 {
		t.Fatalf("exit %d timedOut %v, want 124 true", r.ExitCode, r.TimedOut)
	}
	r = sh(t, m, id, "for p in /proc/[0-9]*; do cat $p/cmdline 2>/dev/null | tr '\\0' ' '; echo; done")
	for _, s := range []string{"sleep 300", "sleep 301", "sleep 302"} {
		if strings.Contains(r.stdout, s) {
			t.Errorf("%q survived the timeout: %q", s, r.stdout)
		}
	}
}

func TestExecStreamsAndExitCodes(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{Env: []string{"GREETING=hello"}})

	r := run(t, m, id, 10*time.Second, "sh", "-c", "echo out; echo err >&2; exit 7")
	if r.ExitCode != 7 || r.stdout != "out\n" || r.stderr != "err\n" {
		t.Errorf("got %d %q %q", r.ExitCode, r.stdout, r.stderr)
	}
	if r := run(t, m, id, 10*time.Second, "sh", "-c", "echo $GREETING; pwd"); r.stdout != "hello\n/work\n" {
		t.Errorf("env/cwd: %q", r.stdout)
	}
	if r := run(t, m, id, 10*time.Second, "no-such-command"); r.ExitCode != 127 {
		t.Errorf("missing command: exit %d", r.ExitCode)
	}

	// Output arrives while the command still runs: the command waits for a
	// file that the test creates only once it has seen the first line.
	w := &gateWriter{open: func() {
		files, release, err := m.Files(context.Background(), id, true)
		if err != nil {
			t.Error(err)
			return
		}
		defer release()
		if err := files.WriteFile(context.Background(), "/work/go", strings.NewReader(""), 0o644, 0); err != nil {
			t.Error(err)
		}
	}}
	res, err := m.Exec(context.Background(), id, sandbox.ExecRequest{
		Argv:    []string{"sh", "-c", "echo early; while [ ! -e /work/go ]; do sleep 0.05; done; echo late"},
		Stdout:  w,
		Timeout: 30 * time.Second,
	})
	if err != nil || res.TimedOut || w.String() != "early\nlate\n" {
		t.Errorf("streaming: %+v %v %q (a timeout means the first line was not streamed)", res, err, w.String())
	}

	// Output past the limit is cut with a marker.
	var out bytes.Buffer
	res, err = m.Exec(context.Background(), id, sandbox.ExecRequest{Argv: []string{"head", "-c", "100000", "/dev/zero"}, Stdout: &out, OutputLimit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if !res.StdoutTruncated || out.Len() != 1000+len(sandbox.TruncationMarker) {
		t.Errorf("truncation: %v, %d bytes", res.StdoutTruncated, out.Len())
	}

	// Stdin is forwarded.
	out.Reset()
	if _, err := m.Exec(context.Background(), id, sandbox.ExecRequest{Argv: []string{"tr", "a-z", "A-Z"}, Stdin: strings.NewReader("abc"), Stdout: &out}); err != nil {
		t.Fatal(err)
	}
	if out.String() != "ABC" {
		t.Errorf("stdin: %q", out.String())
	}
}

// gateWriter collects output and calls open, once, on the first write.
type gateWriter struct {
	open func()
	mu   sync.Mutex
	buf  bytes.Buffer
	once sync.Once
}

func (w *gateWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	w.buf.Write(b)
	w.mu.Unlock()
	w.once.Do(func() { go w.open() })
	return len(b), nil
}

func (w *gateWriter) String() string { w.mu.Lock(); defer w.mu.Unlock(); return w.buf.String() }

func TestSessionsKeepState(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})

	session(t, m, id, sandbox.SessionShell, "cd /tmp; export A=1; B=2; f() { echo fun; }; alias ll='echo aliased'; set -o pipefail")
	r := session(t, m, id, sandbox.SessionShell, "pwd; echo $A $B; f; ll; shopt -o pipefail | awk '{print $2}'")
	if r.stdout != "/tmp\n1 2\nfun\naliased\non\n" || r.ExitCode != 0 {
		t.Errorf("shell state: %q (exit %d, stderr %q)", r.stdout, r.ExitCode, r.stderr)
	}
	if r := session(t, m, id, sandbox.SessionShell, "false"); r.ExitCode != 1 {
		t.Errorf("shell exit code: %d", r.ExitCode)
	}
	if r := session(t, m, id, sandbox.SessionShell, "read x; echo \"[$x]\""); r.stdout != "[]\n" {
		t.Errorf("snippet stdin is not /dev/null: %q", r.stdout)
	}
	// exit kills the shell; the next call gets a fresh one.
	if r := session(t, m, id, sandbox.SessionShell, "exit 3"); r.ExitCode != 3 {
		t.Errorf("exit 3: %d", r.ExitCode)
	}
	if r := session(t, m, id, sandbox.SessionShell, "echo ${A:-fresh}"); r.stdout != "fresh\n" {
		t.Errorf("after exit: %q", r.stdout)
	}

	session(t, m, id, sandbox.SessionPython, "x = 41\ndef g(): return 'ok'")
	if r := session(t, m, id, sandbox.SessionPython, "x + 1"); r.stdout != "42\n" {
		t.Errorf("python repr: %q %q", r.stdout, r.stderr)
	}
	r = session(t, m, id, sandbox.SessionPython, "print('before')\n1/0")
	if r.ExitCode != 1 || r.stdout != "before\n" || !strings.Contains(r.stderr, "ZeroDivisionError") || strings.Contains(r.stderr, "_dbx_main") {
		t.Errorf("python exception: %d %q %q", r.ExitCode, r.stdout, r.stderr)
	}
	if r := session(t, m, id, sandbox.SessionPython, "g(), x"); r.stdout != "('ok', 41)\n" {
		t.Errorf("python state after exception: %q %q", r.stdout, r.stderr)
	}
	if r := session(t, m, id, sandbox.SessionPython, "import sys; sys.exit(5)"); r.ExitCode != 5 {
		t.Errorf("sys.exit(5): %d", r.ExitCode)
	}
	if r := session(t, m, id, sandbox.SessionPython, "x"); r.stdout != "41\n" {
		t.Errorf("python session lost after SystemExit: %q", r.stdout)
	}
	// A timeout kills the session; the next call starts a fresh one.
	var out bytes.Buffer
	res, err := m.Session(context.Background(), id, sandbox.SessionRequest{Kind: sandbox.SessionPython, Code: "import time; time.sleep(60)", Timeout: 500 * time.Millisecond, Stdout: &out})
	if err != nil || !res.TimedOut || res.ExitCode != 124 {
		t.Errorf("session timeout: %+v %v", res, err)
	}
	if r := session(t, m, id, sandbox.SessionPython, "'x' in globals()"); r.stdout != "False\n" {
		t.Errorf("after timeout: %q", r.stdout)
	}
}

func TestFilesRoundTrip(t *testing.T) {
	m := newManager(t)
	id := create(t, m, sandbox.Config{})
	ctx := context.Background()
	mtime := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
	var in bytes.Buffer
	tw := tar.NewWriter(&in)
	entries := []*tar.Header{
		{Name: "proj/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: mtime},
		{Name: "proj/empty/", Typeflag: tar.TypeDir, Mode: 0o700, ModTime: mtime},
		{Name: "proj/run.sh", Typeflag: tar.TypeReg, Mode: 0o4755, Size: 5, ModTime: mtime},
		{Name: "proj/data.bin", Typeflag: tar.TypeReg, Mode: 0o600, Size: 256, ModTime: mtime},
		{Name: "proj/link", Typeflag: tar.TypeSymlink, Linkname: "run.sh", Mode: 0o777, ModTime: mtime},
	}
	content := map[string][]byte{"proj/run.sh": []byte("echo\n"), "proj/data.bin": bytes.Repeat([]byte{0, 1, 2, 255}, 64)}
	for _, h := range entries {
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		tw.Write(content[h.Name])
	}
	tw.Close()

	root, release, err := m.Files(ctx, id, true)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	if err := root.TarIn(ctx, "/work", bytes.NewReader(in.Bytes()), safefs.Limits{}); err != nil {
		t.Fatalf("upload: %v", err)
	}
	// The sandbox sees the files as root's, with their modes.
	r := sh(t, m, id, "cd /work/proj && stat -c '%n %U %a' run.sh data.bin empty && readlink link && cat run.sh")
	want := "run.sh root 4755\ndata.bin root 600\nempty root 700\nrun.sh\necho\n"
	if r.stdout != want {
		t.Errorf("inside view:\n%s\nwant:\n%s(stderr %q)", r.stdout, want, r.stderr)
	}
	var out bytes.Buffer
	if err := root.TarOut(ctx, "/work/proj", &out); err != nil {
		t.Fatalf("download: %v", err)
	}
	got := map[string]*tar.Header{}
	gotData := map[string][]byte{}
	tr := tar.NewReader(&out)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(tr)
		name := strings.TrimSuffix(h.Name, "/")
		got[name] = h
		gotData[name] = b
	}
	for _, h := range entries {
		name := strings.TrimSuffix(h.Name, "/")
		g, ok := got[name]
		if !ok {
			t.Errorf("download lacks %q", name)
			continue
		}
		if g.Typeflag != h.Typeflag || g.Mode&0o7777 != h.Mode&0o7777 || g.Linkname != h.Linkname || !g.ModTime.Equal(h.ModTime) {
			t.Errorf("%s: got type %c mode %o link %q mtime %v; want %c %o %q %v", name, g.Typeflag, g.Mode, g.Linkname, g.ModTime, h.Typeflag, h.Mode, h.Linkname, h.ModTime)
		}
		if !bytes.Equal(gotData[name], content[h.Name]) {
			t.Errorf("%s: content differs", name)
		}
		if g.Uid != 0 || g.Gid != 0 {
			t.Errorf("%s: uid/gid %d/%d, want 0/0", name, g.Uid, g.Gid)
		}
	}

	// Escapes are refused, and change nothing.
	for _, p := range []string{"/../../etc/passwd", "../../../../etc/shadow"} {
		var b bytes.Buffer
		if _, err := root.ReadFile(ctx, p, &b, 0); err == nil && strings.Contains(b.String(), "root:") && p == "../../../../etc/shadow" {
			t.Errorf("read %q escaped the sandbox", p)
		}
	}
	sh(t, m, id, "ln -s /etc/shadow /work/evil; ln -s ../../../../../../root /work/evil2")
	var b bytes.Buffer
	if _, err := root.ReadFile(ctx, "/work/evil", &b, 0); err == nil {
		t.Errorf("read through a symlink to /etc/shadow succeeded (the sandbox has none): %q", b.String())
	}
	if err := root.WriteFile(ctx, "/work/evil2/pwned", strings.NewReader("x"), 0o644, 0); err == nil {
		if _, err := os.Stat("/root/pwned"); err == nil {
			os.Remove("/root/pwned")
			t.Fatalf("write through a symlink escaped to the host's /root")
		}
	}
}

func TestBadInputIsClassified(t *testing.T) {
	m := newManager(t)
	ctx := context.Background()
	id := create(t, m, sandbox.Config{})
	cases := []struct {
		name string
		err  error
		want error
	}{
		{"unknown sandbox", func() error { _, err := m.GetSandbox(ctx, "sb-00000000"); return err }(), errdefs.ErrNotFound},
		{"malformed id", func() error { _, err := m.GetSandbox(ctx, "../etc"); return err }(), errdefs.ErrInvalidArgument},
		{"unknown image", func() error { _, err := m.CreateSandbox(ctx, sandbox.Config{Image: "nope"}); return err }(), errdefs.ErrNotFound},
		{"bad env", func() error { _, err := m.CreateSandbox(ctx, sandbox.Config{Env: []string{"1X=2"}}); return err }(), errdefs.ErrInvalidArgument},
		{"relative workdir", func() error { _, err := m.CreateSandbox(ctx, sandbox.Config{Workdir: "work"}); return err }(), errdefs.ErrInvalidArgument},
		{"tiny memory", func() error {
			_, err := m.CreateSandbox(ctx, sandbox.Config{Limits: sandbox.Limits{MemoryBytes: 1}})
			return err
		}(), errdefs.ErrInvalidArgument},
		{"empty argv", func() error { _, err := m.Exec(ctx, id, sandbox.ExecRequest{}); return err }(), errdefs.ErrInvalidArgument},
		{"missing cwd", func() error {
			_, err := m.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"true"}, Cwd: "/nope"})
			return err
		}(), errdefs.ErrInvalidArgument},
		{"delete unknown", m.DeleteSandbox(ctx, "sb-00000000", false), errdefs.ErrNotFound},
		{"remove host image", m.RemoveImage(ctx, "host"), errdefs.ErrFailedPrecondition},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.err == nil || errdefs.Classify(tc.err) != errdefs.Classify(tc.want) {
				t.Errorf("%s: got %v, want class %v", tc.name, tc.err, tc.want)
			}
		})
	}
	// Nothing half-made is left by the failures above.
	list, err := m.ListSandboxes(ctx)
	if err != nil || len(list) != 1 {
		t.Errorf("after bad input: %d sandboxes (%v), want 1", len(list), err)
	}
}

func TestRestartRecoversSandboxes(t *testing.T) {
	testutil.RequiresRoot(t)
	testutil.CheckLeaks(t)
	root := t.TempDir()
	ctx := context.Background()
	m, err := statemgr.New(ctx, statemgr.Options{Root: root, CgroupParent: testutil.CgroupParent(), Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	in, err := m.CreateSandbox(ctx, sandbox.Config{Labels: map[string]string{"k": "v"}})
	if err != nil {
		t.Fatal(err)
	}
	if r := sh(t, m, in.ID, "echo kept > /work/f"); r.ExitCode != 0 {
		t.Fatal(r.stderr)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	m, err = statemgr.New(ctx, statemgr.Options{Root: root, CgroupParent: testutil.CgroupParent()})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	got, err := m.GetSandbox(ctx, in.ID)
	if err != nil || got.State != sandbox.StateRunning || got.Config.Labels["k"] != "v" {
		t.Fatalf("after restart: %+v %v", got, err)
	}
	if r := sh(t, m, in.ID, "cat /work/f"); r.stdout != "kept\n" {
		t.Errorf("file after restart: %q %q", r.stdout, r.stderr)
	}
	if err := m.DeleteSandbox(ctx, in.ID, false); err != nil {
		t.Fatal(err)
	}
	// Nothing but the runtime's own stand-in root (see sandbox.Runtime).
	entries, _ := os.ReadDir(filepath.Join(root, "run"))
	entries = slices.DeleteFunc(entries, func(e os.DirEntry) bool { return e.Name() == ".stand-in" })
	if len(entries) != 0 {
		t.Errorf("run dir not empty after delete: %v", entries)
	}
}

func TestFullDiskIsResourceExhausted(t *testing.T) {
	testutil.RequiresBtrfs(t)
	ctx := context.Background()
	m := sandboxtest.NewManager(t, func(o *statemgr.Options) {
		layers, err := btrfs.New(filepath.Join(o.Root, "layers"), btrfs.WithImageSize(256<<20))
		if err != nil {
			t.Fatal(err)
		}
		o.Layers, o.Storage = layers, "btrfs"
	})
	in, err := m.CreateSandbox(ctx, sandbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer m.DeleteSandbox(ctx, in.ID, true)
	files, release, err := m.Files(ctx, in.ID, true)
	if err != nil {
		t.Fatal(err)
	}
	err = files.WriteFile(ctx, "/work/big", io.LimitReader(zeroReader{}, 400<<20), 0o644, 1<<30)
	release()
	if !errdefs.IsResourceExhausted(err) {
		t.Fatalf("writing 400 MiB into a 256 MiB store: %v, want resource exhausted", err)
	}
	// Nothing half-written is left, and the sandbox still works.
	if r := sh(t, m, in.ID, "test ! -e /work/big && echo ok"); r.stdout != "ok\n" {
		t.Errorf("after the full disk: %q %q", r.stdout, r.stderr)
	}
}

type zeroReader struct{}

func (zeroReader) Read(b []byte) (int, error) {
	for i := range b {
		b[i] = 0
	}
	return len(b), nil
}

// TestImportedImage builds a tiny rootfs from the host's bash and the
// libraries it needs, imports it, and runs a command in a sandbox of it: the
// idmapped lower and the exec path work for an image that is not the host's.
func TestImportedImage(t *testing.T) {
	m := newManager(t)
	ctx := context.Background()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(name string, mode int64, body []byte) {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: mode, Size: int64(len(body)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write(body)
	}
	out, err := exec.Command("ldd", "/usr/bin/bash").Output()
	if err != nil {
		t.Fatal(err)
	}
	files := []string{"/usr/bin/bash"}
	for _, line := range strings.Split(string(out), "\n") {
		for _, f := range strings.Fields(line) {
			if strings.HasPrefix(f, "/") {
				files = append(files, f)
			}
		}
	}
	for _, d := range []string{"bin/", "lib/", "lib64/", "work/", "tmp/", "proc/", "dev/", "sys/"} {
		tw.WriteHeader(&tar.Header{Name: d, Mode: 0o755, Typeflag: tar.TypeDir})
	}
	for _, f := range files {
		real, err := filepath.EvalSymlinks(f)
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(real)
		if err != nil {
			t.Fatal(err)
		}
		name := strings.TrimPrefix(f, "/")
		if strings.HasPrefix(name, "usr/bin/") {
			name = "bin/" + filepath.Base(name)
		} else if strings.HasPrefix(name, "lib/") || strings.HasPrefix(name, "usr/lib/") {
			name = "lib/" + filepath.Base(name)
		}
		add(name, 0o755, b)
	}
	// The loader looks in /lib64 and /lib/x86_64-linux-gnu: point both at lib.
	tw.WriteHeader(&tar.Header{Name: "lib/x86_64-linux-gnu", Typeflag: tar.TypeSymlink, Linkname: "."})
	tw.Close()
	if _, err := m.ImportImage(ctx, "mini", &buf); err != nil {
		t.Fatalf("import: %v", err)
	}
	id := create(t, m, sandbox.Config{Image: "mini", Env: []string{"PATH=/bin"}})
	r := run(t, m, id, 10*time.Second, "/bin/bash", "-c", "echo hello from mini; echo $(( 6 * 7 )) > /work/x; read -r v < /work/x; echo $v; [[ -e /usr/bin/python3 ]] || echo isolated")
	if r.stdout != "hello from mini\n42\nisolated\n" {
		t.Errorf("mini image: exit %d %q %q", r.ExitCode, r.stdout, r.stderr)
	}
	if err := m.RemoveImage(ctx, "mini"); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("removing an image in use: %v", err)
	}
}

func TestWarmPool(t *testing.T) {
	m := sandboxtest.NewManager(t, func(o *statemgr.Options) { o.WarmPool = 2 })
	ctx := context.Background()
	// More creates than the pool holds: some come warm, some cold; all must
	// be proper, distinct sandboxes with their own limits and files.
	var ids []string
	for i := 0; i < 4; i++ {
		in, err := m.CreateSandbox(ctx, sandbox.Config{Limits: sandbox.Limits{Pids: 100 + int64(i)}, Env: []string{"N=" + strconv.Itoa(i)}})
		if err != nil {
			t.Fatalf("create %d: %v", i, err)
		}
		ids = append(ids, in.ID)
		time.Sleep(50 * time.Millisecond)
	}
	seen := map[string]bool{}
	for i, id := range ids {
		r := sh(t, m, id, "echo $N $(hostname) $(cat /sys/fs/cgroup/pids.max 2>/dev/null || echo -) $(id -u); echo $N > /work/n; cat /work/n")
		want := fmt.Sprintf("%d %s", i, id)
		if !strings.HasPrefix(r.stdout, want) || !strings.HasSuffix(r.stdout, fmt.Sprintf(" 0\n%d\n", i)) {
			t.Errorf("sandbox %d (%s): %q %q", i, id, r.stdout, r.stderr)
		}
		if seen[id] {
			t.Errorf("id %s handed out twice", id)
		}
		seen[id] = true
	}
	for _, id := range ids {
		if err := m.DeleteSandbox(ctx, id, true); err != nil {
			t.Error(err)
		}
	}
}

// Regression: a sandbox's read loop, blocked on its control socket when the
// socket was closed, was restarted by a signal on the same fd number, by
// then another sandbox's socket, and stole that sandbox's "ready": creates
// hung after a few dozen create/delete cycles. The fd now belongs to the
// read loop alone.
func TestCreateDeleteChurn(t *testing.T) {
	m := sandboxtest.NewManager(t, func(o *statemgr.Options) { o.WarmPool = 2 })
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	for i := 0; i < 40; i++ {
		in, err := m.CreateSandbox(ctx, sandbox.Config{})
		if err != nil {
			t.Fatalf("create %d: %v", i, err)
		}
		var out bytes.Buffer
		if _, err := m.Exec(ctx, in.ID, sandbox.ExecRequest{Argv: []string{"echo", strconv.Itoa(i)}, Stdout: &out}); err != nil || out.String() != strconv.Itoa(i)+"\n" {
			t.Fatalf("exec %d: %q %v", i, out.String(), err)
		}
		if err := m.DeleteSandbox(ctx, in.ID, true); err != nil {
			t.Fatalf("delete %d: %v", i, err)
		}
	}
}
