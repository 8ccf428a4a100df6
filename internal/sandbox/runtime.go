//go:build linux

// Package sandbox runs sandboxes: it owns their namespaces, root filesystem
// mounts, cgroups, seccomp filter, init process, the commands and sessions
// that run in them, and their teardown.
//
// # Words
//
// A sandbox is one isolated environment: user, mount, pid, net, uts, ipc and
// cgroup namespaces, a cgroup, a root filesystem (an overlay of the sandbox's
// active layer over the image's lowers, which are idmapped into its user
// namespace), and processes. Its pid 1 is our init (package initproc:
// deltabox-init, or a re-execution of the running binary), which reaps and
// starts processes at the daemon's request over a control socket (package
// initproto).
//
// # Lifecycle
//
//	rt.Start(ctx, spec)   namespaces + idmapped lowers + overlay + cgroup + init
//	sb.Exec / sb.Session  commands (each in its own child cgroup, killable as a
//	                      tree) and persistent bash/python sessions
//	sb.Freeze / sb.Thaw   the whole sandbox, for coupled checkpoints
//	sb.Destroy(ctx)       kill everything, unmount, remove the cgroup
//
// The runtime does not know about layer stores, images or metadata: the
// state manager gives it a Spec with the paths to mount.
package sandbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/inject"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/sandbox/cgroup"
	"github.com/deltabox/deltabox/internal/sandbox/initproc"
	"github.com/deltabox/deltabox/internal/sandbox/initproto"
	"github.com/deltabox/deltabox/internal/sandbox/seccomp"
	"github.com/deltabox/deltabox/internal/sandbox/seccomp/filter"
)

// IDMap places a sandbox's ids on the host: id n inside is HostBase+n.
type IDMap struct {
	HostBase uint32
	Size     uint32
}

// Spec is everything the runtime needs to start one sandbox.
type Spec struct {
	ID       string
	IDs      IDMap
	Hostname string
	// ImageLowers are the image's directories, top first; each is idmapped
	// into the sandbox's user namespace before it is stacked.
	ImageLowers []string
	// Layer is the view of the sandbox's active layer (upper, work and
	// committed lowers, which already hold shifted ids).
	Layer   layer.View
	Limits  Limits
	Env     []string // the default environment of every command
	Workdir string
}

// Runtime starts sandboxes. It is safe for concurrent use.
type Runtime struct {
	runDir     string // mount points and sockets, one directory per sandbox
	exe        string // the binary inits start from (see resolveInit)
	initBin    string // WithInitBinary
	initBinSet bool
	warm       int64 // WithWarm
	// turns bounds the spare generations booted ahead at once (see
	// background).
	turns    chan struct{}
	seccomp  bool
	filter   filter.Filter // the workload's seccomp filter, compiled once (nil without seccomp)
	standIn  string        // the root spare generations are set up on ahead (see setUpAhead)
	cgParent string        // cgroup parent directory, in every hierarchy
	log      *slog.Logger

	tracerOnce sync.Once
	tracer     *inject.Tracer // the ptrace thread of every template operation

	adoptMu sync.Mutex             // guards adopted
	adopted map[string]*generation // generations taken back from a previous daemon, by pid-start

	fanOutMu sync.Mutex
	fanOut   *Templates // the templates keeping spares for a fan-out (see FanOut)

	tidOnce    sync.Once
	hostTID    uintptr // where the host's libc keeps a thread's id (see tidOffset)
	hostTIDErr error
}

// RuntimeOpt configures a Runtime.
type RuntimeOpt func(*Runtime)

// WithoutSeccomp starts sandboxes without the seccomp filter (tests of the
// filter's interaction only).
func WithoutSeccomp() RuntimeOpt { return func(r *Runtime) { r.seccomp = false } }

// background runs f off the critical path, counted in wg (the caller adds
// to it), once it has its turn: booting an init costs milliseconds of CPU,
// and after a fork of many, each new sandbox wants its spare; booting them
// all at once would starve the sandboxes' own first steps. Half the CPUs
// boot at once. quit gives up the wait; f gets a minute.
func (r *Runtime) background(wg *sync.WaitGroup, quit <-chan struct{}, f func(ctx context.Context)) {
	go func() {
		defer wg.Done()
		select {
		case r.turns <- struct{}{}:
		case <-quit:
			return
		}
		defer func() { <-r.turns }()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		f(ctx)
	}()
}

// WithWarm has restores made ready ahead pre-fault, for writing, up to
// max bytes of the memory their templates wrote (0: off): the clones made
// ahead then no longer share those pages with the templates, so their first
// writes after the restore take no copy-on-write faults. It costs that much
// memory per restore made ready, off the critical path.
func WithWarm(max int64) RuntimeOpt { return func(r *Runtime) { r.warm = max } }

// WithCgroupParent puts sandbox cgroups under parent (default
// cgroup.DefaultParent; it must start with "deltabox"). Tests give each test
// process its own, so that leak checks attribute cgroups exactly.
func WithCgroupParent(parent string) RuntimeOpt { return func(r *Runtime) { r.cgParent = parent } }

// WithLogger sets the logger.
func WithLogger(l *slog.Logger) RuntimeOpt { return func(r *Runtime) { r.log = l } }

// NewRuntime returns a runtime that keeps its mount points under runDir.
func NewRuntime(runDir string, opts ...RuntimeOpt) (*Runtime, error) {
	// The init is exec'd through /proc/self/exe: the magic link reaches the
	// binary even where the sandbox's user cannot traverse the directories
	// above it (go run and go test build into 0700 directories).
	r := &Runtime{runDir: runDir, exe: "/proc/self/exe", seccomp: true, cgParent: cgroup.DefaultParent, log: slog.Default()}
	for _, o := range opts {
		o(r)
	}
	r.resolveInit()
	r.turns = make(chan struct{}, max(1, runtime.NumCPU()/2))
	if r.seccomp {
		f, err := seccomp.Compile(seccomp.Default())
		if err != nil {
			return nil, err
		}
		r.filter = f
	}
	if err := os.MkdirAll(runDir, 0o700); err != nil {
		return nil, fmt.Errorf("create run dir: %w", err)
	}
	r.standIn = filepath.Join(runDir, ".stand-in")
	if err := r.makeStandIn(); err != nil {
		return nil, err
	}
	return r, nil
}

// Sandbox is a running sandbox. It is safe for concurrent use.
type Sandbox struct {
	id       string
	dir      string // run directory
	hostname string
	lowers   []string
	ids      IDMap
	limits   Limits
	env      []string
	workdir  string
	cg       cgroup.Cgroup
	log      *slog.Logger
	rt       *Runtime

	mu        sync.Mutex  // guards the fields below
	g         *generation // the live generation (its init runs the sandbox's processes)
	rootfs    string      // host path of the mounted root
	execs     int
	rerooting bool // a restore is replacing the root: no new processes
	destroyed bool // Destroy released the live generation
	// spare is a child generation of g made ahead of time (see
	// prepareNext): a checkpoint takes it instead of booting an init.
	spare     *generation
	nexting   bool // prepareNext's job is queued or running
	nextAgain bool // prepareNext was asked again meanwhile
	// ahead are the next checkpoint's clones, made in the spare (see
	// cloneAhead), when aheadWanted asked for them; stepping says the
	// sandbox was checkpointed or restored since its last session call.
	ahead       *aheadClones
	aheadWanted bool
	aheadTries  int // clones made again after transient failures, this step (see aheadRetry)
	stepping    bool
	// writing counts the operations under way that may change the sandbox
	// without a session call (commands, files written from the host,
	// sessions starting: see changing), epoch their starts and ends: clones
	// are made ahead only while none runs, and kept only if none started.
	writing int
	epoch   uint64
	// view is the live root's layer; copier copies it ahead of a checkpoint
	// (see SetLayerCopier).
	view   layer.View
	copier LayerCopier
	// shellScript is the shell session shellOf's state (ShellState), read
	// ahead, while the session has not been called since.
	shellOf     *session
	shellScript string
	// spareRoot is the root the spare's init is set up on (rootInit),
	// "" while it waits for one: a spare set up on the live root takes a
	// checkpoint's root setup off its pause.
	spareRoot string
	// prepared are the generations of restores made ready (PrepareRoot),
	// which run in the sandbox's cgroup but are no workload.
	prepared map[*generation]*PreparedRoot
	preps    map[*prepRun]bool      // preparations in flight (see startPrep)
	settling map[chan struct{}]bool // teardowns under way (see Settle)
	leaving  map[int]bool           // host pids of a replaced generation's inits being torn down
	// leavingCgs are the session cgroups of a replaced generation, being
	// torn down.
	leavingCgs map[cgroup.Cgroup]bool
	// ancestors are inits of generations the live one nests below that
	// could not leave the sandbox's cgroup (see CheckpointTemplates).
	ancestors map[int]bool
	roots     int // a counter naming what must not reuse a name: mount points of roots, child cgroups
	sess      map[SessionKind]*session
	children  map[string]cgroup.Cgroup // child cgroups of commands and sessions
	replay    map[SessionKind]string   // session state to replay before the session's next call

	bg   sync.WaitGroup // background work (old roots being detached) Destroy waits for
	quit chan struct{}  // closed by Destroy: background work still queued gives up

	// switchMu is held for writing while the live generation is replaced
	// (a checkpoint's or restore's template path), for reading while a
	// process is started in it.
	switchMu sync.RWMutex
}

// cur returns the live generation.
func (s *Sandbox) cur() *generation {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.g
}

// ID returns the sandbox's id.
func (s *Sandbox) ID() string { return s.id }

// Rootfs returns the host path where the sandbox's root is mounted, for file
// operations from the host (internal/safefs confines them to it). A restore
// mounts the new root elsewhere, so ask again after one.
func (s *Sandbox) Rootfs() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rootfs
}

// OpenRoot returns where the sandbox's root is mounted for file operations
// from the host (internal/safefs confines them to it), and ends them with
// done. With write they may change it: clones made ahead are void then, and
// made again once done (see changing).
func (s *Sandbox) OpenRoot(write bool) (rootfs string, done func()) {
	// Not while a checkpoint switches roots (see CheckpointTemplates).
	s.switchMu.RLock()
	defer s.switchMu.RUnlock()
	done = func() {}
	if write {
		done = s.changing()
	}
	return s.Rootfs(), done
}

// changing registers an operation that may change the sandbox, its
// filesystem or its sessions' memory (process_vm_writev), without a session
// call: a command, files written from the host, a session starting. The
// clones made ahead are void; done ends it, and has them made again if
// there were.
func (s *Sandbox) changing() (done func()) {
	s.mu.Lock()
	s.writing++
	s.epoch++
	s.shellOf = nil // the shell's state read ahead, as the clones
	s.mu.Unlock()
	had := s.dropAhead()
	return func() {
		s.mu.Lock()
		s.writing--
		s.epoch++
		s.mu.Unlock()
		if had {
			s.wantAhead()
		}
	}
}

// InitPid returns the host pid of the sandbox's init.
func (s *Sandbox) InitPid() int { return s.cur().hostPid }

// Start starts a sandbox. On failure everything it did is undone.
func (r *Runtime) Start(ctx context.Context, spec Spec) (*Sandbox, error) {
	sb, err := r.Prepare(ctx, spec.ID, spec.IDs, spec.Limits)
	if err != nil {
		return nil, err
	}
	if err := r.Finish(ctx, sb, spec); err != nil {
		return nil, err
	}
	return sb, nil
}

// Prepare does the part of Start that does not depend on the root
// filesystem: the cgroup, and the init in its new namespaces, waiting for its
// root. A warm pool of prepared sandboxes takes the process boot off the path
// of a create. Finish completes it; Destroy discards it.
func (r *Runtime) Prepare(ctx context.Context, id string, ids IDMap, lim Limits) (*Sandbox, error) {
	return r.prepare(ctx, id, ids, lim, nil)
}

// prepare is Prepare; with gen, the sandbox's init is the generation gen
// returns (a child generation of templates, for a fork) instead of a new
// init in a new user namespace.
func (r *Runtime) prepare(ctx context.Context, id string, ids IDMap, lim Limits, gen func(context.Context, cgroup.Cgroup, *slog.Logger) (*generation, error)) (_ *Sandbox, err error) {
	if id == "" || ids.Size == 0 {
		return nil, fmt.Errorf("start sandbox: id and id map are required: %w", errdefs.ErrInvalidArgument)
	}
	dir := filepath.Join(r.runDir, id)
	if err := os.Mkdir(dir, 0o700); err != nil {
		if errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("start sandbox %q: %w", id, errdefs.ErrAlreadyExists)
		}
		return nil, fmt.Errorf("start sandbox %q: %w", id, err)
	}
	var undo []func()
	defer func() {
		if err != nil {
			for i := len(undo) - 1; i >= 0; i-- {
				undo[i]()
			}
			os.RemoveAll(dir)
			err = fmt.Errorf("start sandbox %q: %w", id, err)
		}
	}()
	tr := newTrace(ctx)
	defer tr.done(r.log, "prepare sandbox "+id)

	// 1. The cgroup, so that the init is in it before it can start anything.
	cg, err := cgroup.New(ctx, id, cgroup.Limits{MemoryBytes: lim.MemoryBytes, Pids: lim.Pids, CPUs: lim.CPUs}, cgroup.WithParent(r.cgParent))
	if err != nil {
		return nil, err
	}
	undo = append(undo, func() { _ = cg.Delete(context.Background()) })
	tr.step("cgroup")

	// 2. The init, in new namespaces. It boots while the root is mounted and
	//    waits for its config.
	sb := &Sandbox{
		id: id, dir: dir, rootfs: filepath.Join(dir, "rootfs"), ids: ids, cg: cg,
		log: r.log.With("sandbox", id), limits: lim, rt: r,
		sess: map[SessionKind]*session{}, children: map[string]cgroup.Cgroup{}, replay: map[SessionKind]string{},
		prepared: map[*generation]*PreparedRoot{}, preps: map[*prepRun]bool{}, settling: map[chan struct{}]bool{}, leaving: map[int]bool{}, leavingCgs: map[cgroup.Cgroup]bool{}, ancestors: map[int]bool{}, quit: make(chan struct{}),
		stepping: true, // its first call is a step towards its first checkpoint
	}
	if gen == nil {
		if err := r.spawnInit(sb, ids); err != nil {
			return nil, err
		}
	} else {
		g, err := gen(ctx, cg, sb.log)
		if err != nil {
			return nil, err
		}
		sb.g = g
	}
	tr.step("init spawn")
	return sb, nil
}

// Finish mounts a prepared sandbox's root (the image's lowers idmapped with
// the init's own user namespace, under the active layer) and has the init
// pivot into it. spec.ID and spec.IDs must be the ones it was prepared with.
// On failure the sandbox is destroyed.
func (r *Runtime) Finish(ctx context.Context, sb *Sandbox, spec Spec) (err error) {
	if spec.ID != sb.id || spec.IDs != sb.ids {
		return fmt.Errorf("finish sandbox %q: prepared as %q: %w", spec.ID, sb.id, errdefs.ErrInvalidArgument)
	}
	defer func() {
		if err != nil {
			_ = sb.Destroy(context.Background())
			err = fmt.Errorf("start sandbox %q: %w", spec.ID, err)
		}
	}()
	tr := newTrace(ctx)
	defer tr.done(r.log, "finish sandbox "+spec.ID)
	sb.env, sb.workdir = spec.Env, spec.Workdir
	if spec.Limits != sb.limits {
		if err := sb.cg.SetLimits(cgroup.Limits{MemoryBytes: spec.Limits.MemoryBytes, Pids: spec.Limits.Pids, CPUs: spec.Limits.CPUs}); err != nil {
			return err
		}
		sb.limits = spec.Limits
	}

	// 3. The image's lowers, idmapped with the init's own user namespace
	//    and read-only.
	userns, err := os.Open(fmt.Sprintf("/proc/%d/ns/user", sb.InitPid()))
	if err != nil {
		return fmt.Errorf("open the init's user namespace: %w", err)
	}
	defer userns.Close()
	for i, l := range spec.ImageLowers {
		target := filepath.Join(sb.dir, "lower"+strconv.Itoa(i))
		if err := os.Mkdir(target, 0o700); err != nil {
			return err
		}
		sb.lowers = append(sb.lowers, target) // Destroy unmounts them
		if err := idmapMount(l, target, userns); err != nil {
			return err
		}
	}
	tr.step("idmap")

	// 4. The root: overlay of the active layer over the image. The upper's
	//    root belongs to the sandbox's root user.
	if spec.Layer.Upper != "" {
		for _, d := range []string{spec.Layer.Upper, spec.Layer.Work} {
			if err := os.Chown(d, int(spec.IDs.HostBase), int(spec.IDs.HostBase)); err != nil {
				return fmt.Errorf("chown layer: %w", err)
			}
		}
	}
	if err := os.Mkdir(sb.rootfs, 0o755); err != nil {
		return err
	}
	if err := layer.MountOverlay(spec.Layer, sb.lowers, sb.rootfs); err != nil {
		return err
	}
	sb.mu.Lock()
	sb.view = spec.Layer
	sb.mu.Unlock()
	tr.step("overlay")

	// 5. The init sets the root up.
	sb.hostname = spec.Hostname
	if err := r.rootInit(ctx, sb, sb.cur(), sb.rootfs); err != nil {
		return err
	}
	tr.step("init setup")
	return nil
}

// spawnInit starts the init in new user, mount, pid, net, uts and ipc
// namespaces and puts it in the sandbox's cgroup; it then waits for its
// config.
func (r *Runtime) spawnInit(sb *Sandbox, ids IDMap) error {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("control socketpair: %w", err)
	}
	ours := os.NewFile(uintptr(fds[0]), "control")
	theirs := os.NewFile(uintptr(fds[1]), "control-init")
	defer theirs.Close()
	cmd := exec.Command(r.exe)
	cmd.Args = []string{"deltabox-init"}
	cmd.Env = initproc.Env()
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: unix.CLONE_NEWUSER | unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWNET |
			unix.CLONE_NEWUTS | unix.CLONE_NEWIPC,
		UidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(ids.HostBase), Size: int(ids.Size)}},
		GidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(ids.HostBase), Size: int(ids.Size)}},
		GidMappingsEnableSetgroups: true,
		// Become root of the new user namespace (host id HostBase): created
		// by host root, the child's ids are otherwise unmapped there and
		// exec would drop every capability.
		Credential: &syscall.Credential{Uid: 0, Gid: 0},
		Setsid:     true,
	}
	level, err := ownLevel()
	if err != nil {
		ours.Close()
		return err
	}
	if err := cmd.Start(); err != nil {
		ours.Close()
		return fmt.Errorf("start init: %w", err)
	}
	g := newGeneration(nil, sb.log)
	g.cmd, g.hostPid, g.level = cmd, cmd.Process.Pid, level+1
	sb.g = g
	c, err := initproto.NewConn(ours)
	ours.Close()
	if err != nil {
		g.kill()
		return err
	}
	// The generation's read loop owns the fd from here on.
	g.start(c)
	pid := cmd.Process.Pid
	// The daemon's memory matters more than the init's, and the init more
	// than the workload: never let the OOM killer pick the init.
	_ = os.WriteFile(fmt.Sprintf("/proc/%d/oom_score_adj", pid), []byte("-998"), 0)
	if err := sb.cg.Add(pid); err != nil {
		g.kill()
		return err
	}
	go func() { _ = cmd.Wait(); g.markDead() }()
	return nil
}

// setUpAhead sets a spare generation's init up before its sandbox is
// known: on the runtime's stand-in root (an empty directory tree with the
// mount points setupRoot uses), so that proc, sys, dev, masks, loopback and
// the pivot are done off the critical path; rootInit then only re-roots it
// into its sandbox's root (one pivot instead of some forty mounts).
func (r *Runtime) setUpAhead(ctx context.Context, g *generation) error {
	if _, err := sendRoot(ctx, g, initproto.OpConfig, &initproto.Config{Seccomp: r.filter}, r.standIn, nil); err != nil {
		return err
	}
	g.configured = true
	return nil
}

// makeStandIn makes the stand-in root of generations set up ahead:
// read-only to them (host root's, and they only mount on its directories).
func (r *Runtime) makeStandIn() error {
	for _, d := range []string{"proc", "sys", "dev", "tmp"} {
		if err := os.MkdirAll(filepath.Join(r.standIn, d), 0o755); err != nil {
			return fmt.Errorf("create the stand-in root: %w", err)
		}
	}
	return nil
}

// rootInit gives the init of g, a generation of sb, its root at rootfs:
// its config (it sets the root up), or, when it has one already (set up
// ahead on the stand-in, or on another root of the sandbox), a reroot into
// it.
func (r *Runtime) rootInit(ctx context.Context, sb *Sandbox, g *generation, rootfs string) error {
	home, err := sb.cg.TasksFile() // v1 only: nil on v2
	if err != nil {
		home = nil
	} else if home != nil {
		defer home.Close()
	}
	op, cfg := initproto.OpConfig, &initproto.Config{Hostname: sb.hostname, Seccomp: r.filter}
	if g.configured {
		op, cfg = initproto.OpReroot, &initproto.Config{Hostname: sb.hostname}
	}
	reply, err := sendRoot(ctx, g, op, cfg, rootfs, home)
	if err != nil {
		return err
	}
	g.configured = true
	sb.log.Debug("init ready", "steps", reply.Trace)
	return nil
}

// sendRoot sends g's init its root at rootfs (op config or reroot) with
// cfg and, when not nil, the sandbox cgroup's v1 tasks file, and waits for
// it to be ready. The init gets the root as a detached clone of its mount,
// which it attaches in its own mount namespace: the path of the host's
// mount lies below directories the sandbox's user may not traverse, and an
// fd of a mount of the host's namespace cannot be bound from another.
func sendRoot(ctx context.Context, g *generation, op string, cfg *initproto.Config, rootfs string, home *os.File) (initproto.Message, error) {
	tree, err := cloneMount(rootfs)
	if err != nil {
		return initproto.Message{}, err
	}
	defer tree.Close()
	files := []*os.File{tree}
	if home != nil {
		files = append(files, home)
	}
	reply, err := g.request(ctx, initproto.Message{Op: op, Config: cfg}, files...)
	if err != nil {
		return reply, fmt.Errorf("init %s: %w", op, err)
	}
	if reply.Op != initproto.OpReady {
		return reply, fmt.Errorf("init %s: unexpected %q", op, reply.Op)
	}
	return reply, nil
}

// cloneMount returns a detached clone of the mount at dir, to be attached in
// another mount namespace.
func cloneMount(dir string) (*os.File, error) {
	tfd, err := unix.OpenTree(unix.AT_FDCWD, dir, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
	if err != nil {
		return nil, fmt.Errorf("clone root mount: %w", err)
	}
	return os.NewFile(uintptr(tfd), "rootfs-tree"), nil
}

// idmapMount mounts a detached, idmapped, read-only clone of dir's mount at
// target. Only dir's own mount is cloned, never submounts: for the host image
// whose bottom lower is "/", that is the root filesystem alone.
func idmapMount(dir, target string, userns *os.File) error {
	fd, err := unix.OpenTree(unix.AT_FDCWD, dir, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return fmt.Errorf("open_tree %q: %w", dir, err)
	}
	defer unix.Close(fd)
	attr := unix.MountAttr{
		Attr_set:  unix.MOUNT_ATTR_IDMAP | unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NODEV,
		Userns_fd: uint64(userns.Fd()),
	}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &attr); err != nil {
		return fmt.Errorf("idmap %q: %w", dir, err)
	}
	if err := unix.MoveMount(fd, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach idmapped %q: %w", dir, err)
	}
	return nil
}

// Alive reports whether the sandbox's init still runs.
func (s *Sandbox) Alive() bool { return s.cur().alive() }

// request sends m to the live generation's init and waits for its answer.
func (s *Sandbox) request(ctx context.Context, m initproto.Message, files ...*os.File) (initproto.Message, error) {
	r, err := s.cur().request(ctx, m, files...)
	if err != nil && errors.Is(err, errdefs.ErrFailedPrecondition) {
		return r, fmt.Errorf("sandbox %q is not running: %w", s.id, errdefs.ErrFailedPrecondition)
	}
	return r, err
}

// Settle waits for the teardown of what a restore replaced (the old
// generation, its root's mount) that is under way when it is called. (Not
// a wait for all background work: that wait group is added to from zero
// again by spares in the making, which a concurrent Wait must not see.)
func (s *Sandbox) Settle() {
	s.mu.Lock()
	chs := make([]chan struct{}, 0, len(s.settling))
	for ch := range s.settling {
		chs = append(chs, ch)
	}
	s.mu.Unlock()
	for _, ch := range chs {
		<-ch
	}
}

// tearDown runs f, the teardown of something a restore replaced, in the
// background: Settle and Destroy wait for it.
func (s *Sandbox) tearDown(f func()) {
	ch := make(chan struct{})
	s.mu.Lock()
	s.settling[ch] = true
	s.mu.Unlock()
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		defer func() {
			s.mu.Lock()
			delete(s.settling, ch)
			s.mu.Unlock()
			close(ch)
		}()
		f()
	}()
}

// Freeze stops every process of the sandbox at once (the cgroup freezer), so
// that its filesystem and memory can be captured at one instant.
func (s *Sandbox) Freeze(ctx context.Context) error { return s.cg.Freeze(ctx) }

// Thaw resumes a frozen sandbox.
func (s *Sandbox) Thaw(ctx context.Context) error { return s.cg.Thaw(ctx) }

// Destroy kills every process of the sandbox and removes its mounts, cgroup
// and run directory. It is idempotent.
func (s *Sandbox) Destroy(ctx context.Context) error {
	s.interruptPreps(true)
	s.mu.Lock()
	for _, ss := range s.sess {
		ss.closePipes()
	}
	s.sess = map[SessionKind]*session{}
	s.mu.Unlock()
	var errs []error
	s.mu.Lock()
	g, done, spare, ah := s.g, s.destroyed, s.spare, s.ahead
	s.destroyed, s.spare, s.spareRoot, s.ahead = true, nil, "", nil
	if !done {
		close(s.quit)
	}
	s.mu.Unlock()
	if ah != nil {
		s.discardAhead(ah)
	}
	s.bg.Wait() // a spare generation in the making
	s.mu.Lock()
	preps := make([]*PreparedRoot, 0, len(s.prepared))
	for _, p := range s.prepared {
		preps = append(preps, p)
	}
	s.mu.Unlock()
	for _, p := range preps {
		p.Release()
	}
	s.mu.Lock()
	if s.spare != nil {
		spare, s.spare = s.spare, nil
	}
	s.mu.Unlock()
	if spare != nil {
		spare.release()
	}
	if g != nil && !done {
		g.release()
	}
	s.bg.Wait()
	if err := s.cg.Delete(ctx); err != nil {
		errs = append(errs, err)
	}
	errs = append(errs, removeRunDir(s.dir))
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("destroy sandbox %q: %w", s.id, err)
	}
	return nil
}

// removeRunDir unmounts what a sandbox's run directory holds (its roots,
// the current one and any a restore left, and the image lowers) and removes
// it.
func removeRunDir(dir string) error {
	var errs []error
	mounts, _ := filepath.Glob(filepath.Join(dir, "rootfs*"))
	lowers, _ := filepath.Glob(filepath.Join(dir, "lower*"))
	for _, m := range append(mounts, lowers...) {
		errs = append(errs, unmountIfMounted(m))
	}
	errs = append(errs, os.RemoveAll(dir))
	return errors.Join(errs...)
}

func unmountIfMounted(target string) error {
	err := layer.Unmount(target)
	if err != nil && (errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT)) {
		return nil
	}
	return err
}

// CleanOrphans removes what a previous daemon left under the run directory:
// the mounts and directories of sandboxes whose processes are gone, and their
// cgroups. It returns what it removed, for the log.
func (r *Runtime) CleanOrphans(ctx context.Context) ([]string, error) {
	entries, err := os.ReadDir(r.runDir)
	if err != nil {
		return nil, fmt.Errorf("clean orphans: %w", err)
	}
	var removed []string
	var errs []error
	for _, e := range entries {
		if !e.IsDir() || filepath.Join(r.runDir, e.Name()) == r.standIn {
			continue
		}
		dir := filepath.Join(r.runDir, e.Name())
		errs = append(errs, cgroup.Remove(ctx, e.Name(), cgroup.WithParent(r.cgParent)), removeRunDir(dir))
		removed = append(removed, e.Name())
	}
	return removed, errors.Join(errs...)
}
