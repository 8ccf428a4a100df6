//go:build linux

package image

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/safefs"
)

// The host image is [generated layer, host "/"]. The generated layer decides
// what a sandbox sees of the host: the entries of hostAllowed come through
// from "/", every other top-level entry is hidden, and the directories of
// hostFresh are provided empty (opaque) except etc, which is generated.
//
// # Why the layer may live on a tmpfs
//
// Overlay refuses a lower that lies below another lower's root ("overlapping
// lowerdir path"), and "/" is a lower here: the generated layer must be on
// another filesystem than the host root. When root/host is on the host
// root's filesystem, the store mounts a small tmpfs there (hostLayerFS). The
// layer is then rebuilt after a reboot, which is fine: it is derived from the
// host, and its path depends only on the host's fingerprint.

// generatorVersion changes whenever the layer's content rules change, so
// that layers built by an older daemon are rebuilt.
const generatorVersion = "deltabox-host-layer-1"

// hostAllowed are the host's top-level entries the host image shows.
var hostAllowed = []string{"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"}

// hostFresh are the top-level directories the generated layer provides,
// opaque, with their modes.
var hostFresh = []struct {
	name string
	mode os.FileMode
}{
	{"etc", 0o755}, {"tmp", fs.ModeSticky | 0o777}, {"work", 0o755}, {"root", 0o700}, {"home", 0o755},
	{"var", 0o755}, {"run", 0o755}, {"dev", 0o755}, {"proc", 0o755}, {"sys", 0o755},
	{"mnt", 0o755}, {"opt", 0o755}, {"srv", 0o755}, {"media", 0o755},
}

// etcCopied are the host /etc entries the generated /etc copies (files as
// files, symlinks as symlinks, directories recursively). Missing ones are
// skipped.
var etcCopied = []string{
	"nsswitch.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl",
	"ca-certificates.conf", "perl", "bash.bashrc", "profile", "profile.d", "environment",
	"localtime", "timezone", "mime.types", "inputrc", "os-release", "debian_version", "shells",
	"protocols", "services", "gai.conf", "host.conf", "login.defs", "gitconfig", "magic",
	"magic.mime", "resolv.conf",
}

// etcNever are names never copied, at any depth: secrets, and what would let
// a sandbox user act as another (sudo, ssh host keys).
func etcNever(name string) bool {
	switch name {
	case "shadow", "shadow-", "gshadow", "gshadow-", "ssh", "private", "opasswd", "security":
		return true
	}
	return strings.HasPrefix(name, "sudoers")
}

const (
	overlayOpaque = "trusted.overlay.opaque"
	// maxEtcFile bounds a copied /etc file (ld.so.cache is the big one).
	maxEtcFile = 64 << 20
)

func (s *store) hostInfo(ctx context.Context) (Info, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	layer, created, err := s.hostLayer(ctx)
	if err != nil {
		return Info{}, fmt.Errorf("get image %q: %w", HostImage, err)
	}
	return Info{
		Name:    HostImage,
		Kind:    KindHost,
		Created: created,
		Lowers:  []string{layer, s.cfg.hostRoot},
		Env:     slices.Clone(hostEnv),
	}, nil
}

// hostLayer returns the current generated layer, building it when missing or
// when the host changed. Older layers are left in place: sandboxes may have
// them mounted. The caller holds s.mu.
func (s *store) hostLayer(ctx context.Context) (string, time.Time, error) {
	if err := s.hostLayerFS(); err != nil {
		return "", time.Time{}, err
	}
	fp, err := hostFingerprint(s.cfg.hostRoot)
	if err != nil {
		return "", time.Time{}, err
	}
	dir := filepath.Join(s.hostDir(), "layer-"+fp)
	if fi, err := os.Stat(dir); err == nil {
		return dir, fi.ModTime(), nil
	}
	tmp, err := os.MkdirTemp(s.hostDir(), ".build-")
	if err != nil {
		return "", time.Time{}, err
	}
	if err := buildHostLayer(ctx, s.cfg.hostRoot, tmp); err != nil {
		os.RemoveAll(tmp)
		return "", time.Time{}, fmt.Errorf("build host layer: %w", err)
	}
	if err := syncFS(tmp); err != nil {
		os.RemoveAll(tmp)
		return "", time.Time{}, err
	}
	if err := os.Rename(tmp, dir); err != nil {
		os.RemoveAll(tmp)
		return "", time.Time{}, err
	}
	if err := syncDir(s.hostDir()); err != nil {
		return "", time.Time{}, err
	}
	fi, err := os.Stat(dir)
	if err != nil {
		return "", time.Time{}, err
	}
	return dir, fi.ModTime(), nil
}

// hostLayerFS makes sure root/host is on another filesystem than the host
// root, mounting a tmpfs there if needed (see the type's doc). The caller
// holds s.mu.
func (s *store) hostLayerFS() error {
	var hst, rst unix.Stat_t
	if err := unix.Stat(s.cfg.hostRoot, &rst); err != nil {
		return fmt.Errorf("stat host root %q: %w", s.cfg.hostRoot, err)
	}
	if err := unix.Stat(s.hostDir(), &hst); err != nil {
		return fmt.Errorf("stat %q: %w", s.hostDir(), err)
	}
	if hst.Dev != rst.Dev {
		// Already on its own filesystem. If that is the tmpfs a previous
		// daemon mounted (and died without detaching), adopt it so that
		// Close detaches it.
		var fs unix.Statfs_t
		if unix.Statfs(s.hostDir(), &fs) == nil && fs.Type == unix.TMPFS_MAGIC {
			s.hostMounted = true
		}
		return nil
	}
	// A previous daemon's tmpfs would have another dev: this is a plain
	// directory of the host root's filesystem. Clear what an older layout
	// left there, then mount.
	ents, _ := os.ReadDir(s.hostDir())
	for _, e := range ents {
		os.RemoveAll(filepath.Join(s.hostDir(), e.Name()))
	}
	if err := unix.Mount("deltabox-host", s.hostDir(), "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0700,size=256m"); err != nil {
		return fmt.Errorf("mount tmpfs for the host layer on %q: %w", s.hostDir(), err)
	}
	s.hostMounted = true
	return nil
}

// hostFingerprint hashes what the layer is derived from: the host's
// top-level entries, the /etc entries copied, and the generator's version.
// It is cheap (a few dozen lstats) so Get can run it every time.
func hostFingerprint(hostRoot string) (string, error) {
	h := sha256.New()
	io.WriteString(h, generatorVersion+"\n")
	ents, err := os.ReadDir(hostRoot)
	if err != nil {
		return "", fmt.Errorf("read host root %q: %w", hostRoot, err)
	}
	for _, e := range ents {
		fmt.Fprintf(h, "top %q %v\n", e.Name(), e.Type())
	}
	etc := filepath.Join(hostRoot, "etc")
	for _, name := range append([]string{".", "passwd", "group"}, etcCopied...) {
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(etc, name), &st); err != nil {
			fmt.Fprintf(h, "etc %q missing\n", name)
			continue
		}
		fmt.Fprintf(h, "etc %q %o %d %d.%d\n", name, st.Mode, st.Size, st.Mtim.Sec, st.Mtim.Nsec)
	}
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

// buildHostLayer fills the empty directory dst with the generated layer.
func buildHostLayer(ctx context.Context, hostRoot, dst string) error {
	if err := setMeta(dst, 0o755); err != nil {
		return err
	}
	fresh := map[string]bool{}
	for _, d := range hostFresh {
		fresh[d.name] = true
		p := filepath.Join(dst, d.name)
		if err := os.Mkdir(p, 0o700); err != nil {
			return err
		}
		if err := setMeta(p, d.mode); err != nil {
			return err
		}
		if err := unix.Lsetxattr(p, overlayOpaque, []byte("y"), 0); err != nil {
			return fmt.Errorf("mark %q opaque: %w", d.name, err)
		}
	}
	ents, err := os.ReadDir(hostRoot)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if slices.Contains(hostAllowed, e.Name()) || fresh[e.Name()] {
			continue
		}
		// A whiteout: a 0:0 character device hides the lower entry.
		if err := unix.Mknod(filepath.Join(dst, e.Name()), unix.S_IFCHR, 0); err != nil {
			return fmt.Errorf("whiteout %q: %w", e.Name(), err)
		}
	}
	varDirs := []struct {
		name string
		mode os.FileMode
	}{{"var/tmp", fs.ModeSticky | 0o777}, {"var/lib", 0o755}, {"var/cache", 0o755}, {"var/log", 0o755}}
	for _, d := range varDirs {
		p := filepath.Join(dst, d.name)
		if err := os.Mkdir(p, 0o700); err != nil {
			return err
		}
		if err := setMeta(p, d.mode); err != nil {
			return err
		}
	}
	for name, target := range map[string]string{"var/run": "../run", "var/lock": "../run/lock"} {
		if err := symlinkRoot(target, filepath.Join(dst, name)); err != nil {
			return err
		}
	}
	return buildEtc(ctx, hostRoot, filepath.Join(dst, "etc"))
}

// setMeta sets an exact mode (umask and setuid-clearing chown aside) and
// root ownership.
func setMeta(p string, mode os.FileMode) error {
	if err := os.Lchown(p, 0, 0); err != nil {
		return err
	}
	return os.Chmod(p, mode)
}

func symlinkRoot(target, p string) error {
	if err := os.Symlink(target, p); err != nil {
		return err
	}
	return os.Lchown(p, 0, 0)
}

func writeRoot(p string, data []byte, mode os.FileMode) error {
	if err := os.WriteFile(p, data, 0o600); err != nil {
		return err
	}
	return setMeta(p, mode)
}

// buildEtc generates dst (an empty directory) from the host's /etc.
func buildEtc(ctx context.Context, hostRoot, dst string) error {
	// Read the host's /etc confined to the host root, so that a fake host
	// root in tests, or an absolute symlink such as resolv.conf, resolves
	// inside it.
	host, err := safefs.Open(hostRoot, safefs.IDMap{})
	if err != nil {
		return err
	}
	defer host.Close()
	read := func(name string) ([]byte, error) {
		var buf bytes.Buffer
		_, err := host.ReadFile(ctx, "/etc/"+name, &buf, maxEtcFile)
		return buf.Bytes(), err
	}

	passwd, err := read("passwd")
	if err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	users, passwdOut := filterPasswd(passwd)
	group, err := read("group")
	if err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	generated := map[string][]byte{
		"passwd": passwdOut,
		"group":  filterGroup(group, users),
		"hosts":  []byte("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"),
	}
	// resolv.conf is often a symlink into /run, which the sandbox does not
	// share: copy its content.
	if b, err := read("resolv.conf"); err == nil {
		generated["resolv.conf"] = b
	} else if !errdefs.IsNotFound(err) {
		return err
	}
	for name, b := range generated {
		if err := writeRoot(filepath.Join(dst, name), b, 0o644); err != nil {
			return err
		}
	}
	if err := symlinkRoot("../proc/self/mounts", filepath.Join(dst, "mtab")); err != nil {
		return err
	}

	names := slices.Clone(etcCopied)
	if py, err := filepath.Glob(filepath.Join(hostRoot, "etc", "python3*")); err == nil {
		for _, p := range py {
			names = append(names, filepath.Base(p))
		}
	}
	for _, name := range names {
		if _, done := generated[name]; done {
			continue
		}
		if err := copyTree(ctx, filepath.Join(hostRoot, "etc", name), filepath.Join(dst, name)); err != nil {
			return err
		}
	}
	return nil
}

// copyTree copies src to dst: directories recursively, regular files by
// content, symlinks as symlinks; everything owned by root. It skips what
// etcNever names, any other file type, and files holding a private key.
func copyTree(ctx context.Context, src, dst string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if etcNever(filepath.Base(src)) {
		return nil
	}
	fi, err := os.Lstat(src)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		t, err := os.Readlink(src)
		if err != nil {
			return err
		}
		return symlinkRoot(t, dst)
	case fi.IsDir():
		if err := os.Mkdir(dst, 0o700); err != nil {
			return err
		}
		ents, err := os.ReadDir(src)
		if err != nil {
			return err
		}
		for _, e := range ents {
			if err := copyTree(ctx, filepath.Join(src, e.Name()), filepath.Join(dst, e.Name())); err != nil {
				return err
			}
		}
		return setMeta(dst, fi.Mode()&(fs.ModePerm|fs.ModeSticky|fs.ModeSetgid))
	case fi.Mode().IsRegular():
		if fi.Size() > maxEtcFile {
			return nil
		}
		b, err := os.ReadFile(src)
		if errors.Is(err, os.ErrPermission) {
			return nil
		}
		if err != nil {
			return err
		}
		if bytes.Contains(b, []byte("PRIVATE KEY-----")) {
			return nil
		}
		return writeRoot(dst, b, fi.Mode()&fs.ModePerm)
	}
	return nil
}

// filterPasswd keeps root, nobody and the system accounts (uid < 1000) and
// drops any non-root account whose passwd entry holds a password hash itself;
// the password field is always "x" (no shadow file exists, so no password
// works). It returns the names kept and the new file.
func filterPasswd(b []byte) (map[string]bool, []byte) {
	users := map[string]bool{}
	var out bytes.Buffer
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Split(sc.Text(), ":")
		if len(f) != 7 || f[0] == "" || users[f[0]] {
			continue
		}
		uid, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil || (uid >= 1000 && uid != 65534) {
			continue
		}
		if uid != 0 && !noPassword(f[1]) {
			continue
		}
		f[1] = "x"
		users[f[0]] = true
		out.WriteString(strings.Join(f, ":") + "\n")
	}
	if !users["root"] {
		out.WriteString("root:x:0:0:root:/root:/bin/bash\n")
		users["root"] = true
	}
	if !users["nobody"] {
		out.WriteString("nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
		users["nobody"] = true
	}
	return users, out.Bytes()
}

// noPassword says whether a passwd password field holds no hash.
func noPassword(pw string) bool {
	return pw == "" || pw == "x" || pw == "*" || strings.HasPrefix(pw, "!")
}

// filterGroup keeps the system groups (gid < 1000) and nogroup, with members
// limited to the users kept.
func filterGroup(b []byte, users map[string]bool) []byte {
	seen := map[string]bool{}
	var out bytes.Buffer
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Split(sc.Text(), ":")
		if len(f) != 4 || f[0] == "" || seen[f[0]] {
			continue
		}
		gid, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil || (gid >= 1000 && gid != 65534) {
			continue
		}
		var members []string
		for _, m := range strings.Split(f[3], ",") {
			if users[m] {
				members = append(members, m)
			}
		}
		f[1] = "x"
		f[3] = strings.Join(members, ",")
		seen[f[0]] = true
		out.WriteString(strings.Join(f, ":") + "\n")
	}
	if !seen["root"] {
		out.WriteString("root:x:0:\n")
	}
	if !seen["nogroup"] {
		out.WriteString("nogroup:x:65534:\n")
	}
	return out.Bytes()
}
