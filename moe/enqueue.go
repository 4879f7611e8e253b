package moe

import (
	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// enqueue is the executor: it queues the stages of p over xv into yv (both
// exactly T*H elements) on the main stream, and the shared expert on the side
// stream when p.dual. Routing: router (or nothing on the one-launch path),
// dispatch (plan and gather, or the aligned sort), the routed experts, with
// the shared expert where p.place says, then the combine after the side
// stream is joined back. On the fused path nothing waits for the host and the
// side stream forks before the router (evFork), so the shared expert overlaps
// the routing kernels too, which leave DRAM idle; on the others it forks at
// the counts (evCounts), so it never competes with the router chain the host
// is waiting for.
func (l *Layer) enqueue(p *plan, xv, yv *gpuctx.Buffer) error {
	var err error
	switch p.path {
	case pathNone:
		err = l.sharedAlone(p, xv)
	case pathFused:
		err = l.routedFused(p, xv)
	default:
		err = l.routedPlanned(p, xv)
	}
	if err != nil {
		return err
	}
	if p.dual { // join
		if err := l.main.Wait(l.evJoin); err != nil {
			return err
		}
	}
	return l.combineInto(p, yv)
}

// sharedAlone queues the shared expert alone (SharedOnly), on the side stream
// forked once x is ready on the main stream (Dual) or on the main stream.
func (l *Layer) sharedAlone(p *plan, xv *gpuctx.Buffer) error {
	if !p.shared {
		return nil
	}
	if !p.dual {
		return l.shared.onMain(xv, p.T)
	}
	if err := l.evFork.Record(l.main); err != nil {
		return err
	}
	return l.shared.onSide(l.evFork, xv, p.T)
}

// routedPlanned queues the small-batch or grouped-GEMM path: router GEMM and
// route, plan and gather (the counts copied to the host on the grouped path),
// the shared expert forked at evCounts (Dual), the experts, with the shared
// expert on the main stream before the host waits for the counts (grouped) or
// after the expert kernels (small).
func (l *Layer) routedPlanned(p *plan, xv *gpuctx.Buffer) error {
	T, small := p.T, p.path == pathSmall
	if err := l.router.route(xv, T, p.ks, true); err != nil {
		return err
	}
	if err := l.dispatch.planGather(xv, l.router.idx, T, !small); err != nil {
		return err
	}
	if p.place == sharedSide {
		if err := l.shared.onSide(l.evCounts, xv, T); err != nil {
			return err
		}
	}
	if small {
		if err := l.experts.small(&l.dispatch); err != nil {
			return err
		}
		return l.sharedAfter(p, xv)
	}
	if err := l.sharedAfter(p, xv); err != nil {
		return err
	}
	counts, err := l.dispatch.hostCounts()
	if err != nil {
		return err
	}
	groups, err := groupsOf(counts, T*l.cfg.TopK)
	if err != nil {
		return err
	}
	return l.experts.grouped(l.dispatch.xp, groups, T*l.cfg.TopK)
}

// sharedAfter queues the shared expert on the main stream when p places it
// there (after the routed kernels queued so far).
func (l *Layer) sharedAfter(p *plan, xv *gpuctx.Buffer) error {
	if p.place != sharedMain {
		return nil
	}
	return l.shared.onMain(xv, p.T)
}

// routedFused queues the fused path: evFork (Dual), the routing and the
// aligned sort (one launch, or router GEMM, route and align), the tiles'
// choice where it is not known yet (tune), the fused expert kernels, then the
// shared expert on the side stream from evFork or on the main stream. The
// routed kernels are queued before the side stream's shared expert: an eager
// forward would otherwise leave the main stream idle while the host queues
// the shared expert's BLAS calls.
func (l *Layer) routedFused(p *plan, xv *gpuctx.Buffer) error {
	if p.place == sharedSide {
		if err := l.evFork.Record(l.main); err != nil { // x is ready: the shared expert may start
			return err
		}
	}
	if err := l.sortFused(p, xv); err != nil {
		return err
	}
	if err := l.experts.fused(xv, &l.dispatch, p, p.tiles); err != nil {
		return err
	}
	if p.place == sharedSide {
		return l.shared.onSide(l.evFork, xv, p.T)
	}
	return l.sharedAfter(p, xv)
}

// sortFused queues the fused path's routing and aligned sort with p's tiles'
// rows, settling p.tiles first where they are not known: the one-launch path
// routes and sorts with the rule's rows, tunes on that routing, and sorts
// again; the other routes, tunes, and sorts. Every forward of a one-launch
// batch computes the router logits the same way (in that kernel, never in a
// GEMM), so results do not depend on whether the tiles were tuned yet.
func (l *Layer) sortFused(p *plan, xv *gpuctx.Buffer) error {
	if p.oneLaunch {
		if err := l.ensureFused(p, p.sortBM); err != nil {
			return err
		}
		if err := l.dispatch.routeAlign(xv, &l.router, p, p.sortBM); err != nil {
			return err
		}
	} else if err := l.router.route(xv, p.T, p.ks, true); err != nil {
		return err
	}
	if p.oneLaunch && p.tilesKnown {
		return nil
	}
	if !p.tilesKnown {
		tp, err := l.tilesFor(p, xv)
		if err != nil {
			return err
		}
		p.tiles = tp
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
	needs = append(needs, sort[3:]...)
	synced := false
	for _, nd := range needs {
		if err := l.grow(nd.b, nd.n, &synced); err != nil {
			return err
		}
	}
	return l.dispatch.resetTicket(&synced)
}
