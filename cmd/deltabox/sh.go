package main

import (
	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

func (a *app) shCmd() *cobra.Command {
	return a.sessionCmd("sh", "bash", func(sb *deltabox.Sandbox) sessionFunc { return sb.Shell })
}
