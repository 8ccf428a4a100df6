package harness

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/deltabox/deltabox/errdefs"
)

func TestTools(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ex := newLocal(t)
	tl := NewTools(ex, Limits{MaxFileBytes: 1000, MaxOutputBytes: 100, MaxLines: 3, MaxResults: 5})
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(tl.WriteFile(ctx, "src/a.py", "one\ntwo\nthree\nfour\n"))
	must(tl.WriteFile(ctx, "src/deep/b.py", "x = two\n"))
	must(tl.WriteFile(ctx, "README", "two two\n"))
	must(ex.WriteFile(ctx, "bin.dat", []byte("ab\x00cd"), 0))
	must(ex.WriteFile(ctx, "latin1.txt", []byte("caf\xe9"), 0))
	must(ex.WriteFile(ctx, "huge.txt", []byte(strings.Repeat("x", 2000)), 0))

	for _, tc := range []struct {
		name     string
		from, to int
		want     string
		class    error
	}{
		{"middle", 2, 3, "two\nthree\n", nil},
		{"to end", 3, 0, "three\nfour\n", nil},
		{"past the end clamps", 4, 99, "four\n", nil},
		{"too many", 0, 0, "", errdefs.ErrResourceExhausted},
		{"start past end", 9, 0, "", errdefs.ErrInvalidArgument},
		{"reversed", 3, 2, "", errdefs.ErrInvalidArgument},
	} {
		t.Run("read_file "+tc.name, func(t *testing.T) {
			got, err := tl.ReadFile(ctx, "src/a.py", tc.from, tc.to)
			if got != tc.want || (tc.class == nil) != (err == nil) || (tc.class != nil && !errors.Is(err, tc.class)) {
				t.Errorf("ReadFile(%d, %d) = %q, %v, want %q, %v", tc.from, tc.to, got, err, tc.want, tc.class)
			}
		})
	}
	for _, tc := range []struct {
		path  string
		class error
		text  string
	}{
		{"bin.dat", errdefs.ErrInvalidArgument, "binary"},
		{"latin1.txt", errdefs.ErrInvalidArgument, "UTF-8"},
		{"huge.txt", errdefs.ErrResourceExhausted, "limit"},
		{"src", errdefs.ErrInvalidArgument, "directory"},
		{"nope", errdefs.ErrNotFound, ""},
		{"../etc/passwd", errdefs.ErrInvalidArgument, "outside the workspace"},
		{"/etc/passwd", errdefs.ErrInvalidArgument, "outside the workspace"},
	} {
		_, err := tl.ReadFile(ctx, tc.path, 0, 0)
		if !errors.Is(err, tc.class) || !strings.Contains(err.Error(), tc.text) {
			t.Errorf("ReadFile(%q) = %v, want %v saying %q", tc.path, err, tc.class, tc.text)
		}
	}

	// edit: exactly one match.
	if err := tl.Edit(ctx, "README", "two", "2"); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "2 times") {
		t.Errorf("Edit with 2 matches = %v", err)
	}
	if err := tl.Edit(ctx, "README", "zzz", "2"); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "not found") {
		t.Errorf("Edit with no match = %v", err)
	}
	if err := tl.Edit(ctx, "bin.dat", "ab", "x"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Edit of a binary = %v", err)
	}
	must(tl.Edit(ctx, "src/a.py", "two\n", "TWO\n"))
	if got, _ := tl.ReadFile(ctx, "src/a.py", 1, 2); got != "one\nTWO\n" {
		t.Errorf("after edit: %q", got)
	}
	if err := tl.WriteFile(ctx, "w.txt", strings.Repeat("y", 1001)); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Errorf("WriteFile too big = %v", err)
	}
	if err := tl.WriteFile(ctx, "w.txt", "caf\xe9"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("WriteFile not UTF-8 = %v", err)
	}
	if err := tl.WriteFile(ctx, "../w.txt", "x"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("WriteFile outside = %v", err)
	}

	// glob and grep.
	if got, err := tl.Glob(ctx, "**/*.py"); err != nil || !slices.Equal(got, []string{"src/a.py", "src/deep/b.py"}) {
		t.Errorf("Glob(**/*.py) = %q, %v", got, err)
	}
	if got, err := tl.Glob(ctx, "src/*.py"); err != nil || !slices.Equal(got, []string{"src/a.py"}) {
		t.Errorf("Glob(src/*.py) = %q, %v", got, err)
	}
	if _, err := tl.Glob(ctx, "../*"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Glob(../*) = %v", err)
	}
	if _, err := tl.Glob(ctx, "[x"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Glob([x) = %v", err)
	}
	if _, err := tl.Glob(ctx, "**"); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Errorf("Glob(**) over MaxResults = %v", err)
	}
	m, err := tl.Grep(ctx, `^x = t`, "**/*.py")
	if err != nil || len(m) != 1 || m[0] != (GrepMatch{Path: "src/deep/b.py", Line: 1, Text: "x = two"}) {
		t.Errorf("Grep = %+v, %v", m, err)
	}
	if _, err := tl.Grep(ctx, `(`, ""); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Grep bad regexp = %v", err)
	}
	ents, err := tl.ListDir(ctx, "src")
	if err != nil || len(ents) != 2 || ents[0].Name != "a.py" || !ents[1].IsDir() {
		t.Errorf("ListDir = %+v, %v", ents, err)
	}

	// bash: persistent, output capped.
	must2 := func(r BashResult, err error) BashResult {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	must2(tl.Bash(ctx, "cd src; V=5"))
	if r := must2(tl.Bash(ctx, "echo $V $(basename $PWD); exit 4")); r.Output != "5 src\n" || r.ExitCode != 4 {
		t.Errorf("bash = %+v", r)
	}
	if r := must2(tl.Bash(ctx, "yes | head -c 500")); !r.Truncated || !strings.Contains(r.Output, "[output truncated: 400 more bytes]") {
		t.Errorf("bash big output = %+v", r)
	}
	if _, err := tl.Bash(ctx, " "); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("empty bash = %v", err)
	}

	// Call dispatches by name with JSON arguments.
	out, err := tl.Call(ctx, "read_file", json.RawMessage(`{"path":"src/a.py","from":4,"to":4}`))
	if err != nil || out != "four\n" {
		t.Errorf("Call(read_file) = %q, %v", out, err)
	}
	if _, err := tl.Call(ctx, "rm_rf", nil); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Call(unknown) = %v", err)
	}
}

// TestLLMPolicy drives the LLM policy against a fake OpenAI-compatible
// server.
func TestLLMPolicy(t *testing.T) {
	ctx := context.Background()
	var gotAuth, gotModel string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/chat/completions" {
			http.NotFound(w, r)
			return
		}
		var req struct {
			Model    string `json:"model"`
			Messages []chatMessage
		}
		json.NewDecoder(r.Body).Decode(&req)
		gotAuth, gotModel = r.Header.Get("Authorization"), req.Model
		if !strings.Contains(req.Messages[1].Content, "def add(a, b):") {
			http.Error(w, "the files are missing from the prompt", 400)
			return
		}
		content := "Here:\n```json\n" + `[{"name":"fix add","path":"calc.py","old":"a - b","new":"a + b"},{"name":"noop","path":"calc.py","old":"zzz","new":"y"}]` + "\n```"
		json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"message": map[string]string{"role": "assistant", "content": content}}}})
	}))
	defer srv.Close()

	ex := newLocal(t)
	tl := NewTools(ex, Limits{})
	if err := tl.WriteFile(ctx, "calc.py", "def add(a, b):\n    return a - b\n"); err != nil {
		t.Fatal(err)
	}
	t.Setenv(EnvLLMURL, "")
	if _, ok := LLMConfigFromEnv(); ok {
		t.Fatal("LLM policy on without an endpoint")
	}
	p, err := NewLLMPolicy(LLMConfig{BaseURL: srv.URL + "/v1", Model: "m1", APIKey: "k", Task: "fix the bug"})
	if err != nil {
		t.Fatal(err)
	}
	acts, err := p.Propose(ctx, State{Tools: tl})
	if err != nil || len(acts) != 2 || acts[0].Name != "fix add" {
		t.Fatalf("Propose = %+v, %v", acts, err)
	}
	if gotAuth != "Bearer k" || gotModel != "m1" {
		t.Errorf("request: auth %q model %q", gotAuth, gotModel)
	}
	if err := acts[0].Apply(ctx, tl); err != nil {
		t.Fatal(err)
	}
	if err := acts[1].Apply(ctx, tl); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("applying an edit that does not match = %v", err)
	}
	if got, _ := tl.ReadFile(ctx, "calc.py", 2, 2); got != "    return a + b\n" {
		t.Errorf("after the edit: %q", got)
	}

	bad, _ := NewLLMPolicy(LLMConfig{BaseURL: srv.URL + "/nowhere"})
	if _, err := bad.Propose(ctx, State{Tools: tl}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("Propose against a 404 = %v", err)
	}
}

func TestScoreUnittest(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		out  string
		code int
		want float64
	}{
		{"....\n----\nRan 4 tests in 0.001s\n\nOK\n", 0, 1},
		{"F.E.\n----\nRan 4 tests in 0.001s\n\nFAILED (failures=1, errors=1)\n", 1, 0.5},
		{"ImportError: boom\n", 1, 0},
		{"Ran 0 tests in 0.000s\n\nNO TESTS RAN\n", 5, 0},
	} {
		if got := ScoreUnittest(tc.out, tc.code); fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("ScoreUnittest(%q) = %v, want %v", tc.out, got, tc.want)
		}
	}
}
