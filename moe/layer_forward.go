package moe

import (
	"errors"
	"fmt"
	"math"
	"unsafe"

	"github.com/gpuctx/gpuctx"
)

// Routing codes passed to gpuctx_moe_route (kernels/moe.cu).
const (
	scoreSoftmax int32 = 0
	scoreSigmoid int32 = 1

	methodGreedy    int32 = 0
	methodGroupMax  int32 = 1 // group_limited_greedy
	methodGroupTop2 int32 = 2 // noaux_tc
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
	n := T * H * l.es
	synced := false
	if err := l.grow(&l.scr.xio, n, &synced); err != nil {
		return nil, err
	}
	if err := l.grow(&l.scr.yio, n, &synced); err != nil {
		return nil, err
	}
	if !synced { // an earlier forward may still read xio
		if err := l.main.Synchronize(); err != nil {
			return nil, err
		}
	}
	xv, err := l.scr.xio.Slice(0, n)
	if err != nil {
		return nil, err
	}
	yv, err := l.scr.yio.Slice(0, n)
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
	out := make([]byte, n)
	if err := yv.CopyToHost(out); err != nil {
		return nil, err
	}
	return l.decode(out), nil
}

// ForwardDevice queues y = MoE(x) on the main stream for x and y [T,H] in the
// layer's dtype on the layer's device (each at least T*H elements; y may be x).
// part selects the whole block, the shared expert alone or the routed path
// alone; mode selects Single, Dual (the shared expert on the side stream, forked
// from and joined back into the main stream with events) or Auto.
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

// forward is ForwardDevice with l.mu held.
func (l *Layer) forward(op string, x, y *gpuctx.Buffer, T int, mode Mode, part Part) error {
	if err := l.check(op); err != nil {
		return err
	}
	c := &l.cfg
	H, E, K, I, Is := c.HiddenSize, c.NumExperts, c.TopK, c.Intermediate, c.SharedIntermediate
	es := l.es
	if T <= 0 {
		return fmt.Errorf("moe: %s: T = %d tokens: must be > 0: %w", op, T, gpuctx.ErrInvalid)
	}
	if int64(T)*int64(K) > math.MaxInt32 || int64(T)*int64(max(H, 2*I, 2*Is, E)) > math.MaxInt32 {
		return fmt.Errorf("moe: %s: T = %d tokens is too many for 32-bit kernel arguments; split the batch: %w", op, T, gpuctx.ErrInvalid)
	}
	if mode < Single || mode > FusedShared {
		return fmt.Errorf("moe: %s: unknown mode %v; use Single, Dual, Auto or FusedShared: %w", op, mode, gpuctx.ErrInvalid)
	}
	if part < Whole || part > RoutedOnly {
		return fmt.Errorf("moe: %s: unknown part %v; use Whole, SharedOnly or RoutedOnly: %w", op, part, gpuctx.ErrInvalid)
	}
	hasShared := l.sgu != nil
	if part == SharedOnly && !hasShared {
		return fmt.Errorf("moe: %s: part SharedOnly, but this %s layer has no shared expert: %w", op, c.Family, gpuctx.ErrInvalid)
	}
	n := T * H * es
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
	doRouted := part != SharedOnly
	doShared := hasShared && part != RoutedOnly
	if mode == Auto {
		switch {
		case doRouted && doShared && l.fused(T) && l.ns > 0:
			m, err := l.autoMode(op, x, y, T, part)
			if err != nil {
				return err
			}
			mode = m
		case doRouted && doShared && l.fused(T):
			mode = Dual
		case (part != SharedOnly && l.smallBatch(T)) || T >= l.thresh:
			mode = Dual
		default:
			mode = Single
		}
	}
	fusedShared := mode == FusedShared && doRouted && doShared && l.ns > 0 && l.fused(T)
	if mode == FusedShared && !fusedShared {
		mode = Dual
	}
	dual := mode == Dual && doShared
	l.lastDual = dual
	l.fusedShared = fusedShared
	if err := l.ensure(T, doRouted, doShared); err != nil {
		return err
	}
	// The device-planned kernels read and write rows with 16-byte accesses: a
	// buffer at another alignment goes through the layer's own buffers.
	l.lastStaged = false
	if doRouted && (l.smallBatch(T) || l.fused(T)) && !(aligned16(x) && aligned16(y)) {
		l.lastStaged = true
		if l.useGraphs {
			return l.forwardGraph(x, y, n, T, graphKey{T, dual, fusedShared, doRouted, doShared})
		}
		return l.stagedEager(x, y, n, T, dual, doRouted, doShared)
	}
	if l.useGraphs && (!doRouted || l.smallBatch(T) || l.fused(T)) {
		return l.forwardGraph(x, y, n, T, graphKey{T, dual, fusedShared, doRouted, doShared})
	}
	return l.eager(x, y, n, T, dual, doRouted, doShared)
}

// aligned16 reports whether b's device address is a multiple of 16 bytes.
func aligned16(b *gpuctx.Buffer) bool {
	p, err := b.Ptr()
	return err == nil && p%16 == 0
}

// stagedEager runs the forward eagerly on the layer's own staging buffers
// (16-byte aligned): x is copied in, y copied out, on the main stream.
func (l *Layer) stagedEager(x, y *gpuctx.Buffer, n, T int, dual, doRouted, doShared bool) error {
	synced := false
	if err := l.grow(&l.gx, n, &synced); err != nil {
		return err
	}
	if err := l.grow(&l.gy, n, &synced); err != nil {
		return err
	}
	if err := l.main.CopyDtoD(l.gx, 0, x, 0, n); err != nil {
		return err
	}
	if err := l.eager(l.gx, l.gy, n, T, dual, doRouted, doShared); err != nil {
		return err
	}
	return l.main.CopyDtoD(y, 0, l.gy, 0, n)
}

// eager queues the forward of x's first n bytes into y's (see enqueue).
func (l *Layer) eager(x, y *gpuctx.Buffer, n, T int, dual, doRouted, doShared bool) error {
	xv, err := x.Slice(0, n)
	if err != nil {
		return err
	}
	yv, err := y.Slice(0, n)
	if err != nil {
		return err
	}
	return l.enqueue(xv, yv, T, dual, doRouted, doShared)
}

// enqueue queues the forward of xv into yv (both exactly T*H elements) on the
// main stream (and the side stream when dual).
func (l *Layer) enqueue(xv, yv *gpuctx.Buffer, T int, dual, doRouted, doShared bool) error {
	c := &l.cfg
	H, K := c.HiddenSize, c.TopK
	if dual && !doRouted { // fork: the side stream starts once x is ready on the main stream
		if err := l.evFork.Record(l.main); err != nil {
			return err
		}
		if err := l.sharedOnSide(l.evFork, xv, T); err != nil {
			return err
		}
	}
	if doRouted {
		shared := sharedNone
		switch {
		case doShared && l.fusedShared:
			shared = sharedFused
		case doShared && dual:
			shared = sharedSide
		case doShared:
			shared = sharedMain
		}
		if err := l.routed(xv, T, shared); err != nil {
			return err
		}
		l.routedT = T
	} else if doShared && !dual {
		if err := l.sharedExpert(l.ctx, l.main, xv, T); err != nil {
			return err
		}
	}
	if dual { // join
		if err := l.main.Wait(l.evJoin); err != nil {
			return err
		}
	}
	s := &l.scr
	dummy := l.bias // a valid pointer for arguments the kernel does not read
	out, pos, w, sout, sg := dummy, dummy, dummy, dummy, dummy
	if doRouted {
		out, pos, w = s.out, s.pos, s.w
	}
	if doShared {
		sout = s.sout
		if l.sgate != nil {
			sg = s.sg
		}
	}
	if doRouted && l.fused(T) { // routed rows are in assignment order
		n, ks, sep := T*H, K, doShared
		if l.fusedShared { // the shared expert's chunks are rows K.. of each token
			ks, sep = K+l.ns, false
		}
		per := 1
		if l.dt == gpuctx.BF16 && H%8 == 0 { // the kernel's 16-byte path: eight elements a thread
			per = 8
		}
		blk := 256
		if n/per < 256*l.dev.Info().SMCount { // a small batch: spread it over more multiprocessors
			blk = 64
		}
		return l.launchEarly(l.kCombRows, gpuctx.Dim3{X: max(1, min((n/per+blk-1)/blk, 8192)), Y: 1, Z: 1}, gpuctx.Dim3{X: blk, Y: 1, Z: 1}, 0,
			out, w, sout, sg, yv, int32(T), int32(ks), int32(H),
			flag(doRouted), flag(sep), flag(sep && l.sgate != nil), flag(l.dt == gpuctx.BF16))
	}
	return l.main.Launch(l.kCombine, gpuctx.Dim3{X: gridFor(T), Y: 1, Z: 1}, gpuctx.Dim3{X: blockFor(H), Y: 1, Z: 1}, 0,
		out, pos, w, sout, sg, yv, int32(T), int32(K), int32(H),
		flag(doRouted), flag(doShared), flag(doShared && l.sgate != nil), flag(l.dt == gpuctx.BF16))
}

// Where routed queues the shared expert.
const (
	sharedNone  = iota
	sharedMain  // on the main stream, after the counts copy: it runs while the host waits
	sharedSide  // on the side stream, forked at the counts copy, joined by evJoin
	sharedFused // inside the fused routed kernels, as experts E.. (FusedShared)
)

// routed queues the router, routing and permutation, waits for the per-expert
// counts, and queues the routed experts, all on the main stream. The shared
// expert (see sharedMain, sharedSide) is queued right after the counts copy, so
// that it never competes with the router chain the host is waiting for: on the
// main stream it fills the host's wait and delays the routed experts by what is
// left of it; on the side stream (Dual) it fills the wait and then runs beside
// the routed experts. On the fused path nothing waits for the host, and the
// side stream forks before the router (evFork): the shared expert overlaps the
// routing kernels too, which leave DRAM idle. The caller joins the side
// stream (evJoin).
func (l *Layer) routed(x *gpuctx.Buffer, T int, shared int) error {
	c := &l.cfg
	H, E, K, I := c.HiddenSize, c.NumExperts, c.TopK, c.Intermediate
	TK, es, s := T*K, l.es, &l.scr
	l.routedKS = l.slots(shared)
	if shared == sharedSide && l.fused(T) {
		if err := l.evFork.Record(l.main); err != nil { // x is ready: the shared expert may start
			return err
		}
	}
	if l.routeAlignOK(T) { // router, routing and sort in one launch
		return l.routedSmall(x, T, shared)
	}
	err := l.ctx.BlasFlavour(l.flav, func(h gpuctx.Blas) error {
		return h.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: T, N: E, K: H, Alpha: 1,
			A: x, B: l.router, C: s.logits, AB: l.dt, CType: gpuctx.F32})
	})
	if err != nil {
		return fmt.Errorf("moe: router GEMM: %w", err)
	}
	scoring, method, eps, scale := l.routeArgs()
	one := gpuctx.Dim3{X: 1, Y: 1, Z: 1}
	if err := l.launchEarly(l.kRoute, gpuctx.Dim3{X: gridFor(T), Y: 1, Z: 1}, gpuctx.Dim3{X: 32, Y: 1, Z: 1}, 0,
		s.logits, l.bias, s.idx, s.w, int32(T), int32(E), int32(K), scoring, method,
		int32(c.NumGroups), int32(c.TopKGroups), flag(c.HasBias()), flag(c.NormTopKProb), eps, scale,
		int32(l.slots(shared)), int32(l.slots(shared)-K)); err != nil {
		return err
	}
	if l.fused(T) {
		return l.routedFused(x, T, shared)
	}
	if err := l.main.Launch(l.kPlan, one, gpuctx.Dim3{X: 256, Y: 1, Z: 1}, 0,
		s.idx, s.counts, s.offsets, s.pos, int32(TK), int32(E)); err != nil {
		return err
	}
	small := l.smallBatch(T)
	if !small {
		if err := l.main.CopyDtoH(l.countsHost, 0, s.counts, 0, 4*E); err != nil {
			return err
		}
	}
	if err := l.evCounts.Record(l.main); err != nil {
		return err
	}
	if err := l.main.Launch(l.kGather, gpuctx.Dim3{X: gridFor(TK), Y: 1, Z: 1}, gpuctx.Dim3{X: blockFor(H), Y: 1, Z: 1}, 0,
		x, s.pos, s.xp, int32(TK), int32(K), int32(H), int32(es)); err != nil {
		return err
	}
	if small {
		return l.smallExperts(x, T, shared)
	}
	switch shared {
	case sharedMain:
		if err := l.sharedExpert(l.ctx, l.main, x, T); err != nil {
			return err
		}
	case sharedSide: // fork at the counts copy: x and the router chain are done by then
		if err := l.sharedOnSide(l.evCounts, x, T); err != nil {
			return err
		}
	}
	if err := l.evCounts.Synchronize(); err != nil {
		return fmt.Errorf("moe: waiting for the per-expert counts: %w", err)
	}
	counts := unsafe.Slice((*int32)(unsafe.Pointer(unsafe.SliceData(l.countsHost.Bytes()))), E)
	gateUp := make([]gpuctx.Gemm, 0, E)
	down := make([]gpuctx.Gemm, 0, E)
	off := 0
	for e := 0; e < E; e++ {
		n := int(counts[e])
		if n < 0 || off+n > TK {
			return fmt.Errorf("moe: routing produced count %d for expert %d (%d rows before it, %d in all): a kernel bug", n, e, off, TK)
		}
		if n > 0 {
			views := make([]*gpuctx.Buffer, 6)
			for i, v := range []struct {
				b        *gpuctx.Buffer
				off, len int
			}{
				{s.xp, off * H, n * H}, {l.gu, e * 2 * I * H, 2 * I * H}, {s.h, off * 2 * I, n * 2 * I},
				{s.act, off * I, n * I}, {l.down, e * H * I, H * I}, {s.out, off * H, n * H},
			} {
				if views[i], err = v.b.Slice(v.off*es, v.len*es); err != nil {
					return err
				}
			}
			gateUp = append(gateUp, gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: n, N: 2 * I, K: H, Alpha: 1,
				A: views[0], B: views[1], C: views[2], AB: l.dt, CType: l.dt})
			down = append(down, gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: n, N: H, K: I, Alpha: 1,
				A: views[3], B: views[4], C: views[5], AB: l.dt, CType: l.dt})
		}
		off += n
	}
	if off != TK {
		return fmt.Errorf("moe: routing counted %d rows, want T*K = %d: a kernel bug", off, TK)
	}
	if err := l.ctx.BlasFlavour(l.flav, func(h gpuctx.Blas) error { return h.GemmGrouped(gateUp) }); err != nil {
		return fmt.Errorf("moe: expert gate/up grouped GEMM: %w", err)
	}
	if err := l.main.Launch(l.kSwiglu, eltGrid(TK*I), eltBlock, 0,
		s.h, s.act, int32(TK), int32(I), flag(l.dt == gpuctx.BF16)); err != nil {
		return err
	}
	if err := l.ctx.BlasFlavour(l.flav, func(h gpuctx.Blas) error { return h.GemmGrouped(down) }); err != nil {
		return fmt.Errorf("moe: expert down grouped GEMM: %w", err)
	}
	return nil
}

// routeArgs returns gpuctx_moe_route's scoring and method codes, norm_eps and
// scale for the layer's config.
func (l *Layer) routeArgs() (scoring, method int32, eps, scale float32) {
	c := &l.cfg
	scoring, method, scale = scoreSoftmax, methodGreedy, 1
	if c.Scoring == Sigmoid {
		scoring = scoreSigmoid
	}
	switch c.TopKMethod {
	case GroupLimitedGreedy:
		method = methodGroupMax
	case NoAuxTC:
		method = methodGroupTop2
	}
	if c.Family == DeepseekV3 {
		eps = 1e-20
	}
	if c.Family == DeepseekV2 || c.Family == DeepseekV3 {
		scale = float32(c.RoutedScalingFactor)
	}
	return scoring, method, eps, scale
}

// sharedExpert queues the shared expert (and the Qwen2-MoE gate logits) on
// stream st through ctx, whose current stream must be st: sout = Down(silu(Gate
// x) * Up x), sg = x . shared_expert_gate.
func (l *Layer) sharedExpert(ctx *gpuctx.Context, st *gpuctx.Stream, x *gpuctx.Buffer, T int) error {
	H, Is := l.cfg.HiddenSize, l.cfg.SharedIntermediate
	s := &l.scr
	err := ctx.BlasFlavour(l.flav, func(h gpuctx.Blas) error {
		return h.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: T, N: 2 * Is, K: H, Alpha: 1,
			A: x, B: l.sgu, C: s.sh, AB: l.dt, CType: l.dt})
	})
	if err != nil {
		return fmt.Errorf("moe: shared expert gate/up GEMM: %w", err)
	}
	if err := st.Launch(l.kSwiglu, eltGrid(T*Is), eltBlock, 0,
		s.sh, s.sact, int32(T), int32(Is), flag(l.dt == gpuctx.BF16)); err != nil {
		return err
	}
	err = ctx.BlasFlavour(l.flav, func(h gpuctx.Blas) error {
		if err := h.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: T, N: H, K: Is, Alpha: 1,
			A: s.sact, B: l.sdown, C: s.sout, AB: l.dt, CType: l.dt}); err != nil {
			return err
		}
		if l.sgate == nil {
			return nil
		}
		return h.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: T, N: 1, K: H, Alpha: 1,
			A: x, B: l.sgate, C: s.sg, AB: l.dt, CType: gpuctx.F32})
	})
	if err != nil {
		return fmt.Errorf("moe: shared expert down/gate GEMM: %w", err)
	}
	return nil
}

// ensure grows the scratch buffers a forward of T tokens needs.
func (l *Layer) ensure(T int, routed, shared bool) error {
	c := &l.cfg
	H, E, K, I, Is, es := c.HiddenSize, c.NumExperts, c.TopK, c.Intermediate, c.SharedIntermediate, l.es
	TK, s := T*K, &l.scr
	type need struct {
		b **gpuctx.Buffer
		n int
	}
	var needs []need
	if routed {
		TKS := T * (K + l.ns) // room for the fused shared expert's slots
		needs = append(needs, need{&s.logits, 4 * T * E}, need{&s.idx, 4 * TKS}, need{&s.w, 4 * TKS})
		if !l.fused(T) { // the fused path sizes its own (ensureFused)
			needs = append(needs, need{&s.counts, 4 * E}, need{&s.offsets, 4 * (E + 1)}, need{&s.pos, 4 * TK},
				need{&s.xp, TK * H * es}, need{&s.h, TK * 2 * I * es}, need{&s.act, TK * I * es}, need{&s.out, TK * H * es})
		}
	}
	if shared {
		needs = append(needs, need{&s.sh, T * 2 * Is * es}, need{&s.sact, T * Is * es}, need{&s.sout, T * H * es}, need{&s.sg, 4 * T})
	}
	synced := false
	for _, nd := range needs {
		if err := l.grow(nd.b, nd.n, &synced); err != nil {
			return err
		}
	}
	return nil
}

// grow makes *b hold at least n bytes. Before freeing a buffer that queued work
// may still use it waits for both streams (once per forward, tracked by synced).
func (l *Layer) grow(b **gpuctx.Buffer, n int, synced *bool) error {
	if *b != nil && (*b).Size() >= n {
		return nil
	}
	if *b != nil {
		if !*synced {
			if err := l.main.Synchronize(); err != nil {
				return err
			}
			if err := l.side.Synchronize(); err != nil {
				return err
			}
			*synced = true
		}
		l.dropGraphs() // they hold the old buffer's address
		if err := (*b).Free(); err != nil {
			return err
		}
		*b = nil
		n += n / 4 // headroom for growing batches
	}
	nb, err := l.dev.Alloc(max(n, 256))
	if err != nil {
		return fmt.Errorf("moe: scratch buffer of %d bytes: %w", n, err)
	}
	*b = nb
	return nil
}

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
	if l.routedT == 0 {
		return nil, nil, fmt.Errorf("moe: %s: no forward has routed tokens yet (run Forward, or ForwardDevice with Whole or RoutedOnly)", op)
	}
	if err := l.main.Synchronize(); err != nil {
		return nil, nil, err
	}
	K, KS := l.cfg.TopK, l.routedKS
	n := l.routedT * KS // rows hold KS slots: K routed, then any fused shared ones
	allIdx := make([]int32, n)
	allW := make([]float32, n)
	for _, v := range []struct {
		b   *gpuctx.Buffer
		dst unsafe.Pointer
	}{{l.scr.idx, unsafe.Pointer(unsafe.SliceData(allIdx))}, {l.scr.w, unsafe.Pointer(unsafe.SliceData(allW))}} {
		view, err := v.b.Slice(0, 4*n)
		if err != nil {
			return nil, nil, err
		}
		if err := view.CopyToHost(unsafe.Slice((*byte)(v.dst), 4*n)); err != nil {
			return nil, nil, err
		}
	}
	idx = make([]int32, 0, l.routedT*K)
	w = make([]float32, 0, l.routedT*K)
	for t := 0; t < l.routedT; t++ {
		idx = append(idx, allIdx[t*KS:t*KS+K]...)
		w = append(w, allW[t*KS:t*KS+K]...)
	}
	return idx, w, nil
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

// smallBatch reports whether a batch of T tokens takes the small-batch path.
func (l *Layer) smallBatch(T int) bool {
	return T <= l.small && l.cfg.HiddenSize%8 == 0 && l.cfg.Intermediate%8 == 0
}

// smallExperts queues the routed experts of a small batch with the
// device-planned kernels (gpuctx_moe_expert_up, gpuctx_moe_expert_down): the
// group sizes stay on the device, so nothing waits for the host. The shared
// expert goes on the main stream after them (Single) or on the side stream,
// forked after the plan (evCounts) and joined by the caller (Dual), where it
// runs beside the expert kernels.
func (l *Layer) smallExperts(x *gpuctx.Buffer, T int, shared int) error {
	c, s := &l.cfg, &l.scr
	E, H, I := c.NumExperts, c.HiddenSize, c.Intermediate
	bf := flag(l.dt == gpuctx.BF16)
	block := gpuctx.Dim3{X: 32 * expertWarps, Y: 1, Z: 1}
	if shared == sharedSide {
		if err := l.sharedOnSide(l.evCounts, x, T); err != nil {
			return err
		}
	}
	if err := l.main.Launch(l.kExpertUp, gpuctx.Dim3{X: (I + expertWarps - 1) / expertWarps, Y: E, Z: 1}, block, 0,
		s.xp, l.gu, s.counts, s.offsets, s.act, int32(E), int32(H), int32(I), bf); err != nil {
		return err
	}
	if err := l.main.Launch(l.kExpertDown, gpuctx.Dim3{X: (H + expertWarps - 1) / expertWarps, Y: E, Z: 1}, block, 0,
		s.act, l.down, s.counts, s.offsets, s.out, int32(E), int32(H), int32(I), bf); err != nil {
		return err
	}
	if shared == sharedMain {
		return l.sharedExpert(l.ctx, l.main, x, T)
	}
	return nil
}

// expertWarps is MOE_XW of kernels/moe.cu: output rows (warps) per block.
const expertWarps = 8

// graphKey identifies a captured forward: its shape and what it computes.
type graphKey struct {
	T                                 int
	dual, fusedShared, routed, shared bool
}

// forwardGraph runs a forward that needs no host wait (the small-batch path, or
// the shared expert alone) as a captured graph: x is copied into the layer's
// staging input, the graph runs, and the staging output is copied to y, all on
// the main stream. The first forward of each shape runs eagerly, so that library
// handles, workspaces and heuristics are set up outside any capture; the second
// captures the graph; later ones only launch it. Graphs are dropped when scratch
// buffers grow (their pointers are baked in).
func (l *Layer) forwardGraph(x, y *gpuctx.Buffer, n, T int, key graphKey) error {
	dual, doRouted, doShared := key.dual, key.routed, key.shared
	if l.seen[key] == 0 {
		l.seen[key]++
		if l.lastStaged {
			return l.stagedEager(x, y, n, T, dual, doRouted, doShared)
		}
		return l.eager(x, y, n, T, dual, doRouted, doShared)
	}
	// The same x and y again: a graph captured on them needs no staging copies
	// (if they are aligned for the kernels' 16-byte accesses).
	dk := directKey{key, x, y}
	if g := l.direct[dk]; !l.lastStaged && (g != nil || l.directSeen[dk]) {
		return l.forwardDirect(x, y, n, T, dk)
	}
	if len(l.directSeen) >= maxDirectGraphs {
		clear(l.directSeen)
	}
	l.directSeen[dk] = true
	synced := false
	if err := l.grow(&l.gx, n, &synced); err != nil {
		return err
	}
	if err := l.grow(&l.gy, n, &synced); err != nil {
		return err
	}
	gx, err := l.gx.Slice(0, n)
	if err != nil {
		return err
	}
	gy, err := l.gy.Slice(0, n)
	if err != nil {
		return err
	}
	g := l.graphs[key]
	if g == nil {
		if err := l.main.BeginCapture(); err != nil {
			if errors.Is(err, gpuctx.ErrUnavailable) { // this backend cannot capture: stay eager
				l.useGraphs = false
				return l.eager(x, y, n, T, dual, doRouted, doShared)
			}
			return fmt.Errorf("moe: capturing the forward of %d tokens: %w", T, err)
		}
		l.capturing = true
		qerr := l.enqueue(gx, gy, T, dual, doRouted, doShared)
		l.capturing = false
		g, err = l.main.EndCapture()
		if qerr != nil {
			if g != nil {
				_ = g.Close()
			}
			return fmt.Errorf("moe: capturing the forward of %d tokens: %w", T, qerr)
		}
		if err != nil {
			return fmt.Errorf("moe: capturing the forward of %d tokens: %w", T, err)
		}
		l.graphs[key] = g
	}
	if err := l.main.CopyDtoD(gx, 0, x, 0, n); err != nil {
		return err
	}
	if err := g.Launch(l.main); err != nil {
		return err
	}
	return l.main.CopyDtoD(y, 0, gy, 0, n)
}

// maxDirectGraphs bounds the graphs captured on callers' buffers.
const maxDirectGraphs = 8

// directKey identifies a graph captured on the caller's x and y.
type directKey struct {
	graphKey
	x, y *gpuctx.Buffer
}

// forwardDirect replays (capturing it first if needed) the forward of key
// captured on x and y themselves, so no staging copies run: for callers that
// pass the same buffers every time (a serving loop's activations, a benchmark).
// x and y are checked first, so a freed buffer is an error, never a replay on
// freed memory.
func (l *Layer) forwardDirect(x, y *gpuctx.Buffer, n, T int, dk directKey) error {
	xv, err := x.Slice(0, n)
	if err != nil {
		return err
	}
	yv, err := y.Slice(0, n)
	if err != nil {
		return err
	}
	g := l.direct[dk]
	if g == nil {
		if len(l.direct) >= maxDirectGraphs {
			l.dropDirect()
		}
		if err := l.main.BeginCapture(); err != nil {
			return fmt.Errorf("moe: capturing the forward of %d tokens: %w", T, err)
		}
		l.capturing = true
		qerr := l.enqueue(xv, yv, T, dk.dual, dk.routed, dk.shared)
		l.capturing = false
		g, err = l.main.EndCapture()
		if qerr != nil {
			if g != nil {
				_ = g.Close()
			}
			return fmt.Errorf("moe: capturing the forward of %d tokens: %w", T, qerr)
		}
		if err != nil {
			return fmt.Errorf("moe: capturing the forward of %d tokens: %w", T, err)
		}
		l.direct[dk] = g
	}
	return g.Launch(l.main)
}

// dropDirect closes the graphs captured on callers' buffers.
func (l *Layer) dropDirect() {
	for k, g := range l.direct {
		_ = g.Close()
		delete(l.direct, k)
	}
}

// dropGraphs closes every captured graph (their buffers are about to change).
func (l *Layer) dropGraphs() {
	for k, g := range l.graphs {
		_ = g.Close()
		delete(l.graphs, k)
	}
	l.dropDirect()
}

// sharedOnSide forks the shared expert onto the side stream after fork (an event
// recorded on the main stream) and records evJoin after it; the caller makes the
// main stream wait on evJoin before the combine.
func (l *Layer) sharedOnSide(fork *gpuctx.Event, x *gpuctx.Buffer, T int) error {
	if err := l.side.Wait(fork); err != nil {
		return err
	}
	if err := l.sharedExpert(l.sctx, l.side, x, T); err != nil {
		return err
	}
	return l.evJoin.Record(l.side)
}
