package moe

import (
	"fmt"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// sharedStage is the shared expert (when the config has one): its weights
// (gate-then-up [2Is,H], down [H,Is], and the Qwen2-MoE gate row [H] or nil)
// and its scratch: h [T,2Is], act [T,Is], its output out [T,H] and the gate
// logits g [T] f32, which the combine stage reads.
type sharedStage struct {
	e              *env
	gu, down, gate *gpuctx.Buffer
	kSwiglu        moekernels.Launcher[moekernels.Swiglu]
	h, act, out, g *gpuctx.Buffer
}

// needs returns the shared expert's scratch for T tokens.
func (s *sharedStage) needs(T int) []need {
	c, es := &s.e.cfg, s.e.es
	return []need{{&s.h, T * 2 * c.SharedIntermediate * es}, {&s.act, T * c.SharedIntermediate * es}, {&s.out, T * c.HiddenSize * es}, {&s.g, 4 * T}}
}

// run queues the shared expert (and the Qwen2-MoE gate logits) over T tokens
// of x on stream st through ctx, whose current stream must be st: out =
// Down(silu(Gate x) * Up x), g = x . shared_expert_gate. It waits for nothing
// but the work queued on st.
func (s *sharedStage) run(ctx *gpuctx.Context, st *gpuctx.Stream, x *gpuctx.Buffer, T int) error {
	e := s.e
	H, Is := e.cfg.HiddenSize, e.cfg.SharedIntermediate
	err := ctx.BlasFlavour(e.flav, func(h gpuctx.Blas) error {
		return h.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: T, N: 2 * Is, K: H, Alpha: 1,
			A: x, B: s.gu, C: s.h, AB: e.dt, CType: e.dt})
	})
	if err != nil {
		return fmt.Errorf("moe: shared expert gate/up GEMM: %w", err)
	}
	if err := s.kSwiglu.Launch(st, eltGrid(T*Is), eltBlock, 0, moekernels.Swiglu{
		H: s.h, Act: s.act, Rows: int32(T), I: int32(Is), BF16: e.bf16()}); err != nil {
		return err
	}
	err = ctx.BlasFlavour(e.flav, func(h gpuctx.Blas) error {
		if err := h.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: T, N: H, K: Is, Alpha: 1,
			A: s.act, B: s.down, C: s.out, AB: e.dt, CType: e.dt}); err != nil {
			return err
		}
		if s.gate == nil {
			return nil
		}
		return h.Gemm(gpuctx.Gemm{Layout: gpuctx.RowMajor, TransB: true, M: T, N: 1, K: H, Alpha: 1,
			A: x, B: s.gate, C: s.g, AB: e.dt, CType: gpuctx.F32})
	})
	if err != nil {
		return fmt.Errorf("moe: shared expert down/gate GEMM: %w", err)
	}
	return nil
}

// onStream queues the shared expert over T tokens of x: on the main stream
// through its Context when fork is nil; else on the side stream through sctx
// once fork (an event recorded on the main stream) has passed, recording
// evJoin after it. The caller makes the main stream wait on evJoin before the
// combine (join).
func (s *sharedStage) onStream(fork *gpuctx.Event, x *gpuctx.Buffer, T int) error {
	e := s.e
	ctx, st := e.ctx, e.main
	if fork != nil {
		if err := e.side.Wait(fork); err != nil {
			return err
		}
		ctx, st = e.sctx, e.side
	}
	if err := s.run(ctx, st, x, T); err != nil {
		return err
	}
	if fork == nil {
		return nil
	}
	return e.evJoin.Record(e.side)
}

// fork records evFork on the main stream at the start of a forward whose
// shared expert the side stream runs from x itself (the fused path, the
// shared expert alone): x is ready, the shared expert may start. The other
// paths fork at the counts (evCounts, which the dispatch records).
func (s *sharedStage) fork(p *plan) error {
	if p.place != sharedSide || p.forksAtCounts() {
		return nil
	}
	return s.e.evFork.Record(s.e.main)
}

// beforeExperts queues the shared expert over p's x where p queues it right
// after the dispatch, before the routed experts (plan.sharedFirst).
func (s *sharedStage) beforeExperts(p *plan, x *gpuctx.Buffer) error {
	if !p.sharedFirst() {
		return nil
	}
	return s.placed(p, x)
}

// afterExperts queues the shared expert over p's x where p queues it after
// the routed experts (or alone), not before them (plan.sharedFirst).
func (s *sharedStage) afterExperts(p *plan, x *gpuctx.Buffer) error {
	if p.sharedFirst() {
		return nil
	}
	return s.placed(p, x)
}

// placed queues the shared expert over p's x where p.place says: on the main
// stream, or forked onto the side stream at evCounts (plan.forksAtCounts) or
// evFork; nothing where p has none or fuses it.
func (s *sharedStage) placed(p *plan, x *gpuctx.Buffer) error {
	var fork *gpuctx.Event // nil: the main stream
	switch {
	case p.place == sharedSide && p.forksAtCounts():
		fork = s.e.evCounts
	case p.place == sharedSide:
		fork = s.e.evFork
	case p.place != sharedMain:
		return nil
	}
	return s.onStream(fork, x, p.T)
}

// join makes the main stream wait for the side stream's shared expert
// (evJoin, recorded by onStream) where p runs it there, before the combine.
func (s *sharedStage) join(p *plan) error {
	if p.place != sharedSide {
		return nil
	}
	return s.e.main.Wait(s.e.evJoin)
}
