package main

import (
	"fmt"

	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

func (a *app) forkCmd() *cobra.Command {
	var n int
	cmd := &cobra.Command{
		Use:   "fork CHECKPOINT [-n N]",
		Short: "Create N new sandboxes, each exactly as at a checkpoint; print their ids",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			res, err := c.Fork(cmd.Context(), args[0], n)
			if err != nil {
				return err
			}
			ids := res.IDs()
			if a.json {
				return printJSON(a.stdout, struct {
					Checkpoint string   `json:"checkpoint"`
					IDs        []string `json:"ids"`
					ForkMs     float64  `json:"fork_ms"`
				}{args[0], ids, ms(res.Duration)})
			}
			for _, id := range ids {
				if _, err := fmt.Fprintln(a.stdout, id); err != nil {
					return err
				}
			}
			return nil
		},
	}
	cmd.Flags().IntVarP(&n, "n", "n", 1, fmt.Sprintf("how many sandboxes (1 to %d)", deltabox.MaxFork))
	return cmd
}
