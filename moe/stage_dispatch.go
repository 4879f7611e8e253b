package moe

import (
	"fmt"
	"unsafe"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// dispatchStage orders the routed assignments by expert. On the small-batch
// and grouped-GEMM paths: gpuctx_moe_plan (per-expert counts and offsets, each
// assignment's row) and gpuctx_moe_gather (x's rows into xp in that order),
// with the counts copied to the host for the grouped GEMMs. On the fused path:
// gpuctx_moe_align (or its three-launch form), the block-aligned sort the
// fused expert kernels read, or gpuctx_moe_route_align, which routes and sorts
// in one launch (it then fills the router's outputs too).
type dispatchStage struct {
	e                    *env
	kPlan                moekernels.Launcher[moekernels.Plan]
	kGather              moekernels.Launcher[moekernels.Gather]
	kAlign               moekernels.Launcher[moekernels.Align]
	kAlignCount          moekernels.Launcher[moekernels.AlignCount]   // the three-launch align: count,
	kAlignScan           moekernels.Launcher[moekernels.AlignScan]    // scan,
	kAlignScatter        moekernels.Launcher[moekernels.AlignScatter] // scatter
	kRouteAlign          moekernels.Launcher[moekernels.RouteAlign]
	align3From           int // assignments from which the three-launch align runs
	raTokens             int // batches of at most this many tokens route in gpuctx_moe_route_align
	countsHost           *gpuctx.HostBuffer
	counts, offsets, pos *gpuctx.Buffer // plan: [E], [E+1], [T*K] i32
	xp                   *gpuctx.Buffer // gathered rows [T*K,H]
	sorted, bexp, npost  *gpuctx.Buffer // fused path: aligned sort
	ticket               *gpuctx.Buffer // gpuctx_moe_route_align's last-block ticket (0 at rest)
	bcnt, boff           *gpuctx.Buffer // three-launch align: per-chunk counts, offsets
}

// alignThreads is the block size gpuctx_moe_align needs (MOE_ALIGN_WARPS).
const alignThreads = 512

// align3From is the assignment count from which the dispatch stage sorts in
// three launches (gpuctx_moe_align_count, _scan, _scatter over chunks of
// moekernels.AlignChunk) instead of gpuctx_moe_align's one block.
const align3From = 2 * moekernels.AlignChunk

// routeAlignTokens bounds the batches that route in gpuctx_moe_route_align
// (its last block routes them with a warp per token); T*E is also bounded by
// moekernels.RouteAlignMaxDots. The one launch replaces the router GEMM,
// gpuctx_moe_route and gpuctx_moe_align (bench/RESULTS.md, 2026-12-01
// evening: measured on an H200).
const routeAlignTokens = 16

// planNeeds returns the plan's scratch for TK assignments (small-batch and
// grouped-GEMM paths).
func (d *dispatchStage) planNeeds(TK int) []need {
	E, H, es := d.e.cfg.NumExperts, d.e.cfg.HiddenSize, d.e.es
	return []need{{&d.counts, 4 * E}, {&d.offsets, 4 * (E + 1)}, {&d.pos, 4 * TK}, {&d.xp, TK * H * es}}
}

// sortNeeds returns the aligned sort's scratch for TK assignments over E
// experts in blocks of bm rows (fused path).
func (d *dispatchStage) sortNeeds(TK, E, bm int) []need {
	cp := moekernels.AlignCap(TK, E, bm)
	nb := moekernels.AlignBlocks(TK)
	return []need{{&d.sorted, 4 * cp}, {&d.bexp, 4 * (cp / bm)}, {&d.npost, 4}, {&d.bcnt, 4 * nb * E}, {&d.boff, 4 * nb * E}}
}

// planGather queues gpuctx_moe_plan over the routing idx of T tokens (K slots
// each), then, when toHost, the copy of the per-expert counts to the host,
// then records evCounts, then gpuctx_moe_gather of x's rows, all on the main
// stream.
func (d *dispatchStage) planGather(x, idx *gpuctx.Buffer, T int, toHost bool) error {
	e := d.e
	E, K := e.cfg.NumExperts, e.cfg.TopK
	TK := T * K
	if err := d.kPlan.Launch(e.main, gpuctx.Dim3{X: 1, Y: 1, Z: 1}, gpuctx.Dim3{X: 256, Y: 1, Z: 1}, 0, moekernels.Plan{
		TopkIdx: idx, Counts: d.counts, Offsets: d.offsets, Pos: d.pos, TK: int32(TK), E: int32(E)}); err != nil {
		return err
	}
	if toHost {
		if err := e.main.CopyDtoH(d.countsHost, 0, d.counts, 0, 4*E); err != nil {
			return err
		}
	}
	if err := e.evCounts.Record(e.main); err != nil {
		return err
	}
	return d.gather(x, d.xp, TK)
}

// gather queues gpuctx_moe_gather of x's rows into dst at the rows pos gives
// (TK assignments) on the main stream.
func (d *dispatchStage) gather(x, dst *gpuctx.Buffer, TK int) error {
	e := d.e
	H, K := e.cfg.HiddenSize, e.cfg.TopK
	return d.kGather.Launch(e.main, gpuctx.Dim3{X: gridFor(TK), Y: 1, Z: 1}, gpuctx.Dim3{X: blockFor(H), Y: 1, Z: 1}, 0, moekernels.Gather{
		X: x, Pos: d.pos, Xp: dst, TK: int32(TK), K: int32(K), H: int32(H), ElemBytes: int32(e.es)})
}

// hostCounts waits for evCounts (the counts copy of planGather) and returns
// the per-expert counts, which alias the host buffer until the next forward.
func (d *dispatchStage) hostCounts() ([]int32, error) {
	if err := d.e.evCounts.Synchronize(); err != nil {
		return nil, fmt.Errorf("moe: waiting for the per-expert counts: %w", err)
	}
	E := d.e.cfg.NumExperts
	return unsafe.Slice((*int32)(unsafe.Pointer(unsafe.SliceData(d.countsHost.Bytes()))), E), nil
}

// resetTicket zeroes gpuctx_moe_route_align's ticket on the main stream the
// first time it exists (every launch leaves it 0).
func (d *dispatchStage) resetTicket(synced *bool) error {
	if d.ticket != nil {
		return nil
	}
	if err := d.e.grow(&d.ticket, 4, synced); err != nil {
		return err
	}
	return d.e.main.Memset(d.ticket, 0)
}

// align queues the aligned sort of the routing idx for p with tile rows bm on
// the main stream: gpuctx_moe_align, or from align3From assignments its
// three-launch form (same outputs). The fused shared expert's chunks (experts
// cfg.NumExperts..) sort first (moekernels' moe_shared_rows).
func (d *dispatchStage) align(idx *gpuctx.Buffer, p *plan, bm int) error {
	e := d.e
	TK, E := p.T*p.ks, p.experts
	first := 0
	if p.ks > e.cfg.TopK {
		first = e.cfg.NumExperts
	}
	if first >= E {
		return fmt.Errorf("moe: internal error: the fused shared expert's chunks sort first at expert %d of %d", first, E)
	}
	blk, one, cp := gpuctx.Dim3{X: alignThreads, Y: 1, Z: 1}, gpuctx.Dim3{X: 1, Y: 1, Z: 1}, moekernels.AlignCap(TK, E, bm)
	if TK < d.align3From {
		return d.kAlign.LaunchEarly(e.main, one, blk, 0, moekernels.Align{TopkIdx: idx, Sorted: d.sorted, BlockExpert: d.bexp,
			Npost: d.npost, TK: int32(TK), E: int32(E), BM: int32(bm), Cap: int32(cp), First: int32(first)})
	}
	nb := moekernels.AlignBlocks(TK)
	chunks := gpuctx.Dim3{X: nb, Y: 1, Z: 1}
	if err := d.kAlignCount.LaunchEarly(e.main, chunks, blk, 0, moekernels.AlignCount{
		TopkIdx: idx, Bcnt: d.bcnt, TK: int32(TK), E: int32(E)}); err != nil {
		return err
	}
	if err := d.kAlignScan.LaunchEarly(e.main, one, blk, 0, moekernels.AlignScan{Bcnt: d.bcnt, Boff: d.boff, Sorted: d.sorted,
		BlockExpert: d.bexp, Npost: d.npost, TK: int32(TK), E: int32(E), BM: int32(bm), Cap: int32(cp), NB: int32(nb), First: int32(first)}); err != nil {
		return err
	}
	return d.kAlignScatter.LaunchEarly(e.main, chunks, blk, 0, moekernels.AlignScatter{
		TopkIdx: idx, Boff: d.boff, Npost: d.npost, Sorted: d.sorted, TK: int32(TK), E: int32(E)})
}

// routeAlign queues gpuctx_moe_route_align for p's T tokens of x with tile
// rows bm (the sort's scratch sized for them) on the main stream: one block
// per 16 router logits, the last of them routing into r's outputs and
// sorting; with p.xInRoute the blocks also quantize x into xs's codes and
// scales for the w8a8 tiles (fusedW8A8 then launches no quantizer for x).
func (d *dispatchStage) routeAlign(x *gpuctx.Buffer, r *routerStage, xs *expertStage, p *plan, bm int) error {
	e := d.e
	c := &e.cfg
	T, ks := p.T, p.ks
	a := moekernels.RouteAlign{
		X: x, Router: r.weight, Bias: r.bias, Logits: r.logits, TopkIdx: r.idx, TopkW: r.wts,
		Sorted: d.sorted, BlockExpert: d.bexp, Npost: d.npost, Ticket: d.ticket,
		T: int32(T), H: int32(c.HiddenSize), E: int32(c.NumExperts), K: int32(c.TopK), Rule: routeRule(c),
		Ks: int32(ks), Ns: int32(ks - c.TopK), BM: int32(bm), Cap: int32(moekernels.AlignCap(T*ks, p.experts, bm)),
		Xq: r.bias, Xs: r.bias} // unread without QuantX: any buffer (a launch takes no nil)
	if p.xInRoute {
		a.Xq, a.Xs, a.QuantX = xs.xq, xs.xs, 1
	}
	grid := gpuctx.Dim3{X: moekernels.RouteAlignBlocks(T * c.NumExperts), Y: 1, Z: 1}
	return d.kRouteAlign.LaunchEarly(e.main, grid, gpuctx.Dim3{X: alignThreads, Y: 1, Z: 1}, moekernels.RouteAlignSmem(T, c.NumExperts), a)
}
