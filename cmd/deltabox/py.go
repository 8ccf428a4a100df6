package main

import (
	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

func (a *app) pyCmd() *cobra.Command {
	return a.sessionCmd("py", "python", func(sb *deltabox.Sandbox) sessionFunc { return sb.Python })
}
