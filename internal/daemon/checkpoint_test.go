//go:build linux

package daemon_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/daemon/daemontest"
	deltabox "github.com/deltabox/deltabox/sdk"
)

// TestCheckpointRoundTrip drives every checkpoint RPC through the SDK and
// the daemon against the fake's checkpoint tree.
func TestCheckpointRoundTrip(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	c := dial(t, sock)
	ctx := testCtx(t)
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sb.Shell(ctx, "cd /work", deltabox.SessionOptions{}); err != nil {
		t.Fatal(err)
	}
	write := func(sb *deltabox.Sandbox, content string) {
		t.Helper()
		if err := sb.WriteFile(ctx, "/work/f", []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	read := func(sb *deltabox.Sandbox) string {
		t.Helper()
		b, err := sb.ReadFile(ctx, "/work/f")
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	write(sb, "1")

	ck, err := sb.Checkpoint(ctx, deltabox.WithCheckpointName("base"), deltabox.WithCheckpointLabel("step", "0"))
	if err != nil {
		t.Fatalf("Checkpoint = %v", err)
	}
	wantProcs := []deltabox.ProcessState{{Name: "shell session", Path: deltabox.PathReplay}}
	if ck.ID == "" || ck.Parent != "" || ck.SandboxID != sb.ID() || ck.Name != "base" || ck.Labels["step"] != "0" ||
		ck.Created.IsZero() || ck.Pause != 2100*time.Microsecond || !slices.Equal(ck.Processes, wantProcs) ||
		!slices.Equal(ck.Heads, []string{sb.ID()}) {
		t.Fatalf("Checkpoint = %+v", ck)
	}
	if info, err := sb.Refresh(ctx); err != nil || info.Head != ck.ID {
		t.Fatalf("head after Checkpoint = %q, %v; want %q", info.Head, err, ck.ID)
	}

	write(sb, "2")
	res, err := sb.Restore(ctx, ck.ID)
	if err != nil {
		t.Fatalf("Restore = %v", err)
	}
	if res.Duration != 3500*time.Microsecond || !slices.Equal(res.Processes, wantProcs) {
		t.Fatalf("Restore = %+v", res)
	}
	if got := read(sb); got != "1" {
		t.Fatalf("/work/f after restore = %q, want 1", got)
	}

	ck2, err := sb.Checkpoint(ctx)
	if err != nil || ck2.Parent != ck.ID {
		t.Fatalf("second Checkpoint = %+v, %v; want parent %q", ck2, err, ck.ID)
	}

	fr, err := c.Fork(ctx, ck.ID, 3)
	if err != nil || len(fr.Sandboxes) != 3 || fr.Duration != 4200*time.Microsecond {
		t.Fatalf("Fork = %+v, %v", fr, err)
	}
	for _, f := range fr.Sandboxes {
		if got := read(f); got != "1" {
			t.Errorf("fork %s sees %q, want 1", f.ID(), got)
		}
	}
	fork := fr.Sandboxes[0]
	write(fork, "changed")
	if err := fork.WriteFile(ctx, "/work/new", []byte("n"), 0o644); err != nil {
		t.Fatal(err)
	}
	changes, err := c.Diff(ctx, ck.ID, fork.ID())
	want := []deltabox.Change{{Path: "/work/f", Kind: deltabox.ChangeModified}, {Path: "/work/new", Kind: deltabox.ChangeAdded}}
	if err != nil || !slices.Equal(changes, want) {
		t.Fatalf("Diff(%s, %s) = %+v, %v; want %+v", ck.ID, fork.ID(), changes, err, want)
	}
	changes, err = c.Diff(ctx, fork.ID(), ck.ID)
	if err != nil || len(changes) != 2 || changes[1].Kind != deltabox.ChangeRemoved {
		t.Fatalf("Diff back = %+v, %v", changes, err)
	}

	got, err := c.GetCheckpoint(ctx, ck.ID)
	if err != nil || !slices.Equal(got.Heads, fr.IDs()) || got.Name != "base" {
		t.Fatalf("GetCheckpoint = %+v, %v; want heads %q", got, err, fr.IDs())
	}
	list, err := c.ListCheckpoints(ctx)
	if err != nil || len(list) != 2 || list[0].ID != ck.ID || list[1].ID != ck2.ID {
		t.Fatalf("ListCheckpoints = %+v, %v", list, err)
	}
	for _, id := range []string{"", sb.ID(), ck2.ID} {
		tree, err := c.Tree(ctx, id)
		if err != nil || len(tree.Checkpoints) != 2 || len(tree.Sandboxes) != 4 {
			t.Fatalf("Tree(%q) = %+v, %v", id, tree, err)
		}
	}

	// Another tree: its own checkpoint cannot be restored into sb.
	other, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ock, err := other.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sb.Restore(ctx, ock.ID); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("Restore to another tree's checkpoint = %v, want ErrFailedPrecondition", err)
	}
	if tree, err := c.Tree(ctx, other.ID()); err != nil || len(tree.Checkpoints) != 1 || len(tree.Sandboxes) != 1 {
		t.Fatalf("Tree(other) = %+v, %v", tree, err)
	}

	if err := c.DeleteCheckpoint(ctx, ck.ID, false); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("DeleteCheckpoint with a child = %v, want ErrFailedPrecondition", err)
	}
	if err := c.DeleteCheckpoint(ctx, ck2.ID, false); err != nil {
		t.Fatalf("DeleteCheckpoint(leaf) = %v", err)
	}
	if info, _ := sb.Refresh(ctx); info.Head != ck.ID {
		t.Errorf("head after its checkpoint went = %q, want the parent %q", info.Head, ck.ID)
	}
	if err := c.DeleteCheckpoint(ctx, ck.ID, true); err != nil {
		t.Fatalf("DeleteCheckpoint(recursive) = %v", err)
	}
	if _, err := c.GetCheckpoint(ctx, ck.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("GetCheckpoint after delete = %v, want ErrNotFound", err)
	}
	if info, _ := fork.Refresh(ctx); info.Head != "" {
		t.Errorf("fork's head after the tree went = %q, want none", info.Head)
	}
}

func TestCheckpointNotFound(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	c := dial(t, sock)
	ctx := testCtx(t)
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]func() error{
		"checkpoint": func() error { _, err := c.Sandbox("sb-9999").Checkpoint(ctx); return err },
		"restore":    func() error { _, err := sb.Restore(ctx, "ck-9999"); return err },
		"fork":       func() error { _, err := c.Fork(ctx, "ck-9999", 1); return err },
		"tree":       func() error { _, err := c.Tree(ctx, "ck-9999"); return err },
		"get":        func() error { _, err := c.GetCheckpoint(ctx, "ck-9999"); return err },
		"delete":     func() error { return c.DeleteCheckpoint(ctx, "ck-9999", true) },
		"diff":       func() error { _, err := c.Diff(ctx, sb.ID(), "ck-9999"); return err },
	}
	for name, call := range calls {
		if err := call(); !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "9999") {
			t.Errorf("%s of a missing id = %v, want ErrNotFound naming it", name, err)
		}
	}
}

func TestCheckpointValidation(t *testing.T) {
	t.Parallel()
	sock, _ := daemontest.ServeFake(t)
	c := dial(t, sock)
	ctx := testCtx(t)
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ck, err := sb.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		call func() error
	}{
		{"checkpoint bad sandbox id", func() error { _, err := c.Sandbox("../x").Checkpoint(ctx); return err }},
		{"checkpoint long name", func() error {
			_, err := sb.Checkpoint(ctx, deltabox.WithCheckpointName(strings.Repeat("n", 129)))
			return err
		}},
		{"checkpoint name with newline", func() error {
			_, err := sb.Checkpoint(ctx, deltabox.WithCheckpointName("a\nb"))
			return err
		}},
		{"checkpoint bad label", func() error {
			_, err := sb.Checkpoint(ctx, deltabox.WithCheckpointLabel("a b", "c"))
			return err
		}},
		{"restore empty checkpoint id", func() error { _, err := sb.Restore(ctx, ""); return err }},
		{"restore bad checkpoint id", func() error { _, err := sb.Restore(ctx, "ck/../x"); return err }},
		{"restore bad sandbox id", func() error { _, err := c.Sandbox("").Restore(ctx, ck.ID); return err }},
		{"fork zero", func() error { _, err := c.Fork(ctx, ck.ID, 0); return err }},
		{"fork negative", func() error { _, err := c.Fork(ctx, ck.ID, -1); return err }},
		{"fork too many", func() error { _, err := c.Fork(ctx, ck.ID, deltabox.MaxFork+1); return err }},
		{"fork beyond int32", func() error { _, err := c.Fork(ctx, ck.ID, math.MaxInt32+2); return err }},
		{"fork bad id", func() error { _, err := c.Fork(ctx, "", 1); return err }},
		{"tree bad id", func() error { _, err := c.Tree(ctx, "a b"); return err }},
		{"get bad id", func() error { _, err := c.GetCheckpoint(ctx, "../ck"); return err }},
		{"delete bad id", func() error { return c.DeleteCheckpoint(ctx, "", false) }},
		{"diff empty from", func() error { _, err := c.Diff(ctx, "", ck.ID); return err }},
		{"diff bad to", func() error { _, err := c.Diff(ctx, ck.ID, "/etc"); return err }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.call(); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("%s = %v, want ErrInvalidArgument", tc.name, err)
			}
		})
	}
	// The edge lets the largest fork through.
	if fr, err := c.Fork(ctx, ck.ID, deltabox.MaxFork); err != nil || len(fr.Sandboxes) != deltabox.MaxFork {
		t.Fatalf("Fork(%d) = %d sandboxes, %v", deltabox.MaxFork, len(fr.Sandboxes), err)
	}
}

// TestCheckpointErrorClasses: every class the backend's Checkpointer returns
// reaches the SDK as the same class, through the one table.
func TestCheckpointErrorClasses(t *testing.T) {
	t.Parallel()
	sock, fake := daemontest.ServeFake(t)
	c := dial(t, sock)
	ctx := testCtx(t)
	sb := c.Sandbox("sb-0001")
	calls := map[string]func() error{
		"CreateCheckpoint": func() error { _, err := sb.Checkpoint(ctx); return err },
		"Restore":          func() error { _, err := sb.Restore(ctx, "ck-0001"); return err },
		"Fork":             func() error { _, err := c.Fork(ctx, "ck-0001", 2); return err },
		"GetTree":          func() error { _, err := c.Tree(ctx, ""); return err },
		"GetCheckpoint":    func() error { _, err := c.GetCheckpoint(ctx, "ck-0001"); return err },
		"ListCheckpoints":  func() error { _, err := c.ListCheckpoints(ctx); return err },
		"DeleteCheckpoint": func() error { return c.DeleteCheckpoint(ctx, "ck-0001", false) },
		"Diff":             func() error { _, err := c.Diff(ctx, "ck-0001", "sb-0001"); return err },
	}
	sentinels := []error{
		errdefs.ErrNotFound, errdefs.ErrAlreadyExists, errdefs.ErrInvalidArgument,
		errdefs.ErrFailedPrecondition, errdefs.ErrUnavailable, errdefs.ErrResourceExhausted,
		errdefs.ErrDeadlineExceeded, errdefs.ErrPermissionDenied, errdefs.ErrUnimplemented,
		errdefs.ErrInternal,
	}
	for _, want := range sentinels {
		fake.FailWith(fmt.Errorf("checkpoint %q: %w", "x", want))
		for name, call := range calls {
			err := call()
			if got := errdefs.Classify(err); got != errdefs.Classify(want) {
				t.Errorf("%s: class of %v = %v, want %v", name, err, got, errdefs.Classify(want))
			}
			if err != nil && !strings.Contains(err.Error(), `checkpoint "x"`) {
				t.Errorf("%s: message %q lost the backend's text", name, err)
			}
		}
	}
	fake.FailWith(nil)
}

// TestCheckpointJSONOverHTTP1 is a checkpoint and a refused fork by curl.
func TestCheckpointJSONOverHTTP1(t *testing.T) {
	t.Parallel()
	sock, fake := daemontest.ServeFake(t)
	if _, err := fake.CreateSandbox(testCtx(t), sandboxConfig()); err != nil {
		t.Fatal(err)
	}
	hc := unixHTTPClient(sock)
	post := func(method, body string) (int, string) {
		req, _ := http.NewRequest("POST", "http://deltabox/deltabox.v1.DeltaBoxService/"+method, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		res, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	code, body := post("CreateCheckpoint", `{"sandboxId":"sb-0001","name":"first","labels":{"k":"v"}}`)
	var ck struct {
		Checkpoint struct {
			ID, SandboxID, Name, Pause string
			Labels                     map[string]string
			Heads                      []string
		}
	}
	err := json.Unmarshal([]byte(body), &ck)
	if got := ck.Checkpoint; code != 200 || err != nil || got.ID != "ck-0001" || got.SandboxID != "sb-0001" || got.Name != "first" ||
		got.Pause != "0.002100s" || got.Labels["k"] != "v" || !slices.Equal(got.Heads, []string{"sb-0001"}) {
		t.Fatalf("CreateCheckpoint = %d %s (%v)", code, body, err)
	}
	code, body = post("Fork", `{"checkpointId":"ck-0001","n":0}`)
	if code != 400 || !strings.Contains(body, `"code":"invalid_argument"`) {
		t.Fatalf("Fork n=0 = %d %s, want 400 invalid_argument", code, body)
	}
	code, body = post("Fork", `{"checkpointId":"ck-0001","n":2}`)
	var fork struct{ SandboxIds []string }
	if err := json.Unmarshal([]byte(body), &fork); code != 200 || err != nil || !slices.Equal(fork.SandboxIds, []string{"sb-0002", "sb-0003"}) {
		t.Fatalf("Fork = %d %s (%v)", code, body, err)
	}
	code, body = post("DeleteCheckpoint", `{"id":"ck-0002"}`)
	if code != 404 || !strings.Contains(body, `"code":"not_found"`) {
		t.Fatalf("DeleteCheckpoint(missing) = %d %s", code, body)
	}
}
