package main

import (
	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

func (a *app) rmCmd() *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "rm [--force] SANDBOX...",
		Short: "Remove sandboxes",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			return a.removeEach("rm", args, func(id string) error {
				return c.Sandbox(id).Delete(cmd.Context(), deltabox.DeleteOptions{Force: force})
			})
		},
	}
	cmd.Flags().BoolVarP(&force, "force", "f", false, "kill running commands first")
	return cmd
}
