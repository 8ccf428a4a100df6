//go:build linux

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/deltabox/deltabox/internal/daemon/daemontest"
	"github.com/deltabox/deltabox/internal/testutil/sandboxtest"
)

// TestMain lets the end-to-end tests' daemon re-execute this binary as each
// sandbox's init.
func TestMain(m *testing.M) { sandboxtest.Main(m) }

var update = flag.Bool("update", false, "rewrite the golden files in testdata")

type result struct {
	stdout, stderr string
	code           int
}

// cli runs the CLI in-process against the daemon at sock.
func cli(t *testing.T, sock string, stdin string, args ...string) result {
	t.Helper()
	var out, errb bytes.Buffer
	env := func(string) string { return "" }
	code := run(context.Background(), append([]string{"--socket", sock}, args...), strings.NewReader(stdin), &out, &errb, env)
	return result{out.String(), errb.String(), code}
}

// durationRe hides the one field that varies between runs.
var durationRe = regexp.MustCompile(`"duration_seconds": [0-9.e-]+`)

// golden compares got with testdata/name, or rewrites it with -update.
func golden(t *testing.T, name, got string) {
	t.Helper()
	got = durationRe.ReplaceAllString(got, `"duration_seconds": 0`)
	p := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(p, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(p)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if got != string(want) {
		t.Errorf("%s differs:\n--- got\n%s\n--- want\n%s", name, got, want)
	}
}

func mustCreate(t *testing.T, sock string, args ...string) string {
	t.Helper()
	r := cli(t, sock, "", append([]string{"create"}, args...)...)
	if r.code != 0 {
		t.Fatalf("create: exit %d, stderr %q", r.code, r.stderr)
	}
	return strings.TrimSpace(r.stdout)
}

func TestCreateJSON(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	r := cli(t, sock, "", "create", "--json", "--memory", "1G", "--pids", "512", "--cpus", "1.5",
		"--env", "A=1", "--env", "B=two words", "--label", "job=t1", "--workdir", "/src")
	if r.code != 0 {
		t.Fatalf("create --json: exit %d, stderr %q", r.code, r.stderr)
	}
	var obj map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &obj); err != nil || obj["id"] != "sb-0001" {
		t.Fatalf("create --json printed %q (%v), want an object with id", r.stdout, err)
	}
	golden(t, "create.json", r.stdout)

	// Without --json: just the id, for SB=$(deltabox create).
	if r := cli(t, sock, "", "create"); r.code != 0 || r.stdout != "sb-0002\n" {
		t.Fatalf("create = %+v, want the id alone", r)
	}
	for _, bad := range [][]string{{"--memory", "lots"}, {"--label", "nokey"}, {"--env", "NOEQ"}, {"--pids", "-1"}} {
		if r := cli(t, sock, "", append([]string{"create"}, bad...)...); r.code != 1 || r.stderr == "" {
			t.Errorf("create %q = %+v, want exit 1 and a message", bad, r)
		}
	}
}

func TestExecJSON(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	sb := mustCreate(t, sock)

	r := cli(t, sock, "", "exec", sb, "--json", "--", "echo", "hello", "world")
	if r.code != 0 {
		t.Fatalf("exec --json echo: exit %d, stderr %q", r.code, r.stderr)
	}
	golden(t, "exec-ok.json", r.stdout)

	r = cli(t, sock, "", "exec", sb, "--json", "--", "fail", "oops", "3")
	if r.code != 3 {
		t.Fatalf("exec --json fail: exit %d, want 3 (stderr %q)", r.code, r.stderr)
	}
	golden(t, "exec-fail.json", r.stdout)
	var obj map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &obj); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"exit_code", "stdout", "stderr", "timed_out"} {
		if _, ok := obj[k]; !ok {
			t.Errorf("exec --json lacks %q: %s", k, r.stdout)
		}
	}
}

func TestExecExitCodes(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	sb := mustCreate(t, sock)
	cases := []struct {
		name           string
		stdin          string
		args           []string
		code           int
		stdout, stderr string
	}{
		{"ok", "", []string{"exec", sb, "--", "echo", "hi"}, 0, "hi\n", ""},
		{"exit code", "", []string{"exec", sb, "--", "fail", "oops", "42"}, 42, "", "oops"},
		{"timeout", "", []string{"exec", sb, "--timeout", "20ms", "--", "sleep", "1h"}, 124, "", ""},
		{"not found", "", []string{"exec", sb, "--", "nosuch"}, 127, "", "nosuch: command not found\n"},
		{"stdin", "piped in", []string{"exec", "-i", sb, "--", "cat"}, 0, "piped in", ""},
		{"no stdin without -i", "ignored", []string{"exec", sb, "--", "cat"}, 0, "", ""},
		{"flags after --", "", []string{"exec", sb, "--", "echo", "--json", "-x"}, 0, "--json -x\n", ""},
		{"sh", "", []string{"sh", sb, "--", "cd", "/tmp"}, 0, "shell: cd /tmp\n", ""},
		{"sh exit", "", []string{"sh", sb, "--", "exit 9"}, 9, "", ""},
		{"py", "", []string{"py", sb, "--", "x = 1"}, 0, "python: x = 1\n", ""},
		{"py from stdin", "print(x)", []string{"py", sb}, 0, "python: print(x)\n", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := cli(t, sock, tc.stdin, tc.args...)
			if r.code != tc.code || r.stdout != tc.stdout || r.stderr != tc.stderr {
				t.Errorf("%q = exit %d, stdout %q, stderr %q; want %d, %q, %q",
					tc.args, r.code, r.stdout, r.stderr, tc.code, tc.stdout, tc.stderr)
			}
		})
	}
	// The CLI's own failures exit 125, never a command's code.
	r := cli(t, sock, "", "exec", "missing", "--", "echo")
	if r.code != 125 || !strings.Contains(r.stderr, "not found") {
		t.Errorf("exec in a missing sandbox = %+v, want exit 125 and not found", r)
	}
	r = cli(t, filepath.Join(t.TempDir(), "none.sock"), "", "exec", sb, "--", "echo")
	if r.code != 125 || !strings.Contains(r.stderr, "deltabox serve") {
		t.Errorf("exec with no daemon = %+v, want exit 125 and how to start it", r)
	}
}

func TestLsJSON(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	r := cli(t, sock, "", "ls", "--json")
	if r.code != 0 || r.stdout != "[]\n" {
		t.Fatalf("ls --json with no sandboxes = %+v, want []", r)
	}
	mustCreate(t, sock, "--label", "job=a")
	mustCreate(t, sock, "--image", "host")
	r = cli(t, sock, "", "ls", "--json")
	if r.code != 0 {
		t.Fatalf("ls --json: %+v", r)
	}
	var list []map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &list); err != nil || len(list) != 2 || list[0]["id"] != "sb-0001" {
		t.Fatalf("ls --json printed %q (%v)", r.stdout, err)
	}
	golden(t, "ls.json", r.stdout)

	r = cli(t, sock, "", "ls")
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if r.code != 0 || len(lines) != 3 {
		t.Fatalf("ls = %+v", r)
	}
	// Aligned: every column starts at the same offset on every line.
	col := strings.Index(lines[0], "STATE")
	for _, l := range lines[1:] {
		if len(l) <= col || !strings.HasPrefix(l[col:], "running") {
			t.Errorf("ls table not aligned:\n%s", r.stdout)
		}
	}
	if !strings.Contains(lines[1], "job=a") {
		t.Errorf("ls line %q lacks the label", lines[1])
	}
}

func TestInspectRmInfo(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	sb := mustCreate(t, sock, "--memory", "512M")
	r := cli(t, sock, "", "inspect", sb)
	if r.code != 0 || !strings.Contains(r.stdout, "512 MiB") || !strings.Contains(r.stdout, sb) {
		t.Fatalf("inspect = %+v", r)
	}
	r = cli(t, sock, "", "inspect", "--json", sb)
	var obj map[string]any
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &obj) != nil || obj["id"] != sb {
		t.Fatalf("inspect --json = %+v", r)
	}
	r = cli(t, sock, "", "info", "--json")
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &obj) != nil || obj["storage"] != "copy" {
		t.Fatalf("info --json = %+v", r)
	}
	if r := cli(t, sock, "", "info"); r.code != 0 || !regexp.MustCompile(`(?m)^Storage: +copy$`).MatchString(r.stdout) {
		t.Fatalf("info = %+v", r)
	}
	r = cli(t, sock, "", "rm", sb, "missing")
	if r.code != 1 || r.stdout != sb+"\n" || !strings.Contains(r.stderr, "missing") {
		t.Fatalf("rm = %+v, want the removed id and an error for the missing one", r)
	}
	if r := cli(t, sock, "", "inspect", sb); r.code != 1 || !strings.Contains(r.stderr, "not found") {
		t.Fatalf("inspect after rm = %+v", r)
	}
}

func TestImages(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	img := filepath.Join(t.TempDir(), "rootfs.tar")
	os.WriteFile(img, bytes.Repeat([]byte{1}, 300<<10), 0o644)
	r := cli(t, sock, "", "image", "import", "mini", img)
	if r.code != 0 || r.stdout != "mini (rootfs, 300 KiB)\n" {
		t.Fatalf("image import = %+v", r)
	}
	if r := cli(t, sock, "", "image", "import", "mini", img); r.code != 1 || !strings.Contains(r.stderr, "already exists") {
		t.Fatalf("second import = %+v", r)
	}
	if r := cli(t, sock, "stdin bytes", "image", "import", "--json", "piped", "-"); r.code != 0 || !strings.Contains(r.stdout, `"size": 11`) {
		t.Fatalf("image import from stdin = %+v", r)
	}
	r = cli(t, sock, "", "image", "ls")
	if r.code != 0 || !strings.Contains(r.stdout, "mini") || !strings.HasPrefix(r.stdout, "NAME") {
		t.Fatalf("image ls = %+v", r)
	}
	if r := cli(t, sock, "", "image", "rm", "host"); r.code != 1 {
		t.Fatalf("image rm host = %+v, want a failure", r)
	}
	if r := cli(t, sock, "", "image", "rm", "mini"); r.code != 0 {
		t.Fatalf("image rm = %+v", r)
	}
	var list []map[string]any
	r = cli(t, sock, "", "image", "ls", "--json")
	if json.Unmarshal([]byte(r.stdout), &list) != nil || len(list) != 2 {
		t.Fatalf("image ls --json = %+v", r)
	}
}

func TestFormat(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
	}{{"512", 512}, {"1K", 1024}, {"1G", 1 << 30}, {"1.5GiB", 3 << 29}, {"2gb", 2 << 30}, {"100M", 100 << 20}} {
		if got, err := parseSize(tc.in); err != nil || got != tc.want {
			t.Errorf("parseSize(%q) = %v, %v, want %v", tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{"", "G", "-1", "1X", "lots"} {
		if _, err := parseSize(bad); err == nil {
			t.Errorf("parseSize(%q) succeeded", bad)
		}
	}
	for _, tc := range []struct {
		in   int64
		want string
	}{{0, "0 B"}, {1023, "1023 B"}, {1024, "1 KiB"}, {1536, "1.5 KiB"}, {5 << 30, "5 GiB"}} {
		if got := humanSize(tc.in); got != tc.want {
			t.Errorf("humanSize(%d) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestCp(t *testing.T) {
	t.Parallel()
	sock, fake := daemontest.ServeFake(t)
	sb := mustCreate(t, sock)
	local := t.TempDir()
	src := filepath.Join(local, "src")
	os.MkdirAll(filepath.Join(src, "sub"), 0o755)
	os.WriteFile(filepath.Join(src, "sub", "a.txt"), []byte("A"), 0o600)

	// LOCAL -> SB:relative path (the workdir) and SB:absolute path.
	if r := cli(t, sock, "", "cp", src, sb+":"); r.code != 0 {
		t.Fatalf("cp dir in = %+v", r)
	}
	if b, err := os.ReadFile(filepath.Join(fake.Dir, sb, "work/src/sub/a.txt")); err != nil || string(b) != "A" {
		t.Fatalf("copied in: %q, %v", b, err)
	}
	if r := cli(t, sock, "", "cp", filepath.Join(src, "sub", "a.txt"), sb+":/tmp/b.txt"); r.code != 0 {
		t.Fatalf("cp file in = %+v", r)
	}
	if b, err := os.ReadFile(filepath.Join(fake.Dir, sb, "tmp/b.txt")); err != nil || string(b) != "A" {
		t.Fatalf("copied in under a new name: %q, %v", b, err)
	}
	// SB:PATH -> LOCAL.
	out := filepath.Join(local, "out")
	if r := cli(t, sock, "", "cp", sb+":src", out); r.code != 0 {
		t.Fatalf("cp dir out = %+v", r)
	}
	if b, err := os.ReadFile(filepath.Join(out, "sub", "a.txt")); err != nil || string(b) != "A" {
		t.Fatalf("copied out: %q, %v", b, err)
	}
	for _, bad := range [][]string{{"a", "b"}, {sb + ":/x", sb + ":/y"}} {
		if r := cli(t, sock, "", append([]string{"cp"}, bad...)...); r.code != 1 {
			t.Errorf("cp %q = %+v, want exit 1", bad, r)
		}
	}
	if r := cli(t, sock, "", "cp", sb+":/missing", out); r.code != 1 || !strings.Contains(r.stderr, "not found") {
		t.Errorf("cp of a missing file = %+v", r)
	}
}

func TestSocketFromEnv(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	var out, errb bytes.Buffer
	env := func(k string) string {
		if k == "DELTABOX_SOCKET" {
			return sock
		}
		return ""
	}
	if code := run(context.Background(), []string{"ls", "--json"}, strings.NewReader(""), &out, &errb, env); code != 0 || out.String() != "[]\n" {
		t.Fatalf("ls with DELTABOX_SOCKET = %d, %q, %q", code, out.String(), errb.String())
	}
}
