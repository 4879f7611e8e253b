package gpuctx

import (
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// StreamOptions configures a new stream.
type StreamOptions struct {
	// Blocking makes the stream synchronise with CUDA's legacy default stream
	// (the NULL stream, stream 0) of the device's primary context: work on a
	// blocking stream waits for earlier work on the NULL stream and the other
	// way round, as cuStreamCreate's default flag does. gpuctx has no default
	// stream and never queues work on the NULL stream itself, so this matters
	// only when other code in the process (a cgo library, a framework sharing
	// the primary context) issues work there. Streams are non-blocking by
	// default; the CPU backend ignores the flag (it has no NULL stream).
	//
	// The stream to use when you have none in mind is a Context's own: a
	// Context made with ContextOptions.Stream nil creates one, Context.Stream
	// returns it, and Context.Close closes it.
	Blocking bool
	// Priority: lower numbers run first when both are ready (CUDA convention).
	// 0 is the default priority; Device.PriorityRange gives the valid range.
	Priority int
}

// Stream is an ordered queue of device work. Work queued on one stream runs in
// the order it was queued; work on different streams may run concurrently. All
// methods queue work and return without waiting unless their doc says otherwise,
// and all are safe for concurrent use (work from concurrent callers is queued in
// some order).
type Stream struct {
	dev *Device
	hs  hal.Stream

	mu     sync.RWMutex // read-held while queueing, write-held by Close
	closed bool
}

// PriorityRange returns the least and greatest stream priority.
func (d *Device) PriorityRange() (least, greatest int) { return d.hd.PriorityRange() }

// NewStream makes a stream on d.
func (d *Device) NewStream(o StreamOptions) (*Stream, error) {
	if err := d.check("Device.NewStream"); err != nil {
		return nil, err
	}
	least, greatest := d.hd.PriorityRange()
	if o.Priority != 0 && (o.Priority > least || o.Priority < greatest) {
		return nil, fmt.Errorf("gpuctx: Device.NewStream: priority %d outside [%d (highest), %d (lowest)]: %w", o.Priority, greatest, least, ErrInvalid)
	}
	hs, err := d.hd.NewStream(hal.StreamOptions{NonBlocking: !o.Blocking, Priority: o.Priority})
	if err != nil {
		return nil, fmt.Errorf("gpuctx: Device.NewStream: %w", err)
	}
	s := &Stream{dev: d, hs: hs}
	d.mu.Lock()
	d.streams[s] = struct{}{}
	d.mu.Unlock()
	return s, nil
}

// Device returns the stream's device.
func (s *Stream) Device() *Device { return s.dev }

// ID is a process-unique number for the stream (never reused).
func (s *Stream) ID() uint64 { return s.hs.ID() }

// use read-locks s for the duration of an enqueue; the returned func unlocks.
func (s *Stream) use(op string) (func(), error) {
	if s == nil {
		return nil, fmt.Errorf("gpuctx: %s: nil stream: %w", op, ErrInvalid)
	}
	s.mu.RLock()
	if s.closed {
		s.mu.RUnlock()
		return nil, fmt.Errorf("gpuctx: %s: stream %d: %w", op, s.hs.ID(), ErrClosed)
	}
	return s.mu.RUnlock, nil
}

func rangeCheck(op string, b *Buffer, off, n int) error {
	if off < 0 || n < 0 || off+n > b.size {
		return fmt.Errorf("gpuctx: %s: device range [%d, %d) outside a %d-byte buffer: %w", op, off, off+n, b.size, ErrSize)
	}
	return nil
}

// CopyHtoD queues a copy of n bytes from src[srcOff:] to dst[dstOff:] on s.
// src must stay untouched until the stream has passed the copy.
func (s *Stream) CopyHtoD(dst *Buffer, dstOff int, src *HostBuffer, srcOff, n int) error {
	const op = "Stream.CopyHtoD"
	unlock, err := s.use(op)
	if err != nil {
		return err
	}
	defer unlock()
	if err := dst.onDevice(op, s.dev); err != nil {
		return err
	}
	if err := src.valid(op, srcOff, n); err != nil {
		return err
	}
	if err := rangeCheck(op, dst, dstOff, n); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	if t := s.dev.tracer.Load(); t != nil {
		defer t.begin(s, "memcpy HtoD", "copy", map[string]any{"bytes": n})()
	}
	return s.hs.CopyHtoDAsync(dst.ptr()+hal.Ptr(dstOff), unsafe.Add(src.p, srcOff), n)
}

// CopyDtoH queues a copy of n bytes from src[srcOff:] to dst[dstOff:] on s. The
// host bytes are valid once the stream (or an event after it) has completed.
func (s *Stream) CopyDtoH(dst *HostBuffer, dstOff int, src *Buffer, srcOff, n int) error {
	const op = "Stream.CopyDtoH"
	unlock, err := s.use(op)
	if err != nil {
		return err
	}
	defer unlock()
	if err := src.onDevice(op, s.dev); err != nil {
		return err
	}
	if err := dst.valid(op, dstOff, n); err != nil {
		return err
	}
	if err := rangeCheck(op, src, srcOff, n); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	if t := s.dev.tracer.Load(); t != nil {
		defer t.begin(s, "memcpy DtoH", "copy", map[string]any{"bytes": n})()
	}
	return s.hs.CopyDtoHAsync(unsafe.Add(dst.p, dstOff), src.ptr()+hal.Ptr(srcOff), n)
}

// CopyDtoD queues a device-to-device copy of n bytes on s.
func (s *Stream) CopyDtoD(dst *Buffer, dstOff int, src *Buffer, srcOff, n int) error {
	const op = "Stream.CopyDtoD"
	unlock, err := s.use(op)
	if err != nil {
		return err
	}
	defer unlock()
	if err := dst.onDevice(op, s.dev); err != nil {
		return err
	}
	if err := src.onDevice(op, s.dev); err != nil {
		return err
	}
	if err := rangeCheck(op, dst, dstOff, n); err != nil {
		return err
	}
	if err := rangeCheck(op, src, srcOff, n); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	if t := s.dev.tracer.Load(); t != nil {
		defer t.begin(s, "memcpy DtoD", "copy", map[string]any{"bytes": n})()
	}
	return s.hs.CopyDtoDAsync(dst.ptr()+hal.Ptr(dstOff), src.ptr()+hal.Ptr(srcOff), n)
}

// Memset queues setting every byte of b to v on s.
func (s *Stream) Memset(b *Buffer, v byte) error {
	const op = "Stream.Memset"
	unlock, err := s.use(op)
	if err != nil {
		return err
	}
	defer unlock()
	if err := b.onDevice(op, s.dev); err != nil {
		return err
	}
	if b.size == 0 {
		return nil
	}
	if t := s.dev.tracer.Load(); t != nil {
		defer t.begin(s, "memset", "copy", map[string]any{"bytes": b.size})()
	}
	return s.hs.MemsetAsync(b.ptr(), v, b.size)
}

// Kernel is a compiled kernel of one device.
type Kernel struct {
	dev *Device
	k   hal.Kernel
}

// Kernel returns the named kernel of package kernels (on CUDA compiled by NVRTC
// on first use for the device's architecture and cached for the process).
func (d *Device) Kernel(name string) (*Kernel, error) {
	if err := d.check("Device.Kernel"); err != nil {
		return nil, err
	}
	d.kstats.begin()
	k, err := d.hd.Kernel(name)
	d.kstats.end()
	if err != nil {
		return nil, fmt.Errorf("gpuctx: Device.Kernel(%q): %w", name, err)
	}
	return &Kernel{dev: d, k: k}, nil
}

// Name returns the kernel's name.
func (k *Kernel) Name() string { return k.k.Name() }

// Launch queues kernel k on s with the given grid and block. args are the
// kernel's parameters in order: *Buffer (passed as its device address), int32,
// uint32, int64, uint64, float32 or float64. Go's int is refused because the
// kernel's C type must be explicit.
func (s *Stream) Launch(k *Kernel, grid, block Dim3, sharedMem int, args ...any) error {
	return s.launch("Stream.Launch", false, k, grid, block, sharedMem, args)
}

// LaunchEarly is Launch for a kernel that may start before the kernel queued
// ahead of it on s has finished: on CUDA devices of compute capability 9.0
// and later it is a programmatic dependent launch (the environment variable
// GPUCTX_EARLY_LAUNCH=0 turns that off); elsewhere it is Launch. The kernel
// must execute the PTX instruction griddepcontrol.wait (sm_90+; e.g.
// asm volatile("griddepcontrol.wait;" ::: "memory")) before it reads memory
// that earlier work on s writes or writes memory that earlier work reads: the
// wait returns once the kernels ahead of it have completed and their writes
// are visible. Work before the wait overlaps the previous kernel's tail, and
// griddepcontrol.launch_dependents in the kernel ahead lets this one be
// scheduled before that kernel ends. Inside a stream capture the overlap is
// kept in the graph. Queued on s; the host does not wait.
func (s *Stream) LaunchEarly(k *Kernel, grid, block Dim3, sharedMem int, args ...any) error {
	return s.launch("Stream.LaunchEarly", true, k, grid, block, sharedMem, args)
}

func (s *Stream) launch(op string, early bool, k *Kernel, grid, block Dim3, sharedMem int, args []any) error {
	unlock, err := s.use(op)
	if err != nil {
		return err
	}
	defer unlock()
	if k == nil {
		return fmt.Errorf("gpuctx: %s: nil kernel: %w", op, ErrInvalid)
	}
	if k.dev != s.dev {
		return fmt.Errorf("gpuctx: %s: kernel %s of device %d on a stream of device %d: %w", op, k.Name(), k.dev.info.Index, s.dev.info.Index, ErrWrongDevice)
	}
	for _, d := range []Dim3{grid, block} {
		if d.X <= 0 || d.Y <= 0 || d.Z <= 0 {
			return fmt.Errorf("gpuctx: %s %s: grid %v and block %v must be positive in every dimension: %w", op, k.Name(), grid, block, ErrInvalid)
		}
	}
	conv := make([]any, len(args))
	for i, a := range args {
		switch v := a.(type) {
		case *Buffer:
			if err := v.onDevice(fmt.Sprintf("%s %s argument %d", op, k.Name(), i), s.dev); err != nil {
				return err
			}
			conv[i] = v.ptr()
		case Ptr:
			conv[i] = hal.Ptr(v)
		case int32, uint32, int64, uint64, float32, float64, hal.Ptr:
			conv[i] = v
		default:
			return fmt.Errorf("gpuctx: %s %s: argument %d has Go type %T; use *Buffer, Ptr, int32, uint32, int64, uint64, float32 or float64: %w", op, k.Name(), i, a, ErrInvalid)
		}
	}
	if t := s.dev.tracer.Load(); t != nil {
		defer t.begin(s, k.Name(), "kernel", map[string]any{"grid": grid, "block": block, "shared bytes": sharedMem})()
	}
	if el, ok := s.hs.(hal.EarlyLauncher); ok && early {
		return el.LaunchEarly(k.k, hal.Dim3(grid), hal.Dim3(block), sharedMem, conv...)
	}
	return s.hs.Launch(k.k, hal.Dim3(grid), hal.Dim3(block), sharedMem, conv...)
}

// Wait makes work queued on s after this call wait until e has completed (the
// work captured by e's most recent Record). It does not block the host.
func (s *Stream) Wait(e *Event) error {
	const op = "Stream.Wait"
	unlock, err := s.use(op)
	if err != nil {
		return err
	}
	defer unlock()
	if err := e.check(op, s.dev); err != nil {
		return err
	}
	if t := s.dev.tracer.Load(); t != nil {
		defer t.waitBegin(s, e)()
	}
	if err := s.hs.Wait(e.he); err != nil {
		return err
	}
	s.dev.noteWait(s, e) // joins the capture e was recorded in, if any (graph.go)
	return nil
}

// Synchronize blocks the host until all work queued on s so far is done, and
// returns the first asynchronous error the stream hit, if any.
func (s *Stream) Synchronize() error {
	unlock, err := s.use("Stream.Synchronize")
	if err != nil {
		return err
	}
	defer unlock()
	return s.hs.Synchronize()
}

// Query reports whether all work queued on s is done, without blocking.
func (s *Stream) Query() (bool, error) {
	unlock, err := s.use("Stream.Query")
	if err != nil {
		return false, err
	}
	defer unlock()
	return s.hs.Query()
}

// WorkspaceBytes returns the bytes of device memory the BLAS workspaces of s
// take now: its own workspace (Device.WorkspaceBytes, allocated by the first
// BLAS call on s), its cuBLASLt workspace, and grown-out cuBLASLt ones not
// freed yet; 0 before any BLAS call on s and once s is closed. The workspaces
// of a capture on s belong to its Graph (Graph.WorkspaceBytes). Safe for
// concurrent use.
func (s *Stream) WorkspaceBytes() int {
	if s == nil {
		return 0
	}
	return s.dev.blas.spaces.Bytes(s)
}

// Close waits for s's queued work, releases any BLAS workspace of s, and
// destroys the stream. Later calls on s return ErrClosed. Double Close is harmless.
func (s *Stream) Close() error {
	if s == nil {
		return fmt.Errorf("gpuctx: Stream.Close: nil stream: %w", ErrInvalid)
	}
	s.dev.mu.Lock()
	delete(s.dev.streams, s)
	s.dev.mu.Unlock()
	return s.destroy()
}

func (s *Stream) destroy() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	err := s.hs.Synchronize()
	err2 := s.dev.blas.spaces.StreamClosed(s)
	err3 := s.hs.Destroy()
	if err != nil {
		return err
	}
	if err2 != nil {
		return err2
	}
	return err3
}

// Event marks a point in a stream's work.
type Event struct {
	dev    *Device
	he     hal.Event
	timing bool

	mu     sync.RWMutex
	closed bool
}

// NewEvent makes an event. With timing true, Elapsed can measure between two
// events (a little more costly to record).
func (d *Device) NewEvent(timing bool) (*Event, error) {
	if err := d.check("Device.NewEvent"); err != nil {
		return nil, err
	}
	he, err := d.hd.NewEvent(timing)
	if err != nil {
		return nil, fmt.Errorf("gpuctx: Device.NewEvent: %w", err)
	}
	e := &Event{dev: d, he: he, timing: timing}
	d.mu.Lock()
	d.events[e] = struct{}{}
	d.mu.Unlock()
	return e, nil
}

func (e *Event) check(op string, d *Device) error {
	if e == nil {
		return fmt.Errorf("gpuctx: %s: nil event: %w", op, ErrInvalid)
	}
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return fmt.Errorf("gpuctx: %s: event: %w", op, ErrClosed)
	}
	if d != nil && e.dev != d {
		return fmt.Errorf("gpuctx: %s: event of device %d used with device %d: %w", op, e.dev.info.Index, d.info.Index, ErrWrongDevice)
	}
	return nil
}

// Record captures in e the work queued on s so far. Waiting on e (Stream.Wait,
// Event.Synchronize) then waits for exactly that work.
func (e *Event) Record(s *Stream) error {
	const op = "Event.Record"
	unlock, err := s.use(op)
	if err != nil {
		return err
	}
	defer unlock()
	if err := e.check(op, s.dev); err != nil {
		return err
	}
	if err := e.he.Record(s.hs); err != nil {
		return err
	}
	s.dev.noteRecord(e, s) // tracks events recorded in a capture (graph.go)
	if t := s.dev.tracer.Load(); t != nil {
		t.recorded(e, s)
	}
	return nil
}

// Synchronize blocks the host until the work e captured is done. An event never
// recorded is complete.
func (e *Event) Synchronize() error {
	if err := e.check("Event.Synchronize", nil); err != nil {
		return err
	}
	return e.he.Synchronize()
}

// Query reports whether the work e captured is done, without blocking.
func (e *Event) Query() (bool, error) {
	if err := e.check("Event.Query", nil); err != nil {
		return false, err
	}
	return e.he.Query()
}

// Elapsed returns the device time between start and e. Both must be timing
// events that were recorded and have completed.
func (e *Event) Elapsed(start *Event) (time.Duration, error) {
	const op = "Event.Elapsed"
	if err := e.check(op, nil); err != nil {
		return 0, err
	}
	if err := start.check(op, e.dev); err != nil {
		return 0, err
	}
	if !e.timing || !start.timing {
		return 0, fmt.Errorf("gpuctx: %s: both events must be made with NewEvent(true): %w", op, ErrInvalid)
	}
	return e.he.Elapsed(start.he)
}

// Close destroys e. Double Close is harmless.
func (e *Event) Close() error {
	if e == nil {
		return fmt.Errorf("gpuctx: Event.Close: nil event: %w", ErrInvalid)
	}
	e.dev.mu.Lock()
	delete(e.dev.events, e)
	e.dev.mu.Unlock()
	return e.destroy()
}

func (e *Event) destroy() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	e.closed = true
	return e.he.Destroy()
}
