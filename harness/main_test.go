//go:build linux

package harness

import (
	"testing"

	"github.com/deltabox/deltabox/internal/testutil/sandboxtest"
)

// TestMain lets the daemon of the root tests re-execute this binary as each
// sandbox's init.
func TestMain(m *testing.M) { sandboxtest.Main(m) }
