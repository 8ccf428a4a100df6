package main

import (
	"fmt"

	"github.com/spf13/cobra"
)

func (a *app) infoCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "info",
		Short: "Show the daemon's version, storage backend and the kernel features it found",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			si, err := c.Info(cmd.Context())
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.stdout, si)
			}
			yes := func(b bool) string {
				if b {
					return "yes"
				}
				return "no"
			}
			criu := si.CRIU
			if criu == "" {
				criu = "not found"
			}
			tw, row := table(a.stdout)
			row("Version:", si.Version)
			row("Storage:", si.Storage)
			row("State dir:", si.StateDir)
			row("Kernel:", si.Kernel)
			row("Cgroups:", si.CgroupMode)
			row("CRIU:", criu)
			row("Btrfs:", yes(si.Btrfs))
			row("Overlay:", yes(si.Overlay))
			row("Idmapped mounts:", yes(si.IDMapMounts))
			row("Sandboxes:", si.Sandboxes)
			row("Images:", si.Images)
			row("Process templates:", fmt.Sprintf("%d checkpoints, %s of %s budget", si.Templates, humanBytes(si.TemplateBytes), humanBytes(si.TemplateBudget)))
			return tw.Flush()
		},
	}
}
