package main

import (
	"strings"
	"time"

	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

func (a *app) inspectCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "inspect SANDBOX",
		Short: "Show a sandbox in detail",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			sb, err := c.Get(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			info := sb.Info()
			if a.json {
				return printJSON(a.stdout, info)
			}
			orDefault := func(s, def string) string {
				if s == "" {
					return def
				}
				return s
			}
			limit := func(n int64, f func(int64) string) string {
				if n == 0 {
					return "default"
				}
				return f(n)
			}
			tw, row := table(a.stdout)
			row("ID:", info.ID)
			row("Image:", info.Image)
			row("State:", info.State)
			row("Created:", info.Created.Local().Format(time.RFC3339)+" ("+ago(info.Created, time.Now())+")")
			row("Workdir:", info.Workdir)
			row("Memory:", limit(info.Limits.MemoryBytes, humanSize))
			row("Pids:", limit(info.Limits.Pids, func(n int64) string { return formatInt(n) }))
			row("CPUs:", cpus(info.Limits))
			row("Init pid:", info.InitPid)
			row("Head:", orDefault(info.Head, "-"))
			row("Labels:", labelString(info.Labels))
			row("Env:", orDefault(strings.Join(info.Env, " "), "-"))
			return tw.Flush()
		},
	}
}

func cpus(l deltabox.Limits) string {
	if l.CPUs == 0 {
		return "default"
	}
	return formatFloat(l.CPUs)
}
