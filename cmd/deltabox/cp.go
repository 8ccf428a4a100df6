package main

import (
	"fmt"
	"path"
	"strings"

	"github.com/spf13/cobra"
)

func (a *app) cpCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "cp SRC DST",
		Short: "Copy files and directories between the host and a sandbox",
		Long: `Copy a file or a whole directory into a sandbox (LOCAL SANDBOX:PATH) or out
of it (SANDBOX:PATH LOCAL), like cp -r: when DST is an existing directory the
copy goes inside it, otherwise it becomes DST. A relative sandbox path is
relative to the sandbox's workdir. A local path containing ":" must start
with "/" or "./".`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			srcID, srcPath, srcRemote := splitRemote(args[0])
			dstID, dstPath, dstRemote := splitRemote(args[1])
			if srcRemote == dstRemote {
				return fmt.Errorf("cp: exactly one of SRC and DST must be SANDBOX:PATH")
			}
			c, err := a.client(cmd)
			if err != nil {
				return err
			}
			defer c.Close()
			ctx := cmd.Context()
			id, p := dstID, dstPath
			if srcRemote {
				id, p = srcID, srcPath
			}
			sb := c.Sandbox(id)
			if !path.IsAbs(p) {
				info, err := sb.Refresh(ctx)
				if err != nil {
					return err
				}
				trailing := strings.HasSuffix(p, "/") && p != "/"
				p = path.Join(info.Workdir, p)
				if trailing {
					p += "/"
				}
			}
			if srcRemote {
				return sb.CopyOut(ctx, p, args[1])
			}
			return sb.CopyIn(ctx, args[0], p)
		},
	}
}

// splitRemote splits SANDBOX:PATH. Arguments starting with "/" or "." are
// local whatever they contain.
func splitRemote(arg string) (id, p string, remote bool) {
	if strings.HasPrefix(arg, "/") || strings.HasPrefix(arg, ".") {
		return "", arg, false
	}
	id, p, ok := strings.Cut(arg, ":")
	if !ok || id == "" {
		return "", arg, false
	}
	if p == "" {
		p = "."
	}
	return id, p, true
}
