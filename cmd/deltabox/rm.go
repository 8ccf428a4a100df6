package main

import (
	"fmt"

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
			type removed struct {
				ID    string `json:"id"`
				Error string `json:"error,omitempty"`
			}
			var out []removed
			failed := 0
			for _, id := range args {
				err := c.Sandbox(id).Delete(cmd.Context(), deltabox.DeleteOptions{Force: force})
				r := removed{ID: id}
				if err != nil {
					failed++
					r.Error = err.Error()
					if !a.json {
						fmt.Fprintf(a.stderr, "deltabox: rm %s: %v\n", id, err)
					}
				} else if !a.json {
					fmt.Fprintln(a.stdout, id)
				}
				out = append(out, r)
			}
			if a.json {
				if err := printJSON(a.stdout, out); err != nil {
					return err
				}
			}
			if failed > 0 {
				return exitCode(exitError)
			}
			return nil
		},
	}
	cmd.Flags().BoolVarP(&force, "force", "f", false, "kill running commands first")
	return cmd
}
