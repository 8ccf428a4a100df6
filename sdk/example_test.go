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
