//go:build linux

package sandbox

import (
	"context"
	"fmt"
	"os"

	"github.com/deltabox/deltabox/internal/sandbox/initproto"
)

// stdio is a set of fresh pipes for one clone of a template: the daemon
// keeps its ends; a generation's init holds the clone's ends until the
// clone takes them (pidfd_getfd from the init: the clone, in the sandbox's
// user namespace, cannot take them from the daemon).
type stdio struct {
	ours [3]*os.File // the write end of stdin, the read ends of stdout and stderr
	fds  []int       // the clone's ends, as fds of the init
}

// holdStdio makes a set and has g's init hold the clone's ends.
func (g *generation) holdStdio(ctx context.Context) (*stdio, error) {
	st := &stdio{}
	var theirs [3]*os.File
	defer initproto.CloseFiles(theirs[:])
	for i := range theirs {
		r, w, err := os.Pipe()
		if err != nil {
			st.close()
			return nil, err
		}
		if i == 0 { // the clone reads its stdin, writes the others
			r, w = w, r
		}
		st.ours[i], theirs[i] = r, w
	}
	held, err := g.request(ctx, initproto.Message{Op: initproto.OpHold}, theirs[:]...)
	if err == nil && len(held.Fds) != 3 {
		err = fmt.Errorf("init holds %d fds", len(held.Fds))
	}
	if err != nil {
		st.close()
		return nil, fmt.Errorf("hand over stdio: %w", err)
	}
	st.fds = held.Fds
	return st, nil
}

// prehold has g's init hold n sets ahead of time, off the critical path of
// the clones that will take them (a round trip to the init each).
func (g *generation) prehold(ctx context.Context, n int) {
	for {
		g.mu.Lock()
		have := len(g.stdio)
		g.mu.Unlock()
		if have >= n {
			return
		}
		st, err := g.holdStdio(ctx)
		if err != nil {
			return
		}
		g.mu.Lock()
		if g.dead {
			g.mu.Unlock()
			st.close()
			return
		}
		g.stdio = append(g.stdio, st)
		g.mu.Unlock()
	}
}

// takeStdio returns a set held ahead of time, else holds one now.
func (g *generation) takeStdio(ctx context.Context) (*stdio, error) {
	g.mu.Lock()
	if n := len(g.stdio); n > 0 {
		st := g.stdio[n-1]
		g.stdio = g.stdio[:n-1]
		g.mu.Unlock()
		return st, nil
	}
	g.mu.Unlock()
	return g.holdStdio(ctx)
}

// letGo has g's init close its fds of st (the clone has its own now).
func (g *generation) letGo(st *stdio) {
	_ = g.c.Send(initproto.Message{Op: initproto.OpRelease, Fds: st.fds})
}

// dropStdio closes the daemon's ends of the sets nobody took; the init's
// ends die with it.
func (g *generation) dropStdio() {
	g.mu.Lock()
	sets := g.stdio
	g.stdio = nil
	g.mu.Unlock()
	for _, st := range sets {
		st.close()
	}
}

func (st *stdio) close() { initproto.CloseFiles(st.ours[:]) }
