package harness

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/deltabox/deltabox/errdefs"
)

// The environment variables of LLMConfigFromEnv. The LLM policy is off
// unless EnvLLMURL is set.
const (
	EnvLLMURL   = "DELTABOX_LLM_URL"   // OpenAI-compatible base URL, e.g. http://localhost:8000/v1
	EnvLLMModel = "DELTABOX_LLM_MODEL" // model name
	EnvLLMKey   = "DELTABOX_LLM_API_KEY"
)

// LLMConfig names an OpenAI-compatible chat completions endpoint.
type LLMConfig struct {
	BaseURL string // .../v1; the policy posts to BaseURL + "/chat/completions"
	Model   string
	APIKey  string       // sent as a bearer token when set
	Client  *http.Client // nil means one with a 2-minute timeout
	// Task describes what the agent must achieve (the system prompt's core).
	Task string
	// Candidates is how many edits to ask for per state; 0 means 3.
	Candidates  int
	Temperature float64
}

// LLMConfigFromEnv reads the endpoint from the environment; ok is false
// when EnvLLMURL is unset (the LLM policy is off).
func LLMConfigFromEnv() (cfg LLMConfig, ok bool) {
	cfg = LLMConfig{BaseURL: os.Getenv(EnvLLMURL), Model: os.Getenv(EnvLLMModel), APIKey: os.Getenv(EnvLLMKey)}
	return cfg, cfg.BaseURL != ""
}

// NewLLMPolicy returns a Policy that shows the model the workspace's files
// and the path so far, and asks for candidate edits (exact string
// replacements) as a JSON array.
func NewLLMPolicy(cfg LLMConfig) (Policy, error) {
	if cfg.BaseURL == "" {
		return nil, fmt.Errorf("llm policy: no endpoint (set %s): %w", EnvLLMURL, errdefs.ErrInvalidArgument)
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{Timeout: 2 * time.Minute}
	}
	if cfg.Candidates <= 0 {
		cfg.Candidates = 3
	}
	return &llmPolicy{cfg: cfg}, nil
}

type llmPolicy struct{ cfg LLMConfig }

// llmEdit is one candidate the model proposes.
type llmEdit struct {
	Name string `json:"name"`
	Path string `json:"path"`
	Old  string `json:"old"`
	New  string `json:"new"`
}

const llmMaxContext = 48 << 10 // bytes of files shown to the model

func (p *llmPolicy) Propose(ctx context.Context, s State) ([]Action, error) {
	files, err := s.Tools.Glob(ctx, "**")
	if err != nil {
		return nil, fmt.Errorf("llm policy: %w", err)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "Steps taken so far: %q\n\nFiles of the workspace:\n", s.Path)
	for _, f := range files {
		text, err := s.Tools.ReadFile(ctx, f, 0, 0)
		if err != nil || b.Len()+len(text) > llmMaxContext {
			fmt.Fprintf(&b, "\n--- %s (not shown)\n", f)
			continue
		}
		fmt.Fprintf(&b, "\n--- %s\n%s", f, text)
	}
	fmt.Fprintf(&b, "\n\nPropose up to %d alternative next edits, best first. Reply with only a JSON array of "+
		`{"name": short label, "path": file, "old": exact text to replace (unique in the file), "new": replacement}.`, p.cfg.Candidates)
	content, err := p.chat(ctx, []chatMessage{
		{Role: "system", Content: "You are a coding agent. " + p.cfg.Task},
		{Role: "user", Content: b.String()},
	})
	if err != nil {
		return nil, err
	}
	edits, err := parseEdits(content)
	if err != nil {
		return nil, fmt.Errorf("llm policy: %w", err)
	}
	var acts []Action
	for i, e := range edits {
		if i == p.cfg.Candidates {
			break
		}
		name := e.Name
		if name == "" {
			name = fmt.Sprintf("edit %s #%d", e.Path, i+1)
		}
		acts = append(acts, EditAction(name, "", e.Path, e.Old, e.New))
	}
	return acts, nil
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// chat posts one chat completion request and returns the first choice's
// content.
func (p *llmPolicy) chat(ctx context.Context, msgs []chatMessage) (string, error) {
	body, _ := json.Marshal(map[string]any{"model": p.cfg.Model, "messages": msgs, "temperature": p.cfg.Temperature})
	url := strings.TrimSuffix(p.cfg.BaseURL, "/") + "/chat/completions"
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return "", fmt.Errorf("llm policy: %w", errors.Join(err, errdefs.ErrInvalidArgument))
	}
	req.Header.Set("Content-Type", "application/json")
	if p.cfg.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+p.cfg.APIKey)
	}
	resp, err := p.cfg.Client.Do(req)
	if err != nil {
		return "", fmt.Errorf("llm policy: %s: %w", url, errors.Join(err, errdefs.ErrUnavailable))
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return "", fmt.Errorf("llm policy: %s: %w", url, errors.Join(err, errdefs.ErrUnavailable))
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("llm policy: %s: %s: %.200s: %w", url, resp.Status, raw, errdefs.ErrUnavailable)
	}
	var out struct {
		Choices []struct {
			Message chatMessage `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(raw, &out); err != nil || len(out.Choices) == 0 {
		return "", fmt.Errorf("llm policy: %s: no choice in the answer %.200q: %w", url, raw, errdefs.ErrInternal)
	}
	return out.Choices[0].Message.Content, nil
}

// parseEdits finds the JSON array in a model's answer (fenced or not).
func parseEdits(content string) ([]llmEdit, error) {
	i, j := strings.Index(content, "["), strings.LastIndex(content, "]")
	if i < 0 || j < i {
		return nil, fmt.Errorf("no JSON array in the answer %.200q: %w", content, errdefs.ErrInvalidArgument)
	}
	var edits []llmEdit
	if err := json.Unmarshal([]byte(content[i:j+1]), &edits); err != nil {
		return nil, fmt.Errorf("answer %.200q: %w", content, errors.Join(err, errdefs.ErrInvalidArgument))
	}
	return edits, nil
}
