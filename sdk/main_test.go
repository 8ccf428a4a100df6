//go:build linux

package deltabox_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/daemon/daemontest"
	deltabox "github.com/deltabox/deltabox/sdk"
)

// TestMain serves a fake backend on a unix socket and points
// $DELTABOX_SOCKET at it, so the examples connect the way a program does.
func TestMain(m *testing.M) {
	os.Exit(func() int {
		dir, err := os.MkdirTemp("", "dbxsdk")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		sock := filepath.Join(dir, "d.sock")
		srv, err := daemon.New(daemontest.NewFake(filepath.Join(dir, "roots")),
			daemon.WithSocket(sock), daemon.WithLogger(slog.New(slog.DiscardHandler)))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		if err := srv.Listen(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- srv.Serve(ctx) }()
		defer func() { cancel(); <-done }()
		os.Setenv(deltabox.EnvSocket, sock)
		return m.Run()
	}())
}
