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

// onMain queues the shared expert on the main stream.
func (s *sharedStage) onMain(x *gpuctx.Buffer, T int) error { return s.run(s.e.ctx, s.e.main, x, T) }

// onSide forks the shared expert onto the side stream after fork (an event
// recorded on the main stream) and records evJoin after it; the caller makes
// the main stream wait on evJoin before the combine.
func (s *sharedStage) onSide(fork *gpuctx.Event, x *gpuctx.Buffer, T int) error {
	e := s.e
	if err := e.side.Wait(fork); err != nil {
		return err
	}
	if err := s.run(e.sctx, e.side, x, T); err != nil {
		return err
	}
	return e.evJoin.Record(e.side)
}
