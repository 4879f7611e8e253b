package moekernels

import (
	"fmt"

	"github.com/gpuctx/gpuctx/kernels"
)

// The Go twins of the small-batch routed-expert kernels of moe.cu
// (gpuctx_moe_expert_up, gpuctx_moe_expert_down): the routed experts computed straight from the
// device-side plan (counts, offsets), with the same rounding as the CUDA
// kernels (f32 dot products; gate and up rounded to the activation dtype before
// SwiGLU; results stored in the activation dtype).

// expertPlan reads counts [E] and offsets [E+1] and checks that every expert's
// rows lie inside [0, offsets[E]).
func expertPlan(m kernels.Memory, cp, op Ptr, E int) (counts, offsets []int32, rows int, err error) {
	if counts, err = kernels.Slice[int32](m, "counts", cp, int64(E)); err != nil {
		return nil, nil, 0, err
	}
	if offsets, err = kernels.Slice[int32](m, "offsets", op, int64(E)+1); err != nil {
		return nil, nil, 0, err
	}
	rows = int(offsets[E])
	for e := range E {
		if counts[e] < 0 || offsets[e] < 0 || int(offsets[e])+int(counts[e]) > rows {
			return nil, nil, 0, fmt.Errorf("expert %d: rows [%d, %d) outside the plan's %d rows", e, offsets[e], offsets[e]+counts[e], rows)
		}
	}
	return counts, offsets, rows, nil
}

func expertDims(e, h, i, b int32) (E, H, I int, bf int32, err error) {
	E, H, I, bf = int(e), int(h), int(i), b
	if E <= 0 || H <= 0 || I <= 0 || H%8 != 0 || I%8 != 0 {
		return 0, 0, 0, 0, fmt.Errorf("dimensions E=%d H=%d I=%d: want E > 0 and H, I positive multiples of 8", E, H, I)
	}
	return E, H, I, bf, nil
}

// round rounds v to the activation dtype of s, as a store and a load would.
func (a actSlice) round(v float32) float32 {
	if a.h != nil {
		return bf16ToF32(f32ToBF16(v))
	}
	return v
}

func moeExpertUp(m kernels.Memory, a *expertUpArgs) error {
	E, H, I, bf, err := expertDims(a.E, a.H, a.I, a.BF16)
	if err != nil {
		return fmt.Errorf("expert_up: %w", err)
	}
	counts, offsets, rows, err := expertPlan(m, a.Counts, a.Offsets, E)
	if err != nil {
		return err
	}
	xp, err := actView(m, "xp", a.Xp, int64(rows)*int64(H), bf)
	if err != nil {
		return err
	}
	gu, err := actView(m, "gu", a.Gu, int64(E)*2*int64(I)*int64(H), bf)
	if err != nil {
		return err
	}
	act, err := actView(m, "act", a.Act, int64(rows)*int64(I), bf)
	if err != nil {
		return err
	}
	for e := range E {
		for r := int(offsets[e]); r < int(offsets[e]+counts[e]); r++ {
			for i := range I {
				gRow, uRow := (e*2*I+i)*H, (e*2*I+I+i)*H
				var g, u float32
				for h := range H {
					x := xp.load(r*H + h)
					g += gu.load(gRow+h) * x
					u += gu.load(uRow+h) * x
				}
				g, u = act.round(g), act.round(u)
				act.store(r*I+i, (g/(1+expf(-g)))*u)
			}
		}
	}
	return nil
}

func moeExpertDown(m kernels.Memory, a *expertDownArgs) error {
	E, H, I, bf, err := expertDims(a.E, a.H, a.I, a.BF16)
	if err != nil {
		return fmt.Errorf("expert_down: %w", err)
	}
	counts, offsets, rows, err := expertPlan(m, a.Counts, a.Offsets, E)
	if err != nil {
		return err
	}
	act, err := actView(m, "act", a.Act, int64(rows)*int64(I), bf)
	if err != nil {
		return err
	}
	down, err := actView(m, "down", a.Down, int64(E)*int64(H)*int64(I), bf)
	if err != nil {
		return err
	}
	out, err := actView(m, "out", a.Out, int64(rows)*int64(H), bf)
	if err != nil {
		return err
	}
	for e := range E {
		for r := int(offsets[e]); r < int(offsets[e]+counts[e]); r++ {
			for h := range H {
				dRow := (e*H + h) * I
				var v float32
				for k := range I {
					v += down.load(dRow+k) * act.load(r*I+k)
				}
				out.store(r*H+h, v)
			}
		}
	}
	return nil
}
