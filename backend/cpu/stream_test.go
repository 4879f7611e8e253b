package cpu

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/gpuctx/gpuctx/internal/hal"
)

func mustKernel(t testing.TB, d *device, name string) hal.Kernel {
	t.Helper()
	k, err := d.Kernel(name)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

var one = hal.Dim3{X: 1, Y: 1, Z: 1}

// TestStreamOrder queues fill(i) then copy-out 200 times on one stream: any
// reordering leaves a wrong value in some copy.
func TestStreamOrder(t *testing.T) {
	d := newTestDevice(t)
	s := newTestStream(t, d)
	const n, elems = 200, 64
	y, _ := d.Alloc(elems * 4)
	z, _ := d.Alloc(n * elems * 4)
	fill := mustKernel(t, d, "gpuctx_fill_f32")
	for i := range n {
		if err := s.Launch(fill, one, one, 0, y, float32(i), int64(elems)); err != nil {
			t.Fatal(err)
		}
		if err := s.CopyDtoDAsync(z+hal.Ptr(i*elems*4), y, elems*4); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	got := fromBytes[float32](download(t, d, z, n*elems*4))
	for i := range n {
		for j := range elems {
			if got[i*elems+j] != float32(i) {
				t.Fatalf("copy %d element %d = %v, want %d: the stream ran work out of order", i, j, got[i*elems+j], i)
			}
		}
	}
	if done, err := s.Query(); !done || err != nil {
		t.Errorf("Query after Synchronize = %v, %v; want true, nil", done, err)
	}
}

// TestStreamsRunConcurrently: stream A's work blocks until stream B's work
// runs, which deadlocks if streams were serialised.
func TestStreamsRunConcurrently(t *testing.T) {
	d := newTestDevice(t)
	a, b := newTestStream(t, d), newTestStream(t, d)
	if a.ID() == b.ID() {
		t.Fatalf("two streams share ID %d", a.ID())
	}
	ch, open := newGate(t)
	if err := a.enqueueFn("test", func() error { <-ch; return nil }); err != nil {
		t.Fatal(err)
	}
	if err := b.enqueueFn("test", func() error { open(); return nil }); err != nil {
		t.Fatal(err)
	}
	within(t, "stream A waiting for work on stream B (streams are not concurrent)", func() {
		if err := a.Synchronize(); err != nil {
			t.Error(err)
		}
	})
}

// TestEventWait: B waits on an event recorded on A; only B blocks, the host
// and other streams do not, and B's later work sees A's results.
func TestEventWait(t *testing.T) {
	d := newTestDevice(t)
	a, b, c := newTestStream(t, d), newTestStream(t, d), newTestStream(t, d)
	e, err := d.NewEvent(false)
	if err != nil {
		t.Fatal(err)
	}
	gate, open := newGate(t)
	var fromA int // written on A, read on B: the race detector checks the ordering
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(a.enqueueFn("test", func() error { <-gate; fromA = 42; return nil }))
	must(e.Record(a))
	must(b.Wait(e)) // captures A's record
	// Re-recording e on an idle stream must not release B: Wait captured the
	// earlier record.
	must(e.Record(c))
	must(e.Synchronize())
	seen := make(chan int, 1)
	must(b.enqueueFn("test", func() error { seen <- fromA; return nil }))

	within(t, "stream C (independent of the blocked stream A)", func() { must(c.Synchronize()) })
	if done, err := b.Query(); done || err != nil {
		t.Fatalf("B.Query = %v, %v while A is blocked; want false, nil", done, err)
	}
	open()
	within(t, "stream B after A passed its event", func() { must(b.Synchronize()) })
	if v := <-seen; v != 42 {
		t.Errorf("B saw %d, want 42 written by A before the event", v)
	}

	// An event never recorded is complete: Wait queues nothing.
	fresh, _ := d.NewEvent(false)
	must(b.Wait(fresh))
	within(t, "Synchronize of a never recorded event", func() { must(fresh.Synchronize()) })
	if done, err := fresh.Query(); !done || err != nil {
		t.Errorf("never recorded Query = %v, %v; want true, nil", done, err)
	}
	must(fresh.Destroy())
	if err := b.Wait(fresh); err == nil {
		t.Error("Wait on a destroyed event: want an error")
	}
}

func TestStickyError(t *testing.T) {
	d := newTestDevice(t)
	s, other := newTestStream(t, d), newTestStream(t, d)
	y, _ := d.Alloc(16)
	fill := mustKernel(t, d, "gpuctx_fill_f32")
	// Valid at launch time (the pointer is live); the body finds n too large.
	if err := s.Launch(fill, one, one, 0, y, float32(1), int64(1000)); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := s.Synchronize(); !errors.Is(err, hal.ErrBadPointer) {
			t.Fatalf("Synchronize #%d: got %v, want the sticky hal.ErrBadPointer", i, err)
		}
	}
	if _, err := s.Query(); !errors.Is(err, hal.ErrBadPointer) {
		t.Errorf("Query: got %v, want the sticky error", err)
	}
	if err := s.Launch(fill, one, one, 0, y, float32(1), int64(4)); err == nil {
		t.Error("Launch after an asynchronous error: want the sticky error")
	}
	if err := d.Synchronize(); !errors.Is(err, hal.ErrBadPointer) {
		t.Errorf("device Synchronize: got %v, want the stream's sticky error", err)
	}
	// As after a sticky CUDA error, the whole device is lost: every later call,
	// on any stream, fails with hal.ErrDeviceLost naming the first failure.
	lost := []struct {
		name string
		err  error
	}{
		{"other Launch", other.Launch(fill, one, one, 0, y, float32(1), int64(4))},
		{"other Synchronize", other.Synchronize()},
		{"failed stream Synchronize", s.Synchronize()},
		{"device Synchronize", d.Synchronize()},
		{"CopyHtoD", d.CopyHtoD(y, unsafe.Pointer(new([4]byte)), 4)},
	}
	_, err := d.Alloc(16)
	lost = append(lost, struct {
		name string
		err  error
	}{"Alloc", err})
	_, err = d.NewStream(hal.StreamOptions{})
	lost = append(lost, struct {
		name string
		err  error
	}{"NewStream", err})
	for _, l := range lost {
		if !errors.Is(l.err, hal.ErrDeviceLost) || !errors.Is(l.err, hal.ErrBadPointer) || !strings.Contains(l.err.Error(), "gpuctx_fill_f32") {
			t.Errorf("%s after the failure: got %v, want hal.ErrDeviceLost naming the first failure (gpuctx_fill_f32, hal.ErrBadPointer)", l.name, l.err)
		}
	}
	// Releasing still works.
	if err := other.Destroy(); err != nil {
		t.Errorf("Destroy on a lost device: %v", err)
	}
	if err := d.Free(y); err != nil {
		t.Errorf("Free on a lost device: %v", err)
	}

	// Freed between Launch and execution also fails asynchronously.
	d = newTestDevice(t)
	y, _ = d.Alloc(16)
	fill = mustKernel(t, d, "gpuctx_fill_f32")
	s2 := newTestStream(t, d)
	gate, open := newGate(t)
	if err := s2.enqueueFn("test", func() error { <-gate; return nil }); err != nil {
		t.Fatal(err)
	}
	if err := s2.Launch(fill, one, one, 0, y, float32(1), int64(4)); err != nil {
		t.Fatal(err)
	}
	if err := d.Free(y); err != nil {
		t.Fatal(err)
	}
	open()
	if err := s2.Synchronize(); !errors.Is(err, hal.ErrBadPointer) {
		t.Errorf("use after Free: got %v, want hal.ErrBadPointer", err)
	}
}

func TestStreamDestroy(t *testing.T) {
	d := newTestDevice(t)
	s := newTestStream(t, d)
	y, _ := d.Alloc(4 * 1024)
	add := mustKernel(t, d, "gpuctx_add_i32")
	for range 100 {
		if err := s.Launch(add, one, one, 0, y, int32(1), int64(1024)); err != nil {
			t.Fatal(err)
		}
	}
	within(t, "Destroy", func() {
		if err := s.Destroy(); err != nil {
			t.Error(err)
		}
	})
	// Destroy drained the queue.
	for i, v := range fromBytes[int32](download(t, d, y, 4*1024)) {
		if v != 100 {
			t.Fatalf("y[%d] = %d after Destroy, want 100: Destroy did not drain the queue", i, v)
		}
	}
	e, _ := d.NewEvent(false)
	for name, err := range map[string]error{
		"Launch":      s.Launch(add, one, one, 0, y, int32(1), int64(1)),
		"Synchronize": s.Synchronize(),
		"Destroy":     s.Destroy(),
		"Record":      e.Record(s),
	} {
		if err == nil {
			t.Errorf("%s after Destroy: want an error", name)
		}
	}
	s2 := newTestStream(t, d)
	if s2.ID() <= s.ID() {
		t.Errorf("new stream ID %d not greater than destroyed %d: IDs must never be reused", s2.ID(), s.ID())
	}
}

func TestElapsed(t *testing.T) {
	d := newTestDevice(t)
	s := newTestStream(t, d)
	newEv := func(timing bool) hal.Event {
		e, err := d.NewEvent(timing)
		if err != nil {
			t.Fatal(err)
		}
		return e
	}

	// Success: the closure's own duration lies between the two markers.
	start, end := newEv(true), newEv(true)
	var t1, t2 time.Time
	_ = start.Record(s)
	_ = s.enqueueFn("test", func() error {
		t1 = time.Now()
		x := 0.0
		for i := range 100000 {
			x += float64(i)
		}
		t2 = time.Now()
		_ = x
		return nil
	})
	_ = end.Record(s)
	if err := end.Synchronize(); err != nil {
		t.Fatal(err)
	}
	el, err := end.Elapsed(start)
	if err != nil {
		t.Fatal(err)
	}
	if el < t2.Sub(t1) {
		t.Errorf("Elapsed = %v, shorter than the work between the events (%v)", el, t2.Sub(t1))
	}

	// Errors.
	gate, _ := newGate(t)
	pendingStart, pending := newEv(true), newEv(true)
	_ = pendingStart.Record(s)
	_ = s.enqueueFn("test", func() error { <-gate; return nil })
	_ = pending.Record(s)
	noTiming := newEv(false)
	_ = noTiming.Record(s)
	tests := []struct {
		name       string
		start, end hal.Event
	}{
		{"start never recorded", newEv(true), end},
		{"end never recorded", start, newEv(true)},
		{"not completed", pendingStart, pending},
		{"without timing", start, noTiming},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := tc.end.Elapsed(tc.start); err == nil {
				t.Error("want an error")
			} else {
				t.Log(err)
			}
		})
	}
}

// TestManyStreamsFromGoroutines hammers several streams and events from
// several goroutines; run with -race.
func TestManyStreamsFromGoroutines(t *testing.T) {
	d := newTestDevice(t)
	add := mustKernel(t, d, "gpuctx_add_i32")
	y, _ := d.Alloc(4 * 256)
	const workers, iters = 4, 50
	errs := make(chan error, workers)
	for w := range workers {
		go func() {
			s, err := d.NewStream(hal.StreamOptions{})
			if err != nil {
				errs <- err
				return
			}
			defer s.Destroy()
			region := y + hal.Ptr(w*64*4)
			for range iters {
				if err := s.Launch(add, one, one, 0, region, int32(1), int64(64)); err != nil {
					errs <- err
					return
				}
			}
			errs <- s.Synchronize()
		}()
	}
	for range workers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for i, v := range fromBytes[int32](download(t, d, y, 4*256)) {
		if v != iters {
			t.Fatalf("y[%d] = %d, want %d", i, v, iters)
		}
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(fmt.Errorf("device Synchronize: %w", err))
	}
}
