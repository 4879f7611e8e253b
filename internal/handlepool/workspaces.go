package handlepool

import (
	"errors"
	"sync"
	"sync/atomic"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// Workspace is device memory lent to the BLAS calls of one stream (or of one
// stream of a graph capture). Its fields do not change while it is lent.
type Workspace struct {
	Ptr  hal.Ptr
	Size int
}

// WorkspaceConfig says how Workspaces allocates and frees device memory and
// how it learns that a stream has passed the work queued on it.
type WorkspaceConfig[S any] struct {
	// Size is the size of a stream's workspace, and the least size of a
	// cuBLASLt workspace, in bytes (rounded up to 256).
	Size int
	// Alloc allocates n bytes for s; what names the kind of workspace for the
	// error message ("BLAS", "cuBLASLt", "BLAS (graph capture)", ...).
	Alloc func(s S, n int, what string) (hal.Ptr, error)
	// Free frees memory that Alloc returned.
	Free func(p hal.Ptr) error
	// Event returns a new event recorded on s: it completes once s has passed
	// the work queued on it so far. It fails when s is closing.
	Event func(s S) (hal.Event, error)
	// Closed reports whether s has been closed.
	Closed func(s S) bool
}

// Workspaces keeps a device's BLAS workspaces keyed by stream, as PyTorch keys
// its workspaces by (handle, stream): every stream has its own, so no two
// streams ever use one workspace at the same time, whichever handle they use.
// It also keeps per-stream cuBLASLt workspaces, which only grow (a grown-out
// one is freed once its stream has passed the work that may use it), and the
// workspaces of graph captures: while a stream is in a capture (begun on it,
// or joined by waiting on an event recorded in it) its BLAS calls get the
// capture's own workspaces, which the resulting graph owns.
//
// S is the stream type and E the event type (both used only as map keys).
// The methods are safe for concurrent use; none of them queues device work
// except Event (through LtExit), and none waits for device work.
type Workspaces[S, E comparable] struct {
	cfg WorkspaceConfig[S]

	mu      sync.Mutex
	ws      map[S]*Workspace // one workspace per stream: never shared by two streams
	lt      map[S]*ltState[S]
	retired []retired[S] // grown-out Lt workspaces, freed once their event completes
	// capt maps each stream in a capture to it; evCapt each event recorded in
	// a capture. ncapt counts captures in progress so that NoteRecord and
	// NoteWait skip the bookkeeping when there is none.
	capt   map[S]*capture[S]
	evCapt map[E]*capture[S]
	ncapt  atomic.Int32
	// epoch changes when a stream closes or a capture begins, is joined or
	// ends: a handle bound at another epoch re-checks its workspace.
	epoch atomic.Uint64
}

// ltState is one stream's cuBLASLt workspace.
type ltState[S any] struct {
	cur    *Workspace
	active int // LtEnter without LtExit on the stream
	// pending: grown out while callbacks were active; one of them may still
	// queue work with it. Retired (with an event) when the last one returns.
	pending []*Workspace
}

// retired is a grown-out cuBLASLt workspace: free once ev has completed.
type retired[S any] struct {
	w  *Workspace
	s  S
	ev hal.Event
}

// capture is one capture: its origin stream and the workspaces that calls
// recorded on each of its streams use (the streams of one capture run
// concurrently in the graph, so each has its own). Guarded by mu.
type capture[S comparable] struct {
	origin S
	ws     map[S]*Workspace // BLAS workspace per stream of the capture
	lt     map[S]*Workspace // cuBLASLt workspace per stream (grow-only)
	all    []*Workspace     // every workspace allocated for it, grown-out ones included
}

// Init prepares w; it must be called once before any other method.
func (w *Workspaces[S, E]) Init(cfg WorkspaceConfig[S]) {
	w.cfg = cfg
	w.ws = map[S]*Workspace{}
	w.lt = map[S]*ltState[S]{}
	w.capt = map[S]*capture[S]{}
	w.evCapt = map[E]*capture[S]{}
}

// Size is the configured workspace size in bytes.
func (w *Workspaces[S, E]) Size() int { return w.cfg.Size }

// Epoch changes whenever the workspace For returns may have changed for some
// stream (a stream closed; a capture began, was joined or ended).
func (w *Workspaces[S, E]) Epoch() uint64 { return w.epoch.Load() }

// AlignUp rounds n up to a multiple of 256 bytes.
func AlignUp(n int) int { return (n + 255) &^ 255 }

func (w *Workspaces[S, E]) alloc(s S, n int, what string) (*Workspace, error) {
	n = AlignUp(n)
	p, err := w.cfg.Alloc(s, n, what)
	if err != nil {
		return nil, err
	}
	return &Workspace{Ptr: p, Size: n}, nil
}

func (w *Workspaces[S, E]) free(ws *Workspace) error {
	if ws == nil || ws.Ptr == 0 {
		return nil
	}
	p := ws.Ptr
	ws.Ptr = 0
	return w.cfg.Free(p)
}

// Release frees ws (a graph's workspaces, from EndCapture). Freeing one twice
// is harmless.
func (w *Workspaces[S, E]) Release(ws []*Workspace) error {
	var errs []error
	for _, x := range ws {
		errs = append(errs, w.free(x))
	}
	return errors.Join(errs...)
}

// For returns the workspace s's BLAS calls use, allocating it on first use: s's
// own, or during a capture the capture's own for s. Handles bound to the same
// stream share it safely because the stream orders their work.
func (w *Workspaces[S, E]) For(s S) (*Workspace, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if c := w.capt[s]; c != nil {
		if x := c.ws[s]; x != nil {
			return x, nil
		}
		x, err := w.alloc(s, w.cfg.Size, "BLAS (graph capture)")
		if err != nil {
			return nil, err
		}
		c.ws[s] = x
		c.all = append(c.all, x)
		return x, nil
	}
	if x := w.ws[s]; x != nil {
		return x, nil
	}
	x, err := w.alloc(s, w.cfg.Size, "BLAS")
	if err != nil {
		return nil, err
	}
	w.ws[s] = x
	return x, nil
}

// Capturing reports whether s is in a graph capture now (one atomic load when
// no capture is under way).
func (w *Workspaces[S, E]) Capturing(s S) bool {
	if w.ncapt.Load() == 0 {
		return false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.capt[s] != nil
}

// Lt returns s's cuBLASLt workspace, grown to at least n bytes (and at least
// Size). Call it only between LtEnter(s) and LtExit(s), with s kept open. A
// grown-out workspace is retired by the LtExit that ends the last callback on
// s; during a capture it stays with the graph (recorded nodes use it).
func (w *Workspaces[S, E]) Lt(s S, n int) (*Workspace, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if c := w.capt[s]; c != nil {
		if x := c.lt[s]; x != nil && x.Size >= n {
			return x, nil
		}
		x, err := w.alloc(s, max(n, w.cfg.Size), "cuBLASLt (graph capture)")
		if err != nil {
			return nil, err
		}
		c.lt[s] = x
		c.all = append(c.all, x)
		return x, nil
	}
	st := w.lt[s]
	if st == nil {
		st = &ltState[S]{}
		w.lt[s] = st
	}
	if st.cur != nil && st.cur.Size >= n {
		return st.cur, nil
	}
	x, err := w.alloc(s, max(n, w.cfg.Size), "cuBLASLt")
	if err != nil {
		return nil, err
	}
	if st.cur != nil {
		// Work queued on s, or about to be queued by a callback in progress,
		// may still use the old one: retire it when the callbacks are done.
		st.pending = append(st.pending, st.cur)
	}
	st.cur = x
	return x, nil
}

// LtEnter notes a cuBLASLt callback on s starting.
func (w *Workspaces[S, E]) LtEnter(s S) {
	w.mu.Lock()
	defer w.mu.Unlock()
	st := w.lt[s]
	if st == nil && w.cfg.Closed(s) { // StreamClosed may have run: keep no entry for s
		return
	}
	if st == nil {
		st = &ltState[S]{}
		w.lt[s] = st
	}
	st.active++
}

// LtExit notes a cuBLASLt callback on s returning. When it was the last one,
// the workspaces grown out meanwhile can be used by nothing queued after now:
// an event recorded on s marks when they are free. It also frees retired
// workspaces whose event has completed.
func (w *Workspaces[S, E]) LtExit(s S) error {
	w.mu.Lock()
	st := w.lt[s]
	var pending []*Workspace
	if st != nil {
		st.active--
		if st.active == 0 && w.capt[s] == nil { // an event recorded in a capture would not mark s's eager work
			pending, st.pending = st.pending, nil
		}
	}
	w.mu.Unlock()
	var errs []error
	if len(pending) > 0 {
		errs = append(errs, w.retire(s, pending))
	}
	return errors.Join(append(errs, w.sweep(false))...)
}

// retire records an event on s after which ws are unused and queues them to be
// freed when it completes.
func (w *Workspaces[S, E]) retire(s S, ws []*Workspace) error {
	ev, err := w.cfg.Event(s)
	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil {
		if st := w.lt[s]; st != nil {
			// s is closing (or the event failed): StreamClosed frees them after
			// s's work, or a later callback retires them again.
			st.pending = append(st.pending, ws...)
			return nil
		}
		// StreamClosed already ran: s has no work left.
		var errs []error
		for _, x := range ws {
			errs = append(errs, w.free(x))
		}
		return errors.Join(errs...)
	}
	for _, x := range ws {
		w.retired = append(w.retired, retired[S]{w: x, s: s, ev: ev})
	}
	return nil
}

// sweep frees retired workspaces whose event has completed (all of them when
// all is set: the device is idle).
func (w *Workspaces[S, E]) sweep(all bool) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.retired) == 0 {
		return nil
	}
	var errs []error
	keep := w.retired[:0]
	done := map[hal.Event]bool{}
	for _, r := range w.retired {
		ok, seen := done[r.ev]
		if !seen {
			ok = all
			if !ok {
				q, err := r.ev.Query()
				ok = err == nil && q
			}
			done[r.ev] = ok
		}
		if ok {
			errs = append(errs, w.free(r.w))
		} else {
			keep = append(keep, r)
		}
	}
	for ev, ok := range done {
		if ok {
			errs = append(errs, ev.Destroy())
		}
	}
	clear(w.retired[len(keep):])
	w.retired = keep
	return errors.Join(errs...)
}

// StreamClosed frees s's workspaces (and those of a capture begun on s, which
// can no longer end). Call it once s's work has completed.
func (w *Workspaces[S, E]) StreamClosed(s S) error {
	w.mu.Lock()
	ws, lt := w.ws[s], w.lt[s]
	delete(w.ws, s)
	delete(w.lt, s)
	var capWS []*Workspace
	if c := w.capt[s]; c != nil {
		delete(w.capt, s)
		if c.origin == s { // the capture can never end: nothing will own its workspaces
			capWS = c.takeAll()
		}
	}
	w.epoch.Add(1)
	w.mu.Unlock()
	errs := []error{w.free(ws)}
	if lt != nil {
		errs = append(errs, w.free(lt.cur), w.Release(lt.pending))
	}
	errs = append(errs, w.Release(capWS))
	// s has no work left: its retired workspaces' events have completed.
	return errors.Join(append(errs, w.sweep(false))...)
}

// Close frees every workspace, captures' included. Call it once the device is
// idle; later calls allocate afresh.
func (w *Workspaces[S, E]) Close() error {
	w.mu.Lock()
	var ws []*Workspace
	for _, x := range w.ws {
		ws = append(ws, x)
	}
	for _, st := range w.lt {
		if st.cur != nil {
			ws = append(ws, st.cur)
		}
		ws = append(ws, st.pending...)
	}
	for _, c := range w.capt {
		ws = append(ws, c.takeAll()...)
	}
	w.ws, w.lt, w.capt, w.evCapt = map[S]*Workspace{}, map[S]*ltState[S]{}, map[S]*capture[S]{}, map[E]*capture[S]{}
	w.epoch.Add(1)
	w.mu.Unlock()
	return errors.Join(w.sweep(true), w.Release(ws))
}

// BeginCapture starts a capture on s: until EndCapture(s), BLAS calls on s (and
// on streams that join it through NoteWait) get the capture's workspaces. It
// returns false, changing nothing, when s is already in a capture.
func (w *Workspaces[S, E]) BeginCapture(s S) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.capt[s] != nil {
		return false
	}
	w.capt[s] = &capture[S]{origin: s, ws: map[S]*Workspace{}, lt: map[S]*Workspace{}}
	w.ncapt.Add(1)
	w.epoch.Add(1) // handles bound to s re-check their workspace
	return true
}

// EndCapture ends the capture begun on s and hands over its workspaces (the
// graph's to free with Release). It returns nil when no capture was begun on s
// (s may have joined one begun on another stream: that one goes on).
func (w *Workspaces[S, E]) EndCapture(s S) []*Workspace {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.capt[s]
	if c == nil || c.origin != s {
		return nil
	}
	for x, xc := range w.capt {
		if xc == c {
			delete(w.capt, x)
		}
	}
	for e, ec := range w.evCapt {
		if ec == c {
			delete(w.evCapt, e)
		}
	}
	w.ncapt.Add(-1)
	w.epoch.Add(1)
	return c.takeAll()
}

// NoteRecord tracks an event e recorded on s: when s is in a capture, a stream
// that later waits on e joins it (as in CUDA).
func (w *Workspaces[S, E]) NoteRecord(e E, s S) {
	if w.ncapt.Load() == 0 {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if c := w.capt[s]; c != nil {
		w.evCapt[e] = c
	} else {
		delete(w.evCapt, e)
	}
}

// NoteWait makes s join the capture e was recorded in, if any.
func (w *Workspaces[S, E]) NoteWait(s S, e E) {
	if w.ncapt.Load() == 0 {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if c := w.evCapt[e]; c != nil && w.capt[s] == nil {
		w.capt[s] = c
		w.epoch.Add(1)
	}
}

// Counts reports how many per-stream workspaces, cuBLASLt workspaces and
// retired (grown-out, not yet freed) cuBLASLt workspaces w holds.
func (w *Workspaces[S, E]) Counts() (perStream, lt, retired int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.ws), len(w.lt), len(w.retired)
}

// Bytes returns the bytes of the workspaces w holds for s outside any
// capture: its own BLAS workspace, its cuBLASLt one, and grown-out cuBLASLt
// ones not yet freed (pending or retired). A capture's workspaces belong to
// its graph and are not counted.
func (w *Workspaces[S, E]) Bytes(s S) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	if x := w.ws[s]; x != nil {
		n += x.Size
	}
	if st := w.lt[s]; st != nil {
		if st.cur != nil {
			n += st.cur.Size
		}
		for _, x := range st.pending {
			n += x.Size
		}
	}
	for _, r := range w.retired {
		if r.s == s {
			n += r.w.Size
		}
	}
	return n
}

// LiveBytes returns the bytes of ws not yet freed (see Release).
func LiveBytes(ws []*Workspace) int {
	n := 0
	for _, x := range ws {
		if x != nil && x.Ptr != 0 {
			n += x.Size
		}
	}
	return n
}

// Eager returns s's own workspace without allocating one (nil: none yet).
func (w *Workspaces[S, E]) Eager(s S) *Workspace {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.ws[s]
}

// takeAll hands over the capture's workspaces (mu held); later calls get none.
func (c *capture[S]) takeAll() []*Workspace {
	all := c.all
	c.all, c.ws, c.lt = nil, map[S]*Workspace{}, map[S]*Workspace{}
	return all
}
