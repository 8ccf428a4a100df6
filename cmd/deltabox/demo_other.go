//go:build !linux

package main

import (
	"errors"

	"github.com/spf13/cobra"
)

// The demo starts a daemon in-process when none runs: Linux only.
func (a *app) demoCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "demo",
		Short: "Search for a bug fix over live checkpoints (Linux only)",
		RunE: func(*cobra.Command, []string) error {
			return errors.New("the demo runs on Linux only")
		},
	}
}
