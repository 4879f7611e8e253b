package moe

import (
	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
)

// combineStage sums each token's routed rows with its routing weights in slot
// order and adds the shared expert's output (times its Qwen2-MoE gate):
// gpuctx_moe_combine over rows addressed through the plan's pos, or
// gpuctx_moe_combine_rows over rows in assignment order (fused path).
type combineStage struct {
	e         *env
	kCombine  moekernels.Launcher[moekernels.Combine]
	kCombRows moekernels.Launcher[moekernels.CombineRows]
}

// combineIn is what the combine reads: the routed rows out, addressed
// through pos (tokens) or in assignment order (rows), the routing weights w
// with ks slots per token, and the shared stage's out (sout) and gate logits
// (sg); a nil buffer is one the kernel does not read. routed, shared and
// gated are the kernel's flags: add the routed rows, add sout (separately
// from the routed rows), scale it by sigmoid(sg).
type combineIn struct {
	out, pos, w           *gpuctx.Buffer
	sout, sg              *gpuctx.Buffer
	ks                    int
	routed, shared, gated bool
}

// bufs returns in's buffers with dummy (a valid pointer) for the nil ones.
func (in combineIn) bufs(dummy *gpuctx.Buffer) []*gpuctx.Buffer {
	bs := []*gpuctx.Buffer{in.out, in.pos, in.w, in.sout, in.sg}
	for i, b := range bs {
		if b == nil {
			bs[i] = dummy
		}
	}
	return bs
}

// tokens queues gpuctx_moe_combine into y for T tokens on the main stream.
func (m *combineStage) tokens(in combineIn, dummy, y *gpuctx.Buffer, T int) error {
	e := m.e
	H := e.cfg.HiddenSize
	b := in.bufs(dummy)
	return m.kCombine.Launch(e.main, gpuctx.Dim3{X: gridFor(T), Y: 1, Z: 1}, gpuctx.Dim3{X: blockFor(H), Y: 1, Z: 1}, 0, moekernels.Combine{
		Out: b[0], Pos: b[1], W: b[2], Shared: b[3], Gate: b[4], Y: y, T: int32(T), K: int32(in.ks), H: int32(H),
		HasRouted: flag(in.routed), HasShared: flag(in.shared), HasGate: flag(in.gated), BF16: e.bf16()})
}

// rows queues gpuctx_moe_combine_rows into y for T tokens on the main stream
// (launched early where it waits first): routed rows in assignment order, ks
// slots per token (the fused shared expert's among them: then shared is
// false).
func (m *combineStage) rows(in combineIn, dummy, y *gpuctx.Buffer, T int) error {
	e := m.e
	H := e.cfg.HiddenSize
	b := in.bufs(dummy)
	n := T * H
	per := 1
	if e.dt == gpuctx.BF16 && H%8 == 0 { // the kernel's 16-byte path: eight elements a thread
		per = 8
	}
	blk := 256
	if n/per < 256*e.dev.Info().SMCount { // a small batch: spread it over more multiprocessors
		blk = 64
	}
	return m.kCombRows.LaunchEarly(e.main, gpuctx.Dim3{X: max(1, min((n/per+blk-1)/blk, 8192)), Y: 1, Z: 1}, gpuctx.Dim3{X: blk, Y: 1, Z: 1}, 0, moekernels.CombineRows{
		Out: b[0], W: b[2], Shared: b[3], Gate: b[4], Y: y, T: int32(T), K: int32(in.ks), H: int32(H),
		HasRouted: flag(in.routed), HasShared: flag(in.shared), HasGate: flag(in.gated), BF16: e.bf16()})
}
