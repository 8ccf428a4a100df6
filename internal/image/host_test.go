//go:build linux

package image

import (
	"context"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/testutil"
)

// newStore opens a store under a temp dir and closes it (detaching its tmpfs)
// when t ends. Call testutil.CheckLeaks first.
func newStore(t *testing.T, opts ...Opt) (*store, string) {
	t.Helper()
	root := filepath.Join(t.TempDir(), "store")
	s, err := New(root, opts...)
	if err != nil {
		t.Fatalf("New(%q) = %v", root, err)
	}
	t.Cleanup(func() {
		if err := s.(io.Closer).Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return s.(*store), root
}

func write(t *testing.T, p, content string, mode os.FileMode) {
	t.Helper()
	must(t, os.MkdirAll(filepath.Dir(p), 0o755))
	must(t, os.WriteFile(p, []byte(content), mode))
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// fakeHost builds a small Debian-like host root with secrets that must not
// reach the generated layer.
func fakeHost(t *testing.T) string {
	h := filepath.Join(t.TempDir(), "host")
	write(t, filepath.Join(h, "usr/bin/bash"), "#!bash", 0o755)
	write(t, filepath.Join(h, "usr/lib/os-release"), "ID=debian\n", 0o644)
	must(t, os.Symlink("usr/bin", filepath.Join(h, "bin")))
	must(t, os.Symlink("usr/lib", filepath.Join(h, "lib")))
	e := filepath.Join(h, "etc")
	write(t, filepath.Join(e, "passwd"), strings.Join([]string{
		"root:x:0:0:root:/root:/bin/bash",
		"daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin",
		"legacy:$6$salt$hash:3:3:legacy:/:/bin/sh",
		"alice:x:1000:1000:Alice:/home/alice:/bin/bash",
		"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin",
	}, "\n")+"\n", 0o644)
	write(t, filepath.Join(e, "group"), "root:x:0:\nsudo:x:27:alice,root\nalice:x:1000:\nnogroup:x:65534:\n", 0o644)
	write(t, filepath.Join(e, "shadow"), "root:$6$secret:1::::::\n", 0o640)
	write(t, filepath.Join(e, "gshadow"), "root:*::\n", 0o640)
	write(t, filepath.Join(e, "ssh/ssh_host_ed25519_key"), "-----BEGIN OPENSSH PRIVATE KEY-----\n", 0o600)
	write(t, filepath.Join(e, "sudoers"), "root ALL=(ALL) ALL\n", 0o440)
	write(t, filepath.Join(e, "ssl/private/ssl-cert-snakeoil.key"), "-----BEGIN PRIVATE KEY-----\n", 0o600)
	write(t, filepath.Join(e, "ssl/certs/ca.pem"), "-----BEGIN CERTIFICATE-----\n", 0o644)
	write(t, filepath.Join(e, "ssl/stray.pem"), "-----BEGIN RSA PRIVATE KEY-----\n", 0o644)
	must(t, os.Symlink("/usr/share/ca-certificates/x.crt", filepath.Join(e, "ssl/certs/x.pem")))
	write(t, filepath.Join(e, "resolv.conf.real"), "nameserver 10.0.0.1\n", 0o644)
	must(t, os.Symlink("/etc/resolv.conf.real", filepath.Join(e, "resolv.conf"))) // absolute, within the host root
	must(t, os.Symlink("/usr/share/zoneinfo/Etc/UTC", filepath.Join(e, "localtime")))
	must(t, os.Symlink("../usr/lib/os-release", filepath.Join(e, "os-release")))
	write(t, filepath.Join(e, "python3.11/sitecustomize.py"), "# site\n", 0o644)
	must(t, os.MkdirAll(filepath.Join(e, "alternatives"), 0o755))
	must(t, os.Symlink("/usr/bin/vim.basic", filepath.Join(e, "alternatives/editor")))
	write(t, filepath.Join(e, "nsswitch.conf"), "passwd: files\n", 0o644)
	write(t, filepath.Join(e, "motd"), "not copied\n", 0o644)
	write(t, filepath.Join(h, "root/.bash_history"), "secret commands\n", 0o600)
	write(t, filepath.Join(h, "home/alice/.ssh/id_rsa"), "-----BEGIN OPENSSH PRIVATE KEY-----\n", 0o600)
	write(t, filepath.Join(h, "farm/data"), "x", 0o644)
	write(t, filepath.Join(h, ".dockerenv"), "", 0o644)
	must(t, os.MkdirAll(filepath.Join(h, "boot"), 0o755))
	must(t, os.MkdirAll(filepath.Join(h, "opt/tool"), 0o755))
	return h
}

func isWhiteout(p string) bool {
	var st unix.Stat_t
	return unix.Lstat(p, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == 0
}

func isOpaque(p string) bool {
	buf := make([]byte, 8)
	n, err := unix.Lgetxattr(p, overlayOpaque, buf)
	return err == nil && string(buf[:n]) == "y"
}

// checkHides asserts that the layer hides every top-level entry of host
// except the allowed ones: a whiteout, or an opaque directory.
func checkHides(t *testing.T, layer, host string) {
	t.Helper()
	ents, err := os.ReadDir(host)
	must(t, err)
	for _, e := range ents {
		p := filepath.Join(layer, e.Name())
		allowed := slices.Contains(hostAllowed, e.Name())
		hidden := isWhiteout(p) || isOpaque(p)
		if allowed && hidden || !allowed && !hidden {
			t.Errorf("layer entry %q: hidden %v, want %v", e.Name(), hidden, !allowed)
		}
	}
}

func TestHostLayer(t *testing.T) {
	testutil.RequiresRoot(t)
	testutil.CheckLeaks(t)
	ctx := context.Background()
	host := fakeHost(t)
	s, _ := newStore(t, WithHostRoot(host))

	info, err := s.Get(ctx, HostImage)
	must(t, err)
	if info.Kind != KindHost || len(info.Lowers) != 2 || info.Lowers[1] != host || info.Size != 0 {
		t.Fatalf("Get(host) = %+v", info)
	}
	if !slices.Equal(info.Env, []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8"}) {
		t.Errorf("host Env = %q", info.Env)
	}
	layer := info.Lowers[0]
	checkHides(t, layer, host)
	for _, name := range []string{"farm", "boot", ".dockerenv"} {
		if !isWhiteout(filepath.Join(layer, name)) {
			t.Errorf("layer %q is not a whiteout", name)
		}
	}
	for _, d := range hostFresh {
		fi, err := os.Lstat(filepath.Join(layer, d.name))
		if err != nil || !fi.IsDir() || fi.Mode()&(fs.ModePerm|fs.ModeSticky) != d.mode || !isOpaque(filepath.Join(layer, d.name)) {
			t.Errorf("layer dir %q = %v, %v; want opaque %v", d.name, fi.Mode(), err, d.mode)
		}
	}
	for _, p := range []string{"usr", "bin", "lib"} {
		if _, err := os.Lstat(filepath.Join(layer, p)); !os.IsNotExist(err) {
			t.Errorf("layer has %q (%v); it must come through from the host", p, err)
		}
	}
	if fi, err := os.Lstat(filepath.Join(layer, "var/tmp")); err != nil || fi.Mode()&fs.ModeSticky == 0 {
		t.Errorf("var/tmp = %v, %v, want 1777", fi, err)
	}
	// Only root owns files in the layer, and nothing holds a private key.
	must(t, filepath.WalkDir(layer, func(p string, d fs.DirEntry, err error) error {
		must(t, err)
		fi, err := d.Info()
		must(t, err)
		if st := fi.Sys().(*syscall.Stat_t); st.Uid != 0 || st.Gid != 0 {
			t.Errorf("%q is owned by %d:%d", p, st.Uid, st.Gid)
		}
		if fi.Mode().IsRegular() {
			b, _ := os.ReadFile(p)
			if strings.Contains(string(b), "PRIVATE KEY") || strings.Contains(string(b), "$6$") {
				t.Errorf("%q holds a secret", p)
			}
		}
		return nil
	}))

	etc := filepath.Join(layer, "etc")
	for _, p := range []string{"shadow", "gshadow", "ssh", "sudoers", "ssl/private", "ssl/stray.pem", "motd"} {
		if _, err := os.Lstat(filepath.Join(etc, p)); !os.IsNotExist(err) {
			t.Errorf("etc/%s copied (%v)", p, err)
		}
	}
	passwd, _ := os.ReadFile(filepath.Join(etc, "passwd"))
	for _, want := range []string{"root:x:0:0:", "daemon:x:1:1:", "nobody:x:65534:"} {
		if !strings.Contains(string(passwd), want) {
			t.Errorf("etc/passwd lacks %q:\n%s", want, passwd)
		}
	}
	for _, bad := range []string{"alice", "legacy"} {
		if strings.Contains(string(passwd), bad) {
			t.Errorf("etc/passwd has %q:\n%s", bad, passwd)
		}
	}
	group, _ := os.ReadFile(filepath.Join(etc, "group"))
	if !strings.Contains(string(group), "sudo:x:27:root\n") || strings.Contains(string(group), "alice") {
		t.Errorf("etc/group = %s", group)
	}
	for p, want := range map[string]string{
		"hosts":                       "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
		"resolv.conf":                 "nameserver 10.0.0.1\n",
		"nsswitch.conf":               "passwd: files\n",
		"ssl/certs/ca.pem":            "-----BEGIN CERTIFICATE-----\n",
		"python3.11/sitecustomize.py": "# site\n",
	} {
		if b, err := os.ReadFile(filepath.Join(etc, p)); err != nil || string(b) != want {
			t.Errorf("etc/%s = %q, %v, want %q", p, b, err, want)
		}
	}
	for p, want := range map[string]string{
		"localtime":           "/usr/share/zoneinfo/Etc/UTC",
		"os-release":          "../usr/lib/os-release",
		"mtab":                "../proc/self/mounts",
		"alternatives/editor": "/usr/bin/vim.basic",
		"ssl/certs/x.pem":     "/usr/share/ca-certificates/x.crt",
	} {
		if got, err := os.Readlink(filepath.Join(etc, p)); err != nil || got != want {
			t.Errorf("etc/%s -> %q, %v, want %q", p, got, err, want)
		}
	}
	for _, p := range []string{"root", "home", "work", "tmp"} {
		if ents, _ := os.ReadDir(filepath.Join(layer, p)); len(ents) != 0 {
			t.Errorf("layer %q is not empty", p)
		}
	}

	// Unchanged host: the same layer. A new top-level entry: a new layer
	// that hides it; the old one stays for sandboxes using it.
	again, err := s.Get(ctx, HostImage)
	must(t, err)
	if again.Lowers[0] != layer {
		t.Errorf("Get(host) rebuilt an unchanged layer: %q, then %q", layer, again.Lowers[0])
	}
	must(t, os.Mkdir(filepath.Join(host, "newtop"), 0o755))
	fresh, err := s.Get(ctx, HostImage)
	must(t, err)
	if fresh.Lowers[0] == layer {
		t.Fatalf("Get(host) kept layer %q after the host changed", layer)
	}
	if !isWhiteout(filepath.Join(fresh.Lowers[0], "newtop")) {
		t.Errorf("new layer does not hide newtop")
	}
	checkHides(t, fresh.Lowers[0], host)
	if _, err := os.Stat(layer); err != nil {
		t.Errorf("old layer removed: %v", err)
	}
	// A user added to /etc/passwd changes the layer too.
	write(t, filepath.Join(host, "etc/passwd"), "root:x:0:0:root:/root:/bin/bash\nsvc:x:500:500::/:/bin/false\n", 0o644)
	third, err := s.Get(ctx, HostImage)
	must(t, err)
	if b, _ := os.ReadFile(filepath.Join(third.Lowers[0], "etc/passwd")); !strings.Contains(string(b), "svc:x:500") {
		t.Errorf("layer not rebuilt after /etc/passwd changed: %s", b)
	}

	if err := s.Remove(ctx, HostImage); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Remove(host) = %v, want %v", err, errdefs.ErrFailedPrecondition)
	}
	list, err := s.List(ctx)
	must(t, err)
	if len(list) != 1 || list[0].Name != HostImage {
		t.Errorf("List = %+v, want just host", list)
	}
}

// TestHostOverlay mounts the real host image the way the runtime stacks it
// and checks what a sandbox would see.
func TestHostOverlay(t *testing.T) {
	testutil.RequiresRoot(t)
	testutil.RequiresFilesystem(t, "overlay")
	testutil.CheckLeaks(t)
	ctx := context.Background()
	s, _ := newStore(t)
	info, err := s.Get(ctx, HostImage)
	must(t, err)
	if len(info.Lowers) != 2 || info.Lowers[1] != "/" {
		t.Fatalf("Get(host) lowers = %q", info.Lowers)
	}
	checkHides(t, info.Lowers[0], "/")

	dir := t.TempDir()
	target, upper, work := filepath.Join(dir, "m"), filepath.Join(dir, "u"), filepath.Join(dir, "w")
	for _, d := range []string{target, upper, work} {
		must(t, os.Mkdir(d, 0o755))
	}
	opts := "lowerdir=" + info.Lowers[0] + ":/,upperdir=" + upper + ",workdir=" + work + ",redirect_dir=off,metacopy=off,index=off"
	if err := unix.Mount("overlay", target, "overlay", 0, opts); err != nil {
		t.Fatalf("mount overlay %q: %v", opts, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(target, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %q: %v", target, err)
		}
	})

	if fi, err := os.Stat(filepath.Join(target, "usr/bin/bash")); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("usr/bin/bash: %v, %v", fi, err)
	}
	if _, err := os.Stat(filepath.Join(target, "bin/sh")); err != nil {
		t.Errorf("bin/sh: %v", err)
	}
	for _, p := range []string{"etc/shadow", "etc/gshadow", "etc/ssh", "etc/sudoers"} {
		if _, err := os.Lstat(filepath.Join(target, p)); !os.IsNotExist(err) {
			t.Errorf("%s visible (%v)", p, err)
		}
	}
	if _, err := os.Stat(filepath.Join(target, "etc/passwd")); err != nil {
		t.Errorf("etc/passwd: %v", err)
	}
	for _, p := range []string{"root", "work", "home", "opt", "tmp"} {
		ents, err := os.ReadDir(filepath.Join(target, p))
		if err != nil || len(ents) != 0 {
			t.Errorf("%s = %d entries, %v; want an empty directory", p, len(ents), err)
		}
	}
	// The host's tools run in it, with its environment.
	run := func(args ...string) {
		t.Helper()
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Env, cmd.Dir = info.Env, "/"
		cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: target}
		if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "ok") {
			t.Errorf("chrooted %q = %q, %v", args, out, err)
		}
	}
	run("/usr/bin/bash", "-c", `cd /work && echo hi > /tmp/f && test "$(cat /tmp/f)" = hi && test "$HOME" = /root && echo ok`)
	run("/usr/bin/bash", "-c", "getent passwd root && getent passwd nobody && echo ok")
	if _, err := os.Stat("/usr/bin/python3"); err == nil {
		run("/usr/bin/python3", "-c", "import ssl, json, os; assert os.path.exists('/etc/ssl/certs'); print('ok')")
	}

	hostTop, err := os.ReadDir("/")
	must(t, err)
	fresh := map[string]bool{}
	for _, d := range hostFresh {
		fresh[d.name] = true
	}
	for _, e := range hostTop {
		if slices.Contains(hostAllowed, e.Name()) || fresh[e.Name()] {
			continue
		}
		if _, err := os.Lstat(filepath.Join(target, e.Name())); !os.IsNotExist(err) {
			t.Errorf("host-only %q visible in the sandbox (%v)", e.Name(), err)
		}
	}
}
