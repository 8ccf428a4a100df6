//go:build linux

// Package sysinfo probes what the machine offers DeltaBox (kernel, cgroups,
// filesystems, namespaces, CRIU, seccomp), for `deltabox info`, for choosing
// backends and for test gates.
//
// [Probe] caches nothing: each call looks again. Its probes run in parallel;
// `criu check` dominates (it re-probes the kernel each run: 50-250 ms on a
// busy 2-core VM), the rest takes about 10 ms. Callers on a hot path (test
// gates) pass [SkipCRIUCheck].
package sysinfo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/internal/sandbox/cgroup"
)

// Info is what Probe found.
type Info struct {
	Arch          string      // GOARCH
	Kernel        string      // release, as uname -r
	KernelVersion [3]int      // major, minor, patch
	CgroupMode    cgroup.Mode // v1, hybrid or v2
	// Overlay: the kernel has overlayfs. LowerdirPlus: it takes the
	// "lowerdir+" mount option (one layer per fsconfig call, so no limit
	// from the page-sized option string): Linux 6.8.
	Overlay      bool
	LowerdirPlus bool
	// Btrfs: the kernel has btrfs and mkfs.btrfs is installed.
	Btrfs bool
	// IDMappedMounts: mount_setattr(MOUNT_ATTR_IDMAP), Linux 5.12 (by
	// version; not every filesystem supports it).
	IDMappedMounts bool
	// UserNamespaces: a process could be started in a new user namespace.
	UserNamespaces bool
	Seccomp        bool // seccomp filters that can kill a process
	CRIU           CRIU
	// Problems are probes that failed in an unexpected way (not "absent").
	Problems []string
}

// CRIU is what is known of the criu binary.
type CRIU struct {
	Path    string // "" if not found
	Version string // "4.1.1"
	Checked bool   // `criu check` ran (see SkipCRIUCheck)
	Check   bool   // `criu check` said "Looks good"
	// Usable: version ≥ 4 and, if it ran, the check passed. (Debian 12's
	// criu 3.17 cannot dump on this kernel: see criu.md.)
	Usable bool
}

// KernelAtLeast reports whether the probed kernel is at least major.minor.
func (i Info) KernelAtLeast(major, minor int) bool {
	v := i.KernelVersion
	return v[0] > major || (v[0] == major && v[1] >= minor)
}

// String renders i as aligned "key: value" lines, for `deltabox info`.
func (i Info) String() string {
	var b strings.Builder
	row := func(k string, v any) { fmt.Fprintf(&b, "%-16s %v\n", k+":", v) }
	yes := func(ok bool) string {
		if ok {
			return "yes"
		}
		return "no"
	}
	row("kernel", i.Kernel+" ("+i.Arch+")")
	row("cgroups", i.CgroupMode)
	row("overlay", yes(i.Overlay)+", lowerdir+ "+yes(i.LowerdirPlus))
	row("btrfs", yes(i.Btrfs))
	row("idmapped mounts", yes(i.IDMappedMounts))
	row("user namespaces", yes(i.UserNamespaces))
	row("seccomp", yes(i.Seccomp))
	switch {
	case i.CRIU.Path == "":
		row("criu", "not found")
	default:
		check := "skipped"
		if i.CRIU.Checked {
			check = yes(i.CRIU.Check)
		}
		row("criu", fmt.Sprintf("%s %s, check %s, usable %s", i.CRIU.Path, i.CRIU.Version, check, yes(i.CRIU.Usable)))
	}
	for _, p := range i.Problems {
		row("problem", p)
	}
	return b.String()
}

type config struct{ criuCheck bool }

// Opt configures Probe.
type Opt func(*config)

// SkipCRIUCheck skips `criu check`, the slow probe: CRIU's usability then
// rests on its version alone.
func SkipCRIUCheck() Opt { return func(c *config) { c.criuCheck = false } }

// Probe looks at the machine. Probes that need a process (user namespaces,
// criu) run in parallel and are bounded by ctx and by a few seconds.
func Probe(ctx context.Context, opts ...Opt) Info {
	cfg := config{criuCheck: true}
	for _, o := range opts {
		o(&cfg)
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	info := Info{Arch: runtime.GOARCH}
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex // guards problems, appended to by the goroutines below
		problems []string
	)
	problem := func(format string, args ...any) {
		mu.Lock()
		problems = append(problems, fmt.Sprintf(format, args...))
		mu.Unlock()
	}

	var userns bool
	wg.Add(1)
	go func() {
		defer wg.Done()
		var err error
		if userns, err = probeUserns(ctx); err != nil && !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.ENOSPC) {
			problem("user namespaces: %v", err)
		}
	}()
	var criu CRIU
	wg.Add(1)
	go func() {
		defer wg.Done()
		criu = probeCRIU(ctx, cfg.criuCheck)
	}()

	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		problem("uname: %v", err)
	}
	info.Kernel = unix.ByteSliceToString(u.Release[:])
	info.KernelVersion = parseRelease(info.Kernel)
	mode, err := cgroup.DetectMode("")
	if err != nil {
		problem("cgroups: %v", err)
	}
	info.CgroupMode = mode
	fss, err := os.ReadFile("/proc/filesystems")
	if err != nil {
		problem("filesystems: %v", err)
	}
	info.Overlay = hasFS(fss, "overlay", info.Kernel)
	info.LowerdirPlus = info.Overlay && info.KernelAtLeast(6, 8)
	info.Btrfs = hasFS(fss, "btrfs", info.Kernel) && findBinary("mkfs.btrfs") != ""
	info.IDMappedMounts = info.KernelAtLeast(5, 12)
	info.Seccomp = seccompKill()

	wg.Wait()
	info.UserNamespaces = userns
	info.CRIU = criu
	info.Problems = problems
	return info
}

// parseRelease reads "6.18.44-fc-v782" as [6 18 44].
func parseRelease(rel string) [3]int {
	var v [3]int
	for i, part := range strings.SplitN(rel, ".", 3) {
		end := strings.IndexFunc(part, func(r rune) bool { return r < '0' || r > '9' })
		if end >= 0 {
			part = part[:end]
		}
		v[i], _ = strconv.Atoi(part)
		if end >= 0 {
			break
		}
	}
	return v
}

// hasFS reports whether the kernel has fstype built in, loaded, or as a
// module it can load on first mount.
func hasFS(filesystems []byte, fstype, release string) bool {
	for _, line := range strings.Split(string(filesystems), "\n") {
		if f := strings.Fields(line); len(f) > 0 && f[len(f)-1] == fstype {
			return true
		}
	}
	mods, _ := os.ReadFile("/lib/modules/" + release + "/modules.dep")
	return bytes.Contains(mods, []byte("/"+fstype+".ko"))
}

// findBinary looks on PATH, then in the sbin directories a non-root PATH
// may lack.
func findBinary(name string) string {
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	for _, dir := range []string{"/usr/local/sbin", "/usr/sbin", "/sbin"} {
		if st, err := os.Stat(dir + "/" + name); err == nil && st.Mode()&0o111 != 0 {
			return dir + "/" + name
		}
	}
	return ""
}

// probeUserns starts /bin/true in a new user namespace: the sysctls that
// forbid it differ between distributions, so try it.
func probeUserns(ctx context.Context) (bool, error) {
	cmd := exec.CommandContext(ctx, "/bin/true")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER}
	if err := cmd.Run(); err != nil {
		return false, err
	}
	return true, nil
}

// seccompKill asks the kernel whether filters can kill a process.
func seccompKill() bool {
	action := uint32(unix.SECCOMP_RET_KILL_PROCESS)
	_, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_GET_ACTION_AVAIL, 0, uintptr(unsafe.Pointer(&action)))
	return e == 0
}

func probeCRIU(ctx context.Context, check bool) CRIU {
	var c CRIU
	if c.Path = findBinary("criu"); c.Path == "" {
		return c
	}
	var wg sync.WaitGroup
	if check {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, _ := exec.CommandContext(ctx, c.Path, "check").CombinedOutput()
			c.Checked, c.Check = true, bytes.Contains(out, []byte("Looks good"))
		}()
	}
	out, err := exec.CommandContext(ctx, c.Path, "--version").Output()
	if err == nil {
		for _, line := range strings.Split(string(out), "\n") {
			if v, ok := strings.CutPrefix(line, "Version:"); ok {
				c.Version = strings.TrimSpace(v)
			}
		}
	}
	wg.Wait()
	c.Usable = parseRelease(c.Version)[0] >= 4 && (c.Check || !c.Checked)
	return c
}
