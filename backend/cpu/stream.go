package cpu

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// streamIDs numbers streams process-wide; 0 means "no stream".
var streamIDs atomic.Uint64

// work is one queued item. Markers (event records) run even after the stream
// has failed, so that other streams waiting on them never hang.
type work struct {
	fn     func() error
	marker bool
}

// stream runs its queue in order on its own goroutine. All fields below mu are
// guarded by mu; cond is signalled on every change.
type stream struct {
	dev      *device
	id       uint64
	priority int
	exited   chan struct{}

	mu        sync.Mutex
	cond      *sync.Cond
	queue     []work
	submitted uint64
	completed uint64
	err       error // sticky: the first error raised by queued work
	destroyed bool
	capt      *capture // non-nil while the stream's work is being captured
}

func newStream(d *device, o hal.StreamOptions) *stream {
	s := &stream{dev: d, id: streamIDs.Add(1), priority: o.Priority, exited: make(chan struct{})}
	s.cond = sync.NewCond(&s.mu)
	go s.loop()
	return s
}

func (s *stream) loop() {
	defer close(s.exited)
	for {
		s.mu.Lock()
		for len(s.queue) == 0 && !s.destroyed {
			s.cond.Wait()
		}
		if len(s.queue) == 0 {
			s.mu.Unlock()
			return
		}
		w := s.queue[0]
		s.queue[0] = work{}
		s.queue = s.queue[1:]
		skip := s.err != nil && !w.marker
		s.mu.Unlock()

		var err error
		if w.marker {
			// A marker completes its event under mu, in the same critical section
			// as the stream's count: whoever sees the event done also sees every
			// earlier item of this stream done (Query, Synchronize), as on CUDA.
			s.mu.Lock()
			err = runWork(w.fn)
		} else {
			if !skip {
				err = runWork(w.fn)
			}
			s.mu.Lock()
		}
		s.completed++
		if err != nil && s.err == nil {
			s.err = fmt.Errorf("cpu: stream %d: asynchronous error (sticky: %w, every later call on it fails): %w", s.id, hal.ErrDeviceLost, err)
			s.dev.markLost(s.id, err)
		}
		s.cond.Broadcast()
		s.mu.Unlock()
	}
}

// runWork runs fn, turning a panic into an error so bad input never crashes
// the process.
func runWork(fn func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic in queued work: %v", r)
		}
	}()
	return fn()
}

// enqueue appends w. It fails on a destroyed stream and, like CUDA after an
// asynchronous error, on a stream whose work has failed.
func (s *stream) enqueue(call string, w work) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return fmt.Errorf("cpu: %s: stream %d is destroyed (use a live stream): %w", call, s.id, hal.ErrClosed)
	}
	if s.err != nil {
		return fmt.Errorf("cpu: %s: %w", call, s.err)
	}
	if err := s.dev.lostErr(call); err != nil {
		return err
	}
	if s.capt != nil {
		s.capt.add(w.fn)
		return nil
	}
	s.queue = append(s.queue, w)
	s.submitted++
	s.cond.Broadcast()
	return nil
}

func (s *stream) enqueueFn(call string, fn func() error) error {
	return s.enqueue(call, work{fn: fn})
}

// wait blocks until the work queued so far has run and returns the sticky error.
func (s *stream) wait() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	target := s.submitted
	for s.completed < target {
		s.cond.Wait()
	}
	if s.err != nil {
		return s.err
	}
	return s.dev.lostErr(fmt.Sprintf("stream %d", s.id))
}

// CopyHtoDAsync queues a copy of n bytes from host memory src to dst on this
// stream. src must stay alive and unchanged until the stream has passed the copy.
func (s *stream) CopyHtoDAsync(dst hal.Ptr, src unsafe.Pointer, n int) error {
	return s.enqueueBuilt("CopyHtoDAsync")(s.dev.copyHtoD("CopyHtoDAsync", dst, src, n))
}

// CopyDtoHAsync queues a copy of n bytes from src to host memory dst on this
// stream; dst is valid once the stream (or an event recorded after) completes.
func (s *stream) CopyDtoHAsync(dst unsafe.Pointer, src hal.Ptr, n int) error {
	return s.enqueueBuilt("CopyDtoHAsync")(s.dev.copyDtoH("CopyDtoHAsync", dst, src, n))
}

// CopyDtoDAsync queues a device-to-device copy of n bytes on this stream.
func (s *stream) CopyDtoDAsync(dst, src hal.Ptr, n int) error {
	return s.enqueueBuilt("CopyDtoDAsync")(s.dev.copyDtoD("CopyDtoDAsync", dst, src, n))
}

// MemsetAsync queues setting n bytes at dst to value on this stream.
func (s *stream) MemsetAsync(dst hal.Ptr, value byte, n int) error {
	return s.enqueueBuilt("MemsetAsync")(s.dev.memset("MemsetAsync", dst, value, n))
}

// enqueueBuilt returns a function that queues a validated closure or returns
// its validation error.
func (s *stream) enqueueBuilt(call string) func(fn func() error, err error) error {
	return func(fn func() error, err error) error {
		if err != nil {
			return err
		}
		return s.enqueueFn(call, fn)
	}
}

// Launch checks k's arguments now and queues its body on this stream; errors in
// the body (bad pointers) are sticky on the stream.
func (s *stream) Launch(k hal.Kernel, grid, block hal.Dim3, sharedMem int, args ...any) error {
	kk, ok := k.(*kernel)
	if !ok || kk == nil || kk.dev != s.dev {
		return fmt.Errorf("cpu: Launch: kernel %v does not come from this device's Kernel", k)
	}
	for _, g := range []struct {
		what string
		d    hal.Dim3
	}{{"grid", grid}, {"block", block}} {
		if g.d.X <= 0 || g.d.Y <= 0 || g.d.Z <= 0 {
			return fmt.Errorf("cpu: Launch %s: %s %+v must be positive in every dimension", kk.name, g.what, g.d)
		}
	}
	if sharedMem < 0 {
		return fmt.Errorf("cpu: Launch %s: negative shared memory %d", kk.name, sharedMem)
	}
	if err := kk.spec.check(kk.name, args); err != nil {
		return err
	}
	a := append([]any(nil), args...)
	d := s.dev
	return s.enqueueFn("Launch "+kk.name, func() error {
		if err := kk.spec.body(d, a); err != nil {
			return fmt.Errorf("kernel %s: %w", kk.name, err)
		}
		return nil
	})
}

// Wait makes later work on this stream wait until the work e captured at its
// most recent Record (before this call) completes. It does not block the host;
// an event never recorded is complete, so Wait queues nothing.
func (s *stream) Wait(e hal.Event) error {
	ev, ok := e.(*event)
	if !ok || ev == nil || ev.dev != s.dev {
		return fmt.Errorf("cpu: Wait: event %v does not come from this device's NewEvent", e)
	}
	m, capt, err := ev.state("Wait")
	if err != nil {
		return err
	}
	s.mu.Lock()
	switch {
	case capt != nil: // the event was recorded during a capture: s joins it
		if s.capt != nil && s.capt != capt {
			s.mu.Unlock()
			return fmt.Errorf("cpu: Wait: stream %d is already part of another capture", s.id)
		}
		s.capt = capt
		s.mu.Unlock()
		return nil // replay runs the capture's work in the order it was queued
	case s.capt != nil:
		s.mu.Unlock()
		return fmt.Errorf("cpu: Wait: stream %d is capturing and the event was not recorded in that capture; CUDA refuses this too", s.id)
	}
	s.mu.Unlock()
	if m == nil {
		return nil
	}
	return s.enqueueFn("Wait", func() error {
		<-m.done
		return nil
	})
}

// Synchronize blocks the host until all work queued so far has run and returns
// the stream's sticky error, if any. Safe for concurrent use.
func (s *stream) Synchronize() error {
	s.mu.Lock()
	destroyed, capturing := s.destroyed, s.capt != nil
	s.mu.Unlock()
	if destroyed {
		return fmt.Errorf("cpu: Synchronize: stream %d is destroyed: %w", s.id, hal.ErrClosed)
	}
	if capturing {
		return fmt.Errorf("cpu: Synchronize: stream %d is capturing: end the capture first", s.id)
	}
	return s.wait()
}

// Query reports whether all queued work has run, and the sticky error, if any.
func (s *stream) Query() (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.destroyed {
		return false, fmt.Errorf("cpu: Query: stream %d is destroyed: %w", s.id, hal.ErrClosed)
	}
	if s.capt != nil {
		return false, fmt.Errorf("cpu: Query: stream %d is capturing: end the capture first", s.id)
	}
	if s.err != nil {
		return s.completed == s.submitted, s.err
	}
	return s.completed == s.submitted, s.dev.lostErr("Query")
}

// Destroy lets the queued work finish, then stops the stream's goroutine. Later
// calls on the stream return errors. It blocks until the queue is drained.
func (s *stream) Destroy() error {
	s.mu.Lock()
	if s.destroyed {
		s.mu.Unlock()
		return fmt.Errorf("cpu: Destroy: stream %d is already destroyed: %w", s.id, hal.ErrClosed)
	}
	s.destroyed = true
	s.cond.Broadcast()
	s.mu.Unlock()
	<-s.exited
	s.dev.mu.Lock()
	delete(s.dev.streams, s.id)
	s.dev.mu.Unlock()
	return nil
}

// ID is unique among the streams of this process.
func (s *stream) ID() uint64 { return s.id }

// marker is one recorded point of a stream; done closes when the stream reaches
// it, after at has been set.
type marker struct {
	done chan struct{}
	at   time.Time
}

type event struct {
	dev    *device
	timing bool

	mu        sync.Mutex
	cur       *marker
	capt      *capture // the capture the last Record was made in, or nil
	destroyed bool
}

func (e *event) current(call string) (*marker, error) {
	m, _, err := e.state(call)
	return m, err
}

// state returns the last recorded marker and, when that Record was made during
// a capture that is still open, the capture.
func (e *event) state(call string) (*marker, *capture, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.destroyed {
		return nil, nil, fmt.Errorf("cpu: %s: event is destroyed: %w", call, hal.ErrClosed)
	}
	if e.capt != nil && e.capt.isEnded() {
		e.capt = nil
	}
	return e.cur, e.capt, nil
}

// Record captures the work queued on s so far: the event completes when s
// reaches this point. Safe for concurrent use with other events and streams.
func (e *event) Record(s hal.Stream) error {
	st, ok := s.(*stream)
	if !ok || st == nil || st.dev != e.dev {
		return fmt.Errorf("cpu: Event.Record: stream %v does not come from this device's NewStream", s)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.destroyed {
		return fmt.Errorf("cpu: Event.Record: event is destroyed: %w", hal.ErrClosed)
	}
	st.mu.Lock()
	capt := st.capt
	st.mu.Unlock()
	if capt != nil { // recorded into the capture: streams that wait on it join
		e.cur, e.capt = nil, capt
		return nil
	}
	e.capt = nil
	m := &marker{done: make(chan struct{})}
	if err := st.enqueue("Event.Record", work{marker: true, fn: func() error {
		m.at = time.Now()
		close(m.done)
		return nil
	}}); err != nil {
		return err
	}
	e.cur = m
	return nil
}

// Synchronize blocks the host until the most recently recorded work is done.
func (e *event) Synchronize() error {
	m, err := e.current("Event.Synchronize")
	if err != nil || m == nil {
		return err
	}
	<-m.done
	return nil
}

// Query reports whether the most recently recorded work is done.
func (e *event) Query() (bool, error) {
	m, err := e.current("Event.Query")
	if err != nil || m == nil {
		return err == nil, err
	}
	select {
	case <-m.done:
		return true, nil
	default:
		return false, nil
	}
}

// Elapsed returns the time from start's completion to e's. Both events must
// have been made with timing, recorded and completed.
func (e *event) Elapsed(start hal.Event) (time.Duration, error) {
	st, ok := start.(*event)
	if !ok || st == nil || st.dev != e.dev {
		return 0, fmt.Errorf("cpu: Elapsed: start event %v does not come from this device", start)
	}
	if !e.timing || !st.timing {
		return 0, fmt.Errorf("cpu: Elapsed: both events must be made with NewEvent(true): %w", hal.ErrInvalid)
	}
	var at [2]time.Time
	for i, ev := range []*event{st, e} {
		m, err := ev.current("Elapsed")
		if err != nil {
			return 0, err
		}
		if m == nil {
			return 0, errors.New("cpu: Elapsed: an event was never recorded; Record both first")
		}
		select {
		case <-m.done:
			at[i] = m.at
		default:
			return 0, errors.New("cpu: Elapsed: an event has not completed yet; Synchronize it first")
		}
	}
	return at[1].Sub(at[0]), nil
}

// Destroy releases the event; recorded work still completes and streams
// already waiting on it are unaffected.
func (e *event) Destroy() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.destroyed {
		return fmt.Errorf("cpu: Event.Destroy: event is already destroyed: %w", hal.ErrClosed)
	}
	e.destroyed = true
	return nil
}

var (
	_ hal.Stream = (*stream)(nil)
	_ hal.Event  = (*event)(nil)
)
