package moe

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// env is what the stages of a forward share: the device, the layer's shape
// and dtype, the main and side streams with their BLAS Contexts, the events
// that fork and join the side stream, and the scratch allocator. Each stage
// holds a pointer to the env of the core it belongs to.
type env struct {
	dev        *gpuctx.Device
	cfg        Config
	dt         gpuctx.DType
	es         int // element size of dt
	flav       gpuctx.Flavour
	main, side *gpuctx.Stream
	ownMain    bool
	ctx, sctx  *gpuctx.Context // sctx: ctx.WithStream(side)
	evFork     *gpuctx.Event
	evJoin     *gpuctx.Event
	evCounts   *gpuctx.Event
	weightBufs []*gpuctx.Buffer
	// scratchBytes is the bytes of the live scratch buffers: every buffer grow
	// allocated and neither grow nor release has freed yet.
	scratchBytes int64
	onGrow       func() // runs before a scratch buffer is replaced (Layer: drops its graphs)
}

// core is the stages a Layer and an ExpertShard are built from, around the
// env they share. Each stage owns its weights, its kernels and its scratch
// buffers; a stage reads an earlier stage's outputs, which are passed to it.
type core struct {
	env
	router   routerStage
	dispatch dispatchStage
	experts  expertStage
	shared   sharedStage
	combine  combineStage
}

// coreSpec is what newCore builds: routed experts [lo, hi) (a Layer holds them
// all), and ns chunks of the shared expert fused as experts E.. (0: none).
type coreSpec struct {
	dt     gpuctx.DType
	stream *gpuctx.Stream // the main stream; nil: the core makes its own
	lo, hi int
	ns     int
	fp8    bool // the routed experts in FP8 (fp8Experts)
	// w16only: the FP8 experts load no w8a8 tiles (LayerOptions.FP8WeightOnly).
	w16only bool
}

// init makes the streams, Contexts and events, looks up the stages' kernels
// and uploads the weights from src. On error the caller releases c.
func (c *core) init(dev *gpuctx.Device, cfg *Config, sp coreSpec, src weightSource) error {
	c.env = env{dev: dev, cfg: *cfg, dt: sp.dt, es: sp.dt.Size(), flav: gpuctx.Default, main: sp.stream}
	if c.dt == gpuctx.BF16 {
		c.flav = gpuctx.TensorOp
	}
	c.router.e, c.dispatch.e, c.experts.e, c.shared.e, c.combine.e = &c.env, &c.env, &c.env, &c.env, &c.env
	c.experts.lo, c.experts.hi = sp.lo, sp.hi
	if err := c.initStreams(); err != nil {
		return err
	}
	if err := c.loadKernels(); err != nil {
		return err
	}
	if sp.fp8 {
		c.experts.q = &fp8Experts{}
		if err := c.experts.q.loadKernels(dev, sp.w16only); err != nil {
			return err
		}
	}
	c.dispatch.align3From, c.dispatch.raTokens = align3From, routeAlignTokens
	var err error
	if c.dispatch.countsHost, err = dev.AllocHost(4 * cfg.NumExperts); err != nil {
		return err
	}
	copies, err := c.allocWeights(sp.ns)
	if err != nil {
		return err
	}
	if err := src.upload(&c.env, copies); err != nil {
		return err
	}
	if q := c.experts.q; q != nil {
		if err := q.upload(&c.env, src, sp.lo, sp.hi); err != nil {
			return err
		}
		if err := c.shared.uploadFP8(&c.env, src); err != nil {
			return err
		}
		return q.uploadShared(&c.env, src, sp.hi-sp.lo, sp.ns)
	}
	return nil
}

// initStreams makes the main stream (unless given), the side stream, the
// Contexts and the fork, join and counts events.
func (c *core) initStreams() error {
	var err error
	if c.main == nil {
		if c.main, err = c.dev.NewStream(gpuctx.StreamOptions{}); err != nil {
			return err
		}
		c.ownMain = true
	}
	if c.side, err = c.dev.NewStream(gpuctx.StreamOptions{}); err != nil {
		return err
	}
	if c.ctx, err = c.dev.NewContext(gpuctx.ContextOptions{Stream: c.main}); err != nil {
		return err
	}
	if c.sctx, err = c.ctx.WithStream(c.side); err != nil {
		return err
	}
	for _, e := range []**gpuctx.Event{&c.evFork, &c.evJoin, &c.evCounts} {
		if *e, err = c.dev.NewEvent(false); err != nil {
			return err
		}
	}
	return nil
}

// loadKernels gives every stage the launchers of its kernels (the fused
// tiles' are looked up per tile, see expertStage.fusedKernels).
func (c *core) loadKernels() error {
	ks, err := moekernels.LoadKernels(c.dev)
	if err != nil {
		return err
	}
	r, d, x, s, m := &c.router, &c.dispatch, &c.experts, &c.shared, &c.combine
	r.kRoute = ks.Route
	d.kPlan, d.kGather, d.kAlign, d.kRouteAlign = ks.Plan, ks.Gather, ks.Align, ks.RouteAlign
	d.kAlignCount, d.kAlignScan, d.kAlignScatter = ks.AlignCount, ks.AlignScan, ks.AlignScatter
	x.kSwiglu, x.kExpertUp, x.kExpertDown = ks.Swiglu, ks.ExpertUp, ks.ExpertDown
	s.kSwiglu = ks.Swiglu
	m.kCombine, m.kCombRows = ks.Combine, ks.CombineRows
	return nil
}

// scratch lists every stage's scratch buffers.
func (c *core) scratch() []**gpuctx.Buffer {
	r, d, x, s := &c.router, &c.dispatch, &c.experts, &c.shared
	return []**gpuctx.Buffer{&r.logits, &r.idx, &r.wts, &d.counts, &d.offsets, &d.pos,
		&d.xp, &x.h, &x.act, &x.out, &x.xq, &x.xs, &x.aq, &x.as, &d.sorted, &d.bexp, &d.npost, &d.ticket, &d.bcnt, &d.boff, &s.h, &s.act, &s.out, &s.g}
}

// release frees everything c holds besides extra (the owner's buffers),
// ignoring objects that are already closed or freed (a device closed before
// the core freed them). It waits for both streams first.
func (c *core) release(extra []**gpuctx.Buffer, evs []*gpuctx.Event, before func(keep func(error))) error {
	var errs []error
	keep := func(err error) {
		if err != nil && !errors.Is(err, gpuctx.ErrClosed) && !errors.Is(err, gpuctx.ErrFreed) {
			errs = append(errs, err)
		}
	}
	for _, s := range []*gpuctx.Stream{c.main, c.side} {
		if s != nil {
			keep(s.Synchronize())
		}
	}
	if before != nil {
		before(keep)
	}
	for _, b := range append(c.scratch(), extra...) {
		if *b != nil {
			c.scratchBytes -= int64((*b).Size())
			keep((*b).Free())
			*b = nil
		}
	}
	for _, b := range c.weightBufs {
		keep(b.Free())
	}
	c.weightBufs = nil
	if h := c.dispatch.countsHost; h != nil {
		keep(h.Free())
		c.dispatch.countsHost = nil
	}
	for _, e := range append([]*gpuctx.Event{c.evFork, c.evJoin, c.evCounts}, evs...) {
		if e != nil {
			keep(e.Close())
		}
	}
	if c.ctx != nil {
		keep(c.ctx.Close())
	}
	if c.side != nil {
		keep(c.side.Close())
	}
	if c.ownMain && c.main != nil {
		keep(c.main.Close())
	}
	return errors.Join(errs...)
}

// grow makes *b hold at least n bytes. Before freeing a buffer that queued work
// may still use it waits for both streams (once per forward, tracked by synced).
func (e *env) grow(b **gpuctx.Buffer, n int, synced *bool) error {
	if *b != nil && (*b).Size() >= n {
		return nil
	}
	if *b != nil {
		if !*synced {
			if err := e.main.Synchronize(); err != nil {
				return err
			}
			if err := e.side.Synchronize(); err != nil {
				return err
			}
			*synced = true
		}
		if e.onGrow != nil {
			e.onGrow() // graphs hold the old buffer's address
		}
		if err := (*b).Free(); err != nil {
			return err
		}
		e.scratchBytes -= int64((*b).Size())
		*b = nil
		n += n / 4 // headroom for growing batches
	}
	nb, err := e.dev.Alloc(max(n, 256))
	if err != nil {
		return fmt.Errorf("moe: scratch buffer of %d bytes: %w", n, err)
	}
	e.scratchBytes += int64(nb.Size())
	*b = nb
	return nil
}

// need is a scratch buffer and the bytes a forward needs in it.
type need struct {
	b **gpuctx.Buffer
	n int
}

// growAll grows every buffer of needs, waiting for the streams at most once.
func (e *env) growAll(needs ...need) error {
	synced := false
	for _, nd := range needs {
		if err := e.grow(nd.b, nd.n, &synced); err != nil {
			return err
		}
	}
	return nil
}

// bf16 is the kernels' dtype flag: 1 for bf16, 0 for f32.
func (e *env) bf16() int32 { return flag(e.dt == gpuctx.BF16) }

// encode returns v's bytes in the layer's dtype (bf16 rounds to nearest even).
func (e *env) encode(v []float32) []byte {
	if e.dt == gpuctx.F32 {
		return f32Bytes(v)
	}
	h := half.BF16s(v)
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(h))), 2*len(h))
}

// decode converts b (the layer's dtype) to float32 values.
func (e *env) decode(b []byte) []float32 {
	if e.dt == gpuctx.F32 {
		return append([]float32(nil), unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/4)...)
	}
	h := unsafe.Slice((*uint16)(unsafe.Pointer(unsafe.SliceData(b))), len(b)/2)
	out := make([]float32, len(h))
	for i, v := range h {
		out[i] = half.FromBF16(v)
	}
	return out
}

func f32Bytes(v []float32) []byte {
	if len(v) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(v))), 4*len(v))
}

// gridFor returns a grid width for n rows (blocks stride over the rest).
func gridFor(n int) int { return max(1, min(n, 65535)) }

// eltBlock and eltGrid launch an elementwise kernel over n outputs with one
// thread each (gpuctx_moe_swiglu): every load in flight at once.
var eltBlock = gpuctx.Dim3{X: 256, Y: 1, Z: 1}

func eltGrid(n int) gpuctx.Dim3 { return gpuctx.Dim3{X: max(1, min((n+255)/256, 65535)), Y: 1, Z: 1} }

// blockFor returns a block width for rows of n columns: a multiple of 32, at
// most 256.
func blockFor(n int) int { return max(32, min(256, (n+31)/32*32)) }

func flag(b bool) int32 {
	if b {
		return 1
	}
	return 0
}
