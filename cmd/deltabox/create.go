package main

import (
	"fmt"

	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

func (a *app) createCmd() *cobra.Command {
	var (
		opts   deltabox.CreateOptions
		memory string
		labels []string
	)
	cmd := &cobra.Command{
		Use:   "create",
		Short: "Create a sandbox and print its id",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if memory != "" {
				n, err := parseSize(memory)
				if err != nil {
					return fmt.Errorf("--memory: %w", err)
				}
				opts.Limits.MemoryBytes = n
			}
			var err error
			if opts.Labels, err = parseLabels(labels); err != nil {
				return err
			}
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			sb, err := c.Create(cmd.Context(), opts)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.stdout, sb.Info())
			}
			_, err = fmt.Fprintln(a.stdout, sb.ID())
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&opts.Image, "image", "host", "image to start from")
	f.StringVar(&memory, "memory", "", "memory limit, e.g. 512M, 1G (default: the daemon's)")
	f.Int64Var(&opts.Limits.Pids, "pids", 0, "process limit (default: the daemon's)")
	f.Float64Var(&opts.Limits.CPUs, "cpus", 0, "CPU limit in cores, e.g. 1.5 (default: the daemon's)")
	f.StringArrayVar(&opts.Env, "env", nil, "environment variable K=V for every command (repeatable)")
	f.StringVar(&opts.Workdir, "workdir", "", "default working directory (default /work)")
	f.StringArrayVar(&labels, "label", nil, "label k=v (repeatable)")
	return cmd
}
