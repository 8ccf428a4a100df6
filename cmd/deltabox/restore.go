package main

import (
	"fmt"

	"github.com/spf13/cobra"
)

func (a *app) restoreCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "restore SANDBOX CHECKPOINT",
		Short: "Roll a sandbox back, in place, to a checkpoint of its tree",
		Long: `Roll a sandbox back to a checkpoint: afterwards its files and processes are
those of the checkpoint, and it keeps its id. Commands running in it are
killed. Prints how long it took and, per process, which path brought it back:
template (memory exact), criu, replay (session state replayed), or none.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			res, err := c.Sandbox(args[0]).Restore(cmd.Context(), args[1])
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.stdout, struct {
					Sandbox    string        `json:"sandbox"`
					Checkpoint string        `json:"checkpoint"`
					RestoreMs  float64       `json:"restore_ms"`
					Processes  []processJSON `json:"processes"`
				}{args[0], args[1], ms(res.Duration), toProcessesJSON(res.Processes)})
			}
			fmt.Fprintf(a.stdout, "restored %s to %s in %s\n", args[0], args[1], humanMs(res.Duration))
			if len(res.Processes) == 0 {
				return nil
			}
			tw, row := table(a.stdout, "PROCESS", "PATH", "REASON")
			for _, p := range res.Processes {
				row(p.Name, p.Path, orDash(p.Reason))
			}
			return tw.Flush()
		},
	}
}
