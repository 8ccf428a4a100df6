package daemon

import (
	"fmt"
	"math"
	"regexp"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/deltabox/deltabox/errdefs"
)

// Input is validated here, at the edge, so that the backend only ever sees
// well-formed requests; each check fails with errdefs.ErrInvalidArgument.

var (
	// idRe is what a sandbox id may look like: the state manager picks the
	// ids, this only keeps obviously bad input (paths, empty, control
	// characters) away from it.
	idRe = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)
	// imageRe is an image name: "host", "ubuntu-24.04", "python:3.12".
	imageRe    = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$`)
	envKeyRe   = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	labelKeyRe = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9_./-]{0,126}[A-Za-z0-9])?$`)
)

const (
	maxPath       = 4096
	maxLabelValue = 1024
	maxArgs       = 64 << 10
	// maxCheckpointName is the longest checkpoint name, in bytes.
	maxCheckpointName = 128
)

// MaxFork is the most sandboxes one Fork makes.
const MaxFork = 256

func invalid(format string, args ...any) error {
	return fmt.Errorf("%s: %w", fmt.Sprintf(format, args...), errdefs.ErrInvalidArgument)
}

func validSandboxID(id string) error {
	if !idRe.MatchString(id) {
		return invalid("bad sandbox id %q", id)
	}
	return nil
}

func validCheckpointID(id string) error {
	if !idRe.MatchString(id) {
		return invalid("bad checkpoint id %q", id)
	}
	return nil
}

// validTreeID checks an id that names a sandbox or a checkpoint (Diff, Tree):
// which one it is, is the backend's business.
func validTreeID(id string) error {
	if !idRe.MatchString(id) {
		return invalid("bad sandbox or checkpoint id %q", id)
	}
	return nil
}

func validCheckpointName(name string) error {
	if len(name) > maxCheckpointName {
		return invalid("checkpoint name longer than %d bytes", maxCheckpointName)
	}
	if strings.ContainsFunc(name, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
		return invalid("checkpoint name %q contains a control character", name)
	}
	return nil
}

func validForkCount(n int32) error {
	if n < 1 || n > MaxFork {
		return invalid("fork count %d: want 1 to %d", n, MaxFork)
	}
	return nil
}

// validImageName accepts "" (the default image) only when allowEmpty.
func validImageName(name string, allowEmpty bool) error {
	if name == "" && allowEmpty {
		return nil
	}
	if !imageRe.MatchString(name) {
		return invalid("bad image name %q", name)
	}
	return nil
}

// validEnv checks that every entry is K=V with K a shell variable name.
func validEnv(env []string) error {
	for _, kv := range env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || !envKeyRe.MatchString(k) || strings.ContainsRune(v, 0) {
			return invalid("bad environment entry %q: want KEY=VALUE", kv)
		}
	}
	return nil
}

func validLabels(labels map[string]string) error {
	for k, v := range labels {
		if !labelKeyRe.MatchString(k) {
			return invalid("bad label key %q", k)
		}
		if len(v) > maxLabelValue || strings.ContainsAny(v, "\x00\n") {
			return invalid("bad value of label %q", k)
		}
	}
	return nil
}

// validPath checks an absolute path inside a sandbox. Where it resolves is
// safefs's business; here it only has to be a path at all.
func validPath(what, p string) error {
	switch {
	case p == "":
		return invalid("%s: empty path", what)
	case !strings.HasPrefix(p, "/"):
		return invalid("%s %q: not an absolute path", what, p)
	case len(p) > maxPath || strings.ContainsRune(p, 0):
		return invalid("%s: bad path", what)
	}
	return nil
}

func validArgv(argv []string) error {
	if len(argv) == 0 || argv[0] == "" {
		return invalid("empty command")
	}
	n := 0
	for _, a := range argv {
		if strings.ContainsRune(a, 0) {
			return invalid("argument %q contains a NUL byte", a)
		}
		n += len(a)
	}
	if n > maxArgs*16 {
		return invalid("command line too long")
	}
	return nil
}

func validLimit(what string, n int64) error {
	if n < 0 {
		return invalid("negative %s %d", what, n)
	}
	return nil
}

func validCPUs(c float64) error {
	if c < 0 || math.IsNaN(c) || math.IsInf(c, 0) {
		return invalid("bad cpus %v", c)
	}
	return nil
}

// duration converts an optional protobuf duration; nil is zero.
func duration(what string, d *durationpb.Duration) (time.Duration, error) {
	if d == nil {
		return 0, nil
	}
	if err := d.CheckValid(); err != nil {
		return 0, invalid("bad %s: %v", what, err)
	}
	v := d.AsDuration()
	if v < 0 {
		return 0, invalid("negative %s %v", what, v)
	}
	return v, nil
}
