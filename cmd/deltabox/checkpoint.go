package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

func (a *app) checkpointCmd() *cobra.Command {
	var (
		name   string
		labels []string
	)
	cmd := &cobra.Command{
		Use:     "checkpoint SANDBOX [--name NAME] [--label k=v]...",
		Aliases: []string{"ckpt"},
		Short:   "Checkpoint a sandbox: print the checkpoint's id and how long the sandbox was paused",
		Long: `Take a checkpoint of a sandbox: its files and its processes, captured at the
same instant while the sandbox is frozen. The checkpoint's parent is the
sandbox's head, and it becomes the new head. "checkpoint ls" and
"checkpoint rm" list and remove checkpoints.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			lm, err := parseLabels(labels)
			if err != nil {
				return err
			}
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			opts := []deltabox.CheckpointOption{deltabox.WithCheckpointName(name)}
			if lm != nil {
				opts = append(opts, deltabox.WithCheckpointLabels(lm))
			}
			ck, err := c.Sandbox(args[0]).Checkpoint(cmd.Context(), opts...)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.stdout, toCheckpointJSON(ck))
			}
			_, err = fmt.Fprintf(a.stdout, "%s (paused %s)\n", ck.ID, humanMs(ck.Pause))
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&name, "name", "", "name of the checkpoint")
	f.StringArrayVar(&labels, "label", nil, "label k=v (repeatable)")
	cmd.AddCommand(a.checkpointLsCmd(), a.checkpointRmCmd())
	return cmd
}

func (a *app) checkpointLsCmd() *cobra.Command {
	return listCmd(a, listSpec[deltabox.Checkpoint]{
		use: "ls", short: "List checkpoints, parents before children",
		fetch: func(ctx context.Context, c *deltabox.Client) ([]deltabox.Checkpoint, error) {
			return c.ListCheckpoints(ctx)
		},
		toJSON: func(ck deltabox.Checkpoint) any { return toCheckpointJSON(ck) },
		header: []string{"ID", "NAME", "PARENT", "SANDBOX", "CREATED", "PAUSE", "HEAD OF", "LABELS"},
		row: func(ck deltabox.Checkpoint, now time.Time) []any {
			return []any{ck.ID, orDash(ck.Name), orDash(ck.Parent), ck.SandboxID, ago(ck.Created, now),
				humanMs(ck.Pause), orDash(strings.Join(ck.Heads, ",")), labelString(ck.Labels)}
		},
	})
}

func (a *app) checkpointRmCmd() *cobra.Command {
	var recursive bool
	cmd := &cobra.Command{
		Use:   "rm [--recursive] CHECKPOINT...",
		Short: "Remove checkpoints (with --recursive, their descendants too)",
		Long: `Remove checkpoints. A checkpoint with children is kept unless --recursive
is given, which removes its descendants too. Sandboxes whose head is removed
take its parent as their head; sandboxes themselves are never removed.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			return a.removeEach("checkpoint rm", args, func(id string) error {
				return c.DeleteCheckpoint(cmd.Context(), id, recursive)
			})
		},
	}
	cmd.Flags().BoolVarP(&recursive, "recursive", "r", false, "also remove the checkpoints' descendants")
	return cmd
}

// checkpointJSON is a checkpoint as checkpoint, checkpoint ls and tree print
// it with --json: every key always present.
type checkpointJSON struct {
	ID        string            `json:"id"`
	Parent    string            `json:"parent"`
	Sandbox   string            `json:"sandbox"`
	Name      string            `json:"name"`
	Labels    map[string]string `json:"labels"`
	Created   time.Time         `json:"created"`
	PauseMs   float64           `json:"pause_ms"`
	Processes []processJSON     `json:"processes"`
	Heads     []string          `json:"heads"`
}

// processJSON is one process of a checkpoint or restore.
type processJSON struct {
	Name   string `json:"name"`
	Path   string `json:"path"` // template | criu | replay | none
	Reason string `json:"reason"`
}

func toCheckpointJSON(ck deltabox.Checkpoint) checkpointJSON {
	out := checkpointJSON{
		ID: ck.ID, Parent: ck.Parent, Sandbox: ck.SandboxID, Name: ck.Name, Labels: ck.Labels,
		Created: ck.Created, PauseMs: ms(ck.Pause), Processes: toProcessesJSON(ck.Processes), Heads: ck.Heads,
	}
	if out.Labels == nil {
		out.Labels = map[string]string{}
	}
	if out.Heads == nil {
		out.Heads = []string{}
	}
	return out
}

func toProcessesJSON(ps []deltabox.ProcessState) []processJSON {
	out := make([]processJSON, len(ps))
	for i, p := range ps {
		out[i] = processJSON{Name: p.Name, Path: string(p.Path), Reason: p.Reason}
	}
	return out
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
