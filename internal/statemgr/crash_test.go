//go:build linux

package statemgr_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/sandbox"
	"github.com/deltabox/deltabox/internal/statemgr"
	"github.com/deltabox/deltabox/internal/testutil"
)

// crashChildEnv makes the test binary run crashChild instead of the tests.
const crashChildEnv = "DELTABOX_TEST_CRASH_CHILD"

func init() {
	if root := os.Getenv(crashChildEnv); root != "" {
		crashChild(root)
		os.Exit(0)
	}
}

// crashChild plays a daemon that checkpoints, restores and forks in a loop
// until it is killed, on both checkpoint paths. After each acknowledged checkpoint it appends
// "<checkpoint id> <counter>" to root/acked (fsynced): the counter is what
// /work/counter held at the checkpoint.
func crashChild(root string) {
	ctx := context.Background()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	m, err := statemgr.New(ctx, statemgr.Options{Root: root, Logger: quiet, CgroupParent: os.Getenv("DELTABOX_TEST_CGROUP_PARENT")})
	if err != nil {
		fmt.Fprintln(os.Stderr, "crash child:", err)
		os.Exit(2)
	}
	list, _ := m.ListSandboxes(ctx)
	var id string
	for _, s := range list {
		if s.Config.Labels["role"] == "main" {
			id = s.ID
		}
	}
	if id == "" {
		in, err := m.CreateSandbox(ctx, sandbox.Config{Labels: map[string]string{"role": "main"}})
		if err != nil {
			fmt.Fprintln(os.Stderr, "crash child:", err)
			os.Exit(2)
		}
		id = in.ID
	}
	acked, err := os.OpenFile(filepath.Join(root, "acked"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		os.Exit(2)
	}
	var cks []string
	for n := 0; ; n++ {
		// By a command, or by the shell session (then the checkpoint takes
		// the template path, switching to a copy of the layer made ahead).
		write := "echo " + strconv.Itoa(n) + " > /work/counter"
		if n%2 == 1 {
			_, _ = m.Session(ctx, id, sandbox.SessionRequest{Kind: sandbox.SessionShell, Code: write})
			time.Sleep(20 * time.Millisecond) // the clones and the copy made ahead
		} else {
			_, _ = m.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"sh", "-c", write}})
		}
		ck, err := m.Checkpoint(ctx, id, daemon.CheckpointOptions{})
		if err == nil {
			fmt.Fprintf(acked, "%s %d\n", ck.ID, n)
			_ = acked.Sync()
			cks = append(cks, ck.ID)
		}
		if len(cks) > 0 {
			target := cks[rand.IntN(len(cks))]
			switch n % 3 {
			case 0:
				_, _ = m.Restore(ctx, id, target)
			case 1:
				if res, err := m.Fork(ctx, target, 2); err == nil {
					for _, f := range res.IDs {
						_ = m.DeleteSandbox(ctx, f, true)
					}
				}
			}
		}
	}
}

func TestKillDaemonDuringCheckpointRestoreFork(t *testing.T) {
	testutil.RequiresRoot(t)
	testutil.CheckLeaks(t)
	root := t.TempDir()
	ctx := context.Background()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	opts := statemgr.Options{Root: root, CgroupParent: testutil.CgroupParent()}
	for round := 0; round < 4; round++ {
		cmd := exec.Command(exe, "-test.run=^$")
		cmd.Env = append(os.Environ(), crashChildEnv+"="+root, "DELTABOX_TEST_CGROUP_PARENT="+testutil.CgroupParent())
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(800+rand.IntN(1500)) * time.Millisecond)
		_ = cmd.Process.Signal(syscall.SIGKILL)
		_ = cmd.Wait()

		// Restart: recovery reconciles what the dead daemon left.
		m, err := statemgr.New(ctx, opts)
		if err != nil {
			t.Fatalf("round %d: restart: %v", round, err)
		}
		if err := m.Fsck(ctx); err != nil {
			t.Errorf("round %d: fsck after recovery: %v", round, err)
		}
		list, _ := m.ListSandboxes(ctx)
		for _, s := range list {
			if s.State != sandbox.StateRunning {
				t.Errorf("round %d: sandbox %s is %v after recovery", round, s.ID, s.State)
			}
			if s.Config.Labels["role"] != "main" {
				t.Errorf("round %d: a half-made fork %s is visible after recovery", round, s.ID)
			}
		}
		// Every acknowledged checkpoint is there, with its filesystem.
		acked := readAcked(t, filepath.Join(root, "acked"))
		templated := 0
		for i, a := range acked {
			ck, err := m.GetCheckpoint(ctx, a.id)
			if err != nil {
				t.Errorf("round %d: acknowledged checkpoint %s lost: %v", round, a.id, err)
				continue
			}
			for _, p := range ck.Processes { // templates, or templates the restart lost
				if p.Path == daemon.PathTemplate || strings.Contains(p.Reason, "templates") {
					templated++
					break
				}
			}
			// Check the newest and a few others by forking them.
			if i != len(acked)-1 && i%5 != 0 {
				continue
			}
			res, err := m.Fork(ctx, a.id, 1)
			if err != nil {
				t.Errorf("round %d: fork %s: %v", round, a.id, err)
				continue
			}
			r := sh(t, m, res.IDs[0], "cat /work/counter")
			if strings.TrimSpace(r.stdout) != strconv.Itoa(a.counter) {
				t.Errorf("round %d: checkpoint %s has counter %q, want %d", round, a.id, r.stdout, a.counter)
			}
			_ = m.DeleteSandbox(ctx, res.IDs[0], true)
		}
		t.Logf("round %d: %d acknowledged checkpoints intact, %d on the template path", round, len(acked), templated)
		if len(acked) > 4 && templated == 0 {
			t.Errorf("round %d: no checkpoint took the template path", round)
		}
		if err := m.Close(); err != nil {
			t.Fatalf("round %d: close: %v", round, err)
		}
	}
	// Clean up everything the rounds made.
	m, err := statemgr.New(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	list, _ := m.ListSandboxes(ctx)
	for _, s := range list {
		_ = m.DeleteSandbox(ctx, s.ID, true)
	}
	cks, _ := m.ListCheckpoints(ctx)
	for _, c := range cks {
		if c.Parent == "" {
			_ = m.DeleteCheckpoint(ctx, c.ID, true)
		}
	}
	if err := m.Fsck(ctx); err != nil {
		t.Errorf("final fsck: %v", err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
}

type ackedCk struct {
	id      string
	counter int
}

func readAcked(t *testing.T, path string) []ackedCk {
	f, err := os.Open(path)
	if err != nil {
		if os.IsNotExist(err) {
			return nil
		}
		t.Fatal(err)
	}
	defer f.Close()
	var out []ackedCk
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) != 2 {
			continue // a torn last line: never acknowledged
		}
		n, err := strconv.Atoi(fields[1])
		if err != nil {
			continue
		}
		out = append(out, ackedCk{fields[0], n})
	}
	return out
}
