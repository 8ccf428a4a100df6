package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	deltabox "github.com/deltabox/deltabox/sdk"
	"github.com/spf13/cobra"
)

// Output helpers shared by the commands: JSON for programs, aligned tables,
// human sizes and durations for people.

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// table writes aligned columns; call flush when done.
func table(w io.Writer, header ...string) (*tabwriter.Writer, func(cols ...any)) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row := func(cols ...any) {
		for i, c := range cols {
			if i > 0 {
				io.WriteString(tw, "\t")
			}
			fmt.Fprint(tw, c)
		}
		io.WriteString(tw, "\n")
	}
	if len(header) > 0 {
		cols := make([]any, len(header))
		for i, h := range header {
			cols[i] = h
		}
		row(cols...)
	}
	return tw, row
}

// humanSize formats bytes in binary units: 0 B, 512 B, 1.5 KiB, 2 GiB.
func humanSize(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 5; m /= unit {
		div *= unit
		exp++
	}
	v := float64(n) / float64(div)
	s := strconv.FormatFloat(v, 'f', 1, 64)
	s = strings.TrimSuffix(s, ".0")
	return s + " " + string("KMGTPE"[exp]) + "iB"
}

// parseSize parses "512", "100K", "1G", "1.5GiB", "2gb" (binary units).
func parseSize(s string) (int64, error) {
	t := strings.TrimSpace(strings.ToUpper(s))
	t = strings.TrimSuffix(strings.TrimSuffix(t, "B"), "I")
	mult := int64(1)
	if t != "" {
		if i := strings.IndexByte("KMGTP", t[len(t)-1]); i >= 0 {
			mult = int64(1) << (10 * (i + 1))
			t = t[:len(t)-1]
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || v < 0 || v*float64(mult) > float64(1<<62) {
		return 0, fmt.Errorf("bad size %q: want a number with an optional K, M, G, T or P suffix", s)
	}
	return int64(v * float64(mult)), nil
}

// humanDuration formats a duration roughly: 850ms, 12s, 3m, 5h, 2d.
func humanDuration(d time.Duration) string {
	switch {
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d.Hours()))
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}

// ms is a duration in fractional milliseconds, for JSON.
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// humanMs formats a short duration in milliseconds with up to two decimals:
// 2.1ms, 0.35ms, 1250ms.
func humanMs(d time.Duration) string {
	return formatFloat(math.Round(ms(d)*100)/100) + "ms"
}

// ago formats a past time: "3m ago".
func ago(t time.Time, now time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := now.Sub(t)
	if d < time.Second {
		return "just now"
	}
	return humanDuration(d) + " ago"
}

// labelString formats labels as k=v,k=v sorted by key.
func labelString(labels map[string]string) string {
	if len(labels) == 0 {
		return "-"
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		parts = append(parts, k+"="+labels[k])
	}
	return strings.Join(parts, ",")
}

// parseLabels parses k=v flags.
func parseLabels(kvs []string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	m := map[string]string{}
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("bad label %q: want key=value", kv)
		}
		m[k] = v
	}
	return m, nil
}

// execJSON is what exec, sh and py print with --json.
type execJSON struct {
	ExitCode        int     `json:"exit_code"`
	Stdout          string  `json:"stdout"`
	Stderr          string  `json:"stderr"`
	TimedOut        bool    `json:"timed_out"`
	StdoutTruncated bool    `json:"stdout_truncated"`
	StderrTruncated bool    `json:"stderr_truncated"`
	DurationSeconds float64 `json:"duration_seconds"`
}

func formatInt(n int64) string { return strconv.FormatInt(n, 10) }

func formatFloat(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) }

// listSpec describes a command that lists things: fetch them, then print
// them as JSON (toJSON may convert each; nil prints them as they are) or as
// a table for people.
type listSpec[T any] struct {
	use, short string
	fetch      func(ctx context.Context, c *deltabox.Client) ([]T, error)
	toJSON     func(T) any
	header     []string
	row        func(v T, now time.Time) []any
}

// listCmd builds the command of a listSpec.
func listCmd[T any](a *app, spec listSpec[T]) *cobra.Command {
	return &cobra.Command{
		Use:     spec.use,
		Aliases: []string{"list"},
		Short:   spec.short,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			list, err := spec.fetch(cmd.Context(), c)
			if err != nil {
				return err
			}
			if a.json {
				out := make([]any, len(list))
				for i, v := range list {
					out[i] = any(v)
					if spec.toJSON != nil {
						out[i] = spec.toJSON(v)
					}
				}
				return printJSON(a.stdout, out)
			}
			now := time.Now()
			tw, row := table(a.stdout, spec.header...)
			for _, v := range list {
				row(spec.row(v, now)...)
			}
			return tw.Flush()
		},
	}
}

// removeEach removes each id with remove, printing the ids removed (or, with
// --json, a list of {"id", "error"}); it goes on past failures and exits 1
// if any failed. what names the command in error messages.
func (a *app) removeEach(what string, ids []string, remove func(id string) error) error {
	type removed struct {
		ID    string `json:"id"`
		Error string `json:"error,omitempty"`
	}
	var out []removed
	failed := 0
	for _, id := range ids {
		r := removed{ID: id}
		if err := remove(id); err != nil {
			failed++
			r.Error = err.Error()
			if !a.json {
				fmt.Fprintf(a.stderr, "deltabox: %s %s: %v\n", what, id, err)
			}
		} else if !a.json {
			fmt.Fprintln(a.stdout, id)
		}
		out = append(out, r)
	}
	if a.json {
		if err := printJSON(a.stdout, out); err != nil {
			return err
		}
	}
	if failed > 0 {
		return exitCode(exitError)
	}
	return nil
}

// humanBytes formats a byte count with a binary unit ("1.5 GiB").
func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
