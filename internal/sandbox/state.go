//go:build linux

package sandbox

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"
)

// captureShell prints a bash script that recreates the calling shell's state
// in a fresh bash: cwd, variables (exported or not, arrays, attributes; the
// shell's own read-only and dynamic ones skipped), functions, aliases, shopt
// and set options, traps and umask. It runs inline in the session (not in a
// function, so declare sees globals) and cleans up its own variables.
const captureShell = `printf 'cd -- %q 2>/dev/null\n' "$PWD"
for __dbx_v in $(compgen -v); do
  case $__dbx_v in
    __dbx_*|BASH|BASH_*|BASHOPTS|BASHPID|FUNCNAME|PIPESTATUS|RANDOM|SRANDOM|LINENO|SECONDS|EPOCHREALTIME|EPOCHSECONDS|HISTCMD|GROUPS|DIRSTACK|PPID|UID|EUID|SHELLOPTS|SHLVL|_|PWD|COMP_*|OPTIND|OPTARG) continue;;
  esac
  __dbx_d=$(declare -p "$__dbx_v" 2>/dev/null) || continue
  __dbx_a=${__dbx_d#declare -}; __dbx_a=${__dbx_a%% *}
  case $__dbx_a in *r*) continue;; esac
  printf '%s\n' "$__dbx_d"
done
__dbx_f=$(compgen -A function | grep -v '^__dbx_')
[ -n "$__dbx_f" ] && declare -f $__dbx_f
alias -p
shopt -p
set +o
trap -p
umask -p
unset __dbx_v __dbx_d __dbx_a __dbx_f
`

// ShellState captures the state of the sandbox's shell session as a script
// that ReplayShellState runs in a fresh session. ok is false when no shell
// session runs. The session must be idle: the call waits for it.
func (s *Sandbox) ShellState(ctx context.Context) (script string, ok bool, err error) {
	s.mu.Lock()
	_, running := s.sess[SessionShell]
	s.mu.Unlock()
	if !running {
		return "", false, nil
	}
	var out, errb bytes.Buffer
	res, err := s.Session(ctx, SessionRequest{Kind: SessionShell, Code: captureShell, Stdout: &out, Stderr: &errb, Timeout: 30 * time.Second})
	if err != nil {
		return "", false, fmt.Errorf("capture shell state: %w", err)
	}
	if res.ExitCode != 0 && out.Len() == 0 {
		return "", false, fmt.Errorf("capture shell state: exit %d: %s", res.ExitCode, strings.TrimSpace(errb.String()))
	}
	return out.String(), true, nil
}

// ReplayShellState starts a fresh shell session with the state a ShellState
// script describes.
func (s *Sandbox) ReplayShellState(ctx context.Context, script string) error {
	var errb bytes.Buffer
	_, err := s.Session(ctx, SessionRequest{Kind: SessionShell, Code: script, Stderr: &errb, Timeout: 30 * time.Second})
	if err != nil {
		return fmt.Errorf("replay shell state: %w", err)
	}
	return nil
}

// Sessions lists the kinds of the sessions that run now.
func (s *Sandbox) Sessions() []SessionKind {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []SessionKind
	for k := range s.sess {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
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
	initPid := s.InitPid()
	var out []Process
	for _, pid := range pids {
		if pid == initPid {
			continue
		}
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
		cmd := strings.TrimSpace(strings.ReplaceAll(string(b), "\x00", " "))
		out = append(out, Process{Pid: pid, Cmdline: cmd, Session: sessionOf[pid]})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Pid < out[j].Pid })
	return out, nil
}
