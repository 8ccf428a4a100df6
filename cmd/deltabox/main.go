// Command deltabox is the DeltaBox CLI and daemon: `deltabox serve` runs the
// daemon; every other subcommand is a thin wrapper over the Go SDK (sdk/),
// one file per command.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	deltabox "github.com/deltabox/deltabox/sdk"
)

func main() {
	// The daemon re-executes this binary as a sandbox's init; that never
	// returns.
	maybeRunSandboxInit()
	os.Exit(run(context.Background(), os.Args[1:], os.Stdin, os.Stdout, os.Stderr, os.Getenv))
}

// Exit codes of the CLI itself. A command run with exec, sh or py exits with
// its own code (124 on timeout); when the CLI fails before it has one, it
// exits 125, so that a command's 1 is never confused with a CLI error.
const (
	exitError       = 1
	exitExecFailure = 125
	exitInterrupted = 130
)

// exitCode makes the process exit with a code and no message.
type exitCode int

func (e exitCode) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

// execError is a failure of exec, sh or py before the command's exit code
// was known.
type execError struct{ err error }

func (e execError) Error() string { return e.err.Error() }
func (e execError) Unwrap() error { return e.err }

// app is one invocation of the CLI: its streams and global flags.
type app struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	getenv         func(string) string

	socket, addr, token string
	json                bool
}

// run runs the CLI with args and returns the exit code.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer, getenv func(string) string) int {
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	a := &app{stdin: stdin, stdout: stdout, stderr: stderr, getenv: getenv}
	root := a.rootCmd()
	root.SetArgs(args)
	root.SetIn(stdin)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return 0
	}
	if ec := exitCode(0); errors.As(err, &ec) {
		return int(ec)
	}
	fmt.Fprintf(stderr, "deltabox: %v\n", err)
	if ctx.Err() != nil {
		return exitInterrupted
	}
	if errors.As(err, new(execError)) {
		return exitExecFailure
	}
	return exitError
}

func (a *app) rootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "deltabox",
		Short:         "OS-level sandboxes for AI agents",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	socket := a.getenv(deltabox.EnvSocket)
	if socket == "" {
		socket = deltabox.DefaultSocket
	}
	pf := root.PersistentFlags()
	pf.StringVar(&a.socket, "socket", socket, "daemon unix socket (env "+deltabox.EnvSocket+")")
	pf.StringVar(&a.addr, "addr", a.getenv(deltabox.EnvAddr), "daemon TCP address host:port or URL, instead of the socket (env "+deltabox.EnvAddr+")")
	pf.StringVar(&a.token, "token", a.getenv(deltabox.EnvToken), "bearer token for TCP (env "+deltabox.EnvToken+")")
	pf.BoolVar(&a.json, "json", false, "print JSON for programs instead of tables for people")
	root.AddCommand(
		a.serveCmd(),
		a.infoCmd(),
		a.createCmd(),
		a.execCmd(),
		a.shCmd(),
		a.pyCmd(),
		a.cpCmd(),
		a.lsCmd(),
		a.inspectCmd(),
		a.rmCmd(),
		a.checkpointCmd(),
		a.restoreCmd(),
		a.forkCmd(),
		a.treeCmd(),
		a.diffCmd(),
		a.imageCmd(),
		a.demoCmd(),
	)
	return root
}

// client connects to the daemon as the global flags say: --addr (TCP) wins
// unless --socket was given explicitly.
func (a *app) client(cmd *cobra.Command) (*deltabox.Client, error) {
	if a.addr != "" && !(cmd.Flags().Changed("socket") && !cmd.Flags().Changed("addr")) {
		return deltabox.New(deltabox.WithAddr(a.addr), deltabox.WithToken(a.token))
	}
	return deltabox.New(deltabox.WithSocket(a.socket), deltabox.WithToken(""))
}
