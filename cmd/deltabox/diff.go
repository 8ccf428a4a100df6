package main

import (
	"fmt"

	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

// changeLetters are the marks diff prints for people.
var changeLetters = map[deltabox.ChangeKind]string{
	deltabox.ChangeAdded:    "A",
	deltabox.ChangeModified: "M",
	deltabox.ChangeRemoved:  "D",
}

func (a *app) diffCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "diff FROM TO",
		Short: "List the files added (A), modified (M) and removed (D) from one checkpoint or sandbox to another",
		Long: `List the files that differ between two checkpoints or sandboxes; a sandbox
means its live filesystem. Each line is "A /path" (added), "M /path"
(modified) or "D /path" (removed).`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			changes, err := c.Diff(cmd.Context(), args[0], args[1])
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.stdout, changes)
			}
			for _, ch := range changes {
				l, ok := changeLetters[ch.Kind]
				if !ok {
					l = "?"
				}
				if _, err := fmt.Fprintf(a.stdout, "%s %s\n", l, ch.Path); err != nil {
					return err
				}
			}
			return nil
		},
	}
}
