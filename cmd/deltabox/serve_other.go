//go:build !linux

package main

import (
	"errors"

	"github.com/spf13/cobra"
)

// The daemon needs Linux; the client commands work anywhere (over --addr).
func (a *app) serveCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "serve",
		Short: "Run the daemon (Linux only)",
		RunE: func(*cobra.Command, []string) error {
			return errors.New("the daemon runs on Linux only")
		},
	}
}
