//go:build linux

package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/deltabox/deltabox/internal/procfs"
)

// captureShell prints a bash script that recreates the calling shell's state
// in a fresh bash: cwd, variables (exported or not, arrays, attributes; the
// shell's own read-only and dynamic ones skipped), functions, aliases, shopt
// and set options, traps and umask. It runs inline in the session (not in a
// function, so declare sees globals) and cleans up its own variables. It
// forks twice (the compgen lists), not once per variable: it is on the
// checkpoint's path.
const captureShell = `printf 'cd -- %q 2>/dev/null\n' "$PWD"
for __dbx_v in $(compgen -v); do
  case $__dbx_v in
    __dbx_*|BASH|BASH_*|BASHOPTS|BASHPID|FUNCNAME|PIPESTATUS|RANDOM|SRANDOM|LINENO|SECONDS|EPOCHREALTIME|EPOCHSECONDS|HISTCMD|GROUPS|DIRSTACK|PPID|UID|EUID|SHELLOPTS|SHLVL|_|PWD|COMP_*|OPTIND|OPTARG) continue;;
  esac
  case ${!__dbx_v@a} in *r*) continue;; esac
  declare -p "$__dbx_v" 2>/dev/null
done
for __dbx_v in $(compgen -A function); do
  case $__dbx_v in __dbx_*) ;; *) declare -f "$__dbx_v";; esac
done
alias -p
shopt -p
set +o
trap -p
umask -p
unset __dbx_v
`

// ShellState captures the state of the sandbox's shell session as a script
// that ReplayShellState runs in a fresh session. ok is false when no shell
// session runs. The session must be idle: the call waits for it.
func (s *Sandbox) ShellState(ctx context.Context) (script string, ok bool, err error) {
	s.mu.Lock()
	_, running := s.sess[SessionShell]
	pending, replaying := s.replay[SessionShell]
	s.mu.Unlock()
	if !running && replaying {
		// Restored and not used since: its state is the replay script.
		return pending, true, nil
	}
	if !running {
		return "", false, nil
	}
	ss, err := s.lockSession(ctx, SessionShell)
	if err != nil {
		return "", false, fmt.Errorf("capture shell state: %w", err)
	}
	defer ss.mu.Unlock()
	s.mu.Lock()
	script, cached := s.shellScript, s.shellOf == ss
	s.mu.Unlock()
	if cached {
		// Read when its clone was made ahead, and it has not been called
		// since: reading it again would run it, and void the clone.
		return script, true, nil
	}
	s.dropAhead() // it runs
	if script, err = s.captureShell(ctx, ss); err != nil {
		return "", false, err
	}
	return script, true, nil
}

// captureShell runs the capture of the shell session ss, whose lock the
// caller holds, and keeps the script for ShellState until the session is
// called again.
func (s *Sandbox) captureShell(ctx context.Context, ss *session) (string, error) {
	var out, errb bytes.Buffer
	res, alive, err := ss.call(ctx, s, SessionRequest{Kind: SessionShell, Code: captureShell, Stdout: &out, Stderr: &errb, Timeout: 30 * time.Second})
	if !alive {
		s.dropSession(ss)
	}
	if err == nil && !alive {
		err = errors.New("the session ended")
	}
	if err != nil {
		return "", fmt.Errorf("capture shell state: %w", err)
	}
	if res.ExitCode != 0 && out.Len() == 0 {
		return "", fmt.Errorf("capture shell state: exit %d: %s", res.ExitCode, strings.TrimSpace(errb.String()))
	}
	s.mu.Lock()
	s.shellOf, s.shellScript = ss, out.String()
	s.mu.Unlock()
	return out.String(), nil
}

// ReplayShellState arranges for the shell session to come back with the
// state a ShellState script describes. The replay is lazy: the session is
// started, and the script run, just before the session's next call (or the
// next ShellState), so a restore does not wait for a bash to start.
func (s *Sandbox) ReplayShellState(ctx context.Context, script string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss, ok := s.sess[SessionShell]; ok {
		// A running session would keep its own state: replace it.
		delete(s.sess, SessionShell)
		go func() { ss.kill(); s.deleteChild(ss.p.cg) }()
	}
	s.replay[SessionShell] = script
	return nil
}

// replayPending runs a pending replay script in the fresh session ss.
func (s *Sandbox) replayPending(ctx context.Context, ss *session) error {
	s.mu.Lock()
	script, ok := s.replay[ss.kind]
	delete(s.replay, ss.kind)
	s.mu.Unlock()
	if !ok {
		return nil
	}
	var errb bytes.Buffer
	res, alive, err := ss.call(ctx, s, SessionRequest{Kind: ss.kind, Code: script, Stderr: &errb, Timeout: 30 * time.Second})
	if err == nil && !alive {
		err = fmt.Errorf("session died (exit %d): %s", res.ExitCode, strings.TrimSpace(errb.String()))
	}
	if err != nil {
		return fmt.Errorf("replay %s state: %w", ss.kind, err)
	}
	return nil
}

// Process is a workload process as the host sees it.
type Process struct {
	Pid     int // host pid
	Cmdline string
	Session SessionKind // SessionUnknown for processes that are no session
}

// Processes lists the sandbox's processes other than its init.
func (s *Sandbox) Processes() ([]Process, error) {
	pids, err := s.cg.Procs()
	if err != nil {
		return nil, err
	}
	// A session's processes are those of its cgroup (the pid the init
	// reports is the one inside the sandbox's pid namespace).
	s.mu.Lock()
	sessions := map[SessionKind]*session{}
	for k, ss := range s.sess {
		sessions[k] = ss
	}
	s.mu.Unlock()
	sessionOf := map[int]SessionKind{}
	for k, ss := range sessions {
		if sp, err := ss.p.cg.Procs(); err == nil {
			for _, p := range sp {
				sessionOf[p] = k
			}
		}
	}
	inits := s.initPids()
	var out []Process
	for _, pid := range pids {
		if inits[pid] || (sessionOf[pid] == SessionUnknown && s.notWorkload(pid, inits)) {
			continue // ours, or on its way out
		}
		out = append(out, Process{Pid: pid, Cmdline: procfs.Cmdline(pid), Session: sessionOf[pid]})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Pid < out[j].Pid })
	return out, nil
}
