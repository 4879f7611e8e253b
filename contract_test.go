package gpuctx

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/gpuctx/gpuctx/backend/cpu"
)

// This file is the binding contract as one table of rules run against every
// kind of handle a Context lends (Blas, BlasLt; a new kind is one more entry
// of handleKinds) under both handle policies, on the CPU backend, whose
// handles refuse a contract break (cpu.ErrHandleMisuse: a handle entered by
// two calls at once, used for a stream it is not bound to, or a GEMM after
// set-stream dropped the workspace) where a real library would corrupt
// silently. Every overlap a rule needs is made with sync points (a call held
// inside the library by the backend's Inside hook until the other side
// reaches a hook of the Context: it waits for the handle, waits for the op
// lock, or is refused), never with timing, so that breaking a rule fails its
// case on every run. internal/cmd/mutate breaks each rule on purpose and
// records that these cases catch it.

// lentHandle is what every kind of lent handle offers: its stream and a GEMM.
type lentHandle interface {
	Stream() *Stream
	Gemm(g Gemm) error
}

// ltLent is a BlasLt as a lentHandle.
type ltLent struct{ BlasLt }

func (l ltLent) Gemm(g Gemm) error { return l.Matmul(g) }

// handleKind is one kind of handle a Context lends.
type handleKind struct {
	name string
	call string // the CPU library call its Gemm makes
	// workspace: the handle holds a workspace that set-stream resets (cuBLAS);
	// cuBLASLt takes the stream and workspace with every call.
	workspace bool
	run       func(c *Context, fn func(h lentHandle) error) error
}

var handleKinds = []handleKind{
	{name: "Blas", call: "BlasHandle.Gemm", workspace: true, run: func(c *Context, fn func(lentHandle) error) error {
		return c.Blas(func(h Blas) error { return fn(h) })
	}},
	{name: "BlasLt", call: "LtHandle.Matmul", run: func(c *Context, fn func(lentHandle) error) error {
		return c.BlasLt(func(lt BlasLt) error { return fn(ltLent{lt}) })
	}},
}

// contractRules are the rules of the binding contract (DESIGN.md).
var contractRules = []struct {
	name string
	// oneHandle limits the pool to one handle per kind, so that every callback
	// of the case gets the same handle (the shared policy has one anyway).
	oneHandle bool
	test      func(t *testing.T, f *contractFixture)
}{
	{"OpLockSerialisesCallsInOneCallback", false, testOpLock},
	{"CallbackEndWaitsForCallInFlight", true, testEndWaits},
	{"HandleHeldForWholeCallback", true, testHeldAcross},
	{"StreamReadOnce", false, testStreamReadOnce},
	{"WorkspaceReappliedAfterSetStream", true, testWorkspaceReapplied},
	{"OneContextSwitchedBackAndForth", true, testSwitchBackAndForth},
	{"ConcurrentStreams", false, testConcurrentStreams},
}

// TestContract runs every rule against every handle kind and policy.
func TestContract(t *testing.T) {
	for _, r := range contractRules {
		for _, k := range handleKinds {
			for _, pol := range []HandlePolicy{PooledHandles, SharedHandle} {
				t.Run(fmt.Sprintf("%s/%s/%s", r.name, k.name, pol), func(t *testing.T) {
					r.test(t, newContractFixture(t, k, pol, r.oneHandle, false))
				})
			}
		}
	}
}

// contractFixture is a fresh CPU device with two streams, a Context on the
// first, and the hooks that rules use as sync points.
type contractFixture struct {
	t    *testing.T
	k    handleKind
	pol  HandlePolicy
	d    *Device
	s    [2]*Stream
	ctx  *Context
	a    *Buffer // 4x4 f32 ones: every GEMM's C is all 4
	held atomic.Bool
	// progress is closed (once) when the other side of a held call reached a
	// sync point: it waits for a handle or for the op lock, or the backend
	// refused a call.
	progress     chan struct{}
	progressOnce sync.Once
}

func newContractFixture(t *testing.T, k handleKind, pol HandlePolicy, oneHandle, sharedWS bool) *contractFixture {
	t.Helper()
	rt, err := OpenBackend("cpu")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rt.Close() })
	f := &contractFixture{t: t, k: k, pol: pol, progress: make(chan struct{})}
	if f.d, err = rt.Device(0); err != nil {
		t.Fatal(err)
	}
	if oneHandle {
		if err := f.d.SetBlasHandleLimit(1); err != nil {
			t.Fatal(err)
		}
	}
	for i := range f.s {
		if f.s[i], err = f.d.NewStream(StreamOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if f.ctx, err = f.d.NewContext(ContextOptions{Stream: f.s[0], Policy: pol, UnsafeSharedWorkspace: sharedWS}); err != nil {
		t.Fatal(err)
	}
	f.a = f.upload(4)
	t.Cleanup(func() { testHooks.Store(nil) })
	testHooks.Store(&contractHooks{handleWait: f.advance, opWait: f.advance})
	_, err = cpu.SetHooks(f.d.hd, cpu.Hooks{Misuse: func(error) { f.advance() }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // before the device closes
		if n, first := cpu.Misuses(f.d.hd); n != 0 {
			t.Errorf("the CPU backend refused %d library handle calls that broke the contract; the first: %v", n, first)
		}
	})
	return f
}

// advance closes f.progress.
func (f *contractFixture) advance() { f.progressOnce.Do(func() { close(f.progress) }) }

// hold makes the first call of f's kind to reach the library stay inside it
// (holding the handle) until f.progress is closed; in is closed when it is
// there.
func (f *contractFixture) hold() (in <-chan struct{}) {
	ch := make(chan struct{})
	_, err := cpu.SetHooks(f.d.hd, cpu.Hooks{
		Inside: func(call string) {
			if call == f.k.call && f.held.CompareAndSwap(false, true) {
				close(ch)
				<-f.progress
			}
		},
		Misuse: func(error) { f.advance() },
	})
	if err != nil {
		f.t.Fatal(err)
	}
	return ch
}

// upload returns a buffer of n*n f32 values v (ones when v is 0).
func (f *contractFixture) upload(n int, v ...float32) *Buffer {
	f.t.Helper()
	x := make([]float32, n*n)
	for i := range x {
		x[i] = 1
		if len(v) > 0 {
			x[i] = v[0]
		}
	}
	b, err := f.d.Alloc(4 * len(x))
	if err == nil {
		err = b.CopyFromHost(unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 4*len(x)))
	}
	if err != nil {
		f.t.Fatal(err)
	}
	return b
}

// streamID names s in a message: its ID, or "none".
func streamID(s *Stream) string {
	if s == nil {
		return "none"
	}
	return fmt.Sprint(s.ID())
}

// out returns a 4x4 C of NaNs.
func (f *contractFixture) out() *Buffer { return f.upload(4, float32(math.NaN())) }

// gemm is C = A*A with A all ones (C all 4).
func (f *contractFixture) gemm(c *Buffer) Gemm {
	return Gemm{M: 4, N: 4, K: 4, Alpha: 1, A: f.a, B: f.a, C: c, AB: F32, CType: F32}
}

// checkOuts waits for the device and checks that every C is all 4.
func (f *contractFixture) checkOuts(cs ...*Buffer) {
	f.t.Helper()
	if err := f.d.Synchronize(); err != nil {
		f.t.Fatal(err)
	}
	for i, c := range cs {
		x := make([]float32, 16)
		if err := c.CopyToHost(unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 64)); err != nil {
			f.t.Fatal(err)
		}
		for _, v := range x {
			if v != 4 {
				f.t.Fatalf("output %d: %v, want all 4", i, x)
			}
		}
	}
}

// gemmOn runs one callback on c that checks it was lent want and queues a GEMM into out.
func (f *contractFixture) gemmOn(c *Context, want *Stream, out *Buffer) error {
	return f.k.run(c, func(h lentHandle) error {
		if got := h.Stream(); got != want {
			return fmt.Errorf("%s lent for stream %s, want %d", f.k.name, streamID(got), want.ID())
		}
		return h.Gemm(f.gemm(out))
	})
}

// Two goroutines call through one lent handle inside one callback: the
// second waits for the first (held inside the library) on the op lock, and
// both GEMMs land.
func testOpLock(t *testing.T, f *contractFixture) {
	in := f.hold()
	c1, c2 := f.out(), f.out()
	err := f.k.run(f.ctx, func(h lentHandle) error {
		errc := make(chan error, 1)
		go func() { errc <- h.Gemm(f.gemm(c1)) }()
		<-in
		e2 := h.Gemm(f.gemm(c2)) // the op lock must make it wait (progress)
		return errors.Join(<-errc, e2)
	})
	if err != nil {
		t.Fatal(err)
	}
	f.checkOuts(c1, c2)
}

// A callback that returns while a goroutine's call through its handle is
// still inside the library waits for that call before the handle can go to
// another callback: the next callback, on the other stream with the same
// handle, must find it free.
func testEndWaits(t *testing.T, f *contractFixture) {
	in := f.hold()
	c1, c2 := f.out(), f.out()
	errc := make(chan error, 1)
	err := f.k.run(f.ctx, func(h lentHandle) error {
		go func() { errc <- h.Gemm(f.gemm(c1)) }()
		<-in
		return nil // the callback's end must wait for that call (progress)
	})
	if _, e := f.ctx.SetStream(f.s[1]); e != nil {
		t.Fatal(e)
	}
	err2 := f.gemmOn(f.ctx, f.s[1], c2)
	if err := errors.Join(err, err2, <-errc); err != nil {
		t.Fatal(err)
	}
	f.checkOuts(c1, c2)
}

// A second callback, on another stream, that wants the only handle while a
// first callback holds it waits for the first to return: the first's call is
// held inside the library until the second is waiting for the handle.
func testHeldAcross(t *testing.T, f *contractFixture) {
	f.hold()
	view, err := f.ctx.WithStream(f.s[1])
	if err != nil {
		t.Fatal(err)
	}
	c1, c2 := f.out(), f.out()
	errc := make(chan error, 1)
	err = f.k.run(f.ctx, func(h lentHandle) error {
		go func() { errc <- f.gemmOn(view, f.s[1], c2) }()
		if got := h.Stream(); got != f.s[0] {
			return fmt.Errorf("lent for stream %s, want %d", streamID(got), f.s[0].ID())
		}
		return h.Gemm(f.gemm(c1)) // held until the second callback waits (progress)
	})
	if err := errors.Join(err, <-errc); err != nil {
		t.Fatal(err)
	}
	f.checkOuts(c1, c2)
}

// Each callback reads the Context's current stream once: a hook switches the
// stream after every read, so a second read (to bind, to lend, to enter) gets
// the other stream and the handle is bound to one stream and lent for the
// other, which the backend refuses.
func testStreamReadOnce(t *testing.T, f *contractFixture) {
	ref := &f.ctx.stream
	testHooks.Store(&contractHooks{streamRead: func(r *streamRef, s *Stream) {
		if r == ref {
			r.Store(f.s[0])
			if s == f.s[0] {
				r.Store(f.s[1])
			}
		}
	}})
	var outs []*Buffer
	for i := range 4 {
		c := f.out()
		outs = append(outs, c)
		if err := f.gemmOn(f.ctx, f.s[i%2], c); err != nil {
			t.Fatalf("callback %d: %v", i, err)
		}
	}
	f.checkOuts(outs...)
}

// One handle moved between two streams holds, at every call, the workspace
// of the stream it is on: set-stream resets it (cuBLAS, and the CPU backend
// refuses a GEMM until it is set again), with per-stream workspaces and with
// one workspace per handle (where only the re-apply rule puts it back).
func testWorkspaceReapplied(t *testing.T, f *contractFixture) {
	if !f.k.workspace {
		t.Skipf("%s takes its workspace with each call: no set-stream resets it", f.k.name)
	}
	for _, sharedWS := range []bool{false, true} {
		g := newContractFixture(t, f.k, f.pol, true, sharedWS)
		var outs []*Buffer
		for i := range 6 {
			s := g.s[i%2]
			if _, err := g.ctx.SetStream(s); err != nil {
				t.Fatal(err)
			}
			c := g.out()
			outs = append(outs, c)
			err := g.ctx.Blas(func(h Blas) error {
				if err := h.Gemm(g.gemm(c)); err != nil {
					return err
				}
				_, ws, n, ok := HandleBinding(h)
				want := g.ctx.ctxCore.dev.blas.spaces.Eager(s)
				switch {
				case !ok:
					return errors.New("the CPU handle does not report its workspace")
				case sharedWS && (ws == 0 || n == 0):
					return fmt.Errorf("handle-workspace mode: the handle holds no workspace on stream %d", s.ID())
				case !sharedWS && (want == nil || uintptr(want.Ptr) != ws || want.Size != n):
					return fmt.Errorf("the handle holds workspace [%#x, +%d), want stream %d's", ws, n, s.ID())
				}
				return nil
			})
			if err != nil {
				t.Fatalf("sharedWorkspace=%v, call %d on stream %d: %v", sharedWS, i, s.ID(), err)
			}
		}
		g.checkOuts(outs...)
		if st := g.ctx.Stats(); st.Rebinds == 0 || st.WorkspaceApplies < st.Binds {
			t.Errorf("sharedWorkspace=%v: stats %+v: want rebinds, each followed by a workspace application", sharedWS, st)
		}
	}
}

// One Context, the same object throughout, switched back and forth between
// two streams: every callback is lent the stream current when it started and
// its GEMM runs there (the backend refuses anything else).
func testSwitchBackAndForth(t *testing.T, f *contractFixture) {
	var outs []*Buffer
	for i := range 8 {
		s := f.s[i%2]
		if _, err := f.ctx.SetStream(s); err != nil {
			t.Fatal(err)
		}
		c := f.out()
		outs = append(outs, c)
		if err := f.gemmOn(f.ctx, s, c); err != nil {
			t.Fatalf("callback %d on stream %d: %v", i, s.ID(), err)
		}
	}
	f.checkOuts(outs...)
}

// Several goroutines, each with a view of one Context on a stream of its own:
// with pooled handles all their callbacks are inside at once (a barrier in the
// callback), each on its own handle; with one shared handle they take turns.
func testConcurrentStreams(t *testing.T, f *contractFixture) {
	const workers, rounds = 3, 3
	arrived := make(chan struct{}, workers*rounds)
	var all [rounds]chan struct{}
	for r := range all {
		all[r] = make(chan struct{})
	}
	var outs []*Buffer
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		s, err := f.d.NewStream(StreamOptions{})
		if err != nil {
			t.Fatal(err)
		}
		view, err := f.ctx.WithStream(s)
		if err != nil {
			t.Fatal(err)
		}
		cs := []*Buffer{f.out(), f.out(), f.out()}
		outs = append(outs, cs...)
		wg.Go(func() {
			for r := range rounds {
				in := false
				err := f.k.run(view, func(h lentHandle) error {
					if f.pol == PooledHandles { // every worker inside a callback at once
						in = true
						arrived <- struct{}{}
						<-all[r]
					}
					if got := h.Stream(); got != s {
						return fmt.Errorf("worker %d lent stream %s, want %d", w, streamID(got), s.ID())
					}
					return h.Gemm(f.gemm(cs[r]))
				})
				if !in && f.pol == PooledHandles { // the callback failed before the barrier
					arrived <- struct{}{}
					<-all[r]
				}
				errs[w] = errors.Join(errs[w], err)
			}
		})
	}
	if f.pol == PooledHandles {
		for r := range rounds {
			for range workers {
				<-arrived
			}
			close(all[r])
		}
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	f.checkOuts(outs...)
}
