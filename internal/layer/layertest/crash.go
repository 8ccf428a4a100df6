//go:build linux

package layertest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/layer"
)

// crashEnv, when set in a child test process, holds the store root the child
// hammers until it is killed.
const crashEnv = "LAYERTEST_CRASH_ROOT"

// RunCrash is the crash test: it re-executes the test binary as a child that
// runs Branch, Commit and Remove in a loop and logs every acknowledged
// operation, SIGKILLs it at a random point, reopens the store, and checks that
// every acknowledged layer is intact (kind, parent, content) and that nothing
// half-made is left (Fsck). It repeats this rounds times on the same root.
//
// Call it from a top-level test (the child runs that test again); in the
// child it never returns.
func RunCrash(t *testing.T, newStore NewStore, rounds int) {
	if root := os.Getenv(crashEnv); root != "" {
		crashChild(t, newStore, root)
		return
	}
	root := t.TempDir()
	// A child killed mid-operation can leave its store's mounts (a btrfs
	// image) behind; detach them before the directory is removed, so that
	// a failed round does not leak them onto the machine.
	t.Cleanup(func() { detachMountsUnder(root) })
	ackPath := filepath.Join(t.TempDir(), "acks")
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	pattern := "^" + strings.Join(strings.Split(regexp.QuoteMeta(t.Name()), "/"), "$/^") + "$"
	for round := 0; round < rounds; round++ {
		cmd := exec.Command(os.Args[0], "-test.run="+pattern, "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), crashEnv+"="+root, "LAYERTEST_CRASH_ACKS="+ackPath)
		out, err := os.Create(filepath.Join(t.TempDir(), "child.log"))
		if err != nil {
			t.Fatal(err)
		}
		cmd.Stdout, cmd.Stderr = out, out
		before := countLines(ackPath)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// Wait until the child has opened the store and acknowledged some
		// operations, then kill it somewhere in the next ones.
		deadline := time.Now().Add(30 * time.Second)
		for countLines(ackPath) < before+5 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(time.Duration(r.IntN(150)) * time.Millisecond)
		_ = cmd.Process.Signal(syscall.SIGKILL)
		_ = cmd.Wait()
		out.Close()
		if countLines(ackPath) < before+5 {
			b, _ := os.ReadFile(out.Name())
			t.Fatalf("round %d: child acknowledged nothing:\n%s", round, b)
		}
		verifyAcks(t, newStore, root, ackPath, round)
		if t.Failed() {
			return
		}
	}
}

// IsCrashChild reports whether this process is RunCrash's child (which the
// test must let run RunCrash without setting up anything else, such as a
// leak check: it gets killed).
func IsCrashChild() bool { return os.Getenv(crashEnv) != "" }

func countLines(p string) int {
	b, err := os.ReadFile(p)
	if err != nil {
		return 0
	}
	return strings.Count(string(b), "\n")
}

// verifyAcks reopens the store and checks it against the acknowledgement log.
func verifyAcks(t *testing.T, newStore NewStore, root, ackPath string, round int) {
	ctx := context.Background()
	s := newStore(t, root)
	defer func() {
		if err := s.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	}()
	if err := Fsck(ctx, s); err != nil {
		t.Errorf("round %d: fsck after crash: %v", round, err)
	}
	type want struct {
		kind   layer.Kind
		parent string
		marker string
	}
	live := map[string]want{}
	f, err := os.Open(ackPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	var inFlight []string // the unacknowledged operation: [op, layer]
	for sc.Scan() {
		w := strings.Fields(sc.Text())
		if len(w) == 0 {
			continue
		}
		inFlight = nil
		if w[0] == "begin" {
			inFlight = w[1:]
		}
		arg := func(i int) string {
			if i < len(w) && w[i] != "-" {
				return w[i]
			}
			return ""
		}
		switch w[0] {
		case "branch": // branch id parent
			live[w[1]] = want{layer.KindActive, arg(2), ""}
		case "commit": // commit active committed next parent marker
			delete(live, w[1])
			live[w[2]] = want{layer.KindCommitted, arg(4), w[5]}
			live[w[3]] = want{layer.KindActive, w[2], ""}
		case "remove":
			delete(live, w[1])
		}
	}
	// Record how the interrupted operation ended, for the next rounds.
	if len(inFlight) >= 2 {
		id := inFlight[1]
		if _, err := s.Stat(ctx, id); errdefs.IsNotFound(err) {
			line := ""
			if inFlight[0] == "remove" {
				line = "remove " + id
			} else {
				var c, n layer.Info
				_ = s.Walk(ctx, func(in layer.Info) error {
					if in.Labels["from"] == id && in.Kind == layer.KindCommitted {
						c = in
					}
					return nil
				})
				_ = s.Walk(ctx, func(in layer.Info) error {
					if c.ID != "" && in.Parent == c.ID && in.Kind == layer.KindActive {
						n = in
					}
					return nil
				})
				if c.ID != "" && n.ID != "" {
					p := c.Parent
					if p == "" {
						p = "-"
					}
					line = fmt.Sprintf("commit %s %s %s %s %s", id, c.ID, n.ID, p, inFlight[2])
				}
			}
			if line != "" {
				af, err := os.OpenFile(ackPath, os.O_WRONLY|os.O_APPEND, 0)
				if err != nil {
					t.Fatal(err)
				}
				fmt.Fprintln(af, line)
				af.Close()
			}
		}
	}
	for id, w := range live {
		in, err := s.Stat(ctx, id)
		if len(inFlight) >= 2 && inFlight[1] == id && errdefs.IsNotFound(err) {
			// The operation took effect but was not acknowledged: fine
			// for a remove; a commit must then have made its layers.
			if inFlight[0] == "remove" {
				continue
			}
			_ = s.Walk(ctx, func(c layer.Info) error {
				if c.Labels["from"] == id && c.Kind == layer.KindCommitted {
					err = nil
				}
				return nil
			})
			if err == nil {
				continue
			}
		}
		if err != nil {
			t.Errorf("round %d: acknowledged layer %q: %v", round, id, err)
			continue
		}
		if in.Kind != w.kind || (w.kind == layer.KindCommitted && in.Parent != w.parent) {
			t.Errorf("round %d: layer %q = %+v, want kind %v parent %q", round, id, in, w.kind, w.parent)
		}
		if w.kind != layer.KindCommitted {
			continue
		}
		// Every committed layer holds the marker its active layer had.
		v, err := s.Mounts(ctx, id)
		if err != nil {
			t.Errorf("round %d: Mounts(%q): %v", round, id, err)
			continue
		}
		found := false
		for _, l := range v.Lowers {
			if _, err := os.Stat(filepath.Join(l, w.marker)); err == nil {
				found = true
			}
		}
		if !found {
			t.Errorf("round %d: committed layer %q lost its content", round, id)
		}
	}
}

// crashChild runs operations on the store in root until killed, appending
// one line per acknowledged operation to the log.
func crashChild(t *testing.T, newStore NewStore, root string) {
	ctx := context.Background()
	ackf, err := os.OpenFile(os.Getenv("LAYERTEST_CRASH_ACKS"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	ack := func(format string, args ...any) {
		if _, err := fmt.Fprintf(ackf, format+"\n", args...); err != nil {
			t.Fatal(err)
		}
	}
	s := newStore(t, root)
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 2))
	dash := func(s string) string {
		if s == "" {
			return "-"
		}
		return s
	}
	for {
		var actives, committed, leaves []layer.Info
		parents := map[string]bool{}
		_ = s.Walk(ctx, func(in layer.Info) error {
			if in.Kind == layer.KindActive {
				actives = append(actives, in)
			} else {
				committed = append(committed, in)
			}
			parents[in.Parent] = true
			return nil
		})
		_ = s.Walk(ctx, func(in layer.Info) error {
			if !parents[in.ID] {
				leaves = append(leaves, in)
			}
			return nil
		})
		switch x := r.IntN(10); {
		case x < 2 || len(actives) == 0:
			in, err := s.Branch(ctx, "")
			if err != nil {
				t.Fatal(err)
			}
			ack("branch %s -", in.ID)
		case x < 6:
			a := actives[r.IntN(len(actives))]
			v, err := s.Mounts(ctx, a.ID)
			if err != nil {
				t.Fatal(err)
			}
			// A marker the committed layer must hold after any crash.
			marker := fmt.Sprintf("marker-%x", r.Uint64())
			if err := os.WriteFile(filepath.Join(v.Upper, marker), make([]byte, r.IntN(64<<10)), 0o644); err != nil {
				t.Fatal(err)
			}
			ack("begin commit %s %s", a.ID, marker)
			c, n, err := s.Commit(ctx, a.ID, layer.WithLabels(map[string]string{"from": a.ID}))
			if err != nil {
				t.Fatal(err)
			}
			ack("commit %s %s %s %s %s", a.ID, c.ID, n.ID, dash(c.Parent), marker)
		case x < 8 && len(committed) > 0:
			c := committed[r.IntN(len(committed))]
			in, err := s.Branch(ctx, c.ID)
			if err != nil {
				t.Fatal(err)
			}
			ack("branch %s %s", in.ID, c.ID)
		case len(leaves) > 0:
			l := leaves[r.IntN(len(leaves))]
			ack("begin remove %s", l.ID)
			if err := s.Remove(ctx, l.ID); err != nil {
				if errors.Is(err, os.ErrNotExist) {
					continue
				}
				t.Fatal(err)
			}
			ack("remove %s", l.ID)
		}
	}
}

// detachMountsUnder lazily unmounts every mount below dir, deepest first.
func detachMountsUnder(dir string) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var mounts []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			mounts = append(mounts, f[4])
		}
	}
	sort.Sort(sort.Reverse(sort.StringSlice(mounts)))
	for _, m := range mounts {
		_ = syscall.Unmount(m, syscall.MNT_DETACH)
	}
}
