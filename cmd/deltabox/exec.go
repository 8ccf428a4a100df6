package main

import (
	"bytes"
	"errors"

	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

func (a *app) execCmd() *cobra.Command {
	var (
		opts        deltabox.ExecOptions
		interactive bool
	)
	cmd := &cobra.Command{
		Use:   "exec SANDBOX [flags] -- CMD [ARGS...]",
		Short: "Run a command in a sandbox, streaming its output; exit with its exit code",
		Long: `Run a command in a sandbox. Its stdout and stderr stream as they are
produced, and deltabox exits with the command's exit code: 124 when it timed
out, 125 when it could not be run at all.`,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) < 2 {
				return execError{errors.New("usage: deltabox exec SANDBOX [flags] -- CMD [ARGS...]")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client(cmd)
			if err != nil {
				return execError{err}
			}
			defer c.Close()
			if interactive {
				opts.Stdin = a.stdin
			}
			return a.runExec(opts, func(o deltabox.ExecOptions) (deltabox.ExecResult, error) {
				return c.Sandbox(args[0]).Exec(cmd.Context(), args[1:], o)
			})
		},
	}
	f := cmd.Flags()
	f.DurationVar(&opts.Timeout, "timeout", 0, "kill the command after this long (exit code 124)")
	f.StringVar(&opts.Cwd, "cwd", "", "working directory (default: the sandbox's workdir)")
	f.StringArrayVar(&opts.Env, "env", nil, "environment variable K=V (repeatable)")
	f.BoolVarP(&interactive, "interactive", "i", false, "forward stdin to the command")
	return cmd
}

// runExec runs a command (exec, sh, py) and turns its result into output
// and an exit code: streamed for people, one JSON object with --json.
func (a *app) runExec(opts deltabox.ExecOptions, run func(deltabox.ExecOptions) (deltabox.ExecResult, error)) error {
	var out, errb bytes.Buffer
	if a.json {
		opts.Stdout, opts.Stderr = &out, &errb
	} else {
		opts.Stdout, opts.Stderr = a.stdout, a.stderr
	}
	res, err := run(opts)
	if err != nil {
		return execError{err}
	}
	code := res.ExitCode
	if res.TimedOut && code == 0 {
		code = 124
	}
	if a.json {
		if err := printJSON(a.stdout, execJSON{
			ExitCode: code, Stdout: out.String(), Stderr: errb.String(), TimedOut: res.TimedOut,
			StdoutTruncated: res.StdoutTruncated, StderrTruncated: res.StderrTruncated,
			DurationSeconds: res.Duration.Seconds(),
		}); err != nil {
			return execError{err}
		}
	}
	if code != 0 {
		return exitCode(code)
	}
	return nil
}
