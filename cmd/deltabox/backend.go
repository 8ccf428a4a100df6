//go:build linux

package main

import (
	"context"
	"io"

	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/statemgr"
)

// newBackend builds what the daemon serves: the state manager. The closer
// stops it (after the server has stopped).
func newBackend(ctx context.Context, opts statemgr.Options) (daemon.Backend, io.Closer, error) {
	m, err := statemgr.New(ctx, opts)
	if err != nil {
		return nil, nil, err
	}
	return m, m, nil
}
