package main

import (
	"context"
	"time"

	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

func (a *app) lsCmd() *cobra.Command {
	return listCmd(a, listSpec[deltabox.SandboxInfo]{
		use: "ls", short: "List sandboxes",
		fetch:  func(ctx context.Context, c *deltabox.Client) ([]deltabox.SandboxInfo, error) { return c.List(ctx) },
		header: []string{"ID", "IMAGE", "STATE", "CREATED", "LABELS"},
		row: func(sb deltabox.SandboxInfo, now time.Time) []any {
			return []any{sb.ID, sb.Image, sb.State, ago(sb.Created, now), labelString(sb.Labels)}
		},
	})
}
