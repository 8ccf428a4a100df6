//go:build linux

package sysinfo

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/deltabox/deltabox/internal/sandbox/cgroup"
)

func TestParseRelease(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want [3]int
	}{
		{"6.18.44-fc-v782", [3]int{6, 18, 44}},
		{"5.15.0-91-generic", [3]int{5, 15, 0}},
		{"6.8", [3]int{6, 8, 0}},
		{"6.1-rc3", [3]int{6, 1, 0}},
		{"4.1.1", [3]int{4, 1, 1}},
		{"", [3]int{}},
	} {
		if got := parseRelease(tc.in); got != tc.want {
			t.Errorf("parseRelease(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

// TestProbe sanity-checks the probe against what this machine is known to
// offer, derived independently where that is cheap.
func TestProbe(t *testing.T) {
	info := Probe(context.Background())
	t.Logf("\n%s", info)
	if len(info.Problems) > 0 {
		t.Errorf("Problems = %q", info.Problems)
	}
	if info.Kernel == "" || info.KernelVersion[0] < 3 {
		t.Errorf("Kernel = %q %v", info.Kernel, info.KernelVersion)
	}
	if info.LowerdirPlus != (info.Overlay && info.KernelAtLeast(6, 8)) {
		t.Errorf("LowerdirPlus = %v with overlay %v on %s", info.LowerdirPlus, info.Overlay, info.Kernel)
	}
	if info.IDMappedMounts != info.KernelAtLeast(5, 12) {
		t.Errorf("IDMappedMounts = %v on %s", info.IDMappedMounts, info.Kernel)
	}
	fss, _ := os.ReadFile("/proc/filesystems")
	if strings.Contains(string(fss), "\toverlay\n") && !info.Overlay {
		t.Errorf("Overlay = false with overlay in /proc/filesystems")
	}
	if m, err := cgroup.DetectMode(""); err == nil && info.CgroupMode != m {
		t.Errorf("CgroupMode = %v, want %v", info.CgroupMode, m)
	}
	if _, err := os.Stat("/proc/self/ns/user"); err == nil && os.Geteuid() == 0 && !info.UserNamespaces {
		t.Errorf("UserNamespaces = false for root on a kernel with user namespaces")
	}
	if !info.Seccomp {
		t.Errorf("Seccomp = false")
	}
	if info.CRIU.Path != "" && !info.CRIU.Checked {
		t.Errorf("CRIU = %+v: check did not run", info.CRIU)
	}
	if info.CRIU.Usable && (info.CRIU.Path == "" || !info.CRIU.Check || !strings.HasPrefix(info.CRIU.Version, "4")) {
		t.Errorf("CRIU = %+v: usable without a path, a passing check or version 4", info.CRIU)
	}
	// On a machine set up by scripts/setup.sh (CI), CRIU 4 is installed.
	if os.Getenv("DELTABOX_REQUIRE_ALL") == "1" && os.Geteuid() == 0 && !info.CRIU.Usable {
		t.Errorf("CRIU = %+v, want usable after scripts/setup.sh", info.CRIU)
	}
	if _, err := exec.LookPath("mkfs.btrfs"); err == nil && strings.Contains(string(fss), "btrfs") && !info.Btrfs {
		t.Errorf("Btrfs = false with btrfs in the kernel and mkfs.btrfs on PATH")
	}
	// This machine (the project's kind): kernel 6.18, hybrid cgroups.
	if info.KernelAtLeast(6, 8) && info.Overlay && !info.LowerdirPlus {
		t.Errorf("kernel %s ≥ 6.8 with overlay but LowerdirPlus = false", info.Kernel)
	}
}

func TestProbeSkipCRIUCheck(t *testing.T) {
	full, fast := Probe(context.Background()), Probe(context.Background(), SkipCRIUCheck())
	if fast.CRIU.Checked || fast.CRIU.Check {
		t.Errorf("SkipCRIUCheck: CRIU = %+v, want the check not run", fast.CRIU)
	}
	if fast.CRIU.Path != full.CRIU.Path || fast.CRIU.Version != full.CRIU.Version {
		t.Errorf("SkipCRIUCheck: CRIU = %+v, full probe %+v", fast.CRIU, full.CRIU)
	}
	if full.CRIU.Usable && !fast.CRIU.Usable {
		t.Errorf("SkipCRIUCheck: usable criu reads unusable")
	}
}

func BenchmarkProbe(b *testing.B) {
	for b.Loop() {
		Probe(context.Background())
	}
}

func BenchmarkProbeSkipCRIUCheck(b *testing.B) {
	for b.Loop() {
		Probe(context.Background(), SkipCRIUCheck())
	}
}
