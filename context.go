package gpuctx

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpuctx/gpuctx/internal/hal"
	"github.com/gpuctx/gpuctx/internal/handlepool"
)

// HandlePolicy says how a Context gets BLAS handles.
type HandlePolicy int

const (
	// PooledHandles (the default): each device keeps, per flavour, a bounded pool
	// of handles shared by all its Contexts. A callback takes a free handle,
	// preferring one already bound to its stream, else creates one while the pool
	// is under its limit, else rebinds a free one, else waits. With no more
	// concurrent streams than the limit, steady state has no rebinds and no lock
	// waits: streams never serialise on one handle.
	PooledHandles HandlePolicy = iota
	// SharedHandle: one handle per flavour per Context, shared by all of the
	// Context's streams (the original framework's design). Every stream switch
	// rebinds it and concurrent callbacks on one Context serialise on its lock.
	// Kept so that benchmarks can compare the two.
	SharedHandle
)

// String returns "pooled" or "shared".
func (p HandlePolicy) String() string {
	if p == SharedHandle {
		return "shared"
	}
	return "pooled"
}

// Flavour selects a BLAS handle's math mode.
type Flavour int

const (
	// Default math: full-precision f32 and f64.
	Default Flavour = iota
	// TensorOp: tensor cores where the device has them (f16/bf16 inputs), default
	// math otherwise.
	TensorOp
	// TF32: TF32 tensor-core math for f32 GEMMs when the Context allows it
	// (ContextOptions.AllowTF32, off by default); default math otherwise.
	TF32
	numFlavours
)

// String returns "default", "tensor-op" or "tf32".
func (f Flavour) String() string {
	if f < 0 || f >= numFlavours {
		return fmt.Sprintf("Flavour(%d)", int(f))
	}
	return [...]string{"default", "tensor-op", "tf32"}[f]
}

// Workspace sizes: 32 MiB for compute capability >= 9.0, 4 MiB otherwise
// (cuBLAS's own recommendation), overridable with GPUCTX_BLAS_WORKSPACE (bytes)
// or ContextOptions.WorkspaceBytes.
const (
	WorkspaceHopper  = 32 << 20
	WorkspaceDefault = 4 << 20
	// WorkspaceEnv overrides the per-stream workspace size in bytes.
	WorkspaceEnv = "GPUCTX_BLAS_WORKSPACE"
	// MaxHandlesEnv overrides the per-device, per-flavour handle pool limit.
	MaxHandlesEnv = "GPUCTX_MAX_BLAS_HANDLES"
	// DefaultMaxHandles is the default pool limit per flavour per device. A cuBLAS
	// handle costs some device memory (its own state; the workspace is ours), so
	// the pool is bounded; 16 covers 16 concurrently busy streams without rebinds.
	DefaultMaxHandles = 16
)

// ContextOptions configures a Context.
type ContextOptions struct {
	// Stream is the initial current stream. If nil the Context makes a stream of
	// its own, which it closes at Close (or at SetStreamRelease).
	Stream *Stream
	// Policy chooses pooled handles (default) or one shared handle.
	Policy HandlePolicy
	// AllowTF32 lets the TF32 flavour use TF32 math for f32 GEMMs.
	AllowTF32 bool
	// UnsafeSharedWorkspace gives each handle one workspace for every stream, the
	// bug this package exists to prevent: two streams can then use the same
	// workspace at once. It exists only so tests can prove that the CPU backend's
	// detector catches it. Never set it in real code.
	UnsafeSharedWorkspace bool
}

// ContextStats are a Context's counters since it was made.
type ContextStats struct {
	HandlesCreated   int64         // library handles created on behalf of this Context
	Binds            int64         // SetStream calls on handles (first binds included)
	Rebinds          int64         // binds that moved a handle from another stream
	WorkspaceApplies int64         // SetWorkspace calls (after every bind on CUDA)
	LockWaits        int64         // callbacks that had to wait for a handle
	LockWait         time.Duration // total time spent waiting
}

// Context runs BLAS work on its current stream. Library handles are reached only
// through callbacks (Blas, BlasFlavour, BlasLt) that bind a handle to the stream
// that is current when the callback starts and hold the handle's lock until the
// callback returns. A Context is safe for concurrent use: SetStream may race with
// callbacks; each callback uses the stream it read when it started.
type Context struct {
	*ctxCore
	stream streamRef
}

// streamRef is a Context's current stream. Every read goes through Load, so
// that a test can watch each one: a callback must read it exactly once (the
// binding rule), and a test hook that switches the stream after every read
// turns a second read into a handle bound to one stream and lent for another,
// which the CPU backend refuses.
type streamRef struct{ p atomic.Pointer[Stream] }

// Load returns the current stream.
func (r *streamRef) Load() *Stream {
	s := r.p.Load()
	if h := testHooks.Load(); h != nil && h.streamRead != nil {
		h.streamRead(r, s)
	}
	return s
}

// Store makes s the current stream.
func (r *streamRef) Store(s *Stream) { r.p.Store(s) }

// Swap makes s the current stream and returns the previous one.
func (r *streamRef) Swap(s *Stream) *Stream { return r.p.Swap(s) }

// contractHooks are the binding contract's sync points, for tests only
// (export_test.go, contract_test.go); testHooks is nil otherwise. They run on
// the goroutine that reaches the point.
type contractHooks struct {
	// streamRead runs after every read of a Context's current stream.
	streamRead func(r *streamRef, s *Stream)
	// handleWait runs when a callback finds no free handle and is about to
	// wait for one.
	handleWait func()
	// opWait runs when a call through a lent handle, or the end of its
	// callback, finds another call in flight and is about to wait for it.
	opWait func()
}

var testHooks atomic.Pointer[contractHooks]

// hookHandleWait runs the handleWait hook, if any.
func hookHandleWait() {
	if h := testHooks.Load(); h != nil && h.handleWait != nil {
		h.handleWait()
	}
}

// hookOpWait runs the opWait hook, if any.
func hookOpWait() {
	if h := testHooks.Load(); h != nil && h.opWait != nil {
		h.opWait()
	}
}

// ctxCore is what a Context shares with its views (WithStream): handles,
// policy, counters and lifetime.
type ctxCore struct {
	dev   *Device
	opts  ContextOptions
	owned atomic.Pointer[Stream] // the stream the Context made, if any

	closed atomic.Bool
	mu     sync.Mutex                            // serialises creation of shared slots
	shared [numFlavours + 1]atomic.Pointer[slot] // SharedHandle policy: index numFlavours is Lt

	created, binds, rebinds, applies, waits atomic.Int64
	waitNanos                               atomic.Int64
}

// NewContext makes a Context on d. It fails, with an error wrapping ErrInvalid
// that names the variable and its accepted range, when $GPUCTX_MAX_BLAS_HANDLES
// or $GPUCTX_BLAS_WORKSPACE (read when the device was opened) is set to
// anything but an integer in that range. It queues nothing and waits for
// nothing (a stream it makes itself is new and empty).
func (d *Device) NewContext(o ContextOptions) (*Context, error) {
	if err := d.check("Device.NewContext"); err != nil {
		return nil, err
	}
	if err := d.blas.envErr; err != nil {
		return nil, fmt.Errorf("gpuctx: Device.NewContext: %w", err)
	}
	c := &Context{ctxCore: &ctxCore{dev: d, opts: o}}
	s := o.Stream
	if s == nil {
		var err error
		if s, err = d.NewStream(StreamOptions{}); err != nil {
			return nil, err
		}
		c.owned.Store(s)
	} else if err := c.checkStream("Device.NewContext", s); err != nil {
		return nil, err
	}
	c.stream.Store(s)
	d.mu.Lock()
	d.contexts[c.ctxCore] = struct{}{}
	d.mu.Unlock()
	return c, nil
}

func (c *Context) checkStream(op string, s *Stream) error {
	unlock, err := s.use(op)
	if err != nil {
		return err
	}
	unlock()
	if s.dev != c.dev {
		return fmt.Errorf("gpuctx: %s: stream of device %d given to a context of device %d: %w", op, s.dev.info.Index, c.dev.info.Index, ErrWrongDevice)
	}
	return nil
}

// WithStream returns a view of c whose current stream is s. The view shares c's
// handles, policy, counters and lifetime (closing either closes both); only the
// current stream is its own. Use one view per goroutine to drive several streams
// through one Context.
func (c *Context) WithStream(s *Stream) (*Context, error) {
	if err := c.check("Context.WithStream"); err != nil {
		return nil, err
	}
	if err := c.checkStream("Context.WithStream", s); err != nil {
		return nil, err
	}
	v := &Context{ctxCore: c.ctxCore}
	v.stream.Store(s)
	return v, nil
}

// Device returns the Context's device.
func (c *Context) Device() *Device { return c.dev }

// Stream returns the current stream.
func (c *Context) Stream() *Stream { return c.stream.Load() }

// SetStream makes s the current stream for callbacks that start after it
// returns; callbacks already running keep theirs. It returns the previous stream.
// A stream the Context made itself stays open until Close.
func (c *Context) SetStream(s *Stream) (prev *Stream, err error) {
	if err := c.check("Context.SetStream"); err != nil {
		return nil, err
	}
	if err := c.checkStream("Context.SetStream", s); err != nil {
		return nil, err
	}
	return c.stream.Swap(s), nil
}

// SetStreamRelease is SetStream that also closes the stream the Context made
// itself, if that was the current one (waiting for its queued work first).
func (c *Context) SetStreamRelease(s *Stream) error {
	prev, err := c.SetStream(s)
	if err != nil {
		return err
	}
	if own := c.owned.Load(); own != nil && own == prev && c.owned.CompareAndSwap(own, nil) {
		return own.Close()
	}
	return nil
}

// Stats returns the Context's counters.
func (c *Context) Stats() ContextStats {
	return ContextStats{
		HandlesCreated: c.created.Load(), Binds: c.binds.Load(),
		Rebinds: c.rebinds.Load(), WorkspaceApplies: c.applies.Load(), LockWaits: c.waits.Load(),
		LockWait: time.Duration(c.waitNanos.Load()),
	}
}

func (c *Context) check(op string) error {
	if c.closed.Load() {
		return fmt.Errorf("gpuctx: %s: context: %w", op, ErrClosed)
	}
	return nil
}

// Close waits for nothing itself but releases the Context: its shared handles
// (SharedHandle policy) and the stream it made (which waits for that stream's
// work). Pooled handles stay with the device for other Contexts. Double Close is
// harmless; callbacks after Close return ErrClosed.
func (c *Context) Close() error { return c.ctxCore.close() }

func (c *ctxCore) close() error {
	if !c.closed.CompareAndSwap(false, true) {
		return nil
	}
	// acquireShared creates slots under c.mu and re-checks closed there: taking
	// it once here waits for a creation in flight, so every slot is visible below.
	c.mu.Lock()
	var errs []error
	c.mu.Unlock()
	for i := range c.shared {
		if sl := c.shared[i].Load(); sl != nil {
			sl.Lock() // wait for a running callback
			errs = append(errs, sl.Handle.destroy(c.dev))
			sl.Unlock()
		}
	}
	if own := c.owned.Swap(nil); own != nil {
		errs = append(errs, own.Close())
	}
	c.dev.mu.Lock()
	delete(c.dev.contexts, c)
	c.dev.mu.Unlock()
	return errors.Join(errs...)
}

// slot is one library handle, its lock and what it is bound to: the handle
// pool's slot whose Handle is a binding. Its lock is held from binding until the
// callback that uses it returns.
type slot = handlepool.Slot[binding]

// binding is a library handle and the stream and workspace it is bound to,
// guarded by its slot's lock.
type binding struct {
	blas    hal.BlasHandle // nil for an Lt slot
	lt      hal.LtHandle
	flavour Flavour
	// sharedWS marks an UnsafeSharedWorkspace slot; pooled Contexts never mix them.
	sharedWS bool

	// check and ltBind are the handle's optional contract checks (the CPU
	// backend; nil elsewhere): see streamChecker and ltBinder.
	check  streamChecker
	ltBind ltBinder

	bound   *Stream               // stream the handle is bound to (nil: none yet)
	applied *handlepool.Workspace // workspace applied since the last bind
	epoch   uint64                // workspaces' epoch when applied was checked
	ownWS   *handlepool.Workspace // UnsafeSharedWorkspace only

	lease lease // what the slot lends to the callback holding its lock
}

// streamChecker is implemented by library handles that check the binding
// contract themselves (the CPU backend): CheckStream fails when the handle is
// not bound to s. enter calls it before every call through a lent handle, so
// that a handle bound to one stream and lent for another is caught.
type streamChecker interface {
	CheckStream(s hal.Stream) error
}

// ltBinder is implemented by cuBLASLt handles that record the stream they are
// lent for and refuse any other (the CPU backend; cuBLASLt itself takes the
// stream with every call). bind calls SetStream when the slot moves.
type ltBinder interface {
	SetStream(s hal.Stream) error
}

// lend records who holds sl (whose mu the caller holds) and returns the lease
// generation for the handle value given to the callback.
func (sl *binding) lend(c *Context, s *Stream) uint64 {
	// The previous holder's expire happens before our sl.mu acquisition, and
	// handles of older leases fail their generation check before they read c or s.
	l := &sl.lease
	l.c, l.s = c, s
	return l.gen()
}

// expire ends the current lease: every handle value lent so far is expired.
func (sl *binding) expire() {
	l := &sl.lease
	l.advance()
	l.c, l.s = nil, nil
}

func (sl *binding) destroy(d *Device) error {
	var errs []error
	if sl.blas != nil {
		errs = append(errs, sl.blas.Destroy())
	}
	if sl.lt != nil {
		errs = append(errs, sl.lt.Destroy())
	}
	if w := sl.ownWS; w != nil && w.Ptr != 0 {
		errs = append(errs, d.hd.Free(w.Ptr))
		w.Ptr = 0
	}
	sl.blas, sl.lt, sl.check, sl.ltBind = nil, nil, nil, nil
	return errors.Join(errs...)
}

// blasState is a device's BLAS handle pools and workspaces.
type blasState struct {
	dev *Device
	mu  sync.Mutex // guards closed
	// pools[u][f]: handles of flavour f (numFlavours: cuBLASLt); u == 1 holds the
	// UnsafeSharedWorkspace handles, which never serve a safe Context.
	pools  [2][numFlavours + 1]handlepool.Pool[binding]
	done   chan struct{}                          // closed at device Close: wakes every waiter
	spaces handlepool.Workspaces[*Stream, *Event] // per-stream and per-capture workspaces
	closed bool
	envErr error // an invalid $GPUCTX_MAX_BLAS_HANDLES or $GPUCTX_BLAS_WORKSPACE
}

func (bs *blasState) init(d *Device) {
	bs.dev = d
	bs.done = make(chan struct{})
	limit, err1 := envInt(MaxHandlesEnv, DefaultMaxHandles, 1, maxHandlesLimit)
	for u := range bs.pools {
		for f := range bs.pools[u] {
			unsafeWS, fl := u == 1, Flavour(f)
			bs.pools[u][f].Init(handlepool.Config[binding]{
				Limit:   limit,
				Done:    bs.done,
				New:     func(h *binding) error { return bs.newHandle(h, fl, unsafeWS) },
				Destroy: func(h *binding) error { return h.destroy(d) },
				Stale:   func(h *binding) bool { return h.bound == nil || h.bound.isClosed() },
				Wait:    hookHandleWait,
			})
		}
	}
	size := WorkspaceDefault
	if d.info.ComputeMajor >= 9 {
		size = WorkspaceHopper
	}
	size, err2 := envInt(WorkspaceEnv, size, 1, maxWorkspaceBytes)
	bs.envErr = errors.Join(err1, err2)
	bs.spaces.Init(handlepool.WorkspaceConfig[*Stream]{
		Size: size,
		Alloc: func(s *Stream, n int, what string) (hal.Ptr, error) {
			p, err := d.hd.Alloc(n)
			if err != nil {
				return 0, fmt.Errorf("gpuctx: allocating a %d-byte %s workspace for stream %d (size from $%s or the device default): %w", n, what, s.ID(), WorkspaceEnv, err)
			}
			return p, nil
		},
		Free:   d.hd.Free,
		Event:  eventOn,
		Closed: (*Stream).isClosed,
	})
}

// eventOn returns a new event recorded on s (failing when s is closed).
func eventOn(s *Stream) (hal.Event, error) {
	ev, err := s.dev.hd.NewEvent(false)
	if err != nil {
		return nil, err
	}
	unlock, err := s.use("BlasLt")
	if err == nil {
		err = ev.Record(s.hs)
		unlock()
	}
	if err != nil {
		_ = ev.Destroy()
		return nil, err
	}
	return ev, nil
}

// maxWorkspaceBytes is the largest accepted $GPUCTX_BLAS_WORKSPACE (4 GiB).
const maxWorkspaceBytes = 1 << 32

// envInt reads the integer environment variable name: def when it is unset or
// empty, an error naming the variable and the accepted range [lo, hi] when it
// is not an integer in that range (the default is used meanwhile).
func envInt(name string, def, lo, hi int) (int, error) {
	v, ok := os.LookupEnv(name)
	if !ok || strings.TrimSpace(v) == "" {
		return def, nil
	}
	n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
	if err != nil || n < int64(lo) || n > int64(hi) {
		return def, fmt.Errorf("gpuctx: $%s=%q: want an integer in [%d, %d]: %w", name, v, lo, hi, ErrInvalid)
	}
	return int(n), nil
}

// SetBlasHandleLimit sets the per-flavour pool limit of pooled BLAS handles
// (default DefaultMaxHandles or $GPUCTX_MAX_BLAS_HANDLES). Handles already
// created are kept.
func (d *Device) SetBlasHandleLimit(n int) error {
	if n < 1 {
		return fmt.Errorf("gpuctx: Device.SetBlasHandleLimit(%d): the limit must be >= 1: %w", n, ErrInvalid)
	}
	d.blas.setLimit(min(n, maxHandlesLimit))
	return nil
}

// maxHandlesLimit is the largest accepted per-flavour pool limit.
const maxHandlesLimit = 1 << 20

// WorkspaceBytes is the size of each stream's BLAS workspace on d.
func (d *Device) WorkspaceBytes() int { return d.blas.spaces.Size() }

func (bs *blasState) close() error {
	bs.mu.Lock()
	if bs.closed {
		bs.mu.Unlock()
		return nil
	}
	bs.closed = true
	close(bs.done) // first: no slot is added to a pool after this (see acquire)
	var slots []*slot
	for u := range bs.pools {
		for f := range bs.pools[u] {
			slots = append(slots, bs.pools[u][f].Drain()...)
		}
	}
	bs.mu.Unlock()
	var errs []error
	for _, sl := range slots {
		sl.Lock()
		errs = append(errs, sl.Handle.destroy(bs.dev))
		sl.Unlock()
	}
	// The device is idle (Device.Close synchronised it): every workspace,
	// retired ones included, can go.
	return errors.Join(append(errs, bs.spaces.Close())...)
}

// newHandle makes sl a handle of flavour f (f == numFlavours: cuBLASLt), with a
// workspace of its own when unsafeWS is set (UnsafeSharedWorkspace).
func (bs *blasState) newHandle(sl *binding, f Flavour, unsafeWS bool) error {
	d := bs.dev
	sl.flavour = f
	if f == numFlavours {
		h, err := d.hd.NewLtHandle()
		if err != nil {
			return fmt.Errorf("gpuctx: creating a cuBLASLt handle: %w", err)
		}
		sl.lt = h
		sl.ltBind, _ = h.(ltBinder)
		sl.check, _ = h.(streamChecker)
	} else {
		h, err := d.hd.NewBlasHandle()
		if err != nil {
			return fmt.Errorf("gpuctx: creating a BLAS handle: %w", err)
		}
		mode := hal.MathDefault
		switch f {
		case TensorOp:
			mode = hal.MathTensorOp
		case TF32:
			mode = hal.MathTF32
		}
		if err := h.SetMathMode(mode); err != nil {
			_ = h.Destroy()
			return fmt.Errorf("gpuctx: setting BLAS math mode %v: %w", f, err)
		}
		sl.blas = h
		sl.check, _ = h.(streamChecker)
	}
	if unsafeWS && sl.blas != nil {
		n := handlepool.AlignUp(bs.spaces.Size())
		p, err := d.hd.Alloc(n)
		if err != nil {
			_ = sl.destroy(d)
			return fmt.Errorf("gpuctx: allocating a %d-byte BLAS workspace (size from $%s or the device default): %w", n, WorkspaceEnv, err)
		}
		sl.ownWS = &handlepool.Workspace{Ptr: p, Size: n}
		sl.sharedWS = true
	}
	return nil
}

// setLimit changes the per-flavour limit of every pool, adjusting free tokens
// by the difference.
func (bs *blasState) setLimit(n int) {
	for u := range bs.pools {
		for f := range bs.pools[u] {
			bs.pools[u][f].SetLimit(n)
		}
	}
}

// acquire returns a slot of flavour f locked for the caller, preferring one bound
// to s. The caller must call c.release(sl). The pooled fast path takes no lock:
// a token CAS, then a TryLock scan of a copy-on-write slice of slots.
func (c *Context) acquire(f Flavour, s *Stream) (*slot, error) {
	if c.opts.Policy == SharedHandle {
		return c.acquireShared(f)
	}
	p, id := c.dev.blas.pool(f, c.opts.UnsafeSharedWorkspace), s.ID()
	if sl := p.TryAcquire(id); sl != nil {
		return sl, nil // steady state: a free handle already bound to s
	}
	sl, info, err := p.Acquire(id)
	if info.Waited {
		c.waits.Add(1)
	}
	if info.Wait != 0 {
		c.waitNanos.Add(int64(info.Wait))
	}
	if err != nil {
		return nil, fmt.Errorf("gpuctx: BLAS callback: %w", err)
	}
	if info.Created {
		c.created.Add(1)
	}
	return sl, nil
}

// isClosed reports whether s has been closed.
func (s *Stream) isClosed() bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.closed
}

func (bs *blasState) pool(f Flavour, unsafeWS bool) *handlepool.Pool[binding] {
	if unsafeWS {
		return &bs.pools[1][f]
	}
	return &bs.pools[0][f]
}

func (c *Context) acquireShared(f Flavour) (*slot, error) {
	sl := c.shared[f].Load()
	if sl == nil {
		c.mu.Lock()
		if c.closed.Load() {
			c.mu.Unlock()
			return nil, fmt.Errorf("gpuctx: BLAS callback: context: %w", ErrClosed)
		}
		if sl = c.shared[f].Load(); sl == nil {
			sl = new(slot)
			if err := c.dev.blas.newHandle(&sl.Handle, f, c.opts.UnsafeSharedWorkspace); err != nil {
				c.mu.Unlock()
				return nil, err
			}
			c.created.Add(1)
			c.shared[f].Store(sl)
		}
		c.mu.Unlock()
	}
	if !sl.TryLock() {
		hookHandleWait()
		c.waits.Add(1)
		t := time.Now()
		sl.Lock()
		c.waitNanos.Add(int64(time.Since(t)))
	}
	if sl.Handle.blas == nil && sl.Handle.lt == nil { // destroyed by Close while we waited
		sl.Unlock()
		return nil, fmt.Errorf("gpuctx: BLAS callback: context: %w", ErrClosed)
	}
	return sl, nil
}

// release unlocks sl and returns the caller's token to its pool.
func (c *Context) release(sl *slot) {
	if c.opts.Policy == SharedHandle {
		sl.Unlock()
		return
	}
	c.dev.blas.pool(sl.Handle.flavour, sl.Handle.sharedWS).Release(sl)
}

// bind makes sl's handle run on s with s's workspace: SetStream only when
// the bound stream differs (lazy), then the workspace again after every bind
// when the library drops it there (cuBLAS; rocBLAS keeps it), and, where the
// library asks (rocBLAS with a user-owned workspace), s ordered after the work
// the handle queued on its old stream. s is passed in, read once by the caller.
// The fast path (bound to s, s's workspace applied, and no stream closed or
// capture begun or ended since) reads one atomic; otherwise bind read-locks s
// for the bind, so that s cannot close meanwhile, and fails with ErrClosed if it
// is closed: a closed stream never gets a handle or a fresh workspace.
func (c *Context) bind(slt *slot, s *Stream) error {
	bs := &c.dev.blas
	epoch := bs.spaces.Epoch()
	sl := &slt.Handle
	if sl.blas != nil && sl.bound == s && sl.applied != nil && sl.ownWS == nil && sl.epoch == epoch {
		return nil // fast path: bound to s with s's workspace applied
	}
	keepsWS, needsIdle := vendorRule(sl.blas)
	var after hal.Event // recorded on the old stream; s waits on it before the move
	if needsIdle && sl.bound != nil && sl.bound != s && sl.applied != nil {
		var err error
		if after, err = c.markOldStream(sl.bound); err != nil {
			return err
		}
		if after != nil {
			defer func() { _ = after.Destroy() }()
		}
	}
	unlock, err := s.use("Context BLAS callback")
	if err != nil {
		return err
	}
	defer unlock()
	if sl.blas == nil {
		return bindLt(slt, s)
	}
	ws := sl.ownWS
	if ws == nil {
		if ws, err = bs.spaces.For(s); err != nil {
			return err
		}
	}
	if err := c.setStream(slt, s, after, keepsWS); err != nil {
		return err
	}
	if err := c.applyWorkspace(sl, s, ws); err != nil {
		return err
	}
	sl.epoch = epoch
	return nil
}

// vendorRule is the library's stream-move rule for h (hal.StreamBinder):
// cuBLAS drops the workspace on a rebind; rocBLAS keeps it but wants the old
// stream's work finished first when it is user-owned, which an event orders
// without blocking the host. A handle that does not say is treated as cuBLAS.
func vendorRule(h hal.BlasHandle) (keepsWS, needsIdle bool) {
	if b, ok := h.(hal.StreamBinder); ok {
		return b.SetStreamKeepsWorkspace(), b.NeedsOldStreamIdle()
	}
	return false, false
}

// bindLt records s as the stream of the cuBLASLt slot slt (which takes the
// stream with each call), so that the pool hands this slot to s again rather
// than making another, and tells a handle that checks its stream (ltBinder).
// s's lock is held.
func bindLt(slt *slot, s *Stream) error {
	sl := &slt.Handle
	if sl.bound == s {
		return nil
	}
	if sl.ltBind != nil {
		if err := sl.ltBind.SetStream(s.hs); err != nil {
			sl.bound = nil
			slt.SetBoundID(0)
			return fmt.Errorf("gpuctx: binding a cuBLASLt handle to stream %d: %w", s.ID(), err)
		}
	}
	sl.bound = s
	slt.SetBoundID(s.ID())
	return nil
}

// setStream binds the BLAS handle of slt to s when it is bound to another
// stream (none: a first bind), s first waiting on after (the old stream's
// end) when that is set. Unless the library keeps the workspace across the
// move (keepsWS), it forgets the applied one: cublasSetStream resets it to
// the library default, and applyWorkspace must set it again. s's lock is held.
func (c *Context) setStream(slt *slot, s *Stream, after hal.Event, keepsWS bool) error {
	sl := &slt.Handle
	if sl.bound == s {
		return nil
	}
	if after != nil {
		if err := s.hs.Wait(after); err != nil {
			return fmt.Errorf("gpuctx: ordering stream %d after the BLAS handle's old stream: %w", s.ID(), err)
		}
	}
	if err := sl.blas.SetStream(s.hs); err != nil {
		sl.bound, sl.applied = nil, nil
		slt.SetBoundID(0)
		return fmt.Errorf("gpuctx: binding a BLAS handle to stream %d: %w", s.ID(), err)
	}
	if sl.bound != nil {
		c.rebinds.Add(1)
	}
	c.binds.Add(1)
	sl.bound = s
	if !keepsWS {
		sl.applied = nil
	}
	slt.SetBoundID(s.ID())
	return nil
}

// applyWorkspace sets ws, s's workspace, on sl's BLAS handle unless it is the
// one applied since the last bind.
func (c *Context) applyWorkspace(sl *binding, s *Stream, ws *handlepool.Workspace) error {
	if sl.applied == ws {
		return nil
	}
	if err := sl.blas.SetWorkspace(ws.Ptr, ws.Size); err != nil {
		sl.applied = nil
		return fmt.Errorf("gpuctx: applying the %d-byte workspace of stream %d: %w", ws.Size, s.ID(), err)
	}
	c.applies.Add(1)
	sl.applied = ws
	return nil
}

// markOldStream records an event on old, the stream a handle is about to
// leave, so that the new stream can wait for the work the handle queued there
// (hal.StreamBinder.NeedsOldStreamIdle). It returns nil when there is nothing
// to wait for: old is capturing (its work runs later, from a graph with the
// graph's own workspace). When old is closing, its queued work may still run
// and its stream handle may be gone, so markOldStream waits for the whole
// device instead. It takes only old's lock, never two streams' locks at once.
func (c *Context) markOldStream(old *Stream) (hal.Event, error) {
	if c.dev.blas.spaces.Capturing(old) {
		return nil, nil
	}
	unlock, err := old.use("Context BLAS callback")
	if err != nil {
		if err := c.dev.hd.Synchronize(); err != nil {
			return nil, fmt.Errorf("gpuctx: waiting for the BLAS handle's closed stream %d: %w", old.ID(), err)
		}
		return nil, nil
	}
	defer unlock()
	ev, err := c.dev.hd.NewEvent(false)
	if err != nil {
		return nil, fmt.Errorf("gpuctx: an event to order a BLAS handle's move from stream %d: %w", old.ID(), err)
	}
	if err := ev.Record(old.hs); err != nil {
		_ = ev.Destroy()
		return nil, fmt.Errorf("gpuctx: recording the end of stream %d's BLAS work: %w", old.ID(), err)
	}
	return ev, nil
}

// Blas runs fn with a default-math BLAS handle bound to the Context's current
// stream (read once, when Blas starts). Every call made through h inside fn is
// queued on that stream; Blas does not wait for the work to finish. The handle's
// lock is held until fn returns (or panics), so no other goroutine can rebind it
// in between; h is unusable after fn returns. Blas waits for no device work; it
// may wait on the host for a free pooled handle (bounded by the pool limit). On a
// closed stream it returns an error wrapping ErrClosed without running fn.
// Blas returns fn's error.
func (c *Context) Blas(fn func(h Blas) error) error { return c.BlasFlavour(Default, fn) }

// BlasFlavour is Blas with a chosen math flavour (Default, TensorOp, TF32).
func (c *Context) BlasFlavour(f Flavour, fn func(h Blas) error) (err error) {
	if f < 0 || f >= numFlavours {
		return fmt.Errorf("gpuctx: Context.BlasFlavour: unknown flavour %d: %w", f, ErrInvalid)
	}
	if f == TF32 && !c.opts.AllowTF32 {
		f = Default
	}
	if err := c.check("Context.Blas"); err != nil {
		return err
	}
	s := c.stream.Load()
	sl, err := c.acquire(f, s)
	if err != nil {
		return err
	}
	defer c.release(sl)
	if err := c.bind(sl, s); err != nil {
		return err
	}
	gen := sl.Handle.lend(c, s)
	defer sl.Handle.expire() // runs before release: no call through the handle can follow it
	return fn(Blas{sl: sl, gen: gen})
}

// BlasLt runs fn with a cuBLASLt handle for the Context's current stream (read
// once, when BlasLt starts). Matmuls made through lt are queued on that stream
// with its persistent, grow-only workspace (a workspace grown out by Reserve is
// freed once the stream has passed the work queued with it; the current one
// when the stream or device closes; during a capture, the graph's own). BlasLt
// waits for no device work; it may wait on the host for a free handle. Lock and
// lifetime rules are those of Blas; on a closed stream it returns ErrClosed
// without running fn.
func (c *Context) BlasLt(fn func(lt BlasLt) error) (err error) {
	if err := c.check("Context.BlasLt"); err != nil {
		return err
	}
	s := c.stream.Load()
	sl, err := c.acquire(numFlavours, s)
	if err != nil {
		return err
	}
	defer c.release(sl)
	if err := c.bind(sl, s); err != nil {
		return err
	}
	ws := &c.dev.blas.spaces
	ws.LtEnter(s)
	defer func() {
		if e := ws.LtExit(s); err == nil && e != nil {
			err = e
		}
	}()
	gen := sl.Handle.lend(c, s)
	defer sl.Handle.expire()
	return fn(BlasLt{sl: sl, gen: gen})
}

// WorkspaceConflicts reports how many times the backend saw one BLAS workspace
// used by two streams at once, or -1 when the backend cannot tell (CUDA).
func (d *Device) WorkspaceConflicts() int64 {
	if wc, ok := d.hd.(hal.WorkspaceChecker); ok {
		return wc.WorkspaceConflicts()
	}
	return -1
}
