package conformance

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/gpuctx/gpuctx"
)

// chain is a sequence of dependent kernels y = a_k*x + b_k*y (gpuctx_axpby_f32)
// with one gpuctx_fill_f32 in the middle. Each step is an affine map and the maps
// do not commute (b_k is +1 or -1), so running any two steps out of order, or
// overlapping them, gives a different y. x, y and every a_k are small integers,
// so every intermediate value is an exact float32 and the host reference is
// exact, FMA or not.
type chain struct {
	n, steps int
	x, y0    []float32
	a, b     []float32
	fillAt   int
	fillV    float32
}

func newChain(r *rand.Rand, n, steps int) *chain {
	c := &chain{n: n, steps: steps, x: randInts(r, n, -8, 8), y0: randInts(r, n, -100, 100),
		a: randInts(r, steps, -3, 3), b: make([]float32, steps), fillAt: steps / 3, fillV: float32(r.IntN(41) - 20)}
	for k := range c.b {
		c.b[k] = float32(1 - 2*r.IntN(2))
	}
	return c
}

// want returns y after the first k steps. The steps compose to one affine map
// per element, y = B*start + A*x (start is y0, or fillV once the fill ran), and
// every value involved is a small integer, so this equals the element-by-element
// float32 computation exactly at O(n + k) cost instead of O(n*k).
func (c *chain) want(k int) []float32 {
	start := c.y0
	var A, B float64 = 0, 1
	for j := range k {
		if j == c.fillAt {
			start, A, B = nil, 0, 1
		}
		A = float64(c.a[j]) + float64(c.b[j])*A
		B = float64(c.b[j]) * B
	}
	y := make([]float32, c.n)
	for i := range y {
		s0 := float64(c.fillV)
		if start != nil {
			s0 = float64(start[i])
		}
		y[i] = float32(B*s0 + A*float64(c.x[i]))
	}
	return y
}

// queue queues steps [from, to) of the chain on s.
func (c *chain) queue(t *testing.T, s *gpuctx.Stream, fill, axpby *gpuctx.Kernel, y, x *gpuctx.Buffer, from, to int) {
	t.Helper()
	g, b := launchDims(c.n)
	for j := from; j < to; j++ {
		if j == c.fillAt {
			must(t, "Launch gpuctx_fill_f32", s.Launch(fill, g, b, 0, y, c.fillV, int64(c.n)))
		}
		must(t, fmt.Sprintf("Launch gpuctx_axpby_f32 step %d", j), s.Launch(axpby, g, b, 0, y, x, c.a[j], c.b[j], int64(c.n)))
	}
}

// chainSize returns the element count and step count of a long chain: large
// enough on a GPU that each kernel takes microseconds and the whole chain
// milliseconds, small on the CPU backend (which runs under the race detector).
func chainSize(dev *gpuctx.Device) (n, steps int) {
	if onGPU(dev) {
		return 1 << 22, 400
	}
	return 1 << 13, 120
}

// TestStreamOrdering queues a long chain of dependent kernels on one stream,
// with a device-to-device snapshot of y in the middle and the final
// device-to-host copy at the end, and checks both against the host reference:
// a stream must run its work in the order it was queued, copies included.
func TestStreamOrdering(t *testing.T, dev *gpuctx.Device) {
	r := newRand(t)
	n, steps := chainSize(dev)
	c := newChain(r, n, steps)
	fill, axpby := kernel(t, dev, "gpuctx_fill_f32"), kernel(t, dev, "gpuctx_axpby_f32")
	s := newStream(t, dev)
	x := upload(t, dev, f32Bytes(c.x))
	y := upload(t, dev, f32Bytes(c.y0))
	snap := alloc(t, dev, 4*n)
	host := allocHost(t, dev, 4*n)
	copy(host.Bytes(), filled(4*n, 0xee))

	mid := steps / 2
	c.queue(t, s, fill, axpby, y, x, 0, mid)
	must(t, "CopyDtoD snapshot", s.CopyDtoD(snap, 0, y, 0, 4*n))
	c.queue(t, s, fill, axpby, y, x, mid, steps)
	must(t, "CopyDtoH", s.CopyDtoH(host, 0, y, 0, 4*n))
	must(t, "Synchronize", s.Synchronize())

	sameF32(t, fmt.Sprintf("y after %d steps (async copy)", steps), bytesF32(host.Bytes()), c.want(steps))
	sameF32(t, fmt.Sprintf("snapshot after %d steps", mid), bytesF32(download(t, dev, snap)), c.want(mid))
}

// TestEventDependency checks Event.Record and Stream.Wait across streams.
func TestEventDependency(t *testing.T, dev *gpuctx.Device) {
	n, steps := chainSize(dev)

	// Stream B waits on an event recorded on A after a long chain, then copies A's
	// result: the copy must see the whole chain. Only B is synchronised.
	t.Run("WaitThenRead", func(t *testing.T) {
		r := newRand(t)
		c := newChain(r, n, steps)
		fill, axpby := kernel(t, dev, "gpuctx_fill_f32"), kernel(t, dev, "gpuctx_axpby_f32")
		a, b := newStream(t, dev), newStream(t, dev)
		e := newEvent(t, dev, false)
		x := upload(t, dev, f32Bytes(c.x))
		y := upload(t, dev, f32Bytes(c.y0))
		z := alloc(t, dev, 4*n)
		host := allocHost(t, dev, 4*n)
		copy(host.Bytes(), filled(4*n, 0xee))

		c.queue(t, a, fill, axpby, y, x, 0, steps)
		must(t, "Event.Record on A", e.Record(a))
		must(t, "B.Wait", b.Wait(e))
		must(t, "B.CopyDtoD", b.CopyDtoD(z, 0, y, 0, 4*n))
		must(t, "B.CopyDtoH", b.CopyDtoH(host, 0, z, 0, 4*n))
		must(t, "B.Synchronize", b.Synchronize())
		sameF32(t, "B's copy of A's result", bytesF32(host.Bytes()), c.want(steps))
		if done, err := e.Query(); err != nil || !done {
			t.Errorf("Event.Query after a stream that waited on it finished = %v, %v; want true, nil", done, err)
		}
		if done, err := a.Query(); err != nil || !done {
			t.Errorf("A.Query: all of A's work was captured by the event B waited for, yet Query = %v, %v", done, err)
		}
	})

	// The host waits on the event (Event.Synchronize), then reads synchronously.
	t.Run("HostWait", func(t *testing.T) {
		r := newRand(t)
		c := newChain(r, n, steps)
		fill, axpby := kernel(t, dev, "gpuctx_fill_f32"), kernel(t, dev, "gpuctx_axpby_f32")
		a := newStream(t, dev)
		e := newEvent(t, dev, false)
		x := upload(t, dev, f32Bytes(c.x))
		y := upload(t, dev, f32Bytes(c.y0))
		c.queue(t, a, fill, axpby, y, x, 0, steps)
		must(t, "Event.Record", e.Record(a))
		must(t, "Event.Synchronize", e.Synchronize())
		if done, err := e.Query(); err != nil || !done {
			t.Errorf("Event.Query after Event.Synchronize = %v, %v; want true, nil", done, err)
		}
		got := make([]byte, 4*n)
		must(t, "CopyToHost", y.CopyToHost(got))
		sameF32(t, "y after Event.Synchronize", bytesF32(got), c.want(steps))
	})

	// Four streams each run a chain on their own view of one buffer and record
	// an event; a fifth waits on all four and copies the whole buffer out.
	t.Run("FanIn", func(t *testing.T) {
		const parts = 4
		r := newRand(t)
		m := n / parts
		fill, axpby := kernel(t, dev, "gpuctx_fill_f32"), kernel(t, dev, "gpuctx_axpby_f32")
		y := alloc(t, dev, 4*m*parts)
		sink := newStream(t, dev)
		host := allocHost(t, dev, 4*m*parts)
		copy(host.Bytes(), filled(4*m*parts, 0xee))
		var want []float32
		for p := range parts {
			c := newChain(r, m, steps)
			s := newStream(t, dev)
			e := newEvent(t, dev, false)
			x := upload(t, dev, f32Bytes(c.x))
			yp, err := y.Slice(4*m*p, 4*m)
			must(t, "Slice", err)
			must(t, "CopyFromHost into view", yp.CopyFromHost(f32Bytes(c.y0)))
			c.queue(t, s, fill, axpby, yp, x, 0, steps)
			must(t, "Event.Record", e.Record(s))
			must(t, "sink.Wait", sink.Wait(e))
			want = append(want, c.want(steps)...)
		}
		must(t, "sink.CopyDtoH", sink.CopyDtoH(host, 0, y, 0, 4*m*parts))
		must(t, "sink.Synchronize", sink.Synchronize())
		sameF32(t, "fan-in result", bytesF32(host.Bytes()), want)
	})

	// Without a Wait, B's work does not depend on A's. Nothing racy is asserted:
	// B touches only its own memory, B's result is checked after synchronising B
	// alone, and A's after synchronising A. This documents that independent
	// streams need no event, and that a Wait-free B may finish before A.
	t.Run("IndependentNoWait", func(t *testing.T) {
		r := newRand(t)
		ca, cb := newChain(r, n, steps), newChain(r, n/8, 8)
		fill, axpby := kernel(t, dev, "gpuctx_fill_f32"), kernel(t, dev, "gpuctx_axpby_f32")
		a, b := newStream(t, dev), newStream(t, dev)
		xa, ya := upload(t, dev, f32Bytes(ca.x)), upload(t, dev, f32Bytes(ca.y0))
		xb, yb := upload(t, dev, f32Bytes(cb.x)), upload(t, dev, f32Bytes(cb.y0))
		hb := allocHost(t, dev, 4*cb.n)
		ca.queue(t, a, fill, axpby, ya, xa, 0, steps)
		cb.queue(t, b, fill, axpby, yb, xb, 0, cb.steps)
		must(t, "B.CopyDtoH", b.CopyDtoH(hb, 0, yb, 0, 4*cb.n))
		must(t, "B.Synchronize", b.Synchronize())
		sameF32(t, "B's own result", bytesF32(hb.Bytes()), cb.want(cb.steps))
		must(t, "A.Synchronize", a.Synchronize())
		got := make([]byte, 4*n)
		must(t, "CopyToHost", ya.CopyToHost(got))
		sameF32(t, "A's result", bytesF32(got), ca.want(steps))
	})

	// An event that was never recorded is complete.
	t.Run("NeverRecorded", func(t *testing.T) {
		e := newEvent(t, dev, false)
		must(t, "Event.Synchronize", e.Synchronize())
		if done, err := e.Query(); err != nil || !done {
			t.Errorf("Query of a never-recorded event = %v, %v; want true, nil", done, err)
		}
		s := newStream(t, dev)
		must(t, "Stream.Wait on a never-recorded event", s.Wait(e))
		must(t, "Stream.Synchronize", s.Synchronize())
	})
}

// TestEventElapsed records two timing events around real work and checks that
// Elapsed is positive and does not exceed the host's wall time around it.
func TestEventElapsed(t *testing.T, dev *gpuctx.Device) {
	r := newRand(t)
	n, steps := chainSize(dev)
	c := newChain(r, n, steps)
	fill, axpby := kernel(t, dev, "gpuctx_fill_f32"), kernel(t, dev, "gpuctx_axpby_f32")
	s := newStream(t, dev)
	start, end := newEvent(t, dev, true), newEvent(t, dev, true)
	x := upload(t, dev, f32Bytes(c.x))
	y := upload(t, dev, f32Bytes(c.y0))
	t0 := time.Now()
	must(t, "Record start", start.Record(s))
	c.queue(t, s, fill, axpby, y, x, 0, steps)
	must(t, "Record end", end.Record(s))
	must(t, "end.Synchronize", end.Synchronize())
	wall := time.Since(t0)
	d, err := end.Elapsed(start)
	must(t, "Event.Elapsed", err)
	if d <= 0 {
		t.Errorf("Elapsed over %d kernels on %d elements = %v, want > 0", steps, n, d)
	}
	// The device interval lies inside the host interval; allow 1 ms for clocks.
	if d > wall+time.Millisecond {
		t.Errorf("Elapsed = %v, longer than the %v the host waited from the first Record to Synchronize", d, wall)
	}
	back, err := start.Elapsed(end)
	if err == nil && back > 0 {
		t.Errorf("start.Elapsed(end) = %v, want <= 0 (end was recorded after start)", back)
	}
	t.Logf("%d dependent kernels on %d floats: %v device time", steps, n, d)
}
