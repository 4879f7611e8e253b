package moe

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/collective"
	"golang.org/x/sync/errgroup"
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
// routed experts ExpertRange(E, comm.Size(), comm.Rank()). It is built from
// the same stages as a Layer (see core), with a collective.Comm between the
// dispatch and the experts. Each rank routes its own tokens (data parallel in,
// expert parallel in the middle):
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
	mu     sync.Mutex
	closed bool
	core
	comm collective.Comm

	send, ret *gpuctx.Buffer     // dispatch rows out, result rows back [T*K,H]
	idxHost   *gpuctx.HostBuffer // the routing's expert indices [T*K]
}

// NewExpertShard makes rank comm.Rank() of an expert-parallel layer on dev:
// it uploads the router, the shared expert and the routed experts of its range
// (see ExpertRange) in dtype (gpuctx.F32 or gpuctx.BF16). Errors are those of
// NewLayer, and comm nil or with more ranks than experts.
func NewExpertShard(dev *gpuctx.Device, comm collective.Comm, cfg *Config, w *Weights, dtype gpuctx.DType) (*ExpertShard, error) {
	const op = "NewExpertShard"
	if comm == nil {
		return nil, fmt.Errorf("moe: %s: nil communicator: %w", op, gpuctx.ErrInvalid)
	}
	if cfg == nil {
		return nil, fmt.Errorf("moe: %s: nil config: %w", op, gpuctx.ErrInvalid)
	}
	n, r := comm.Size(), comm.Rank()
	if n < 1 || r < 0 || r >= n {
		return nil, fmt.Errorf("moe: %s: rank %d of %d: %w", op, r, n, gpuctx.ErrInvalid)
	}
	if n > cfg.NumExperts {
		return nil, fmt.Errorf("moe: %s: %d ranks for %d experts: every rank needs at least one expert: %w", op, n, cfg.NumExperts, gpuctx.ErrInvalid)
	}
	if dev == nil {
		return nil, fmt.Errorf("moe: %s: nil device: %w", op, gpuctx.ErrInvalid)
	}
	if err := w.Check(cfg); err != nil {
		return nil, fmt.Errorf("moe: %s: %w", op, err)
	}
	o := LayerOptions{DType: dtype, NoFused: true, SmallBatchTokens: -1, NoGraphs: true}
	if err := checkLayerOptions(dev, cfg, o); err != nil {
		return nil, fmt.Errorf("moe: %s: %w", op, err)
	}
	lo, hi := ExpertRange(cfg.NumExperts, n, r)
	s := &ExpertShard{comm: comm}
	if err := s.init(dev, cfg, coreSpec{dt: dtype, lo: lo, hi: hi}, memWeights{w}); err != nil {
		_ = s.release()
		return nil, fmt.Errorf("moe: %s: %w", op, err)
	}
	return s, nil
}

// Rank returns the shard's rank.
func (s *ExpertShard) Rank() int { return s.comm.Rank() }

// Experts returns the routed experts [lo, hi) the shard holds.
func (s *ExpertShard) Experts() (lo, hi int) { return s.experts.lo, s.experts.hi }

// MainStream returns the stream ForwardDevice queues work on.
func (s *ExpertShard) MainStream() *gpuctx.Stream { return s.main }

// SideStream returns the stream the shared expert runs on.
func (s *ExpertShard) SideStream() *gpuctx.Stream { return s.side }

// epCall is one ExpertShard forward's exchange plan: this rank's T tokens
// (TK assignments) and its view of x, the counts per expert of its routing,
// every rank's counts (all, rank-major), the bytes sent to and received from
// each rank, and the rows R this rank's experts compute.
type epCall struct {
	T, TK                  int
	xv                     *gpuctx.Buffer
	cnt, all               []int
	sendCounts, recvCounts []int
	R                      int
}

// ForwardDevice queues y = MoE(x) for this rank's T tokens (x and y [T,H] in
// the shard's dtype on its device; T may be 0, then x and y may be nil) on
// the main stream, the shared expert on the side stream. It blocks while the
// host waits for the routing and for the exchanges, which meet the other
// ranks' calls (see ExpertShard). Later work on the main stream is ordered
// after the forward. An error from a collective leaves the group unusable:
// close the shards.
func (s *ExpertShard) ForwardDevice(x, y *gpuctx.Buffer, T int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	const op = "ExpertShard.ForwardDevice"
	if err := s.checkForward(op, x, y, T); err != nil {
		return err
	}
	c := &epCall{T: T, TK: T * s.cfg.TopK}
	if T > 0 {
		if err := s.prepare(c, x); err != nil {
			return err
		}
		// 1-2. The shared expert on the side stream, router and routing.
		if err := s.routeLocal(c); err != nil {
			return err
		}
	}
	// 3. Counts, then the dispatch plan.
	if err := s.exchangeCounts(op, c); err != nil {
		return err
	}
	if err := s.gather(c); err != nil {
		return err
	}
	if err := s.runExperts(op, c); err != nil {
		return err
	}
	if T == 0 {
		return nil
	}
	// 5. Join the shared expert and combine (Layer's combine kernel; pos
	// points each assignment at its returned row).
	return s.combineInto(c, y)
}

// checkForward checks ForwardDevice's arguments; s.mu must be held.
func (s *ExpertShard) checkForward(op string, x, y *gpuctx.Buffer, T int) error {
	if s.closed {
		return fmt.Errorf("moe: %s: layer: %w", op, gpuctx.ErrClosed)
	}
	H, es := s.cfg.HiddenSize, s.es
	if T < 0 {
		return fmt.Errorf("moe: %s: T = %d tokens: must be >= 0: %w", op, T, gpuctx.ErrInvalid)
	}
	if T == 0 {
		return nil
	}
	for _, b := range []struct {
		name string
		buf  *gpuctx.Buffer
	}{{"x", x}, {"y", y}} {
		if b.buf == nil {
			return fmt.Errorf("moe: %s: %s is nil: %w", op, b.name, gpuctx.ErrInvalid)
		}
		if b.buf.Device() != s.dev {
			return fmt.Errorf("moe: %s: %s belongs to another device than the shard: %w", op, b.name, gpuctx.ErrWrongDevice)
		}
		if b.buf.Size() < T*H*es {
			return fmt.Errorf("moe: %s: %s holds %d bytes; T*H = %d*%d %v elements need %d: %w", op, b.name, b.buf.Size(), T, H, s.dt, T*H*es, gpuctx.ErrSize)
		}
	}
	return nil
}

// prepare grows the scratch of c's T > 0 tokens and takes c's view of x.
func (s *ExpertShard) prepare(c *epCall, x *gpuctx.Buffer) error {
	T, TK, row := c.T, c.TK, s.cfg.HiddenSize*s.es
	if s.shared.gu != nil {
		if err := s.growAll(s.shared.needs(T)...); err != nil {
			return err
		}
	}
	r := &s.router
	if err := s.growAll(need{&r.logits, 4 * T * s.cfg.NumExperts}, need{&r.idx, 4 * TK}, need{&r.wts, 4 * TK},
		need{&s.dispatch.pos, 4 * TK}, need{&s.send, TK * row}, need{&s.ret, TK * row}); err != nil {
		return err
	}
	if s.idxHost == nil || s.idxHost.Size() < 4*TK {
		if s.idxHost != nil {
			if err := s.idxHost.Free(); err != nil {
				return err
			}
			s.idxHost = nil
		}
		var err error
		if s.idxHost, err = s.dev.AllocHost(4 * TK); err != nil {
			return err
		}
	}
	var err error
	c.xv, err = x.Slice(0, T*row)
	return err
}

// routeLocal forks the shared expert onto the side stream once x is ready,
// queues the router and the routing on the main stream (as a Layer's grouped
// path does), copies the expert indices to the host and waits for them.
func (s *ExpertShard) routeLocal(c *epCall) error {
	if s.shared.gu != nil {
		if err := s.evFork.Record(s.main); err != nil {
			return err
		}
		if err := s.shared.onStream(s.evFork, c.xv, c.T); err != nil {
			return err
		}
	}
	if err := s.router.route(c.xv, c.T, s.cfg.TopK, false); err != nil {
		return err
	}
	if err := s.main.CopyDtoH(s.idxHost, 0, s.router.idx, 0, 4*c.TK); err != nil {
		return err
	}
	if err := s.evCounts.Record(s.main); err != nil {
		return err
	}
	if err := s.evCounts.Synchronize(); err != nil {
		return fmt.Errorf("moe: waiting for the routing: %w", err)
	}
	return nil
}

// hostIdx returns the routing's expert indices on the host (T > 0).
func (s *ExpertShard) hostIdx(c *epCall) []int32 {
	return unsafe.Slice((*int32)(unsafe.Pointer(unsafe.SliceData(s.idxHost.Bytes()))), c.TK)
}

// exchangeCounts counts this rank's assignments per expert, exchanges the
// counts with every rank (AllGather) and derives the bytes sent to and
// received from each rank and the rows this rank's experts compute.
func (s *ExpertShard) exchangeCounts(op string, c *epCall) error {
	E, n, row := s.cfg.NumExperts, s.comm.Size(), s.cfg.HiddenSize*s.es
	c.cnt = make([]int, E)
	if c.T > 0 {
		for i, e := range s.hostIdx(c) {
			if e < 0 || int(e) >= E {
				return fmt.Errorf("moe: routing chose expert %d for assignment %d of %d experts: a kernel bug", e, i, E)
			}
			c.cnt[e]++
		}
	}
	var err error
	if c.all, err = s.comm.AllGather(c.cnt); err != nil {
		return fmt.Errorf("moe: %s: exchanging counts: %w", op, err)
	}
	c.sendCounts, c.recvCounts = make([]int, n), make([]int, n)
	for d := range n {
		lo, hi := ExpertRange(E, n, d)
		for e := lo; e < hi; e++ {
			c.sendCounts[d] += c.cnt[e] * row
		}
	}
	for src := range n {
		for e := s.experts.lo; e < s.experts.hi; e++ {
			c.recvCounts[src] += c.all[src*E+e] * row
			c.R += c.all[src*E+e]
		}
	}
	return nil
}

// gather orders this rank's assignment rows by expert, then by assignment
// (token, slot): pos on the host, copied to the device, and the gather kernel
// into the send buffer on the main stream.
func (s *ExpertShard) gather(c *epCall) error {
	if c.T == 0 {
		return nil
	}
	E := s.cfg.NumExperts
	start := make([]int32, E+1)
	for e := range E {
		start[e+1] = start[e] + int32(c.cnt[e])
	}
	pos := make([]int32, c.TK)
	for i, e := range s.hostIdx(c) {
		pos[i] = start[e]
		start[e]++
	}
	// The main stream has drained up to the routing (evCounts), and
	// nothing queued since reads pos, so a synchronous copy is safe.
	d := &s.dispatch
	pv, err := d.pos.Slice(0, 4*c.TK)
	if err != nil {
		return err
	}
	if err := pv.CopyFromHost(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(pos))), 4*c.TK)); err != nil {
		return err
	}
	return d.gather(c.xv, s.send, c.TK)
}

// runExperts sends the rows to their experts' ranks (AllToAllV), runs the
// local experts, one GEMM group per (source rank, expert), and sends the
// results back in the layout they came in.
func (s *ExpertShard) runExperts(op string, c *epCall) error {
	d, x := &s.dispatch, &s.experts
	if c.R > 0 {
		if err := s.growAll(need{&d.xp, c.R * s.cfg.HiddenSize * s.es}, x.needs(c.R)[0], x.needs(c.R)[1], x.needs(c.R)[2]); err != nil {
			return err
		}
	}
	sendBuf, recvBuf, retBuf, outBuf := s.send, d.xp, s.ret, x.out
	if c.T == 0 {
		sendBuf, retBuf = nil, nil
	}
	if c.R == 0 {
		recvBuf, outBuf = nil, nil
	}
	if err := s.comm.AllToAllV(sendBuf, c.sendCounts, recvBuf, c.recvCounts, s.main); err != nil {
		return fmt.Errorf("moe: %s: dispatch: %w", op, err)
	}
	// 4. The local experts, one GEMM group per (source rank, expert).
	if c.R > 0 {
		E, lo, hi := s.cfg.NumExperts, x.lo, x.hi
		var groups []group
		off := 0
		for src := range s.comm.Size() {
			for e := lo; e < hi; e++ {
				if m := c.all[src*E+e]; m > 0 {
					groups = append(groups, group{e - lo, off, m})
					off += m
				}
			}
		}
		if err := x.grouped(d.xp, groups, c.R); err != nil {
			return err
		}
	}
	if err := s.comm.AllToAllV(outBuf, c.recvCounts, retBuf, c.sendCounts, s.main); err != nil {
		return fmt.Errorf("moe: %s: return: %w", op, err)
	}
	return nil
}

// combineInto joins the shared expert and queues the combine into y.
func (s *ExpertShard) combineInto(c *epCall, y *gpuctx.Buffer) error {
	doShared := s.shared.gu != nil
	if doShared {
		if err := s.main.Wait(s.evJoin); err != nil {
			return err
		}
	}
	yv, err := y.Slice(0, c.T*s.cfg.HiddenSize*s.es)
	if err != nil {
		return err
	}
	in := combineIn{out: s.ret, pos: s.dispatch.pos, w: s.router.wts, ks: s.cfg.TopK, routed: true, shared: doShared}
	if doShared {
		in.sout = s.shared.out
		if s.shared.gate != nil {
			in.sg = s.shared.g
		}
	}
	in.gated = doShared && s.shared.gate != nil
	return s.combine.tokens(in, s.router.bias, yv, c.T)
}

// Close waits for the shard's streams and releases it, then closes its
// communicator (which, for a Local group, ends the group). Double Close is
// harmless.
func (s *ExpertShard) Close() error {
	s.mu.Lock()
	var errs []error
	if !s.closed {
		s.closed = true
		errs = append(errs, s.release())
	}
	s.mu.Unlock()
	errs = append(errs, s.comm.Close())
	return errors.Join(errs...)
}

// release frees everything the shard holds.
func (s *ExpertShard) release() error {
	err := s.core.release([]**gpuctx.Buffer{&s.send, &s.ret}, nil, nil)
	if s.idxHost != nil {
		if ferr := s.idxHost.Free(); ferr != nil && !errors.Is(ferr, gpuctx.ErrClosed) {
			err = errors.Join(err, ferr)
		}
		s.idxHost = nil
	}
	return err
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
	const op = "NewExpertParallel"
	if len(devs) == 0 {
		return nil, fmt.Errorf("moe: %s: no devices: %w", op, gpuctx.ErrInvalid)
	}
	comms, err := collective.NewLocal(len(devs))
	if err != nil {
		return nil, fmt.Errorf("moe: %s: %w", op, err)
	}
	p := &ExpertParallel{dt: dtype}
	for r, d := range devs {
		s, err := NewExpertShard(d, comms[r], cfg, w, dtype)
		if err != nil {
			_ = p.Close()
			for _, c := range comms[r:] {
				_ = c.Close()
			}
			return nil, fmt.Errorf("moe: %s: rank %d: %w", op, r, err)
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
		return nil, fmt.Errorf("moe: %s: T = %d tokens: must be > 0: %w", op, T, gpuctx.ErrInvalid)
	}
	if len(x) != T*H {
		return nil, fmt.Errorf("moe: %s: x has %d values, want T*H = %d*%d = %d: %w", op, len(x), T, H, T*H, gpuctx.ErrSize)
	}
	n := len(p.shards)
	y := make([]float32, T*H)
	var g errgroup.Group
	for r, s := range p.shards {
		g.Go(func() error {
			t0, t1 := TokenRange(T, n, r)
			if err := s.forwardHost(x[t0*H:t1*H], y[t0*H:t1*H], t1-t0); err != nil {
				_ = s.comm.Close() // release the ranks waiting on this one
				return fmt.Errorf("moe: %s: rank %d: %w", op, r, err)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	return y, nil
}

// forwardHost uploads x, runs ForwardDevice and downloads y (T may be 0).
func (s *ExpertShard) forwardHost(x, y []float32, T int) error {
	l := &s.env
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
