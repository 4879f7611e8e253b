package moe

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/collective"
)

// ExpertRange returns the routed experts [lo, hi) that rank r of n holds in
// expert parallelism over E experts: [r*E/n, (r+1)*E/n). When n does not
// divide E the ranks hold E/n or E/n+1 experts.
func ExpertRange(E, n, r int) (lo, hi int) { return r * E / n, (r + 1) * E / n }

// TokenRange returns the tokens [lo, hi) of a batch of T that rank r of n
// routes in ExpertParallel.Forward: [r*T/n, (r+1)*T/n) (possibly none).
func TokenRange(T, n, r int) (lo, hi int) { return r * T / n, (r + 1) * T / n }

// ExpertShard is one rank of an expert-parallel MoE layer: the router (and
// correction bias) and the shared expert, replicated on every rank, and the
// routed experts ExpertRange(E, comm.Size(), comm.Rank()). Each rank routes its
// own tokens (data parallel in, expert parallel in the middle):
//
//  1. the shared expert is forked onto the side stream, where it runs while
//     the rest below is in flight, and joined back before the combine;
//  2. the router GEMM and the routing kernel run on the main stream, and the
//     host waits for the expert indices;
//  3. the per-expert counts are exchanged (comm.AllGather), every token's
//     assignment rows are gathered into a send buffer ordered by expert, and
//     sent to the ranks that own the experts (comm.AllToAllV);
//  4. the owner runs its experts as grouped GEMMs (one group per source rank
//     and expert) and SwiGLU, and sends the result rows back (AllToAllV);
//  5. the combine kernel sums each token's K rows with its routing weights in
//     slot order, then adds the shared expert, exactly as Layer does.
//
// Every step runs the same kernels and GEMM shapes per row as a Layer on the
// grouped-GEMM path, so on a backend whose GEMM rows do not depend on the
// number of rows (the CPU backend below split-K sizes) the output equals
// Layer.Forward's bitwise in f32. Shards never take the small-batch or fused
// paths.
//
// ForwardDevice must be called by every rank of the communicator, with the
// same sequence of calls (each rank with its own tokens, possibly none). A
// shard serialises its own calls with a mutex.
type ExpertShard struct {
	l    *Layer
	comm collective.Comm

	send, ret *gpuctx.Buffer     // dispatch rows out, result rows back [T*K,H]
	idxHost   *gpuctx.HostBuffer // the routing's expert indices [T*K]
}

// NewExpertShard makes rank comm.Rank() of an expert-parallel layer on dev:
// it uploads the router, the shared expert and the routed experts of its range
// (see ExpertRange) in dtype (gpuctx.F32 or gpuctx.BF16). Errors are those of
// NewLayer, and comm nil or with more ranks than experts.
func NewExpertShard(dev *gpuctx.Device, comm collective.Comm, cfg *Config, w *Weights, dtype gpuctx.DType) (*ExpertShard, error) {
	const op = "moe.NewExpertShard"
	if comm == nil {
		return nil, fmt.Errorf("%w: %s: nil communicator", gpuctx.ErrInvalid, op)
	}
	if cfg == nil {
		return nil, fmt.Errorf("%w: %s: nil config", gpuctx.ErrInvalid, op)
	}
	n, r := comm.Size(), comm.Rank()
	if n < 1 || r < 0 || r >= n {
		return nil, fmt.Errorf("%w: %s: rank %d of %d", gpuctx.ErrInvalid, op, r, n)
	}
	if n > cfg.NumExperts {
		return nil, fmt.Errorf("%w: %s: %d ranks for %d experts: every rank needs at least one expert", gpuctx.ErrInvalid, op, n, cfg.NumExperts)
	}
	lo, hi := ExpertRange(cfg.NumExperts, n, r)
	l, err := newLayer(op, dev, cfg, w, LayerOptions{DType: dtype, NoFused: true, SmallBatchTokens: -1, NoGraphs: true}, &[2]int{lo, hi})
	if err != nil {
		return nil, err
	}
	return &ExpertShard{l: l, comm: comm}, nil
}

// Rank returns the shard's rank.
func (s *ExpertShard) Rank() int { return s.comm.Rank() }

// Experts returns the routed experts [lo, hi) the shard holds.
func (s *ExpertShard) Experts() (lo, hi int) { return s.l.expLo, s.l.expHi }

// MainStream returns the stream ForwardDevice queues work on.
func (s *ExpertShard) MainStream() *gpuctx.Stream { return s.l.main }

// SideStream returns the stream the shared expert runs on.
func (s *ExpertShard) SideStream() *gpuctx.Stream { return s.l.side }

// ForwardDevice queues y = MoE(x) for this rank's T tokens (x and y [T,H] in
// the shard's dtype on its device; T may be 0, then x and y may be nil) on
// the main stream, the shared expert on the side stream. It blocks while the
// host waits for the routing and for the exchanges, which meet the other
// ranks' calls (see ExpertShard). Later work on the main stream is ordered
// after the forward. An error from a collective leaves the group unusable:
// close the shards.
func (s *ExpertShard) ForwardDevice(x, y *gpuctx.Buffer, T int) error {
	l := s.l
	l.mu.Lock()
	defer l.mu.Unlock()
	const op = "ExpertShard.ForwardDevice"
	if err := l.check(op); err != nil {
		return err
	}
	c := &l.cfg
	H, E, K, I := c.HiddenSize, c.NumExperts, c.TopK, c.Intermediate
	es, sc := l.es, &l.scr
	if T < 0 {
		return fmt.Errorf("%w: moe: %s: T = %d tokens: must be >= 0", gpuctx.ErrInvalid, op, T)
	}
	if T > 0 {
		for _, b := range []struct {
			name string
			buf  *gpuctx.Buffer
		}{{"x", x}, {"y", y}} {
			if b.buf == nil {
				return fmt.Errorf("%w: moe: %s: %s is nil", gpuctx.ErrInvalid, op, b.name)
			}
			if b.buf.Device() != l.dev {
				return fmt.Errorf("%w: moe: %s: %s belongs to another device than the shard", gpuctx.ErrWrongDevice, op, b.name)
			}
			if b.buf.Size() < T*H*es {
				return fmt.Errorf("%w: moe: %s: %s holds %d bytes; T*H = %d*%d %v elements need %d", gpuctx.ErrSize, op, b.name, b.buf.Size(), T, H, l.dt, T*H*es)
			}
		}
	}
	doShared := l.sgu != nil
	TK := T * K
	row := H * es
	if T > 0 {
		if err := l.ensure(T, false, doShared); err != nil {
			return err
		}
		synced := false
		for _, nd := range []struct {
			b **gpuctx.Buffer
			n int
		}{{&sc.logits, 4 * T * E}, {&sc.idx, 4 * TK}, {&sc.w, 4 * TK}, {&sc.pos, 4 * TK}, {&s.send, TK * row}, {&s.ret, TK * row}} {
			if err := l.grow(nd.b, nd.n, &synced); err != nil {
				return err
			}
		}
		if s.idxHost == nil || s.idxHost.Size() < 4*TK {
			if s.idxHost != nil {
				if err := s.idxHost.Free(); err != nil {
					return err
				}
				s.idxHost = nil
			}
			var err error
			if s.idxHost, err = l.dev.AllocHost(4 * TK); err != nil {
				return err
			}
		}
	}
	var xv *gpuctx.Buffer
	if T > 0 {
		var err error
		if xv, err = x.Slice(0, T*row); err != nil {
			return err
		}
		// 1. The shared expert on the side stream, forked once x is ready.
		if doShared {
			if err := l.evFork.Record(l.main); err != nil {
				return err
			}
			if err := l.sharedOnSide(l.evFork, xv, T); err != nil {
				return err
			}
		}
		// 2. Router and routing, as Layer.routed does.
		err = l.ctx.BlasFlavour(l.flav, func(h gpuctx.Blas) error {
			return h.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: T, N: E, K: H, Alpha: 1,
				A: xv, B: l.router, C: sc.logits, AB: l.dt, CType: gpuctx.F32})
		})
		if err != nil {
			return fmt.Errorf("moe: router GEMM: %w", err)
		}
		scoring, method, eps, scale := l.routeArgs()
		if err := l.main.Launch(l.kRoute, gpuctx.Dim3{X: gridFor(T), Y: 1, Z: 1}, gpuctx.Dim3{X: 32, Y: 1, Z: 1}, 0,
			sc.logits, l.bias, sc.idx, sc.w, int32(T), int32(E), int32(K), scoring, method,
			int32(c.NumGroups), int32(c.TopKGroups), flag(c.HasBias()), flag(c.NormTopKProb), eps, scale,
			int32(K), int32(0)); err != nil {
			return err
		}
		if err := l.main.CopyDtoH(s.idxHost, 0, sc.idx, 0, 4*TK); err != nil {
			return err
		}
		if err := l.evCounts.Record(l.main); err != nil {
			return err
		}
		if err := l.evCounts.Synchronize(); err != nil {
			return fmt.Errorf("moe: waiting for the routing: %w", err)
		}
	}
	// 3. Counts, then the dispatch plan: rows ordered by expert, then by
	// assignment (token, slot).
	n := s.comm.Size()
	cnt := make([]int, E)
	var idx []int32
	if T > 0 {
		idx = unsafe.Slice((*int32)(unsafe.Pointer(unsafe.SliceData(s.idxHost.Bytes()))), TK)
		for i, e := range idx {
			if e < 0 || int(e) >= E {
				return fmt.Errorf("moe: routing chose expert %d for assignment %d of %d experts: a kernel bug", e, i, E)
			}
			cnt[e]++
		}
	}
	all, err := s.comm.AllGather(cnt)
	if err != nil {
		return fmt.Errorf("moe: %s: exchanging counts: %w", op, err)
	}
	sendCounts, recvCounts := make([]int, n), make([]int, n)
	for d := range n {
		lo, hi := ExpertRange(E, n, d)
		for e := lo; e < hi; e++ {
			sendCounts[d] += cnt[e] * row
		}
	}
	lo, hi := l.expLo, l.expHi
	R := 0
	for src := range n {
		for e := lo; e < hi; e++ {
			recvCounts[src] += all[src*E+e] * row
			R += all[src*E+e]
		}
	}
	if T > 0 {
		start := make([]int32, E+1)
		for e := range E {
			start[e+1] = start[e] + int32(cnt[e])
		}
		pos := make([]int32, TK)
		for i, e := range idx {
			pos[i] = start[e]
			start[e]++
		}
		// The main stream has drained up to the routing (evCounts), and
		// nothing queued since reads pos, so a synchronous copy is safe.
		pv, err := sc.pos.Slice(0, 4*TK)
		if err != nil {
			return err
		}
		if err := pv.CopyFromHost(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(pos))), 4*TK)); err != nil {
			return err
		}
		if err := l.main.Launch(l.kGather, gpuctx.Dim3{X: gridFor(TK), Y: 1, Z: 1}, gpuctx.Dim3{X: blockFor(H), Y: 1, Z: 1}, 0,
			xv, sc.pos, s.send, int32(TK), int32(K), int32(H), int32(es)); err != nil {
			return err
		}
	}
	if R > 0 {
		synced := false
		for _, nd := range []struct {
			b **gpuctx.Buffer
			n int
		}{{&sc.xp, R * row}, {&sc.h, R * 2 * I * es}, {&sc.act, R * I * es}, {&sc.out, R * row}} {
			if err := l.grow(nd.b, nd.n, &synced); err != nil {
				return err
			}
		}
	}
	sendBuf, recvBuf, retBuf, outBuf := s.send, sc.xp, s.ret, sc.out
	if T == 0 {
		sendBuf, retBuf = nil, nil
	}
	if R == 0 {
		recvBuf, outBuf = nil, nil
	}
	if err := s.comm.AllToAllV(sendBuf, sendCounts, recvBuf, recvCounts, l.main); err != nil {
		return fmt.Errorf("moe: %s: dispatch: %w", op, err)
	}
	// 4. The local experts, one GEMM group per (source rank, expert).
	if R > 0 {
		gateUp := make([]gpuctx.Gemm, 0, n*(hi-lo))
		down := make([]gpuctx.Gemm, 0, n*(hi-lo))
		off := 0
		for src := range n {
			for e := lo; e < hi; e++ {
				m := all[src*E+e]
				if m == 0 {
					continue
				}
				views := make([]*gpuctx.Buffer, 6)
				for i, v := range []struct {
					b        *gpuctx.Buffer
					off, len int
				}{
					{sc.xp, off * H, m * H}, {l.gu, (e - lo) * 2 * I * H, 2 * I * H}, {sc.h, off * 2 * I, m * 2 * I},
					{sc.act, off * I, m * I}, {l.down, (e - lo) * H * I, H * I}, {sc.out, off * H, m * H},
				} {
					if views[i], err = v.b.Slice(v.off*es, v.len*es); err != nil {
						return err
					}
				}
				gateUp = append(gateUp, gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: m, N: 2 * I, K: H, Alpha: 1,
					A: views[0], B: views[1], C: views[2], AB: l.dt, CType: l.dt})
				down = append(down, gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: m, N: H, K: I, Alpha: 1,
					A: views[3], B: views[4], C: views[5], AB: l.dt, CType: l.dt})
				off += m
			}
		}
		if err := l.ctx.BlasFlavour(l.flav, func(h gpuctx.Blas) error { return h.GemmGrouped(gateUp) }); err != nil {
			return fmt.Errorf("moe: expert gate/up grouped GEMM: %w", err)
		}
		if err := l.main.Launch(l.kSwiglu, eltGrid(R*I), eltBlock, 0,
			sc.h, sc.act, int32(R), int32(I), flag(l.dt == gpuctx.BF16)); err != nil {
			return err
		}
		if err := l.ctx.BlasFlavour(l.flav, func(h gpuctx.Blas) error { return h.GemmGrouped(down) }); err != nil {
			return fmt.Errorf("moe: expert down grouped GEMM: %w", err)
		}
	}
	// The results go back in the layout they came in.
	if err := s.comm.AllToAllV(outBuf, recvCounts, retBuf, sendCounts, l.main); err != nil {
		return fmt.Errorf("moe: %s: return: %w", op, err)
	}
	if T == 0 {
		return nil
	}
	// 5. Join the shared expert and combine (Layer's combine kernel; pos
	// points each assignment at its returned row).
	if doShared {
		if err := l.main.Wait(l.evJoin); err != nil {
			return err
		}
	}
	yv, err := y.Slice(0, T*row)
	if err != nil {
		return err
	}
	dummy := l.bias
	sout, sg := dummy, dummy
	if doShared {
		sout = sc.sout
		if l.sgate != nil {
			sg = sc.sg
		}
	}
	return l.main.Launch(l.kCombine, gpuctx.Dim3{X: gridFor(T), Y: 1, Z: 1}, gpuctx.Dim3{X: blockFor(H), Y: 1, Z: 1}, 0,
		s.ret, sc.pos, sc.w, sout, sg, yv, int32(T), int32(K), int32(H),
		flag(true), flag(doShared), flag(doShared && l.sgate != nil), flag(l.dt == gpuctx.BF16))
}

// Close waits for the shard's streams and releases it, then closes its
// communicator (which, for a Local group, ends the group). Double Close is
// harmless.
func (s *ExpertShard) Close() error {
	l := s.l
	l.mu.Lock()
	var errs []error
	if !l.closed {
		l.closed = true
		errs = append(errs, l.release())
		for _, b := range []**gpuctx.Buffer{&s.send, &s.ret} {
			if *b != nil {
				if err := (*b).Free(); err != nil && !errors.Is(err, gpuctx.ErrClosed) {
					errs = append(errs, err)
				}
				*b = nil
			}
		}
		if s.idxHost != nil {
			if err := s.idxHost.Free(); err != nil && !errors.Is(err, gpuctx.ErrClosed) {
				errs = append(errs, err)
			}
			s.idxHost = nil
		}
	}
	l.mu.Unlock()
	errs = append(errs, s.comm.Close())
	return errors.Join(errs...)
}

// ExpertParallel is an expert-parallel MoE layer over N devices of one
// process: an ExpertShard per device, joined by an in-process collective
// group (collective.NewLocal), driven by one goroutine per rank.
type ExpertParallel struct {
	mu     sync.Mutex
	shards []*ExpertShard
	dt     gpuctx.DType
	cfg    Config
}

// NewExpertParallel makes an ExpertShard on each of devs (rank r on devs[r])
// with an in-process communicator. On error everything made is released.
func NewExpertParallel(devs []*gpuctx.Device, cfg *Config, w *Weights, dtype gpuctx.DType) (*ExpertParallel, error) {
	const op = "moe.NewExpertParallel"
	if len(devs) == 0 {
		return nil, fmt.Errorf("%w: %s: no devices", gpuctx.ErrInvalid, op)
	}
	comms, err := collective.NewLocal(len(devs))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	p := &ExpertParallel{dt: dtype}
	for r, d := range devs {
		s, err := NewExpertShard(d, comms[r], cfg, w, dtype)
		if err != nil {
			_ = p.Close()
			for _, c := range comms[r:] {
				_ = c.Close()
			}
			return nil, fmt.Errorf("%s: rank %d: %w", op, r, err)
		}
		p.shards = append(p.shards, s)
	}
	p.cfg = *cfg
	return p, nil
}

// Shards returns the ranks' shards (rank r at index r).
func (p *ExpertParallel) Shards() []*ExpertShard { return p.shards }

// Forward computes y [T,H] for x [T,H] (host float32, row-major): rank r
// routes tokens TokenRange(T, N, r), each rank's forward runs in its own
// goroutine, and the ranks' outputs are concatenated in rank order. It blocks
// until y is on the host. In bf16 x is rounded on upload and y widened
// exactly. An error on one rank closes the group (the other ranks' exchanges
// fail with gpuctx.ErrClosed instead of waiting forever), so the layer is
// unusable afterwards.
func (p *ExpertParallel) Forward(x []float32, T int) ([]float32, error) {
	const op = "ExpertParallel.Forward"
	p.mu.Lock()
	defer p.mu.Unlock()
	H := p.cfg.HiddenSize
	if len(p.shards) == 0 {
		return nil, fmt.Errorf("moe: %s: %w", op, gpuctx.ErrClosed)
	}
	if T <= 0 {
		return nil, fmt.Errorf("%w: moe: %s: T = %d tokens: must be > 0", gpuctx.ErrInvalid, op, T)
	}
	if len(x) != T*H {
		return nil, fmt.Errorf("%w: moe: %s: x has %d values, want T*H = %d*%d = %d", gpuctx.ErrSize, op, len(x), T, H, T*H)
	}
	n := len(p.shards)
	y := make([]float32, T*H)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r, s := range p.shards {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t0, t1 := TokenRange(T, n, r)
			if errs[r] = s.forwardHost(x[t0*H:t1*H], y[t0*H:t1*H], t1-t0); errs[r] != nil {
				_ = s.comm.Close() // release the ranks waiting on this one
			}
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			return nil, fmt.Errorf("moe: %s: rank %d: %w", op, r, err)
		}
	}
	return y, nil
}

// forwardHost uploads x, runs ForwardDevice and downloads y (T may be 0).
func (s *ExpertShard) forwardHost(x, y []float32, T int) error {
	l := s.l
	if T == 0 {
		return s.ForwardDevice(nil, nil, 0)
	}
	nb := len(x) * l.es
	xb, err := l.dev.Alloc(nb)
	if err != nil {
		return err
	}
	defer xb.Free()
	yb, err := l.dev.Alloc(nb)
	if err != nil {
		return err
	}
	defer yb.Free()
	if err := xb.CopyFromHost(l.encode(x)); err != nil {
		return err
	}
	if err := s.ForwardDevice(xb, yb, T); err != nil {
		return err
	}
	if err := l.main.Synchronize(); err != nil {
		return err
	}
	out := make([]byte, nb)
	if err := yb.CopyToHost(out); err != nil {
		return err
	}
	copy(y, l.decode(out))
	return nil
}

// Close closes every shard (and so the group). Double Close is harmless.
func (p *ExpertParallel) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var errs []error
	for _, s := range p.shards {
		errs = append(errs, s.Close())
	}
	p.shards = nil
	return errors.Join(errs...)
}
