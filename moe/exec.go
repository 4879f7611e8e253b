package moe

import (
	"fmt"
	"math"
	"slices"
	"time"
	"unsafe"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// Forward computes y [T,H] for x [T,H] (host float32, row-major) with the
// layer's Mode: it uploads x, queues ForwardDevice on the main stream, waits for
// the main stream, and downloads y. It blocks until the result is on the host.
// In bf16 mode x is rounded to bf16 on upload and y is widened exactly.
func (l *Layer) Forward(x []float32, T int) ([]float32, error) {
	const op = "Layer.Forward"
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.check(op); err != nil {
		return nil, err
	}
	H := l.cfg.HiddenSize
	if T <= 0 {
		return nil, fmt.Errorf("moe: %s: T = %d tokens: must be > 0: %w", op, T, gpuctx.ErrInvalid)
	}
	if len(x) != T*H {
		return nil, fmt.Errorf("moe: %s: x has %d values, want T*H = %d*%d = %d: %w", op, len(x), T, H, T*H, gpuctx.ErrSize)
	}
	xv, yv, err := l.hostIO(T * H * l.es)
	if err != nil {
		return nil, err
	}
	if err := xv.CopyFromHost(l.encode(x)); err != nil {
		return nil, err
	}
	if err := l.forward(op, xv, yv, T, l.mode, Whole); err != nil {
		return nil, err
	}
	if err := l.main.Synchronize(); err != nil {
		return nil, fmt.Errorf("moe: %s: %w", op, err)
	}
	out := make([]byte, T*H*l.es)
	if err := yv.CopyToHost(out); err != nil {
		return nil, err
	}
	return l.decode(out), nil
}

// hostIO returns views of n bytes of Forward's input and output buffers,
// grown as needed, once the main stream has finished reading them.
func (l *Layer) hostIO(n int) (xv, yv *gpuctx.Buffer, err error) {
	synced := false
	if err := l.grow(&l.xio, n, &synced); err != nil {
		return nil, nil, err
	}
	if err := l.grow(&l.yio, n, &synced); err != nil {
		return nil, nil, err
	}
	if !synced { // an earlier forward may still read xio
		if err := l.main.Synchronize(); err != nil {
			return nil, nil, err
		}
	}
	if xv, err = l.xio.Slice(0, n); err != nil {
		return nil, nil, err
	}
	if yv, err = l.yio.Slice(0, n); err != nil {
		return nil, nil, err
	}
	return xv, yv, nil
}

// ForwardDevice queues y = MoE(x) on the main stream for x and y [T,H] in the
// layer's dtype on the layer's device (each at least T*H elements; y may be x).
// part selects the whole block, the shared expert alone or the routed path
// alone; mode selects Single, Dual (the shared expert on the side stream, forked
// from and joined back into the main stream with events), Auto or FusedShared.
//
// Batches of up to LayerOptions.SmallBatchTokens tokens (and the shared expert
// alone) need no host wait: the routed experts read the per-expert plan on the
// device, and from the second forward of a given shape on the whole forward is
// replayed as a captured graph (x copied into the layer's staging buffer, the
// graph, the result copied to y, all on the main stream). ForwardDevice then
// returns once the work is queued. Larger batches use grouped GEMMs, whose sizes
// the host needs: ForwardDevice blocks once until the main stream has finished
// the router, the routing and the permutation plan (an event after the counts
// copy; the shared expert, queued before that wait, keeps the device busy). The
// caller must keep x and y alive and unmodified until the main stream has passed
// the forward; later work on the main stream is ordered after it, including the
// side stream's part.
//
// Single and Dual produce bitwise identical y: the same kernels and GEMMs with
// the same shapes, and a combine with a fixed summation order. The small-batch
// and grouped-GEMM paths agree to rounding (their dot products sum in different
// orders).
func (l *Layer) ForwardDevice(x, y *gpuctx.Buffer, T int, mode Mode, part Part) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.forward("Layer.ForwardDevice", x, y, T, mode, part)
}

// forward is ForwardDevice with l.mu held: it checks the arguments, settles
// Auto's mode, plans the forward, sizes the stages' scratch, and runs the
// plan: as a captured graph where it can, else eagerly (staged or not).
func (l *Layer) forward(op string, x, y *gpuctx.Buffer, T int, mode Mode, part Part) error {
	if err := l.check(op); err != nil {
		return err
	}
	if err := l.checkForward(op, x, y, T, mode, part); err != nil {
		return err
	}
	mode, err := l.autoMode(op, x, y, T, mode, part)
	if err != nil {
		return err
	}
	p := l.plan(x, y, T, mode, part)
	if l.hook != nil {
		l.hook(p)
	}
	if err := l.ensure(p); err != nil {
		return err
	}
	ran := false
	if p.graph {
		if ran, err = l.forwardGraph(p, x, y); err != nil {
			return err
		}
	}
	if !ran {
		if err := l.runEager(p, x, y); err != nil {
			return err
		}
	}
	if p.routed {
		l.last = lastRouting{T: T, ks: p.ks}
	}
	return nil
}

// checkForward checks ForwardDevice's arguments; the error names the bad one.
func (l *Layer) checkForward(op string, x, y *gpuctx.Buffer, T int, mode Mode, part Part) error {
	c := &l.cfg
	H, E, K, I, Is := c.HiddenSize, c.NumExperts, c.TopK, c.Intermediate, c.SharedIntermediate
	switch {
	case T <= 0:
		return fmt.Errorf("moe: %s: T = %d tokens: must be > 0: %w", op, T, gpuctx.ErrInvalid)
	case int64(T)*int64(K) > math.MaxInt32 || int64(T)*int64(max(H, 2*I, 2*Is, E)) > math.MaxInt32:
		return fmt.Errorf("moe: %s: T = %d tokens is too many for 32-bit kernel arguments; split the batch: %w", op, T, gpuctx.ErrInvalid)
	case mode < Single || mode > FusedShared:
		return fmt.Errorf("moe: %s: unknown mode %v; use Single, Dual, Auto or FusedShared: %w", op, mode, gpuctx.ErrInvalid)
	case part < Whole || part > RoutedOnly:
		return fmt.Errorf("moe: %s: unknown part %v; use Whole, SharedOnly or RoutedOnly: %w", op, part, gpuctx.ErrInvalid)
	case part == SharedOnly && l.shared.gu == nil:
		return fmt.Errorf("moe: %s: part SharedOnly, but this %s layer has no shared expert: %w", op, c.Family, gpuctx.ErrInvalid)
	}
	if mode == FusedShared {
		if err := l.fusedSharedLimit(); err != nil {
			return fmt.Errorf("moe: %s: %w", op, err)
		}
	}
	if l.fused(T) {
		// The fused kernels' sorted rows stay 32-bit: the slots and experts
		// of FusedShared where the mode may run it.
		ks, ne := K, E
		if mode == FusedShared || mode == Auto {
			ks, ne = K+l.ns, E+l.ns
		}
		if err := moekernels.CheckLimits(T, ks, ne, H, I); err != nil {
			return fmt.Errorf("moe: %s: %v: %w", op, err, gpuctx.ErrInvalid)
		}
	}
	n := T * H * l.es
	for _, b := range []struct {
		name string
		buf  *gpuctx.Buffer
	}{{"x", x}, {"y", y}} {
		if b.buf == nil {
			return fmt.Errorf("moe: %s: %s is nil: %w", op, b.name, gpuctx.ErrInvalid)
		}
		if b.buf.Device() != l.dev {
			return fmt.Errorf("moe: %s: %s belongs to another device than the layer: %w", op, b.name, gpuctx.ErrWrongDevice)
		}
		if b.buf.Size() < n {
			return fmt.Errorf("moe: %s: %s holds %d bytes; T*H = %d*%d %v elements need %d: %w", op, b.name, b.buf.Size(), T, H, l.dt, n, gpuctx.ErrSize)
		}
	}
	return nil
}

// autoMode returns the mode a forward of mode runs (resolveMode). Auto on
// the fused path with a fusable shared expert runs the tuner's choice for T's
// bucket (tuner.knownMode); where there is none yet, this forward measures it
// on x and y: Dual and FusedShared each run twice (eagerly, which tunes the
// tiles, then the capture) and then three times timed (timeForward, each
// after an L2 flush: coldTuning), waiting for the main stream, and the tuner
// keeps the faster (tuner.keepMode).
func (l *Layer) autoMode(op string, x, y *gpuctx.Buffer, T int, mode Mode, part Part) (Mode, error) {
	m, timed := l.resolveMode(T, mode, part)
	if !timed {
		return m, nil
	}
	if m, ok := l.tuner.knownMode(T); ok {
		return m, nil
	}
	return coldTuning(l, func() (Mode, error) {
		var medians [len(autoCandidates)]time.Duration
		for i, m := range autoCandidates {
			for range 2 { // eager (tunes the tiles), then the capture
				if err := l.forward(op, x, y, T, m, part); err != nil {
					return 0, err
				}
			}
			var ds []time.Duration
			for range 3 {
				d, err := l.timeForward(op, x, y, T, m, part)
				if err != nil {
					return 0, err
				}
				ds = append(ds, d)
			}
			slices.Sort(ds)
			medians[i] = ds[1]
		}
		return l.tuner.keepMode(T, medians), nil
	})
}

// timeForward times one forward between the tuning events on the main stream
// (after the L2 flush, where autoMode opened one) and waits for it.
func (l *Layer) timeForward(op string, x, y *gpuctx.Buffer, T int, m Mode, part Part) (time.Duration, error) {
	if timingHook != nil {
		timingHook(true)
	}
	start, stop := l.tuner.evTune[0], l.tuner.evTune[1]
	if err := l.flushL2(); err != nil {
		return 0, err
	}
	if err := start.Record(l.main); err != nil {
		return 0, err
	}
	if err := l.forward(op, x, y, T, m, part); err != nil {
		return 0, err
	}
	if err := stop.Record(l.main); err != nil {
		return 0, err
	}
	if err := stop.Synchronize(); err != nil {
		return 0, err
	}
	return stop.Elapsed(start)
}

// runEager queues p eagerly: on x and y, or through the staging buffers.
func (l *Layer) runEager(p *plan, x, y *gpuctx.Buffer) error {
	if p.staged {
		return l.stagedEager(p, x, y)
	}
	return l.eager(p, x, y)
}

// stagedEager runs the forward eagerly on the layer's own staging buffers
// (16-byte aligned): x is copied in, y copied out, on the main stream.
func (l *Layer) stagedEager(p *plan, x, y *gpuctx.Buffer) error {
	if err := l.gc.staging(&l.env, p.n); err != nil {
		return err
	}
	if err := l.main.CopyDtoD(l.gc.gx, 0, x, 0, p.n); err != nil {
		return err
	}
	if err := l.eager(p, l.gc.gx, l.gc.gy); err != nil {
		return err
	}
	return l.main.CopyDtoD(y, 0, l.gc.gy, 0, p.n)
}

// eager queues the forward of x's first p.n bytes into y's (see enqueue).
func (l *Layer) eager(p *plan, x, y *gpuctx.Buffer) error {
	xv, err := x.Slice(0, p.n)
	if err != nil {
		return err
	}
	yv, err := y.Slice(0, p.n)
	if err != nil {
		return err
	}
	return l.enqueue(p, xv, yv)
}

// lastRouting is where LastRouting finds the last routed forward's routing:
// its tokens (0: none yet) and slots per token.
type lastRouting struct{ T, ks int }

// LastRouting waits for the main stream and returns the expert indices [T,K]
// and routing weights [T,K] of the last forward that ran the routed path, each
// token's experts in decreasing order of selection score (ties: lower index).
func (l *Layer) LastRouting() (idx []int32, w []float32, err error) {
	const op = "Layer.LastRouting"
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.check(op); err != nil {
		return nil, nil, err
	}
	T, KS := l.last.T, l.last.ks
	if T == 0 {
		return nil, nil, fmt.Errorf("moe: %s: no forward has routed tokens yet (run Forward, or ForwardDevice with Whole or RoutedOnly)", op)
	}
	if err := l.main.Synchronize(); err != nil {
		return nil, nil, err
	}
	K := l.cfg.TopK
	n := T * KS // rows hold KS slots: K routed, then any fused shared ones
	allIdx := make([]int32, n)
	allW := make([]float32, n)
	for _, v := range []struct {
		b   *gpuctx.Buffer
		dst unsafe.Pointer
	}{{l.router.idx, unsafe.Pointer(unsafe.SliceData(allIdx))}, {l.router.wts, unsafe.Pointer(unsafe.SliceData(allW))}} {
		view, err := v.b.Slice(0, 4*n)
		if err != nil {
			return nil, nil, err
		}
		if err := view.CopyToHost(unsafe.Slice((*byte)(v.dst), 4*n)); err != nil {
			return nil, nil, err
		}
	}
	idx = make([]int32, 0, T*K)
	w = make([]float32, 0, T*K)
	for t := 0; t < T; t++ {
		idx = append(idx, allIdx[t*KS:t*KS+K]...)
		w = append(w, allW[t*KS:t*KS+K]...)
	}
	return idx, w, nil
}

// smallBatch reports whether a batch of T tokens takes the small-batch path.
func (l *Layer) smallBatch(T int) bool {
	return T <= l.small && l.cfg.HiddenSize%8 == 0 && l.cfg.Intermediate%8 == 0
}

// fused reports whether a batch of T tokens takes the fused routed path.
func (l *Layer) fused(T int) bool {
	return l.fusedOK && !l.smallBatch(T)
}

// xQuantInRoute reports whether the one-launch routing may quantize x for
// the w8a8 tiles (plan.xInRoute): an FP8 layer with its w8a8 tiles loaded.
// A plan uses it where its tiles are w8a8 or not yet tuned, so that the
// tuner times the w8a8 chains as the forward will run them: without a
// quantizer launch for x (a w8a16 winner leaves that forward's codes unread,
// T*ceil(H/128) half-warp steps spread over the routing's blocks).
func (l *Layer) xQuantInRoute() bool {
	q := l.experts.q
	return q != nil && q.w8 && q.quantInRoute
}

// routeAlignOK reports whether a fused-path batch of T tokens may route and
// sort in one launch (gpuctx_moe_route_align); the plan also bounds the
// experts it sorts by MaxExperts.
func (l *Layer) routeAlignOK(T int) bool {
	return l.fused(T) && T <= l.dispatch.raTokens && T*l.cfg.NumExperts <= moekernels.RouteAlignMaxDots
}
