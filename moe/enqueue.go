package moe

import (
	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// enqueue is the executor: it queues the stages of p over xv into yv (both
// exactly T*H elements), the same steps in the same order on every path, each
// stage queueing what p asks of it there (or nothing):
//
//	shared.fork           evFork on the main stream: x is ready, the side
//	                      stream may start the shared expert (fused path,
//	                      shared expert alone)
//	routeAndDispatch      router and dispatch on the main stream: plan and
//	                      gather (evCounts after them), or the aligned sort
//	shared.beforeExperts  the shared expert forked at evCounts (small-batch
//	                      and grouped paths), or on the main stream (grouped:
//	                      it runs while the host waits for the counts)
//	experts.forPlan       the routed experts on the main stream (the grouped
//	                      GEMMs after the host waits for the counts)
//	shared.afterExperts   the shared expert on the main stream (small-batch,
//	                      fused, alone) or forked at evFork (fused, alone)
//	shared.join           the main stream waits for the side stream (evJoin)
//	combineInto           the combine on the main stream
//
// On the fused path nothing waits for the host and the side stream forks
// before the router (evFork), so the shared expert overlaps the routing
// kernels too, which leave DRAM idle; on the others it forks at the counts
// (evCounts), so it never competes with the router chain the host is waiting
// for.
func (l *Layer) enqueue(p *plan, xv, yv *gpuctx.Buffer) error {
	if err := l.shared.fork(p); err != nil {
		return err
	}
	if err := l.routeAndDispatch(p, xv); err != nil {
		return err
	}
	if err := l.shared.beforeExperts(p, xv); err != nil {
		return err
	}
	if err := l.experts.forPlan(p, xv, &l.dispatch); err != nil {
		return err
	}
	if err := l.shared.afterExperts(p, xv); err != nil {
		return err
	}
	if err := l.shared.join(p); err != nil {
		return err
	}
	return l.combineInto(p, yv)
}

// routeAndDispatch queues the routing and the dispatch of p over xv on the
// main stream: the fused path's routing and aligned sort (sortFused); on the
// small-batch and grouped-GEMM paths the router GEMM and route, then plan and
// gather (the counts copied to the host on the grouped path, then evCounts);
// nothing for the shared expert alone.
func (l *Layer) routeAndDispatch(p *plan, xv *gpuctx.Buffer) error {
	switch p.path {
	case pathNone:
		return nil
	case pathFused:
		return l.sortFused(p, xv)
	}
	if err := l.router.route(xv, p.T, p.ks, true); err != nil {
		return err
	}
	return l.dispatch.planGather(xv, l.router.idx, p.T, p.path == pathGrouped)
}

// sortFused queues the fused path's routing and aligned sort with p's tiles'
// rows, settling p's tiles (bf16 or FP8: settleTiles) first where they are
// not known: the one-launch path routes and sorts with the rule's rows,
// tunes on that routing, and sorts again; the other routes, tunes, and
// sorts. Every forward of a one-launch batch computes the router logits the
// same way (in that kernel, never in a GEMM), so results do not depend on
// whether the tiles were tuned yet.
func (l *Layer) sortFused(p *plan, xv *gpuctx.Buffer) error {
	if p.oneLaunch {
		if err := l.ensureFused(p, p.sortBM); err != nil {
			return err
		}
		if err := l.dispatch.routeAlign(xv, &l.router, &l.experts, p, p.sortBM); err != nil {
			return err
		}
	} else if err := l.router.route(xv, p.T, p.ks, true); err != nil {
		return err
	}
	if p.oneLaunch && p.tilesKnown {
		return nil
	}
	if !p.tilesKnown {
		if err := l.settleTiles(p, xv); err != nil {
			return err
		}
	}
	if err := l.ensureFused(p, p.rowsBM()); err != nil {
		return err
	}
	return l.dispatch.align(l.router.idx, p, p.rowsBM())
}

// combineInto queues the combine of p into yv.
func (l *Layer) combineInto(p *plan, yv *gpuctx.Buffer) error {
	in := combineIn{ks: l.cfg.TopK, routed: p.routed, shared: p.shared}
	if p.routed {
		in.out, in.pos, in.w = l.experts.out, l.dispatch.pos, l.router.wts
	}
	if p.shared {
		in.sout = l.shared.out
		if l.shared.gate != nil {
			in.sg = l.shared.g
		}
	}
	if p.path != pathFused {
		in.gated = in.shared && l.shared.gate != nil
		return l.combine.tokens(in, l.router.bias, yv, p.T)
	}
	// Routed rows are in assignment order; the fused shared expert's chunks
	// are rows K.. of each token, not a separate output.
	in.pos = nil
	if p.fusedShared() {
		in.ks, in.shared = p.ks, false
	}
	in.gated = in.shared && l.shared.gate != nil
	return l.combine.rows(in, l.router.bias, yv, p.T)
}

// ensure grows the scratch buffers a forward of p needs (the fused path's
// sort is sized by ensureFused, once its tile rows are known).
func (l *Layer) ensure(p *plan) error {
	var needs []need
	if p.routed {
		TKS := p.T * (l.cfg.TopK + l.ns) // room for the fused shared expert's slots
		needs = append(needs, l.router.needs(p.T, TKS/p.T)...)
		if p.path != pathFused {
			TK := p.T * l.cfg.TopK
			needs = append(needs, l.dispatch.planNeeds(TK)...)
			needs = append(needs, l.experts.needs(TK)...)
		}
	}
	if p.shared {
		needs = append(needs, l.shared.needs(p.T)...)
	}
	return l.growAll(needs...)
}

// ensureFused grows the fused path's scratch for p with tile rows bm.
func (l *Layer) ensureFused(p *plan, bm int) error {
	TK := p.T * p.ks
	sort := l.dispatch.sortNeeds(TK, p.experts, bm)
	cp := moekernels.AlignCap(TK, p.experts, bm)
	needs := append(sort[:3:3], l.experts.fusedNeeds(cp, TK)...)
	if p.fp8.w8 {
		needs = append(needs, l.experts.w8a8Needs(p.T, cp)...)
	} else if p.xInRoute {
		needs = append(needs, l.experts.w8a8Needs(p.T, cp)[:2]...) // x's codes and scales
	}
	needs = append(needs, sort[3:]...)
	synced := false
	for _, nd := range needs {
		if err := l.grow(nd.b, nd.n, &synced); err != nil {
			return err
		}
	}
	return l.dispatch.resetTicket(&synced)
}
