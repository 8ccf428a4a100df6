package harness

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/deltabox/deltabox/errdefs"
)

// Limits bound what the agent tools read, write and return; zero fields
// take the defaults in DefaultLimits.
type Limits struct {
	MaxFileBytes   int64         // largest file read, edited or grepped
	MaxOutputBytes int           // bash output kept (the rest is cut, with a marker)
	MaxLines       int           // lines read_file returns at once
	MaxResults     int           // glob paths and grep matches
	MaxWalk        int           // directory entries glob and grep visit
	BashTimeout    time.Duration // per bash call
}

// DefaultLimits are the limits of NewTools.
var DefaultLimits = Limits{
	MaxFileBytes: 1 << 20, MaxOutputBytes: 64 << 10, MaxLines: 2000,
	MaxResults: 1000, MaxWalk: 50000, BashTimeout: 2 * time.Minute,
}

// Tools are the tools coding agents call (bash, read_file, write_file,
// edit, glob, grep, list_dir), over one job's Executor and confined to its
// workspace. Errors carry errdefs classes: ErrInvalidArgument (bad path,
// binary or non-UTF-8 file, no or several matches), ErrNotFound,
// ErrResourceExhausted (over a limit). Safe for concurrent use as far as its
// Executor is.
type Tools struct {
	ex  Executor
	lim Limits
}

// NewTools returns the tools over ex.
func NewTools(ex Executor, lim Limits) *Tools {
	d := DefaultLimits
	if lim.MaxFileBytes <= 0 {
		lim.MaxFileBytes = d.MaxFileBytes
	}
	if lim.MaxOutputBytes <= 0 {
		lim.MaxOutputBytes = d.MaxOutputBytes
	}
	if lim.MaxLines <= 0 {
		lim.MaxLines = d.MaxLines
	}
	if lim.MaxResults <= 0 {
		lim.MaxResults = d.MaxResults
	}
	if lim.MaxWalk <= 0 {
		lim.MaxWalk = d.MaxWalk
	}
	if lim.BashTimeout <= 0 {
		lim.BashTimeout = d.BashTimeout
	}
	return &Tools{ex: ex, lim: lim}
}

// Executor is the executor the tools work on.
func (t *Tools) Executor() Executor { return t.ex }

// BashResult is what bash returns.
type BashResult struct {
	Output    string `json:"output"` // stdout and stderr interleaved
	ExitCode  int    `json:"exit_code"`
	TimedOut  bool   `json:"timed_out,omitempty"`
	Truncated bool   `json:"truncated,omitempty"`
}

// Bash runs command in the job's persistent shell session (cwd and
// variables persist between calls).
func (t *Tools) Bash(ctx context.Context, command string) (BashResult, error) {
	if strings.TrimSpace(command) == "" {
		return BashResult{}, fmt.Errorf("bash: empty command: %w", errdefs.ErrInvalidArgument)
	}
	out := &capBuffer{max: t.lim.MaxOutputBytes}
	r, err := t.ex.Shell(ctx, command, SessionOptions{Timeout: t.lim.BashTimeout, Stdout: out, Stderr: out})
	if err != nil {
		return BashResult{}, fmt.Errorf("bash: %w", err)
	}
	res := BashResult{Output: out.String(), ExitCode: r.ExitCode, TimedOut: r.TimedOut, Truncated: out.cut > 0}
	if res.Truncated {
		res.Output += fmt.Sprintf("\n[output truncated: %d more bytes]", out.cut)
	}
	return res, nil
}

// ReadFile returns lines from to to (1-based, inclusive; 0 means the first
// and the last) of a text file, at most Limits.MaxLines of them.
func (t *Tools) ReadFile(ctx context.Context, p string, from, to int) (string, error) {
	text, err := t.readText(ctx, p)
	if err != nil {
		return "", fmt.Errorf("read_file: %w", err)
	}
	if from < 0 || to < 0 || (to > 0 && to < from) {
		return "", fmt.Errorf("read_file %q: bad line range %d-%d: %w", p, from, to, errdefs.ErrInvalidArgument)
	}
	if from == 0 {
		from = 1
	}
	lines := strings.SplitAfter(text, "\n")
	if lines[len(lines)-1] == "" {
		lines = lines[:len(lines)-1]
	}
	if from > len(lines) && !(from == 1 && len(lines) == 0) {
		return "", fmt.Errorf("read_file %q: line %d is past the end (%d lines): %w", p, from, len(lines), errdefs.ErrInvalidArgument)
	}
	if to == 0 || to > len(lines) {
		to = len(lines)
	}
	if to-from+1 > t.lim.MaxLines {
		return "", fmt.Errorf("read_file %q: %d lines asked, at most %d at once: read a range: %w", p, to-from+1, t.lim.MaxLines, errdefs.ErrResourceExhausted)
	}
	if len(lines) == 0 {
		return "", nil
	}
	return strings.Join(lines[from-1:to], ""), nil
}

// WriteFile replaces (or creates) a text file.
func (t *Tools) WriteFile(ctx context.Context, p, content string) error {
	if int64(len(content)) > t.lim.MaxFileBytes {
		return fmt.Errorf("write_file %q: %d bytes, over the limit of %d: %w", p, len(content), t.lim.MaxFileBytes, errdefs.ErrResourceExhausted)
	}
	if !utf8.ValidString(content) || strings.ContainsRune(content, 0) {
		return fmt.Errorf("write_file %q: content is not UTF-8 text: %w", p, errdefs.ErrInvalidArgument)
	}
	if _, err := t.ex.Stat(ctx, p); err == nil {
		if err := t.checkFile(ctx, p); err != nil {
			return fmt.Errorf("write_file: %w", err)
		}
	} else if !errors.Is(err, errdefs.ErrNotFound) {
		return fmt.Errorf("write_file: %w", err)
	}
	if err := t.ex.WriteFile(ctx, p, []byte(content), 0); err != nil {
		return fmt.Errorf("write_file: %w", err)
	}
	return nil
}

// Edit replaces the one occurrence of old in a text file by new. It fails
// (changing nothing) when old occurs zero times or more than once.
func (t *Tools) Edit(ctx context.Context, p, old, new string) error {
	if old == "" {
		return fmt.Errorf("edit %q: empty old string: %w", p, errdefs.ErrInvalidArgument)
	}
	text, err := t.readText(ctx, p)
	if err != nil {
		return fmt.Errorf("edit: %w", err)
	}
	switch n := strings.Count(text, old); n {
	case 0:
		return fmt.Errorf("edit %q: old string not found: %w", p, errdefs.ErrInvalidArgument)
	case 1:
	default:
		return fmt.Errorf("edit %q: old string found %d times, must be unique: add context: %w", p, n, errdefs.ErrInvalidArgument)
	}
	return t.WriteFile(ctx, p, strings.Replace(text, old, new, 1))
}

// ListDir lists a directory of the workspace.
func (t *Tools) ListDir(ctx context.Context, p string) ([]FileInfo, error) {
	ents, err := t.ex.ListDir(ctx, p)
	if err != nil {
		return nil, fmt.Errorf("list_dir: %w", err)
	}
	return ents, nil
}

// Glob returns the workspace's files matching pattern (path.Match syntax
// per segment, and ** for any number of directories), relative to the
// workspace, sorted.
func (t *Tools) Glob(ctx context.Context, pattern string) ([]string, error) {
	if pattern == "" {
		return nil, fmt.Errorf("glob: empty pattern: %w", errdefs.ErrInvalidArgument)
	}
	if path.IsAbs(pattern) {
		abs, err := resolve(t.ex.Workspace(), pattern)
		if err != nil {
			return nil, fmt.Errorf("glob: %w", err)
		}
		pattern = rel(t.ex.Workspace(), abs)
	}
	if slices.Contains(strings.Split(pattern, "/"), "..") {
		return nil, fmt.Errorf("glob %q: .. leaves the workspace: %w", pattern, errdefs.ErrInvalidArgument)
	}
	if _, err := path.Match(strings.ReplaceAll(pattern, "**", "*"), ""); err != nil {
		return nil, fmt.Errorf("glob %q: %w", pattern, errors.Join(err, errdefs.ErrInvalidArgument))
	}
	segs := strings.Split(path.Clean(pattern), "/")
	var out []string
	visited := 0
	var walk func(dir string) error
	walk = func(dir string) error {
		ents, err := t.ex.ListDir(ctx, dir)
		if err != nil {
			return err
		}
		for _, e := range ents {
			if visited++; visited > t.lim.MaxWalk {
				return fmt.Errorf("glob %q: more than %d entries to visit: narrow the pattern: %w", pattern, t.lim.MaxWalk, errdefs.ErrResourceExhausted)
			}
			p := e.Name
			if dir != "." {
				p = dir + "/" + e.Name
			}
			if !e.IsDir() && matchGlob(segs, strings.Split(p, "/")) {
				if len(out) >= t.lim.MaxResults {
					return fmt.Errorf("glob %q: more than %d matches: %w", pattern, t.lim.MaxResults, errdefs.ErrResourceExhausted)
				}
				out = append(out, p)
			}
			if e.IsDir() {
				if err := walk(p); err != nil {
					return err
				}
			}
		}
		return nil
	}
	if err := walk("."); err != nil {
		return nil, fmt.Errorf("glob: %w", err)
	}
	slices.Sort(out)
	return out, nil
}

// matchGlob matches path segments against pattern segments; "**" matches
// zero or more segments.
func matchGlob(pat, segs []string) bool {
	if len(pat) == 0 {
		return len(segs) == 0
	}
	if pat[0] == "**" {
		for i := 0; i <= len(segs); i++ {
			if matchGlob(pat[1:], segs[i:]) {
				return true
			}
		}
		return false
	}
	if len(segs) == 0 {
		return false
	}
	ok, _ := path.Match(pat[0], segs[0])
	return ok && matchGlob(pat[1:], segs[1:])
}

// GrepMatch is one matching line.
type GrepMatch struct {
	Path string `json:"path"`
	Line int    `json:"line"`
	Text string `json:"text"`
}

// Grep returns the lines matching the regular expression pattern (RE2
// syntax) in the text files matching glob ("" means every file). Binary,
// non-UTF-8 and oversized files are skipped.
func (t *Tools) Grep(ctx context.Context, pattern, glob string) ([]GrepMatch, error) {
	re, err := regexp.Compile(pattern)
	if err != nil {
		return nil, fmt.Errorf("grep %q: %w", pattern, errors.Join(err, errdefs.ErrInvalidArgument))
	}
	if glob == "" {
		glob = "**"
	}
	files, err := t.Glob(ctx, glob)
	if err != nil {
		return nil, fmt.Errorf("grep: %w", err)
	}
	var out []GrepMatch
	for _, f := range files {
		text, err := t.readText(ctx, f)
		if err != nil {
			if errors.Is(err, errdefs.ErrInvalidArgument) || errors.Is(err, errdefs.ErrResourceExhausted) {
				continue // binary, not UTF-8, or too big
			}
			return nil, fmt.Errorf("grep: %w", err)
		}
		for i, line := range strings.Split(text, "\n") {
			if re.MatchString(line) {
				if len(out) >= t.lim.MaxResults {
					return out, fmt.Errorf("grep %q: more than %d matches: %w", pattern, t.lim.MaxResults, errdefs.ErrResourceExhausted)
				}
				out = append(out, GrepMatch{Path: f, Line: i + 1, Text: line})
			}
		}
	}
	return out, nil
}

// checkFile refuses what is not a regular file of a readable size.
func (t *Tools) checkFile(ctx context.Context, p string) error {
	fi, err := t.ex.Stat(ctx, p)
	if err != nil {
		return err
	}
	switch {
	case fi.IsDir():
		return fmt.Errorf("%q is a directory: %w", p, errdefs.ErrInvalidArgument)
	case !fi.Mode.IsRegular():
		// Symlinks included: a tool never follows one, in or out.
		return fmt.Errorf("%q is not a regular file (%v): %w", p, fi.Mode.Type(), errdefs.ErrInvalidArgument)
	}
	if fi.Size > t.lim.MaxFileBytes {
		return fmt.Errorf("%q: %d bytes, over the limit of %d: %w", p, fi.Size, t.lim.MaxFileBytes, errdefs.ErrResourceExhausted)
	}
	return nil
}

// readText reads a regular UTF-8 text file within the size limit.
func (t *Tools) readText(ctx context.Context, p string) (string, error) {
	if err := t.checkFile(ctx, p); err != nil {
		return "", err
	}
	b, err := t.ex.ReadFile(ctx, p)
	if err != nil {
		return "", err
	}
	if int64(len(b)) > t.lim.MaxFileBytes {
		return "", fmt.Errorf("%q: over the limit of %d bytes: %w", p, t.lim.MaxFileBytes, errdefs.ErrResourceExhausted)
	}
	if bytes.IndexByte(b[:min(len(b), 8000)], 0) >= 0 {
		return "", fmt.Errorf("%q is a binary file: %w", p, errdefs.ErrInvalidArgument)
	}
	if !utf8.Valid(b) {
		return "", fmt.Errorf("%q is not UTF-8 text: %w", p, errdefs.ErrInvalidArgument)
	}
	return string(b), nil
}

// ToolNames are the tools Call knows, in the names coding agents use.
var ToolNames = []string{"bash", "read_file", "write_file", "edit", "glob", "grep", "list_dir"}

// Call runs the tool name with its JSON arguments (as an LLM's tool call
// gives them) and returns its result as text.
func (t *Tools) Call(ctx context.Context, name string, args json.RawMessage) (string, error) {
	var a struct {
		Command string `json:"command"`
		Path    string `json:"path"`
		From    int    `json:"from"`
		To      int    `json:"to"`
		Content string `json:"content"`
		Old     string `json:"old"`
		New     string `json:"new"`
		Pattern string `json:"pattern"`
		Glob    string `json:"glob"`
	}
	if len(args) > 0 {
		if err := json.Unmarshal(args, &a); err != nil {
			return "", fmt.Errorf("tool %q: arguments: %w", name, errors.Join(err, errdefs.ErrInvalidArgument))
		}
	}
	js := func(v any, err error) (string, error) {
		if err != nil {
			return "", err
		}
		b, _ := json.Marshal(v)
		return string(b), nil
	}
	switch name {
	case "bash":
		return js(t.Bash(ctx, a.Command))
	case "read_file":
		return t.ReadFile(ctx, a.Path, a.From, a.To)
	case "write_file":
		return "ok", t.WriteFile(ctx, a.Path, a.Content)
	case "edit":
		return "ok", t.Edit(ctx, a.Path, a.Old, a.New)
	case "glob":
		return js(t.Glob(ctx, a.Pattern))
	case "grep":
		return js(t.Grep(ctx, a.Pattern, a.Glob))
	case "list_dir":
		ents, err := t.ListDir(ctx, a.Path)
		names := make([]string, len(ents))
		for i, e := range ents {
			names[i] = e.Name
			if e.IsDir() {
				names[i] += "/"
			}
		}
		return js(names, err)
	}
	return "", fmt.Errorf("tool %q: unknown (have %s): %w", name, strings.Join(ToolNames, ", "), errdefs.ErrNotFound)
}

// capBuffer keeps the first max bytes written and counts the rest.
type capBuffer struct {
	mu  sync.Mutex // guards buf and cut
	max int
	buf bytes.Buffer
	cut int
}

func (c *capBuffer) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	room := c.max - c.buf.Len()
	if room < len(p) {
		c.buf.Write(p[:max(room, 0)])
		c.cut += len(p) - max(room, 0)
	} else {
		c.buf.Write(p)
	}
	return len(p), nil
}

func (c *capBuffer) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return strings.ToValidUTF8(c.buf.String(), "\uFFFD")
}
