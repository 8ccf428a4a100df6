//go:build linux

package daemontest

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/deltabox/deltabox/internal/daemon"
)

// Serve serves backend on a unix socket in a fresh short temporary directory
// (socket paths are limited to 108 bytes) until t ends, and returns the
// socket's path and the server.
func Serve(t testing.TB, backend daemon.Backend, opts ...daemon.Opt) (string, *daemon.Server) {
	t.Helper()
	dir, err := os.MkdirTemp("", "dbx")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "d.sock")
	srv, err := daemon.New(backend, append([]daemon.Opt{daemon.WithSocket(sock), daemon.WithLogger(slog.New(slog.DiscardHandler))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return sock, srv
}

// ServeFake serves a new Fake (its roots in a temporary directory) and
// returns the socket path and the fake.
func ServeFake(t testing.TB, opts ...daemon.Opt) (string, *Fake) {
	t.Helper()
	f := NewFake(t.TempDir())
	sock, _ := Serve(t, f, opts...)
	return sock, f
}
