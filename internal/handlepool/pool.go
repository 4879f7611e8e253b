// Package handlepool keeps library handles (cuBLAS, cuBLASLt, rocBLAS) of one
// kind on one device: PyTorch's CublasHandlePool for Go.
//
// A Pool is a bounded set of handles of one kind, each with its own lock,
// handed to callers that prefer the handle already bound to their stream. The
// package knows nothing about how a handle is bound to a stream: the caller
// (package gpuctx) binds the handle it was lent while holding its lock, and
// applies the workspace that Workspaces gives the stream.
//
// Workspaces is the device memory those handles use, keyed by stream (as
// PyTorch keys its workspaces by handle and stream) so that no two streams
// share one: per-stream cuBLAS workspaces, grow-only cuBLASLt workspaces whose
// grown-out predecessors are freed once their stream has passed them, and the
// workspaces of graph captures, which the graph owns.
//
// Nothing here queues device work or waits for it, except the events that
// WorkspaceConfig.Event records; Pool.Acquire may wait on the host for a free
// handle.
package handlepool

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// Slot is one handle and the state its owner keeps with it (H). Its lock is the
// handle's lock: held from Acquire (or Lock) until Release (or Unlock), across
// the bind and every library call made through the handle.
type Slot[H any] struct {
	mu sync.Mutex
	// boundID is the ID of the stream the handle is bound to (0: none). It is
	// written under mu and read without it by the pool's lock-free scan.
	boundID atomic.Uint64
	// Handle is the owner's handle and binding state, guarded by mu.
	Handle H
}

// Lock takes the handle's lock.
func (s *Slot[H]) Lock() { s.mu.Lock() }

// TryLock takes the handle's lock if it is free.
func (s *Slot[H]) TryLock() bool { return s.mu.TryLock() }

// Unlock releases the handle's lock (not the pool token: see Pool.Release).
func (s *Slot[H]) Unlock() { s.mu.Unlock() }

// BoundID returns the ID of the stream the handle is bound to (0: none).
func (s *Slot[H]) BoundID() uint64 { return s.boundID.Load() }

// SetBoundID records the stream the handle is now bound to (lock held).
func (s *Slot[H]) SetBoundID(id uint64) { s.boundID.Store(id) }

// Config says how a Pool makes handles and which ones it prefers to rebind.
type Config[H any] struct {
	// Limit is the initial number of handles the pool may hold (>= 1).
	Limit int
	// Done is closed when the device closes: waiters wake and Acquire fails.
	Done <-chan struct{}
	// New initialises a new handle in place. It is called without the pool's
	// lock, at most Limit times concurrently.
	New func(h *H) error
	// Destroy releases a handle that New made (used when the device closed while
	// New ran).
	Destroy func(h *H) error
	// Stale reports whether a handle (whose lock the caller holds) is bound to no
	// stream or to a closed one: such handles are rebound first.
	Stale func(h *H) bool
	// Wait, when set, runs each time Acquire finds no free handle and is about
	// to wait for one (a sync point for tests; nil in production).
	Wait func()
}

// Pool is the handles of one kind on one device. A token semaphore bounds the
// number of handles held at once by the pool's limit; holding a token
// guarantees that a free handle exists or may be created. Waiting is on a
// per-waiter channel that is closed to hand it a token, so a wakeup cannot be
// lost: a releaser adds its token and then looks for waiters; a waiter
// registers and then looks for tokens; with sequentially consistent atomics at
// least one of the two sees the other. The fast path is one CAS for the token,
// a TryLock scan of the copy-on-write slot slice and one atomic add to release.
type Pool[H any] struct {
	cfg   Config[H]
	slots atomic.Pointer[[]*Slot[H]] // copy-on-write; appended under mu
	avail atomic.Int64               // free tokens (negative after the limit was lowered)
	nwait atomic.Int64               // len(waiters), readable without mu
	limit atomic.Int64

	mu       sync.Mutex
	waiters  []chan struct{} // FIFO; closed to hand the waiter a token
	creating int             // handles being created
}

// Init prepares p; call it once before any other method.
func (p *Pool[H]) Init(cfg Config[H]) {
	p.cfg = cfg
	p.limit.Store(int64(cfg.Limit))
	p.avail.Store(int64(cfg.Limit))
}

// Acquired says how Acquire got its handle.
type Acquired struct {
	Created bool          // the handle is new (New ran)
	Waited  bool          // the caller waited for a free handle
	Wait    time.Duration // time spent waiting (zero when Waited is false)
}

// Acquire returns a slot locked for the caller, preferring a free one bound to
// the stream with ID streamID, else a new one while the pool is under its
// limit, else a free one to rebind (stale ones first), else it waits for one.
// The caller must call Release(sl). It queues no device work and waits for
// none; it may wait on the host until another caller releases a handle. It
// fails, with an error wrapping hal.ErrClosed, once Done is closed, and with
// New's error. Safe for concurrent use.
func (p *Pool[H]) Acquire(streamID uint64) (sl *Slot[H], info Acquired, err error) {
	var waitStart time.Time
	if !p.tryTake() {
		waitStart = time.Now()
		waited, err := p.take()
		if err != nil {
			return nil, Acquired{Waited: waited, Wait: time.Since(waitStart)}, err
		}
		if waited {
			info.Waited = true
		} else {
			waitStart = time.Time{}
		}
	}
	// We hold a token: at most limit-1 other callers hold a slot, so a free
	// slot exists or the pool may grow.
	for {
		if sl := p.pickBound(streamID); sl != nil {
			return sl, info.since(waitStart), nil
		}
		// A handle whose stream is gone costs only a rebind; a new one holds
		// the library's device resources (cublasCreate allocates them) until
		// the device closes, so reuse it first.
		if !p.closed() {
			if sl := p.pickStale(); sl != nil {
				return sl, info.since(waitStart), nil
			}
		}
		p.mu.Lock()
		if p.closed() {
			p.mu.Unlock()
			p.give()
			return nil, info.since(waitStart), errDeviceClosed
		}
		if len(p.all())+p.creating < int(p.limit.Load()) {
			// A new handle is better than a rebind while under the limit.
			p.creating++
			p.mu.Unlock()
			sl := new(Slot[H])
			err := p.cfg.New(&sl.Handle)
			p.mu.Lock()
			p.creating--
			if err == nil && p.closed() {
				err = errDeviceClosed
				if p.cfg.Destroy != nil {
					err = joinErr(err, p.cfg.Destroy(&sl.Handle))
				}
			}
			if err != nil {
				p.mu.Unlock()
				p.give()
				return nil, info.since(waitStart), err
			}
			sl.mu.Lock() // new and unpublished: uncontended
			old := p.all()
			grown := append(old[:len(old):len(old)], sl)
			p.slots.Store(&grown)
			p.mu.Unlock()
			info.Created = true
			return sl, info.since(waitStart), nil
		}
		p.mu.Unlock()
		if sl := p.pickAny(); sl != nil {
			return sl, info.since(waitStart), nil
		}
		// Another token holder's scan has the free slot locked for a moment.
		runtime.Gosched()
	}
}

// TryAcquire is Acquire's fast path: it returns a free slot bound to stream
// streamID, locked for the caller (who must call Release), or nil, holding
// nothing, when there is none or no token is free. It never waits or creates.
func (p *Pool[H]) TryAcquire(streamID uint64) *Slot[H] {
	if !p.tryTake() {
		return nil
	}
	if sl := p.pickBound(streamID); sl != nil {
		return sl
	}
	p.give()
	return nil
}

func (a Acquired) since(start time.Time) Acquired {
	if !start.IsZero() {
		a.Wait = time.Since(start)
	}
	return a
}

// Release unlocks sl and returns the caller's token to the pool.
func (p *Pool[H]) Release(sl *Slot[H]) {
	sl.mu.Unlock()
	p.give()
}

// SetLimit changes the pool's limit, adjusting free tokens by the difference.
// Handles already made are kept.
func (p *Pool[H]) SetLimit(n int) {
	old := p.limit.Swap(int64(n))
	p.avail.Add(int64(n) - old)
	p.handOff()
}

// Slots returns the pool's slots (a snapshot, never modified in place).
func (p *Pool[H]) Slots() []*Slot[H] { return p.all() }

// Drain empties the pool and returns its slots, for destruction at device
// close (after Done is closed, so that no slot is added later).
func (p *Pool[H]) Drain() []*Slot[H] {
	p.mu.Lock()
	defer p.mu.Unlock()
	all := p.all()
	p.slots.Store(nil)
	return all
}

var errDeviceClosed = fmt.Errorf("handlepool: Acquire: device: %w", hal.ErrClosed)

func joinErr(a, b error) error {
	if b == nil {
		return a
	}
	return fmt.Errorf("%w (and destroying the new handle: %w)", a, b)
}

func (p *Pool[H]) closed() bool {
	select {
	case <-p.cfg.Done:
		return true
	default:
		return false
	}
}

// all returns the pool's slots (never modified in place).
func (p *Pool[H]) all() []*Slot[H] {
	if s := p.slots.Load(); s != nil {
		return *s
	}
	return nil
}

// tryTake takes a token if one is free.
func (p *Pool[H]) tryTake() bool {
	for {
		n := p.avail.Load()
		if n <= 0 {
			return false
		}
		if p.avail.CompareAndSwap(n, n-1) {
			return true
		}
	}
}

// testHookBeforeWait, set by tests only, runs when a caller has found no free
// handle and is about to wait for one: the window of a lost wakeup.
var testHookBeforeWait func()

// take takes a token, waiting for one; it fails once Done is closed.
func (p *Pool[H]) take() (waited bool, err error) {
	if p.tryTake() {
		return false, nil
	}
	if testHookBeforeWait != nil {
		testHookBeforeWait()
	}
	if p.cfg.Wait != nil {
		p.cfg.Wait()
	}
	p.mu.Lock()
	ch := make(chan struct{})
	p.waiters = append(p.waiters, ch)
	p.nwait.Add(1)
	// Registered: a release from now on sees nwait > 0 and hands out tokens
	// under mu. Look again for a token released before we registered.
	if p.tryTake() {
		p.unwait(ch)
		p.mu.Unlock()
		return false, nil
	}
	p.mu.Unlock()
	select {
	case <-ch:
		return true, nil
	case <-p.cfg.Done:
		p.mu.Lock()
		if p.unwait(ch) {
			p.mu.Unlock()
		} else { // handed a token as Done closed: give it back
			p.mu.Unlock()
			p.give()
		}
		return true, errDeviceClosed
	}
}

// unwait removes ch from the waiters (p.mu held) and reports whether it was
// there (false: a token was handed to it).
func (p *Pool[H]) unwait(ch chan struct{}) bool {
	for i, w := range p.waiters {
		if w == ch {
			p.waiters = append(p.waiters[:i], p.waiters[i+1:]...)
			p.nwait.Add(-1)
			return true
		}
	}
	return false
}

// give returns a token and hands free tokens to waiters, oldest first.
func (p *Pool[H]) give() {
	p.avail.Add(1)
	if p.nwait.Load() > 0 {
		p.handOff()
	}
}

func (p *Pool[H]) handOff() {
	p.mu.Lock()
	for len(p.waiters) > 0 && p.tryTake() {
		close(p.waiters[0])
		p.waiters = p.waiters[1:]
		p.nwait.Add(-1)
	}
	p.mu.Unlock()
}

// pickBound locks and returns a free slot bound to stream id, or nil.
func (p *Pool[H]) pickBound(id uint64) *Slot[H] {
	for _, sl := range p.all() {
		if sl.boundID.Load() == id && sl.mu.TryLock() {
			if sl.boundID.Load() == id {
				return sl
			}
			sl.mu.Unlock()
		}
	}
	return nil
}

// pickStale returns a free slot whose handle is stale (Stale; bound to no
// live stream), locked, or nil. Without a Stale function no slot is stale.
func (p *Pool[H]) pickStale() *Slot[H] {
	if p.cfg.Stale == nil {
		return nil
	}
	for _, sl := range p.all() {
		if sl.mu.TryLock() {
			if p.cfg.Stale(&sl.Handle) {
				return sl
			}
			sl.mu.Unlock()
		}
	}
	return nil
}

// pickAny locks and returns a free slot to rebind, or nil: first a stale one
// (bound to no stream or to a closed one: rebinding it takes no live stream's
// handle), then any.
func (p *Pool[H]) pickAny() *Slot[H] {
	if sl := p.pickStale(); sl != nil {
		return sl
	}
	for _, sl := range p.all() {
		if sl.mu.TryLock() {
			return sl
		}
	}
	return nil
}
