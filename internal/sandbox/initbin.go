//go:build linux

package sandbox

import (
	"debug/buildinfo"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"syscall"
)

// InitBinaryName is the init-only binary (cmd/deltabox-init) a runtime
// looks for beside its own executable.
const InitBinaryName = "deltabox-init"

// WithInitBinary has the runtime start inits from path (cmd/deltabox-init)
// instead of looking beside its own executable; "" re-executes the running
// binary.
func WithInitBinary(path string) RuntimeOpt {
	return func(r *Runtime) { r.initBin, r.initBinSet = path, true }
}

// resolveInit picks the binary every generation's init boots from. Every
// checkpoint, restore and fork starts one, so its boot is on the path of
// forks and behind every spare: deltabox-init, which links only the init's
// packages (a static binary), boots on about a third of the CPU of a
// re-execution of the daemon binary (measured here, side by side: 15 vs 41
// ms to reach main). It is used when it sits beside the running
// executable, was built from the same source, only root may have written it
// or its directories, and the sandbox's root (an unprivileged host uid) can
// reach and execute it; otherwise the running binary is re-executed through /proc/self/exe,
// which every binary that starts sandboxes supports (see initproc.IsInit).
func (r *Runtime) resolveInit() {
	path := r.initBin
	if !r.initBinSet {
		exe, err := os.Executable()
		if err != nil {
			return
		}
		path = filepath.Join(filepath.Dir(exe), InitBinaryName)
		if _, err := os.Stat(path); err != nil {
			return // not installed: the common case of tests and go run
		}
	}
	if path == "" {
		return
	}
	if err := usableInit(path); err != nil {
		r.log.Warn("init binary not used; re-executing the daemon's binary as init", "path", path, "err", err)
		return
	}
	r.exe = path
}

// usableInit checks that path is a regular file every user may execute, in
// directories every user may traverse, owned and writable by root alone
// (directories: or sticky), built from the same revision as the running
// binary.
func usableInit(path string) error {
	abs, err := filepath.Abs(path)
	if err != nil {
		return err
	}
	st, err := os.Stat(abs)
	if err != nil {
		return err
	}
	if !st.Mode().IsRegular() || st.Mode().Perm()&0o005 != 0o005 {
		return fmt.Errorf("not a file every user may read and execute (%v)", st.Mode())
	}
	// Every sandbox runs it as pid 1: only root may have written it, or
	// replaced it in its directories (a sticky one, like /tmp, is fine).
	if err := rootOnly(abs, st, false); err != nil {
		return err
	}
	for d := filepath.Dir(abs); ; d = filepath.Dir(d) {
		ds, err := os.Stat(d)
		if err != nil {
			return err
		}
		if ds.Mode().Perm()&0o001 == 0 {
			return fmt.Errorf("directory %s is not traversable by every user", d)
		}
		if err := rootOnly(d, ds, true); err != nil {
			return err
		}
		if d == "/" {
			break
		}
	}
	theirs, err := buildinfo.ReadFile(abs)
	if err != nil {
		return fmt.Errorf("read its build info: %w", err)
	}
	ours, ok := debug.ReadBuildInfo()
	if !ok {
		return fmt.Errorf("the running binary has no build info")
	}
	if a, b := buildStamp(ours), buildStamp(theirs); a != b {
		return fmt.Errorf("built from another source (%s, the daemon %s): build both together", b, a)
	}
	return nil
}

// buildStamp identifies the source a binary was built from, as far as the Go
// toolchain records it.
func buildStamp(bi *debug.BuildInfo) string {
	s := bi.GoVersion
	for _, kv := range bi.Settings {
		switch kv.Key {
		case "vcs.revision", "vcs.modified", "vcs.time":
			s += " " + kv.Key + "=" + kv.Value
		}
	}
	return s
}

// rootOnly checks that path is owned by root and that nobody else may write
// it (a sticky directory excepted).
func rootOnly(path string, st os.FileInfo, dir bool) error {
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok || sys.Uid != 0 {
		return fmt.Errorf("%s is not owned by root", path)
	}
	if st.Mode().Perm()&0o022 != 0 && !(dir && st.Mode()&os.ModeSticky != 0) {
		return fmt.Errorf("%s is writable by others than root (%v)", path, st.Mode())
	}
	return nil
}
