package cpu

import (
	"fmt"

	"github.com/gpuctx/gpuctx/internal/hal"
	"github.com/gpuctx/gpuctx/kernels"
)

// The fused, graph-capturable routed-expert path: gpuctx_moe_align (a
// block-aligned stable sort of the assignments by expert, kernels/moe.cu), the
// grouped expert GEMMs of kernels/moe_gemm.cu (gpuctx_moe_up_<tag>,
// gpuctx_moe_down_<tag>, one per tile config of kernels.MoEGemms) and
// gpuctx_moe_combine_rows (gpuctx_moe_combine with the routed rows in
// assignment order). Same arithmetic as the CUDA kernels: f32 dot products in
// ascending order, gate and up rounded to bf16 before SwiGLU, bf16 stores
// rounded to nearest even. The tile shape changes no result, so every config
// shares one Go body parameterised by its BM.

func init() {
	// gpuctx_moe_align(const int* topk_idx, int* sorted, int* block_expert,
	// int* npost, int TK, int E, int BM, int cap).
	registerKernel("gpuctx_moe_align", []argKind{argPtr, argPtr, argPtr, argPtr,
		argI32, argI32, argI32, argI32}, moeAlign)

	for _, c := range kernels.MoEGemms {
		bm := c.BM
		// (x, gu, sorted, block_expert, npost, act, TK, K, H, I).
		registerKernel(c.UpName(), []argKind{argPtr, argPtr, argPtr, argPtr, argPtr, argPtr,
			argI32, argI32, argI32, argI32}, func(d *device, a []any) error { return moeFusedUp(d, a, bm) })
		// (act, down, sorted, block_expert, npost, out, TK, H, I).
		registerKernel(c.DownName(), []argKind{argPtr, argPtr, argPtr, argPtr, argPtr, argPtr,
			argI32, argI32, argI32}, func(d *device, a []any) error { return moeFusedDown(d, a, bm) })
	}

	// gpuctx_moe_route_align(x, router, bias, logits, topk_idx, topk_w, sorted,
	// block_expert, npost, T, H, E, K, scoring, method, groups, topk_groups,
	// has_bias, norm, norm_eps, scale, ks, ns, BM, cap).
	registerKernel("gpuctx_moe_route_align", []argKind{argPtr, argPtr, argPtr, argPtr, argPtr, argPtr, argPtr, argPtr, argPtr,
		argI32, argI32, argI32, argI32, argI32, argI32, argI32, argI32, argI32, argI32, argF32, argF32,
		argI32, argI32, argI32, argI32}, moeRouteAlign)

	// gpuctx_moe_combine_rows(const void* out, const float* w, const void* shared,
	// const float* gate, void* y, int T, int K, int H, int has_routed,
	// int has_shared, int has_gate, int bf16).
	registerKernel("gpuctx_moe_combine_rows", []argKind{argPtr, argPtr, argPtr, argPtr, argPtr,
		argI32, argI32, argI32, argI32, argI32, argI32, argI32}, moeCombineRows)
}

func roundUp(n, m int) int { return (n + m - 1) / m * m }

// moeRouteAlign is gpuctx_moe_route_align: the router logits (bf16 x [T,H]
// times bf16 router [E,H], f32 sums in ascending h), then the route and the
// align twins on them, with the arguments the CUDA kernel passes them.
func moeRouteAlign(d *device, a []any) error {
	T, H, E := a[9].(int32), a[10].(int32), a[11].(int32)
	ks, ns, bm, cp := a[21].(int32), a[22].(int32), a[23].(int32), a[24].(int32)
	if T < 0 || H <= 0 || H%8 != 0 || E <= 0 || E > moeMaxE {
		return fmt.Errorf("route_align: T=%d H=%d E=%d: want T >= 0, H > 0 a multiple of 8, 0 < E <= %d", T, H, E, moeMaxE)
	}
	x, err := deviceSlice[uint16](d, "x", a[0].(hal.Ptr), int64(T)*int64(H))
	if err != nil {
		return err
	}
	router, err := deviceSlice[uint16](d, "router", a[1].(hal.Ptr), int64(E)*int64(H))
	if err != nil {
		return err
	}
	logits, err := deviceSlice[float32](d, "logits", a[3].(hal.Ptr), int64(T)*int64(E))
	if err != nil {
		return err
	}
	for t := 0; t < int(T); t++ {
		xr := x[t*int(H) : (t+1)*int(H)]
		for e := 0; e < int(E); e++ {
			wr := router[e*int(H) : (e+1)*int(H)]
			var acc float32
			for h := range xr {
				acc += bf16ToF32(xr[h]) * bf16ToF32(wr[h])
			}
			logits[t*int(E)+e] = acc
		}
	}
	route := []any{a[3], a[2], a[4], a[5], T, E}
	route = append(route, a[12:21]...) // K, scoring, method, groups, topk_groups, has_bias, norm, norm_eps, scale
	route = append(route, ks, ns)
	if err := moeRoute(d, route); err != nil {
		return err
	}
	return moeAlign(d, []any{a[4], a[6], a[7], a[8], T * ks, E + ns, bm, cp})
}

func moeAlign(d *device, a []any) error {
	TK, E, BM, cp := int(a[4].(int32)), int(a[5].(int32)), int(a[6].(int32)), int(a[7].(int32))
	if TK < 0 || E <= 0 || E > moeMaxE || BM <= 0 || cp < 0 || cp%BM != 0 {
		return fmt.Errorf("align: TK=%d E=%d BM=%d cap=%d: want TK >= 0, 0 < E <= %d, BM > 0 and cap >= 0 a multiple of BM",
			TK, E, BM, cp, moeMaxE)
	}
	idx, err := deviceSlice[int32](d, "topk_idx", a[0].(hal.Ptr), int64(TK))
	if err != nil {
		return err
	}
	counts := make([]int, E)
	for _, e := range idx {
		if e >= 0 && int(e) < E {
			counts[e]++
		}
	}
	starts := make([]int, E) // S_e, then the next free row of expert e
	npost := 0
	for e, c := range counts {
		starts[e] = npost
		npost += roundUp(c, BM)
	}
	if cp < npost {
		return fmt.Errorf("align: cap=%d < %d, the padded rows of %d assignments in blocks of BM=%d", cp, npost, TK, BM)
	}
	sorted, err := deviceSlice[int32](d, "sorted", a[1].(hal.Ptr), int64(cp))
	if err != nil {
		return err
	}
	blockExpert, err := deviceSlice[int32](d, "block_expert", a[2].(hal.Ptr), int64(cp/BM))
	if err != nil {
		return err
	}
	np, err := deviceSlice[int32](d, "npost", a[3].(hal.Ptr), 1)
	if err != nil {
		return err
	}
	for i := range sorted {
		sorted[i] = int32(TK)
	}
	for b := range blockExpert {
		blockExpert[b] = -1
	}
	for e, c := range counts {
		for b := starts[e] / BM; b < (starts[e]+roundUp(c, BM))/BM; b++ {
			blockExpert[b] = int32(e)
		}
	}
	for i, e := range idx {
		if e >= 0 && int(e) < E {
			sorted[starts[e]] = int32(i)
			starts[e]++
		}
	}
	np[0] = int32(npost)
	return nil
}

// fusedPlan reads the output of gpuctx_moe_align for blocks of BM rows: the
// sorted rows and block experts of the blocks below npost[0]. It checks that
// the rows of the blocks with an expert hold assignments in [0, TK] (TK is
// padding) and returns the largest expert seen (-1 if none).
func fusedPlan(d *device, a []any, BM, TK int) (sorted, blockExpert []int32, rows, maxE int, err error) {
	np, err := deviceSlice[int32](d, "npost", a[4].(hal.Ptr), 1)
	if err != nil {
		return nil, nil, 0, 0, err
	}
	if np[0] < 0 {
		return nil, nil, 0, 0, fmt.Errorf("npost = %d < 0", np[0])
	}
	nb := (int(np[0]) + BM - 1) / BM
	rows = nb * BM
	if sorted, err = deviceSlice[int32](d, "sorted", a[2].(hal.Ptr), int64(rows)); err != nil {
		return nil, nil, 0, 0, err
	}
	if blockExpert, err = deviceSlice[int32](d, "block_expert", a[3].(hal.Ptr), int64(nb)); err != nil {
		return nil, nil, 0, 0, err
	}
	maxE = -1
	for b, e := range blockExpert {
		if e < 0 {
			continue
		}
		maxE = max(maxE, int(e))
		for p := b * BM; p < (b+1)*BM; p++ {
			if s := sorted[p]; s < 0 {
				return nil, nil, 0, 0, fmt.Errorf("sorted[%d] = %d < 0 (want an assignment in [0, TK=%d] with TK for padding)", p, s, TK)
			}
		}
	}
	return sorted, blockExpert, rows, maxE, nil
}

func moeFusedUp(d *device, a []any, BM int) error {
	TK, K, H, I := int(a[6].(int32)), int(a[7].(int32)), int(a[8].(int32)), int(a[9].(int32))
	if TK < 0 || K <= 0 || H <= 0 || I <= 0 || H%8 != 0 || I%8 != 0 {
		return fmt.Errorf("moe_up: TK=%d K=%d H=%d I=%d: want TK >= 0, K > 0 and H, I positive multiples of 8", TK, K, H, I)
	}
	sorted, blockExpert, rows, maxE, err := fusedPlan(d, a, BM, TK)
	if err != nil {
		return err
	}
	T := (TK + K - 1) / K
	x, err := deviceSlice[uint16](d, "x", a[0].(hal.Ptr), int64(T)*int64(H))
	if err != nil {
		return err
	}
	gu, err := deviceSlice[uint16](d, "gu", a[1].(hal.Ptr), int64(maxE+1)*2*int64(I)*int64(H))
	if err != nil {
		return err
	}
	act, err := deviceSlice[uint16](d, "act", a[5].(hal.Ptr), int64(rows)*int64(I))
	if err != nil {
		return err
	}
	for b, e := range blockExpert {
		if e < 0 {
			continue
		}
		for p := b * BM; p < (b+1)*BM; p++ {
			ar := act[p*I : (p+1)*I]
			s := int(sorted[p])
			if s >= TK {
				clear(ar)
				continue
			}
			xr := x[(s/K)*H : (s/K+1)*H]
			for i := range I {
				gr := gu[(int(e)*2*I+i)*H:][:H]
				ur := gu[(int(e)*2*I+I+i)*H:][:H]
				var g, u float32
				for h, xv := range xr {
					xf := bf16ToF32(xv)
					g += xf * bf16ToF32(gr[h])
					u += xf * bf16ToF32(ur[h])
				}
				g, u = bf16ToF32(f32ToBF16(g)), bf16ToF32(f32ToBF16(u))
				ar[i] = f32ToBF16((g / (1 + expf(-g))) * u)
			}
		}
	}
	return nil
}

func moeFusedDown(d *device, a []any, BM int) error {
	TK, H, I := int(a[6].(int32)), int(a[7].(int32)), int(a[8].(int32))
	if TK < 0 || H <= 0 || I <= 0 || H%8 != 0 || I%8 != 0 {
		return fmt.Errorf("moe_down: TK=%d H=%d I=%d: want TK >= 0 and H, I positive multiples of 8", TK, H, I)
	}
	sorted, blockExpert, rows, maxE, err := fusedPlan(d, a, BM, TK)
	if err != nil {
		return err
	}
	act, err := deviceSlice[uint16](d, "act", a[0].(hal.Ptr), int64(rows)*int64(I))
	if err != nil {
		return err
	}
	down, err := deviceSlice[uint16](d, "down", a[1].(hal.Ptr), int64(maxE+1)*int64(H)*int64(I))
	if err != nil {
		return err
	}
	out, err := deviceSlice[uint16](d, "out", a[5].(hal.Ptr), int64(TK)*int64(H))
	if err != nil {
		return err
	}
	for b, e := range blockExpert {
		if e < 0 {
			continue
		}
		for p := b * BM; p < (b+1)*BM; p++ {
			s := int(sorted[p])
			if s >= TK {
				continue
			}
			ar := act[p*I : (p+1)*I]
			or := out[s*H : (s+1)*H]
			for h := range H {
				dr := down[(int(e)*H+h)*I:][:I]
				var v float32
				for i, av := range ar {
					v += bf16ToF32(av) * bf16ToF32(dr[i])
				}
				or[h] = f32ToBF16(v)
			}
		}
	}
	return nil
}

func moeCombineRows(d *device, a []any) error {
	return combine(d, combineArgs{
		out: a[0].(hal.Ptr), w: a[1].(hal.Ptr), shared: a[2].(hal.Ptr), gate: a[3].(hal.Ptr), y: a[4].(hal.Ptr),
		T: int(a[5].(int32)), K: int(a[6].(int32)), H: int(a[7].(int32)),
		hasRouted: a[8].(int32) != 0, hasShared: a[9].(int32) != 0, hasGate: a[10].(int32) != 0, bf: a[11].(int32),
		identity: true,
	})
}
