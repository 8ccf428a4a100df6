//go:build linux

package deltabox_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"strings"
	"time"

	"github.com/deltabox/deltabox/errdefs"
	deltabox "github.com/deltabox/deltabox/sdk"
)

// A sandbox's life: connect, create, run a command, delete.
func Example() {
	ctx := context.Background()
	c, err := deltabox.Dial(ctx) // $DELTABOX_SOCKET or /run/deltabox/deltabox.sock
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	sb, err := c.Create(ctx, deltabox.CreateOptions{
		Labels: map[string]string{"agent": "example"},
		Limits: deltabox.Limits{MemoryBytes: 1 << 30, Pids: 512, CPUs: 1},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer sb.Delete(ctx, deltabox.DeleteOptions{Force: true})

	res, err := sb.Exec(ctx, []string{"echo", "hello from", "the sandbox"}, deltabox.ExecOptions{
		Stdout:  os.Stdout, // streamed as produced
		Stderr:  os.Stderr,
		Timeout: 30 * time.Second,
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("exit code", res.ExitCode)
	// Output:
	// hello from the sandbox
	// exit code 0
}

// Run collects the output, for when streaming is not needed.
func ExampleSandbox_Run() {
	ctx := context.Background()
	c, _ := deltabox.New()
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer sb.Delete(ctx, deltabox.DeleteOptions{})

	out, err := sb.Run(ctx, []string{"fail", "oops", "2"}, deltabox.ExecOptions{})
	if err != nil {
		log.Fatal(err) // the daemon could not run it
	}
	fmt.Printf("exit %d, stderr %q\n", out.ExitCode, out.Stderr)
	// Output: exit 2, stderr "oops"
}

// With Stdin set, the command reads it (the call uses a bidirectional
// stream).
func ExampleSandbox_Exec_stdin() {
	ctx := context.Background()
	c, _ := deltabox.New()
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer sb.Delete(ctx, deltabox.DeleteOptions{})

	_, err = sb.Exec(ctx, []string{"cat"}, deltabox.ExecOptions{
		Stdin:  strings.NewReader("piped through\n"),
		Stdout: os.Stdout,
	})
	if err != nil {
		log.Fatal(err)
	}
	// Output: piped through
}

// Shell and Python keep their state between calls.
func ExampleSandbox_Shell() {
	ctx := context.Background()
	c, _ := deltabox.New()
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer sb.Delete(ctx, deltabox.DeleteOptions{})

	for _, code := range []string{"cd /tmp", "pwd"} {
		if _, err := sb.Shell(ctx, code, deltabox.SessionOptions{Stdout: os.Stdout}); err != nil {
			log.Fatal(err)
		}
	}
	res, _ := sb.Python(ctx, "exit 3", deltabox.SessionOptions{})
	fmt.Println("python exit code", res.ExitCode)
	// Output:
	// shell: cd /tmp
	// shell: pwd
	// python exit code 3
}

// Files are read and written inside the sandbox's root filesystem.
func ExampleSandbox_WriteFile() {
	ctx := context.Background()
	c, _ := deltabox.New()
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer sb.Delete(ctx, deltabox.DeleteOptions{})

	if err := sb.WriteFile(ctx, "/work/notes/todo.txt", []byte("write tests\n"), 0o644); err != nil {
		log.Fatal(err)
	}
	b, err := sb.ReadFile(ctx, "/work/notes/todo.txt")
	if err != nil {
		log.Fatal(err)
	}
	fi, _ := sb.Stat(ctx, "/work/notes/todo.txt")
	fmt.Printf("%q %v %d\n", b, fi.Mode, fi.Size)
	// Output: "write tests\n" -rw-r--r-- 12
}

// Errors keep their class across the wire: test them with errors.Is.
func ExampleClient_Get() {
	ctx := context.Background()
	c, _ := deltabox.New()
	_, err := c.Get(ctx, "no-such-sandbox")
	fmt.Println(errors.Is(err, errdefs.ErrNotFound))
	// Output: true
}

// A daemon that is not running gives ErrUnavailable and says how to start it.
func ExampleDial_unavailable() {
	_, err := deltabox.Dial(context.Background(), deltabox.WithSocket("/nonexistent/deltabox.sock"))
	fmt.Println(errors.Is(err, errdefs.ErrUnavailable))
	fmt.Println(strings.Contains(err.Error(), "sudo deltabox serve"))
	// Output:
	// true
	// true
}

func ExampleClient_List() {
	ctx := context.Background()
	c, _ := deltabox.New()
	sb, err := c.Create(ctx, deltabox.CreateOptions{Labels: map[string]string{"run": "list-example"}})
	if err != nil {
		log.Fatal(err)
	}
	defer sb.Delete(ctx, deltabox.DeleteOptions{})

	list, err := c.List(ctx)
	if err != nil {
		log.Fatal(err)
	}
	for _, info := range list {
		if info.Labels["run"] == "list-example" {
			fmt.Println(info.State, info.Image, info.Workdir)
		}
	}
	// Output: running host /work
}

// A checkpoint captures the files and processes at one instant; it becomes
// the sandbox's head and the parent of its next checkpoint.
func ExampleSandbox_Checkpoint() {
	ctx := context.Background()
	c, _ := deltabox.New()
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer sb.Delete(ctx, deltabox.DeleteOptions{})

	first, err := sb.Checkpoint(ctx, deltabox.WithCheckpointName("clean"), deltabox.WithCheckpointLabel("step", "0"))
	if err != nil {
		log.Fatal(err)
	}
	defer c.DeleteCheckpoint(ctx, first.ID, true)
	second, err := sb.Checkpoint(ctx, deltabox.WithCheckpointName("after step 1"))
	if err != nil {
		log.Fatal(err)
	}
	info, _ := sb.Refresh(ctx)
	fmt.Println(first.Name, first.Labels["step"], first.Parent == "")
	fmt.Println(second.Name, second.Parent == first.ID, info.Head == second.ID)
	fmt.Println(first.Pause > 0)
	// Output:
	// clean 0 true
	// after step 1 true true
	// true
}

// Restore rolls a sandbox back in place: same id, the checkpoint's files and
// processes. The result says how each process came back.
func ExampleSandbox_Restore() {
	ctx := context.Background()
	c, _ := deltabox.New()
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer sb.Delete(ctx, deltabox.DeleteOptions{})

	sb.Shell(ctx, "cd /work", deltabox.SessionOptions{})
	sb.WriteFile(ctx, "/work/plan.txt", []byte("v1"), 0o644)
	ck, err := sb.Checkpoint(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer c.DeleteCheckpoint(ctx, ck.ID, true)

	sb.WriteFile(ctx, "/work/plan.txt", []byte("v2: a bad idea"), 0o644)
	res, err := sb.Restore(ctx, ck.ID)
	if err != nil {
		log.Fatal(err)
	}
	b, _ := sb.ReadFile(ctx, "/work/plan.txt")
	fmt.Printf("%s\n", b)
	for _, p := range res.Processes {
		fmt.Println(p.Name, p.Path)
	}
	// Output:
	// v1
	// shell session replay
}

// Fork makes N sandboxes from one checkpoint, each isolated from the others:
// one per branch of an agent's search.
func ExampleClient_Fork() {
	ctx := context.Background()
	c, _ := deltabox.New()
	sb, err := c.Create(ctx, deltabox.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer sb.Delete(ctx, deltabox.DeleteOptions{})
	sb.WriteFile(ctx, "/work/plan.txt", []byte("shared"), 0o644)
	ck, err := sb.Checkpoint(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer c.DeleteCheckpoint(ctx, ck.ID, true)

	res, err := c.Fork(ctx, ck.ID, 3)
	if err != nil {
		log.Fatal(err)
	}
	for i, f := range res.Sandboxes {
		defer f.Delete(ctx, deltabox.DeleteOptions{})
		f.WriteFile(ctx, "/work/branch.txt", []byte(fmt.Sprint("branch ", i)), 0o644)
	}
	for _, f := range res.Sandboxes {
		plan, _ := f.ReadFile(ctx, "/work/plan.txt")
		branch, _ := f.ReadFile(ctx, "/work/branch.txt")
		fmt.Printf("%s, %s\n", plan, branch)
	}
	changes, _ := c.Diff(ctx, ck.ID, res.Sandboxes[0].ID())
	fmt.Println(changes)
	tree, _ := c.Tree(ctx, ck.ID)
	fmt.Println(len(tree.Checkpoints), len(tree.Checkpoints[0].Heads))
	// Output:
	// shared, branch 0
	// shared, branch 1
	// shared, branch 2
	// [{/work/branch.txt added}]
	// 1 4
}
