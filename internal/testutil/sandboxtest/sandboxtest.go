//go:build linux

// Package sandboxtest sets up what tests that start real sandboxes share: a
// TestMain that lets the daemon re-execute the test binary as each
// sandbox's init, and a state manager on a fresh root whose checkpoint tree
// is checked and whose machine state is leak-checked when the test ends.
package sandboxtest

import (
	"context"
	"io"
	"log/slog"
	"os"
	"testing"

	"github.com/deltabox/deltabox/internal/sandbox/initproc"
	"github.com/deltabox/deltabox/internal/statemgr"
	"github.com/deltabox/deltabox/internal/testutil"
)

// Main is the TestMain of a test binary that starts sandboxes:
//
//	func TestMain(m *testing.M) { sandboxtest.Main(m) }
//
// Re-executed as a sandbox's init, the binary runs the init and never the
// tests; after the tests it removes this process's cgroup parent.
func Main(m *testing.M) {
	if initproc.IsInit() {
		initproc.Run()
	}
	code := m.Run()
	testutil.RemoveCgroupParent()
	os.Exit(code)
}

// NewManager gates t on root, registers the leak checker (first, so that it
// runs last), and opens a state manager on a fresh root with this test
// process's cgroup parent and a quiet logger; opts may change the options.
// When t ends, the checkpoint tree is checked (Fsck) and the manager closed.
func NewManager(t testing.TB, opts ...func(*statemgr.Options)) *statemgr.Manager {
	t.Helper()
	testutil.RequiresRoot(t)
	testutil.CheckLeaks(t)
	o := statemgr.Options{
		Root: t.TempDir(), CgroupParent: testutil.CgroupParent(),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	if os.Getenv("DELTABOX_TEST_LOG") == "1" { // the manager's debug log, to debug a test
		o.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	for _, f := range opts {
		f(&o)
	}
	ctx := context.Background()
	m, err := statemgr.New(ctx, o)
	if err != nil {
		t.Fatalf("statemgr.New: %v", err)
	}
	// Cleanups run in reverse: the test's own (deleting its sandboxes), the
	// tree check, then the close.
	t.Cleanup(func() {
		if err := m.Close(); err != nil {
			t.Errorf("close manager: %v", err)
		}
	})
	t.Cleanup(func() {
		if err := m.Fsck(ctx); err != nil {
			t.Errorf("fsck of the checkpoint tree: %v", err)
		}
	})
	return m
}
