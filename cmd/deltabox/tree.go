package main

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

func (a *app) treeCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "tree [SANDBOX|CHECKPOINT]",
		Short: "Show the checkpoint tree of a sandbox or checkpoint (every tree without one)",
		Long: `Show the checkpoint tree: each checkpoint with its name and age, and
"◀ SANDBOX" after the checkpoint that is the sandbox's head (the one it last
took or restored; its next checkpoint's parent). Sandboxes with no head are
listed below the tree.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			id := ""
			if len(args) == 1 {
				id = args[0]
			}
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			t, err := c.Tree(cmd.Context(), id)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.stdout, toTreeJSON(t))
			}
			return renderTree(a.stdout, t, time.Now())
		},
	}
}

// treeJSON is what tree prints with --json.
type treeJSON struct {
	Checkpoints []checkpointJSON  `json:"checkpoints"`
	Sandboxes   []treeSandboxJSON `json:"sandboxes"`
}

type treeSandboxJSON struct {
	ID      string         `json:"id"`
	Head    string         `json:"head"` // "" when it has none
	State   deltabox.State `json:"state"`
	Created time.Time      `json:"created"`
}

func toTreeJSON(t deltabox.Tree) treeJSON {
	out := treeJSON{Checkpoints: make([]checkpointJSON, len(t.Checkpoints)), Sandboxes: make([]treeSandboxJSON, len(t.Sandboxes))}
	for i, ck := range t.Checkpoints {
		out.Checkpoints[i] = toCheckpointJSON(ck)
	}
	for i, sb := range t.Sandboxes {
		out.Sandboxes[i] = treeSandboxJSON{ID: sb.ID, Head: sb.Head, State: sb.State, Created: sb.Created}
	}
	return out
}

// renderTree draws the checkpoints as a tree, one line each, children in
// the order given (oldest first), roots separated by a blank line:
//
//	ck-0001 base (2h ago)
//	├── ck-0002 (2h ago)  ◀ sb-0002 sb-0003
//	└── ck-0003 (1h ago)  ◀ sb-0001
//
//	no head: sb-0004
//
// A checkpoint whose parent is not in the list is drawn as a root.
func renderTree(w io.Writer, t deltabox.Tree, now time.Time) error {
	known := map[string]bool{}
	for _, ck := range t.Checkpoints {
		known[ck.ID] = true
	}
	// Heads come from both the checkpoints and the sandboxes: they agree,
	// but a sandbox is never left out if one side lags.
	heads := map[string][]string{}
	var headless []string
	for _, ck := range t.Checkpoints {
		heads[ck.ID] = append(heads[ck.ID], ck.Heads...)
	}
	for _, sb := range t.Sandboxes {
		if sb.Head == "" || !known[sb.Head] {
			headless = append(headless, sb.ID)
			continue
		}
		if !slices.Contains(heads[sb.Head], sb.ID) {
			heads[sb.Head] = append(heads[sb.Head], sb.ID)
		}
	}
	children := map[string][]deltabox.Checkpoint{}
	var roots []deltabox.Checkpoint
	for _, ck := range t.Checkpoints {
		if ck.Parent == "" || !known[ck.Parent] {
			roots = append(roots, ck)
		} else {
			children[ck.Parent] = append(children[ck.Parent], ck)
		}
	}

	var b strings.Builder
	line := func(ck deltabox.Checkpoint) {
		b.WriteString(ck.ID)
		if ck.Name != "" {
			b.WriteString(" " + ck.Name)
		}
		b.WriteString(" (" + ago(ck.Created, now) + ")")
		if hs := heads[ck.ID]; len(hs) > 0 {
			hs = slices.Clone(hs)
			slices.Sort(hs)
			b.WriteString("  ◀ " + strings.Join(slices.Compact(hs), " "))
		}
		b.WriteString("\n")
	}
	var walk func(ck deltabox.Checkpoint, prefix string)
	walk = func(ck deltabox.Checkpoint, prefix string) {
		kids := children[ck.ID]
		for i, kid := range kids {
			branch, next := "├── ", "│   "
			if i == len(kids)-1 {
				branch, next = "└── ", "    "
			}
			b.WriteString(prefix + branch)
			line(kid)
			walk(kid, prefix+next)
		}
	}
	for i, root := range roots {
		if i > 0 {
			b.WriteString("\n")
		}
		line(root)
		walk(root, "")
	}
	if len(roots) == 0 {
		b.WriteString("no checkpoints\n")
	}
	if len(headless) > 0 {
		b.WriteString("\nno head: " + strings.Join(headless, " ") + "\n")
	}
	_, err := io.WriteString(w, b.String())
	if err != nil {
		return fmt.Errorf("tree: %w", err)
	}
	return nil
}
