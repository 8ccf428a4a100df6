package harness

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// UnittestEvaluator scores a Python project by its unittest suite: the
// share of tests that pass when `python3 -m unittest` runs in Dir (relative
// to the workspace). A suite that does not even load scores 0.
type UnittestEvaluator struct {
	Dir     string
	Timeout time.Duration // 0 means a minute
	// Session runs the suite from the job's persistent shell session, as
	// an agent working in a terminal does, instead of as a command of its
	// own: the session, idle between steps, is then part of every
	// checkpoint (on DeltaBox, its live process, the fast path).
	Session bool
}

var (
	ranRe    = regexp.MustCompile(`(?m)^Ran (\d+) tests? in`)
	failedRe = regexp.MustCompile(`(?m)^FAILED \(([^)]*)\)`)
	countRe  = regexp.MustCompile(`(failures|errors|unexpected successes)=(\d+)`)
)

func (u UnittestEvaluator) Evaluate(ctx context.Context, t *Tools) (float64, error) {
	timeout := u.Timeout
	if timeout <= 0 {
		timeout = time.Minute
	}
	var out bytes.Buffer
	w := &capBuffer{max: 1 << 20}
	var r ExecResult
	var err error
	if u.Session {
		var dir string
		if dir, err = resolve(t.Executor().Workspace(), u.Dir); err != nil {
			return 0, fmt.Errorf("unittest: %w", err)
		}
		// The suite's own time limit (timeout(1), where the image has it):
		// a session call that times out costs the session, and the agent
		// its shell state.
		code := fmt.Sprintf("(cd %s && t=; command -v timeout >/dev/null && t='timeout -k 5 %d'; PYTHONDONTWRITEBYTECODE=1 $t python3 -m unittest)",
			shellQuote(dir), int(timeout.Seconds()+0.5))
		r, err = t.Executor().Shell(ctx, code, SessionOptions{Timeout: timeout + 30*time.Second, Stdout: &out, Stderr: w})
	} else {
		r, err = t.Executor().Exec(ctx, Cmd{
			Argv: []string{"python3", "-m", "unittest"}, Cwd: u.Dir, Timeout: timeout,
			Env: []string{"PYTHONDONTWRITEBYTECODE=1"}, Stdout: &out, Stderr: w,
		})
	}
	if err != nil {
		return 0, fmt.Errorf("unittest: %w", err)
	}
	return ScoreUnittest(w.String(), r.ExitCode), nil
}

// ScoreUnittest scores the output of a unittest run: passed over ran.
func ScoreUnittest(output string, exitCode int) float64 {
	m := ranRe.FindStringSubmatch(output)
	if m == nil {
		return 0
	}
	ran, _ := strconv.Atoi(m[1])
	if ran == 0 {
		return 0
	}
	if exitCode == 0 {
		return 1
	}
	bad := 0
	if f := failedRe.FindStringSubmatch(output); f != nil {
		for _, c := range countRe.FindAllStringSubmatch(f[1], -1) {
			n, _ := strconv.Atoi(c[2])
			bad += n
		}
	}
	if bad == 0 {
		return 0 // failed without saying how: trust the exit code
	}
	return float64(max(ran-bad, 0)) / float64(ran)
}

// shellQuote quotes s as one bash word.
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
