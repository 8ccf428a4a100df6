//go:build linux

// Package statemgr owns the daemon's state: which sandboxes exist, their
// configuration, id ranges and layers, kept in bbolt so that it survives a
// daemon restart, and the wiring of the image store, the layer store and the
// sandbox runtime behind the API (it implements daemon.Backend).
package statemgr

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"
	"golang.org/x/sys/unix"

	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/daemon"
	"github.com/deltabox/deltabox/internal/image"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/layer/probe"
	"github.com/deltabox/deltabox/internal/safefs"
	"github.com/deltabox/deltabox/internal/sandbox"
	"github.com/deltabox/deltabox/internal/sysinfo"
)

// Version is the DeltaBox version the daemon reports.
const Version = "0.1.0-dev"

// Id ranges: sandbox k owns host ids [idBase+k*idSize, idBase+(k+1)*idSize),
// far above the host's own users and the usual /etc/subuid ranges.
const (
	idBase  = 1 << 24
	idSize  = 1 << 16
	maxIDKs = 4096
)

// Defaults applied to a sandbox created without limits.
const (
	DefaultMemory = 4 << 30
	DefaultPids   = 4096
)

var bucketSandboxes = []byte("sandboxes")

// record is a sandbox as stored in bbolt.
type record struct {
	ID      string         `json:"id"`
	Config  sandbox.Config `json:"config"`
	State   sandbox.State  `json:"state"`
	Created time.Time      `json:"created"`
	Layer   string         `json:"layer"`  // active layer id
	IDSlot  int            `json:"idslot"` // k of the id range
	Head    string         `json:"head,omitempty"`
}

func (r *record) ids() sandbox.IDMap {
	return sandbox.IDMap{HostBase: uint32(idBase + r.IDSlot*idSize), Size: idSize}
}

// openFiles opens the sandbox's root for file operations from the host, with
// the sandbox's ids; write says they may change it (see
// sandbox.Sandbox.OpenRoot). done ends them.
func (r *record) openFiles(sb *sandbox.Sandbox, write bool) (_ *safefs.Root, done func(), err error) {
	ids := r.ids()
	rootfs, end := sb.OpenRoot(write)
	root, err := safefs.Open(rootfs, safefs.IDMap{HostBase: ids.HostBase, Size: ids.Size})
	if err != nil {
		end()
		return nil, nil, err
	}
	return root, func() { root.Close(); end() }, nil
}

// Manager implements daemon.Backend. It is safe for concurrent use.
type Manager struct {
	root    string
	storage string
	db      *bolt.DB
	layers  layer.Store
	images  image.Store
	rt      *sandbox.Runtime
	log     *slog.Logger

	mu   sync.Mutex // guards live, busy and ops
	live map[string]*sandbox.Sandbox
	busy map[string]int         // running calls per sandbox
	ops  map[string]*sync.Mutex // per-sandbox lock of checkpoint, restore, delete

	bg sync.WaitGroup // background work: removals of replaced layers, spares, the templates' budget

	// layersMu orders layer creation against garbage collection: an
	// operation that makes a layer before a record references it (create,
	// fork, checkpoint, restore) holds it for reading from the layer's birth
	// until the record is written; gc and Fsck hold it for writing, so they
	// never see such a layer as unreferenced.
	layersMu sync.RWMutex

	// The warm pool (pool.go); nil when off.
	pool       chan warm
	refill     chan struct{}
	poolCancel context.CancelFunc
	poolDone   sync.WaitGroup
	spares     map[string]map[string]spare // spare branches of each sandbox, by checkpoint (spare.go; guarded by mu)
	spareSeq   uint64                      // the order spares are made in (guarded by mu)
	spareHead  map[string]string           // the checkpoint of each sandbox's latest spare asked for (guarded by mu)
	reserved   map[int]bool                // id ranges held for sandboxes not yet stored (guarded by mu)
	inflight   map[string]bool             // ids handed out, not yet stored or dropped (guarded by mu)

	// Process templates of checkpoints (templates.go; guarded by mu).
	tpl       map[string]*heldTemplates // by checkpoint
	tplGone   map[string]string         // checkpoint -> why its templates are gone
	tplBudget int64                     // bytes of private memory templates may hold
	keepTpl   bool                      // Close leaves them for the next daemon
	// budgeting: enforceBudgetLater's run is under way; budgetAgain: it
	// was asked for again meanwhile.
	budgeting, budgetAgain bool
}

var _ daemon.Backend = (*Manager)(nil)

// New opens (or creates) the state in opts.Root and recovers the sandboxes a
// previous daemon left: their processes are gone, their filesystems are not,
// so each is restarted on its own layer (recovered) or, if that fails,
// marked stopped (lost), and reported in the log.
func New(ctx context.Context, opts Options) (_ *Manager, err error) {
	if opts.Root == "" {
		return nil, fmt.Errorf("open state: no root: %w", errdefs.ErrInvalidArgument)
	}
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	if err := os.MkdirAll(opts.Root, 0o700); err != nil {
		return nil, fmt.Errorf("open state %q: %w", opts.Root, err)
	}
	m := &Manager{root: opts.Root, log: log, live: map[string]*sandbox.Sandbox{}, busy: map[string]int{},
		ops: map[string]*sync.Mutex{}, reserved: map[int]bool{}, inflight: map[string]bool{}, spares: map[string]map[string]spare{}, spareHead: map[string]string{},
		tpl: map[string]*heldTemplates{}, tplGone: map[string]string{}, tplBudget: opts.TemplateBudget,
		keepTpl: opts.KeepTemplates}
	if m.tplBudget <= 0 {
		var si unix.Sysinfo_t
		if err := unix.Sysinfo(&si); err == nil {
			m.tplBudget = int64(si.Totalram) * int64(si.Unit) / 4
		}
	}
	var closers []io.Closer
	defer func() {
		if err != nil {
			for i := len(closers) - 1; i >= 0; i-- {
				closers[i].Close()
			}
		}
	}()
	m.db, err = bolt.Open(filepath.Join(opts.Root, "meta.db"), 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("open metadata (is another daemon using %q?): %w", opts.Root, errors.Join(err, errdefs.ErrUnavailable))
	}
	closers = append(closers, m.db)
	if err := m.db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketSandboxes, bucketCheckpoints} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("init metadata: %w", err)
	}
	m.storage = opts.Storage
	if opts.Layers != nil {
		m.layers = opts.Layers
	} else {
		if m.storage == "" {
			m.storage = probe.DefaultKind(filepath.Join(opts.Root, "layers"))
		}
		m.layers, err = probe.Open(ctx, m.storage, filepath.Join(opts.Root, "layers"))
		if err != nil {
			return nil, err
		}
	}
	closers = append(closers, m.layers)
	m.images, err = image.New(opts.Root)
	if err != nil {
		return nil, err
	}
	if c, ok := m.images.(io.Closer); ok {
		closers = append(closers, c)
	}
	var rtOpts []sandbox.RuntimeOpt
	rtOpts = append(rtOpts, sandbox.WithLogger(log))
	if opts.CgroupParent != "" {
		rtOpts = append(rtOpts, sandbox.WithCgroupParent(opts.CgroupParent))
	}
	if opts.NoSeccomp {
		rtOpts = append(rtOpts, sandbox.WithoutSeccomp())
	}
	if opts.WarmRestores > 0 {
		rtOpts = append(rtOpts, sandbox.WithWarm(opts.WarmRestores))
	}
	if opts.InitBinary != "" {
		rtOpts = append(rtOpts, sandbox.WithInitBinary(opts.InitBinary))
	}
	m.rt, err = sandbox.NewRuntime(filepath.Join(opts.Root, "run"), rtOpts...)
	if err != nil {
		return nil, err
	}
	if err := m.recover(ctx); err != nil {
		return nil, err
	}
	if opts.WarmPool > 0 {
		pctx, cancel := context.WithCancel(context.Background())
		m.pool = make(chan warm, opts.WarmPool)
		m.refill = make(chan struct{}, 1)
		m.poolCancel = cancel
		m.poolDone.Add(1)
		go m.fillPool(pctx, opts.WarmPool)
	}
	return m, nil
}

// Close stops every sandbox's processes (their filesystems stay, and the next
// daemon restarts them) and closes the stores.
func (m *Manager) Close() error {
	m.drainPool()
	m.mu.Lock()
	live := m.live
	m.live = map[string]*sandbox.Sandbox{}
	m.mu.Unlock()
	var errs []error
	for _, sb := range live {
		if err := sb.Destroy(context.Background()); err != nil {
			errs = append(errs, err)
		}
	}
	m.bg.Wait()
	m.mu.Lock()
	var cks []string
	for id := range m.tpl {
		cks = append(cks, id)
	}
	m.mu.Unlock()
	for _, id := range cks {
		if m.keepTpl {
			m.mu.Lock()
			h := m.tpl[id]
			delete(m.tpl, id)
			m.mu.Unlock()
			h.ts.Disconnect()
			continue
		}
		m.dropTemplates(id, "")
	}
	m.dropSpares(context.Background(), func(string, spare) bool { return true })
	if c, ok := m.images.(io.Closer); ok {
		errs = append(errs, c.Close())
	}
	errs = append(errs, m.layers.Close(), m.db.Close())
	return errors.Join(errs...)
}

// recover reconciles what a previous daemon left: mounts under run/ are
// cleaned, and sandboxes that were running are restarted.
func (m *Manager) recover(ctx context.Context) error {
	removed, err := m.rt.CleanOrphans(ctx)
	for _, id := range removed {
		m.log.Warn("reconciled orphan mounts and cgroup of a previous daemon", "sandbox", id)
	}
	if err != nil {
		m.log.Warn("clean orphans", "err", err)
	}
	m.adoptTemplates(ctx)
	recs, err := m.records()
	if err != nil {
		return err
	}
	// Every stored sandbox was running (a record is written once it runs):
	// its processes are gone, its filesystem is not.
	for _, r := range recs {
		if _, err := m.startRecord(ctx, r); err != nil {
			m.log.Warn("sandbox lost: its processes are gone and it could not be restarted", "sandbox", r.ID, "err", err)
			r.State = sandbox.StateStopped
			_ = m.put(r)
			continue
		}
		m.log.Info("sandbox recovered: filesystem kept, processes restarted", "sandbox", r.ID)
	}
	for _, l := range m.gc(ctx) {
		m.log.Warn("removed an orphan layer no sandbox or checkpoint references", "layer", l)
	}
	return nil
}

func (m *Manager) SystemInfo(ctx context.Context) (daemon.SystemInfo, error) {
	p := sysinfo.Probe(ctx, sysinfo.SkipCRIUCheck())
	criu := ""
	if p.CRIU.Usable {
		criu = p.CRIU.Version
	}
	recs, err := m.records()
	if err != nil {
		return daemon.SystemInfo{}, err
	}
	imgs, err := m.images.List(ctx)
	if err != nil {
		return daemon.SystemInfo{}, err
	}
	nt, tb, budget := m.Templates()
	return daemon.SystemInfo{
		Templates: nt, TemplateBytes: tb, TemplateBudget: budget,
		Version: Version, Storage: m.storage, StateDir: m.root, Kernel: p.Kernel,
		CgroupMode: p.CgroupMode.String(), CRIU: criu, Btrfs: p.Btrfs, Overlay: p.Overlay,
		IDMapMounts: p.IDMappedMounts, Sandboxes: len(recs), Images: len(imgs),
	}, nil
}

var (
	envKeyRe = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	labelRe  = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$`)
	idRe     = regexp.MustCompile(`^sb-[0-9a-f]{8}$`)
)

func validateConfig(cfg *sandbox.Config) error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("invalid sandbox config: "+format+": %w", append(a, errdefs.ErrInvalidArgument)...)
	}
	for _, kv := range cfg.Env {
		k, _, ok := strings.Cut(kv, "=")
		if !ok || !envKeyRe.MatchString(k) {
			return bad("environment entry %q is not K=V", kv)
		}
	}
	for k := range cfg.Labels {
		if !labelRe.MatchString(k) {
			return bad("label key %q", k)
		}
	}
	if cfg.Workdir == "" {
		cfg.Workdir = "/work"
	}
	if !path.IsAbs(cfg.Workdir) {
		return bad("workdir %q is not absolute", cfg.Workdir)
	}
	cfg.Workdir = path.Clean(cfg.Workdir)
	if cfg.Limits.MemoryBytes < 0 || cfg.Limits.Pids < 0 || cfg.Limits.CPUs < 0 {
		return bad("negative limit")
	}
	if cfg.Limits.MemoryBytes > 0 && cfg.Limits.MemoryBytes < 16<<20 {
		return bad("memory limit %d is below 16 MiB", cfg.Limits.MemoryBytes)
	}
	if cfg.Limits.Pids > 0 && cfg.Limits.Pids < 8 {
		return bad("pids limit %d is below 8", cfg.Limits.Pids)
	}
	if cfg.Limits.MemoryBytes == 0 {
		cfg.Limits.MemoryBytes = DefaultMemory
	}
	if cfg.Limits.Pids == 0 {
		cfg.Limits.Pids = DefaultPids
	}
	if cfg.Image == "" {
		cfg.Image = image.HostImage
	}
	return nil
}

func (m *Manager) CreateSandbox(ctx context.Context, cfg sandbox.Config) (_ sandbox.Info, err error) {
	if err := validateConfig(&cfg); err != nil {
		return sandbox.Info{}, err
	}
	t0 := time.Now()
	defer func() { m.log.Debug("create", "total_ms", msSince(t0), "err", err) }()
	m.layersMu.RLock()
	defer m.layersMu.RUnlock()
	if _, err := m.images.Get(ctx, cfg.Image); err != nil {
		return sandbox.Info{}, fmt.Errorf("create sandbox: image %q: %w", cfg.Image, err)
	}
	// The id and id range are held in memory until the record is written,
	// once, when the sandbox runs: a crash before that leaves only an
	// unreferenced layer and run directory, which recovery removes.
	r := &record{Config: cfg, State: sandbox.StateRunning, Created: time.Now().UTC()}
	w, warmOK := m.takeWarm()
	if warmOK {
		defer m.kickRefill()
		r.ID, r.IDSlot = w.id, w.slot
	} else if r.ID, r.IDSlot, err = m.reserve(); err != nil {
		return sandbox.Info{}, err
	}
	defer m.unreserve(r.IDSlot) // the record holds the range once written
	defer func() {
		if err != nil {
			if warmOK {
				_ = w.sb.Destroy(context.Background())
			}
			if r.Layer != "" {
				_ = m.layers.Remove(context.Background(), r.Layer)
			}
		}
	}()
	active, err := m.layers.Branch(ctx, "", layer.WithLabels(map[string]string{"sandbox": r.ID}))
	if err != nil {
		return sandbox.Info{}, fmt.Errorf("create sandbox %q: %w", r.ID, err)
	}
	r.Layer = active.ID
	var prepared *sandbox.Sandbox
	if warmOK {
		prepared = w.sb
	}
	sb, err := m.startPrepared(ctx, r, prepared)
	warmOK = false // startPrepared destroyed or adopted it
	if err != nil {
		return sandbox.Info{}, err
	}
	return m.info(r, sb), nil
}

// startRecord starts the runtime side of a stored sandbox and marks it
// running.
func (m *Manager) startRecord(ctx context.Context, r *record) (*sandbox.Sandbox, error) {
	return m.startPrepared(ctx, r, nil)
}

// startPrepared is startRecord on a sandbox the warm pool prepared (nil:
// prepare one now). It consumes prepared: adopted on success, destroyed on
// failure.
func (m *Manager) startPrepared(ctx context.Context, r *record, prepared *sandbox.Sandbox) (_ *sandbox.Sandbox, err error) {
	return m.startWith(ctx, r, prepared, nil)
}

// startWith is startPrepared; with templates (and no prepared sandbox) the
// sandbox's processes are clones of them, in a generation nested under
// theirs (a fork on the template path).
func (m *Manager) startWith(ctx context.Context, r *record, prepared *sandbox.Sandbox, ts *sandbox.Templates) (_ *sandbox.Sandbox, err error) {
	img, err := m.images.Get(ctx, r.Config.Image)
	if err != nil {
		if prepared != nil {
			_ = prepared.Destroy(context.Background())
		}
		return nil, fmt.Errorf("start sandbox %q: image %q: %w", r.ID, r.Config.Image, err)
	}
	view, err := m.layers.Mounts(ctx, r.Layer)
	if err != nil {
		if prepared != nil {
			_ = prepared.Destroy(context.Background())
		}
		return nil, fmt.Errorf("start sandbox %q: %w", r.ID, err)
	}
	env := sandbox.MergeEnv(defaultEnv, img.Env)
	env = sandbox.MergeEnv(env, []string{"HOSTNAME=" + r.ID})
	env = sandbox.MergeEnv(env, r.Config.Env)
	spec := sandbox.Spec{
		ID: r.ID, IDs: r.ids(), Hostname: r.ID, ImageLowers: img.Lowers, Layer: view,
		Limits: r.Config.Limits, Env: env, Workdir: r.Config.Workdir,
	}
	sb := prepared
	switch {
	case ts != nil:
		sb, err = m.rt.ForkTemplates(ctx, spec, ts)
	case sb == nil:
		sb, err = m.rt.Start(ctx, spec)
	default:
		err = m.rt.Finish(ctx, sb, spec)
	}
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = sb.Destroy(context.Background())
		}
	}()
	// The workdir may be missing in an imported image.
	root, done, err := r.openFiles(sb, true)
	if err != nil {
		return nil, err
	}
	err = root.Mkdir(ctx, r.Config.Workdir, 0o755, true)
	done()
	if err != nil && !errdefs.IsAlreadyExists(err) {
		return nil, fmt.Errorf("create workdir %q: %w", r.Config.Workdir, err)
	}
	if _, ok := m.layers.(layer.Preparer); ok {
		sb.SetLayerCopier(layerCopier{m: m, id: r.ID})
	}
	r.State = sandbox.StateRunning
	if err := m.put(r); err != nil {
		return nil, err
	}
	m.mu.Lock()
	m.live[r.ID] = sb
	delete(m.inflight, r.ID)
	m.mu.Unlock()
	return sb, nil
}

var defaultEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"HOME=/root", "LANG=C.UTF-8", "TERM=xterm",
}

func (m *Manager) info(r *record, sb *sandbox.Sandbox) sandbox.Info {
	in := sandbox.Info{ID: r.ID, Config: r.Config, State: r.State, Created: r.Created, Head: r.Head}
	if sb != nil {
		if sb.Alive() {
			in.InitPid = sb.InitPid()
		} else {
			in.State = sandbox.StateStopped
		}
	}
	return in
}

func checkID(id string) error {
	if !idRe.MatchString(id) {
		return fmt.Errorf("sandbox id %q is malformed (want sb-xxxxxxxx): %w", id, errdefs.ErrInvalidArgument)
	}
	return nil
}

func (m *Manager) GetSandbox(ctx context.Context, id string) (sandbox.Info, error) {
	if err := checkID(id); err != nil {
		return sandbox.Info{}, err
	}
	r, err := m.get(id)
	if err != nil {
		return sandbox.Info{}, err
	}
	m.mu.Lock()
	sb := m.live[id]
	m.mu.Unlock()
	return m.info(r, sb), nil
}

func (m *Manager) ListSandboxes(ctx context.Context) ([]sandbox.Info, error) {
	recs, err := m.records()
	if err != nil {
		return nil, err
	}
	out := make([]sandbox.Info, 0, len(recs))
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, r := range recs {
		out = append(out, m.info(r, m.live[r.ID]))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out, nil
}

func (m *Manager) DeleteSandbox(ctx context.Context, id string, force bool) error {
	if err := checkID(id); err != nil {
		return err
	}
	unlock := m.opLock(id)
	defer unlock()
	r, err := m.get(id)
	if err != nil {
		return err
	}
	m.mu.Lock()
	if m.busy[id] > 0 && !force {
		m.mu.Unlock()
		return fmt.Errorf("delete sandbox %q: a command is running (use force): %w", id, errdefs.ErrFailedPrecondition)
	}
	sb := m.live[id]
	delete(m.live, id)
	m.mu.Unlock()
	if sb != nil {
		if err := sb.Destroy(ctx); err != nil {
			// Keep it tracked: Destroy is idempotent, and a retry (or the
			// daemon's close) finishes the teardown.
			m.mu.Lock()
			m.live[id] = sb
			m.mu.Unlock()
			return fmt.Errorf("delete sandbox %q: %w", id, err)
		}
	}
	m.bg.Wait() // a restore's old layer, or a spare, may still be on its way
	m.dropSpares(ctx, func(sb string, _ spare) bool { return sb == id })
	m.mu.Lock()
	delete(m.spareHead, id)
	m.mu.Unlock()
	if err := m.removeRecord(ctx, r); err != nil {
		return err
	}
	// Its layer may have been the last child of a deleted checkpoint's.
	m.gc(ctx)
	return nil
}

// removeRecord removes a sandbox's layer and record.
func (m *Manager) removeRecord(ctx context.Context, r *record) error {
	// The record goes first: a crash between the two then leaves an
	// unreferenced layer, which recovery's gc removes, never a record whose
	// layer is gone.
	if err := m.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSandboxes).Delete([]byte(r.ID))
	}); err != nil {
		return fmt.Errorf("remove sandbox %q: %w", r.ID, err)
	}
	m.mu.Lock()
	delete(m.ops, r.ID)
	m.mu.Unlock()
	if r.Layer != "" && !m.layerPinned(r.Layer) {
		if err := m.layers.Remove(ctx, r.Layer); err != nil && !errdefs.IsNotFound(err) {
			m.log.Warn("sandbox removed; its layer is left for gc", "sandbox", r.ID, "layer", r.Layer, "err", err)
		}
	}
	return nil
}

// acquire returns the live sandbox id and counts a call on it; release ends it.
func (m *Manager) acquire(id string) (*sandbox.Sandbox, func(), error) {
	if err := checkID(id); err != nil {
		return nil, nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	sb, ok := m.live[id]
	if !ok {
		if _, err := m.get(id); err != nil {
			return nil, nil, err
		}
		return nil, nil, fmt.Errorf("sandbox %q is stopped: %w", id, errdefs.ErrFailedPrecondition)
	}
	m.busy[id]++
	return sb, func() {
		m.mu.Lock()
		m.busy[id]--
		if m.busy[id] == 0 {
			delete(m.busy, id)
		}
		m.mu.Unlock()
	}, nil
}

func (m *Manager) Exec(ctx context.Context, id string, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	sb, release, err := m.acquire(id)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	defer release()
	return sb.Exec(ctx, req)
}

func (m *Manager) Session(ctx context.Context, id string, req sandbox.SessionRequest) (sandbox.ExecResult, error) {
	sb, release, err := m.acquire(id)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	defer release()
	return sb.Session(ctx, req)
}

func (m *Manager) Files(ctx context.Context, id string, write bool) (*safefs.Root, func(), error) {
	sb, release, err := m.acquire(id)
	if err != nil {
		return nil, nil, err
	}
	r, err := m.get(id)
	if err != nil {
		release()
		return nil, nil, err
	}
	root, done, err := r.openFiles(sb, write)
	if err != nil {
		release()
		return nil, nil, err
	}
	return root, func() { done(); release() }, nil
}

func (m *Manager) ImportImage(ctx context.Context, name string, r io.Reader) (image.Info, error) {
	return m.images.Import(ctx, name, r)
}

func (m *Manager) ListImages(ctx context.Context) ([]image.Info, error) { return m.images.List(ctx) }

func (m *Manager) RemoveImage(ctx context.Context, name string) error {
	recs, err := m.records()
	if err != nil {
		return err
	}
	for _, r := range recs {
		if r.Config.Image == name {
			return fmt.Errorf("remove image %q: used by sandbox %q: %w", name, r.ID, errdefs.ErrFailedPrecondition)
		}
	}
	return m.images.Remove(ctx, name)
}

// reserve picks a fresh sandbox id and a free id range (a new tree),
// without storing a record: both are held in memory until the record is
// written (or the caller lets them go).
func (m *Manager) reserve() (id string, slot int, err error) {
	used, ids, err := m.usedIDs()
	if err != nil {
		return "", 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	slot = -1
	for k := 0; k < maxIDKs; k++ {
		if !used[k] && !m.reserved[k] {
			slot = k
			break
		}
	}
	if slot < 0 {
		return "", 0, fmt.Errorf("all %d id ranges in use: %w", maxIDKs, errdefs.ErrResourceExhausted)
	}
	m.reserved[slot] = true
	return m.freshID(ids), slot, nil
}

// usedIDs reads the id ranges and sandbox ids the records hold. (m.mu is
// never taken inside a transaction: a bbolt writer waiting to remap would
// deadlock with a holder of m.mu opening a read transaction.)
func (m *Manager) usedIDs() (slots map[int]bool, ids map[string]bool, err error) {
	slots, ids = map[int]bool{}, map[string]bool{}
	err = m.db.View(func(tx *bolt.Tx) error {
		for _, bucket := range [][]byte{bucketSandboxes, bucketCheckpoints} {
			if err := tx.Bucket(bucket).ForEach(func(k, v []byte) error {
				var o struct {
					IDSlot int `json:"idslot"`
				}
				if json.Unmarshal(v, &o) == nil {
					slots[o.IDSlot] = true
				}
				if bucket[0] == bucketSandboxes[0] {
					ids[string(k)] = true
				}
				return nil
			}); err != nil {
				return err
			}
		}
		return nil
	})
	return slots, ids, err
}

// freshID returns a sandbox id that no record (ids) and no sandbox in
// flight has, and marks it in flight. The caller holds m.mu.
func (m *Manager) freshID(ids map[string]bool) string {
	for {
		id := newID("sb-")
		if !ids[id] && !m.inflight[id] {
			m.inflight[id] = true
			return id
		}
	}
}

func (m *Manager) unreserve(slot int) {
	m.mu.Lock()
	delete(m.reserved, slot)
	m.mu.Unlock()
}

func (m *Manager) put(r *record) error {
	v, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return m.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketSandboxes).Put([]byte(r.ID), v) })
}

func (m *Manager) get(id string) (*record, error) {
	var r *record
	err := m.db.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketSandboxes).Get([]byte(id))
		if v == nil {
			return fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
		}
		r = &record{}
		return json.Unmarshal(v, r)
	})
	return r, err
}

func (m *Manager) records() ([]*record, error) {
	var out []*record
	err := m.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSandboxes).ForEach(func(_, v []byte) error {
			r := &record{}
			if err := json.Unmarshal(v, r); err != nil {
				return err
			}
			out = append(out, r)
			return nil
		})
	})
	return out, err
}
