package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

func (a *app) imageCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "image",
		Short: "Manage images (base root filesystems)",
	}
	cmd.AddCommand(&cobra.Command{
		Use:   "import NAME FILE",
		Short: "Import a rootfs tarball (.tar, .tar.gz, .tar.xz), a docker-save tar or an OCI layout tar; FILE - reads stdin",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			var r io.Reader = a.stdin
			if args[1] != "-" {
				f, err := os.Open(args[1])
				if err != nil {
					return err
				}
				defer f.Close()
				r = f
			}
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			info, err := c.ImportImage(cmd.Context(), args[0], r)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.stdout, info)
			}
			_, err = fmt.Fprintf(a.stdout, "%s (%s, %s)\n", info.Name, info.Kind, humanSize(info.Size))
			return err
		},
	}, listCmd(a, listSpec[deltabox.ImageInfo]{
		use: "ls", short: "List images",
		fetch:  func(ctx context.Context, c *deltabox.Client) ([]deltabox.ImageInfo, error) { return c.ListImages(ctx) },
		header: []string{"NAME", "KIND", "SIZE", "CREATED"},
		row: func(im deltabox.ImageInfo, now time.Time) []any {
			return []any{im.Name, im.Kind, humanSize(im.Size), ago(im.Created, now)}
		},
	}), &cobra.Command{
		Use:   "rm NAME",
		Short: "Remove an imported image",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			if err := c.RemoveImage(cmd.Context(), args[0]); err != nil {
				return err
			}
			if a.json {
				return printJSON(a.stdout, map[string]string{"name": args[0]})
			}
			_, err = fmt.Fprintln(a.stdout, args[0])
			return err
		},
	})
	return cmd
}
