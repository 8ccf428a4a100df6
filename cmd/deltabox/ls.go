package main

import (
	"time"

	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

func (a *app) lsCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List sandboxes",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			list, err := c.List(cmd.Context())
			if err != nil {
				return err
			}
			if a.json {
				if list == nil {
					list = []deltabox.SandboxInfo{}
				}
				return printJSON(a.stdout, list)
			}
			now := time.Now()
			tw, row := table(a.stdout, "ID", "IMAGE", "STATE", "CREATED", "LABELS")
			for _, sb := range list {
				row(sb.ID, sb.Image, sb.State, ago(sb.Created, now), labelString(sb.Labels))
			}
			return tw.Flush()
		},
	}
}
