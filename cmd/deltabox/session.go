package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

type sessionFunc func(context.Context, string, deltabox.SessionOptions) (deltabox.ExecResult, error)

// sessionCmd is sh and py: run a snippet in the sandbox's persistent session.
func (a *app) sessionCmd(name, lang string, method func(*deltabox.Sandbox) sessionFunc) *cobra.Command {
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   name + " SANDBOX -- CODE",
		Short: fmt.Sprintf("Run %s code in the sandbox's persistent %s session", lang, lang),
		Long: fmt.Sprintf(`Run %s code in the sandbox's persistent %s session, whose state lasts
across calls. CODE is the remaining arguments joined by spaces; "-" or none
reads it from stdin. Exits with the snippet's exit code (124 on timeout).`, lang, lang),
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) < 1 {
				return execError{fmt.Errorf("usage: deltabox %s SANDBOX -- CODE", name)}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			code := strings.Join(args[1:], " ")
			if code == "" || code == "-" {
				b, err := io.ReadAll(a.stdin)
				if err != nil {
					return execError{fmt.Errorf("read code from stdin: %w", err)}
				}
				code = string(b)
			}
			c, err := a.client(cmd)
			if err != nil {
				return execError{err}
			}
			defer c.Close()
			run := method(c.Sandbox(args[0]))
			return a.runExec(deltabox.ExecOptions{}, func(o deltabox.ExecOptions) (deltabox.ExecResult, error) {
				return run(cmd.Context(), code, deltabox.SessionOptions{Timeout: timeout, Stdout: o.Stdout, Stderr: o.Stderr})
			})
		},
	}
	cmd.Flags().DurationVar(&timeout, "timeout", 0, "kill the session after this long (exit code 124; the next call starts a fresh one)")
	return cmd
}
