//go:build linux

package main

import (
	"fmt"
	"log/slog"
	"os"
	"strconv"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/statemgr"
)

func (a *app) serveCmd() *cobra.Command {
	var (
		root, storage, listen, logLevel string
		warmPool                        int
		keepTemplates                   bool
		templateBudgetMiB, warmMiB      int64
	)
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the daemon",
		Long: `Run the DeltaBox daemon. It serves the API on a root-only unix socket
(--socket) and, with --listen and --token, on TCP for clients that present the
token. SIGINT or SIGTERM stop it gracefully.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// Before anything opens a file: fds inherited from whoever
			// started us must not leak into sandboxes.
			if err := markInheritedCloexec(); err != nil {
				return err
			}
			if listen != "" && a.token == "" {
				return fmt.Errorf("--listen needs --token (or %s): TCP is never open to everyone", "DELTABOX_TOKEN")
			}
			switch storage {
			case "", "btrfs", "overlay", "copy":
			default:
				return fmt.Errorf("--storage %q: want btrfs, overlay or copy", storage)
			}
			var level slog.Level
			if err := level.UnmarshalText([]byte(logLevel)); err != nil {
				return fmt.Errorf("--log-level: %w", err)
			}
			log := slog.New(slog.NewTextHandler(a.stderr, &slog.HandlerOptions{Level: level}))
			ctx := cmd.Context()

			// Refuse early, before touching the state, when a daemon runs.
			if err := daemon.ProbeSocket(a.socket); err != nil {
				return err
			}
			backend, closer, err := newBackend(ctx, statemgr.Options{Root: root, Storage: storage, Logger: log, WarmPool: warmPool, KeepTemplates: keepTemplates, TemplateBudget: templateBudgetMiB << 20, WarmRestores: warmMiB << 20})
			if err != nil {
				return fmt.Errorf("start: %w", err)
			}
			defer func() {
				if err := closer.Close(); err != nil {
					log.Error("stop backend", "err", err)
				}
			}()
			opts := []daemon.Opt{daemon.WithSocket(a.socket), daemon.WithLogger(log)}
			if listen != "" {
				opts = append(opts, daemon.WithTCP(listen, a.token))
			}
			srv, err := daemon.New(backend, opts...)
			if err != nil {
				return err
			}
			return srv.Serve(ctx) // ctx ends on SIGINT/SIGTERM (see run)
		},
	}
	f := cmd.Flags()
	f.StringVar(&root, "root", "/var/lib/deltabox", "state directory")
	f.StringVar(&storage, "storage", "", "layer store: btrfs, overlay or copy (default: the best available)")
	f.StringVar(&listen, "listen", "", "also serve on this TCP address (needs --token)")
	f.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	f.IntVar(&warmPool, "warm-pool", 2, "prepared sandboxes kept ready so that a create skips the process start (0: none)")
	f.Int64Var(&warmMiB, "warm-restores-mib", statemgr.DefaultWarmRestores>>20, "memory a rollback made ready ahead pre-faults for writing, in MiB: what its templates wrote, so that the first step after the rollback takes no copy-on-write faults (0: off; bench/templates measures it)")
	f.Int64Var(&templateBudgetMiB, "template-budget-mib", 0, "private memory checkpoints' process templates may hold, in MiB; the least recently used are evicted past it (0: 25% of RAM)")
	f.BoolVar(&keepTemplates, "keep-templates", true, "leave checkpoints' process templates running when the daemon stops, for the next daemon to re-adopt")
	return cmd
}

// markInheritedCloexec marks every fd above stderr close-on-exec, so that
// nothing the daemon inherited reaches a sandbox's processes.
func markInheritedCloexec() error {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return fmt.Errorf("list inherited fds: %w", err)
	}
	for _, e := range entries {
		fd, err := strconv.Atoi(e.Name())
		if err != nil || fd < 3 {
			continue
		}
		unix.CloseOnExec(fd)
	}
	return nil
}
