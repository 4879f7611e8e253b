package cpu

import (
	"fmt"
	"math"

	"github.com/gpuctx/gpuctx/internal/hal"
)

// The Mixture-of-Experts kernels of kernels/moe.cu, in Go with the same
// arithmetic: f32 math, fixed summation orders, bf16 stores rounded to nearest
// even. Results match the CUDA kernels up to f32 rounding of exp and of the
// order of the softmax sum (the integer outputs of the plan kernel match
// exactly). Grid and block are ignored.

// Limits shared with kernels/moe.cu.
const (
	moeMaxE      = 512
	moeMaxK      = 16
	moeMaxShared = 16 // shared-expert slots gpuctx_moe_route may append
)

// moeBetter reports whether (v, i) beats (bv, bi): a larger value, or an equal
// value with a lower index; index -1 means none (as moe_better in moe.cu).
func moeBetter(v float32, i int, bv float32, bi int) bool {
	if i < 0 {
		return false
	}
	if bi < 0 {
		return true
	}
	return v > bv || (v == bv && i < bi)
}

func expf(v float32) float32 { return float32(math.Exp(float64(v))) }

// actSlice views n activations (f32 when bf16 == 0, else bf16 bits) at p.
type actSlice struct {
	f []float32
	h []uint16
}

func (a actSlice) load(i int) float32 {
	if a.h != nil {
		return bf16ToF32(a.h[i])
	}
	return a.f[i]
}

func (a actSlice) store(i int, v float32) {
	if a.h != nil {
		a.h[i] = f32ToBF16(v)
	} else {
		a.f[i] = v
	}
}

func actView(d *device, what string, p hal.Ptr, n int64, bf16 int32) (actSlice, error) {
	if bf16 != 0 {
		h, err := deviceSlice[uint16](d, what, p, n)
		return actSlice{h: h}, err
	}
	f, err := deviceSlice[float32](d, what, p, n)
	return actSlice{f: f}, err
}

func init() {
	// gpuctx_moe_route(const float* logits, const float* bias, int* topk_idx,
	// float* topk_w, int T, int E, int K, int scoring, int method, int groups,
	// int topk_groups, int has_bias, int norm, float norm_eps, float scale,
	// int ks, int ns).
	registerKernel("gpuctx_moe_route", []argKind{argPtr, argPtr, argPtr, argPtr,
		argI32, argI32, argI32, argI32, argI32, argI32, argI32, argI32, argI32, argF32, argF32, argI32, argI32}, moeRoute)

	// gpuctx_moe_plan(const int* topk_idx, int* counts, int* offsets, int* pos, int TK, int E).
	registerKernel("gpuctx_moe_plan", []argKind{argPtr, argPtr, argPtr, argPtr, argI32, argI32}, moePlan)

	// gpuctx_moe_gather(const void* x, const int* pos, void* xp, int TK, int K, int H, int elem_bytes).
	registerKernel("gpuctx_moe_gather", []argKind{argPtr, argPtr, argPtr, argI32, argI32, argI32, argI32}, moeGather)

	// gpuctx_moe_swiglu(const void* h, void* act, int rows, int I, int bf16).
	registerKernel("gpuctx_moe_swiglu", []argKind{argPtr, argPtr, argI32, argI32, argI32}, moeSwiglu)

	// gpuctx_moe_combine(const void* out, const int* pos, const float* w,
	// const void* shared, const float* gate, void* y, int T, int K, int H,
	// int has_routed, int has_shared, int has_gate, int bf16).
	registerKernel("gpuctx_moe_combine", []argKind{argPtr, argPtr, argPtr, argPtr, argPtr, argPtr,
		argI32, argI32, argI32, argI32, argI32, argI32, argI32}, moeCombine)
}

func moeRoute(d *device, a []any) error {
	T, E, K := int(a[4].(int32)), int(a[5].(int32)), int(a[6].(int32))
	scoring, method, groups, topkGroups := a[7].(int32), a[8].(int32), int(a[9].(int32)), int(a[10].(int32))
	hasBias, norm := a[11].(int32) != 0, a[12].(int32) != 0
	normEps, scale := a[13].(float32), a[14].(float32)
	ks, ns := int(a[15].(int32)), int(a[16].(int32))
	if T < 0 || E <= 0 || E > moeMaxE || K <= 0 || K > moeMaxK || K > E {
		return fmt.Errorf("route: T=%d E=%d K=%d: want T >= 0, 0 < E <= %d, 0 < K <= min(E, %d)", T, E, K, moeMaxE, moeMaxK)
	}
	if ns < 0 || ns > moeMaxShared || ks < K+ns {
		return fmt.Errorf("route: ks=%d ns=%d: want 0 <= ns <= %d and ks >= K+ns = %d", ks, ns, moeMaxShared, K+ns)
	}
	if method < 0 || method > 2 || scoring < 0 || scoring > 1 {
		return fmt.Errorf("scoring %d (want 0 softmax, 1 sigmoid), method %d (want 0 greedy, 1 group max, 2 group top-2 sum)", scoring, method)
	}
	if method != 0 && (groups <= 0 || groups > E || E%groups != 0 || topkGroups > groups) {
		return fmt.Errorf("groups=%d topk_groups=%d do not divide E=%d experts into kept groups", groups, topkGroups, E)
	}
	logits, err := deviceSlice[float32](d, "logits", a[0].(hal.Ptr), int64(T)*int64(E))
	if err != nil {
		return err
	}
	var bias []float32
	if hasBias {
		if bias, err = deviceSlice[float32](d, "bias", a[1].(hal.Ptr), int64(E)); err != nil {
			return err
		}
	}
	idx, err := deviceSlice[int32](d, "topk_idx", a[2].(hal.Ptr), int64(T)*int64(ks))
	if err != nil {
		return err
	}
	wt, err := deviceSlice[float32](d, "topk_w", a[3].(hal.Ptr), int64(T)*int64(ks))
	if err != nil {
		return err
	}
	sc := make([]float32, E)
	ch := make([]float32, E)
	taken := make([]bool, E)
	gs := make([]float32, max(groups, 1))
	keep := make([]bool, max(groups, 1))
	wsel := make([]float32, K)
	negInf := float32(math.Inf(-1))
	for t := 0; t < T; t++ {
		lg := logits[t*E : (t+1)*E]
		if scoring == 1 {
			for e, v := range lg {
				sc[e] = 1 / (1 + expf(-v))
			}
		} else {
			m := negInf
			for _, v := range lg {
				if v > m { // fmaxf: a NaN never becomes the maximum
					m = v
				}
			}
			var s float32
			for e, v := range lg {
				sc[e] = expf(v - m)
				s += sc[e]
			}
			for e := range sc {
				sc[e] /= s
			}
		}
		for e := range ch {
			ch[e] = sc[e]
			if hasBias {
				ch[e] = sc[e] + bias[e]
			}
			taken[e] = false
		}
		if method != 0 {
			per := E / groups
			for g := 0; g < groups; g++ {
				x, y := negInf, negInf
				for _, v := range ch[g*per : (g+1)*per] {
					if v > x {
						x, y = v, x
					} else if v > y {
						y = v
					}
				}
				if method == 1 {
					gs[g] = x
				} else {
					gs[g] = x + y
				}
				keep[g] = false
			}
			for r := 0; r < topkGroups; r++ {
				bv, bi := negInf, -1
				for g := 0; g < groups; g++ {
					if !keep[g] && moeBetter(gs[g], g, bv, bi) {
						bv, bi = gs[g], g
					}
				}
				if bi >= 0 {
					keep[bi] = true
				}
			}
			for e := range ch {
				if !keep[e/per] {
					ch[e] = 0
				}
			}
		}
		for k := 0; k < K; k++ {
			bv, bi := negInf, -1
			for e := 0; e < E; e++ {
				if !taken[e] && moeBetter(ch[e], e, bv, bi) {
					bv, bi = ch[e], e
				}
			}
			if bi < 0 {
				bi = 0
			}
			taken[bi] = true
			idx[t*ks+k] = int32(bi)
			if method == 2 {
				wsel[k] = sc[bi]
			} else {
				wsel[k] = ch[bi]
			}
		}
		var s float32
		if norm {
			for _, v := range wsel {
				s += v
			}
			s += normEps
		}
		for k, v := range wsel {
			if norm {
				v /= s
			}
			wt[t*ks+k] = v * scale
		}
		for j := 0; j < ns; j++ { // shared experts: ids E.., weight 1
			idx[t*ks+K+j], wt[t*ks+K+j] = int32(E+j), 1
		}
	}
	return nil
}

func moePlan(d *device, a []any) error {
	TK, E := int(a[4].(int32)), int(a[5].(int32))
	if TK < 0 || E <= 0 || E > moeMaxE {
		return fmt.Errorf("TK=%d E=%d: want TK >= 0 and 0 < E <= %d", TK, E, moeMaxE)
	}
	idx, err := deviceSlice[int32](d, "topk_idx", a[0].(hal.Ptr), int64(TK))
	if err != nil {
		return err
	}
	counts, err := deviceSlice[int32](d, "counts", a[1].(hal.Ptr), int64(E))
	if err != nil {
		return err
	}
	offsets, err := deviceSlice[int32](d, "offsets", a[2].(hal.Ptr), int64(E)+1)
	if err != nil {
		return err
	}
	pos, err := deviceSlice[int32](d, "pos", a[3].(hal.Ptr), int64(TK))
	if err != nil {
		return err
	}
	for e := range counts {
		counts[e] = 0
	}
	for _, e := range idx {
		if e >= 0 && int(e) < E {
			counts[e]++
		}
	}
	var acc int32
	for e := 0; e < E; e++ {
		offsets[e] = acc
		acc += counts[e]
	}
	offsets[E] = acc
	cursor := make([]int32, E)
	copy(cursor, offsets[:E])
	for i, e := range idx {
		if e < 0 || int(e) >= E {
			pos[i] = -1
			continue
		}
		pos[i] = cursor[e]
		cursor[e]++
	}
	return nil
}

func moeGather(d *device, a []any) error {
	TK, K, H, eb := int(a[3].(int32)), int(a[4].(int32)), int(a[5].(int32)), a[6].(int32)
	if TK < 0 || K <= 0 || H <= 0 || (eb != 2 && eb != 4) {
		return fmt.Errorf("TK=%d K=%d H=%d elem_bytes=%d: want TK >= 0, K > 0, H > 0, elem_bytes 2 or 4", TK, K, H, eb)
	}
	if TK == 0 {
		return nil
	}
	T := (TK-1)/K + 1
	bf := int32(0)
	if eb == 2 {
		bf = 1
	}
	x, err := actView(d, "x", a[0].(hal.Ptr), int64(T)*int64(H), bf)
	if err != nil {
		return err
	}
	pos, err := deviceSlice[int32](d, "pos", a[1].(hal.Ptr), int64(TK))
	if err != nil {
		return err
	}
	xp, err := actView(d, "xp", a[2].(hal.Ptr), int64(TK)*int64(H), bf)
	if err != nil {
		return err
	}
	for i, r := range pos {
		if r < 0 {
			continue
		}
		if int(r) >= TK {
			return fmt.Errorf("pos[%d] = %d is outside the %d rows of xp", i, r, TK)
		}
		src, dst := (i/K)*H, int(r)*H
		if bf != 0 {
			copy(xp.h[dst:dst+H], x.h[src:src+H])
		} else {
			copy(xp.f[dst:dst+H], x.f[src:src+H])
		}
	}
	return nil
}

func moeSwiglu(d *device, a []any) error {
	rows, I, bf := int(a[2].(int32)), int(a[3].(int32)), a[4].(int32)
	if rows < 0 || I <= 0 {
		return fmt.Errorf("rows=%d I=%d: want rows >= 0 and I > 0", rows, I)
	}
	h, err := actView(d, "h", a[0].(hal.Ptr), int64(rows)*2*int64(I), bf)
	if err != nil {
		return err
	}
	act, err := actView(d, "act", a[1].(hal.Ptr), int64(rows)*int64(I), bf)
	if err != nil {
		return err
	}
	for r := 0; r < rows; r++ {
		hb, ab := r*2*I, r*I
		for i := 0; i < I; i++ {
			g, u := h.load(hb+i), h.load(hb+I+i)
			act.store(ab+i, (g/(1+expf(-g)))*u)
		}
	}
	return nil
}

func moeCombine(d *device, a []any) error {
	return combine(d, combineArgs{
		out: a[0].(hal.Ptr), pos: a[1].(hal.Ptr), w: a[2].(hal.Ptr), shared: a[3].(hal.Ptr), gate: a[4].(hal.Ptr), y: a[5].(hal.Ptr),
		T: int(a[6].(int32)), K: int(a[7].(int32)), H: int(a[8].(int32)),
		hasRouted: a[9].(int32) != 0, hasShared: a[10].(int32) != 0, hasGate: a[11].(int32) != 0, bf: a[12].(int32),
	})
}

// combineArgs are the arguments of gpuctx_moe_combine and
// gpuctx_moe_combine_rows; identity replaces pos by pos[i] = i (the routed
// rows of out are in assignment order).
type combineArgs struct {
	out, pos, w, shared, gate, y            hal.Ptr
	T, K, H                                 int
	hasRouted, hasShared, hasGate, identity bool
	bf                                      int32
}

func combine(d *device, c combineArgs) error {
	T, K, H := c.T, c.K, c.H
	if T < 0 || K < 0 || H <= 0 || (c.hasRouted && K == 0) {
		return fmt.Errorf("combine: T=%d K=%d H=%d: want T >= 0, H > 0 and K > 0 when routed", T, K, H)
	}
	y, err := actView(d, "y", c.y, int64(T)*int64(H), c.bf)
	if err != nil {
		return err
	}
	var out actSlice
	var pos []int32
	var w []float32
	if c.hasRouted {
		if out, err = actView(d, "out", c.out, int64(T)*int64(K)*int64(H), c.bf); err != nil {
			return err
		}
		if !c.identity {
			if pos, err = deviceSlice[int32](d, "pos", c.pos, int64(T)*int64(K)); err != nil {
				return err
			}
		}
		if w, err = deviceSlice[float32](d, "w", c.w, int64(T)*int64(K)); err != nil {
			return err
		}
		for i, p := range pos {
			if int(p) >= T*K {
				return fmt.Errorf("pos[%d] = %d is outside the %d rows of out", i, p, T*K)
			}
		}
	}
	var shared actSlice
	var gate []float32
	if c.hasShared {
		if shared, err = actView(d, "shared", c.shared, int64(T)*int64(H), c.bf); err != nil {
			return err
		}
		if c.hasGate {
			if gate, err = deviceSlice[float32](d, "gate", c.gate, int64(T)); err != nil {
				return err
			}
		}
	}
	for t := 0; t < T; t++ {
		sg := float32(1)
		if c.hasShared && c.hasGate {
			sg = 1 / (1 + expf(-gate[t]))
		}
		row := t * H
		for h := 0; h < H; h++ {
			var acc float32
			if c.hasRouted {
				for k := 0; k < K; k++ {
					p := int32(t*K + k)
					if !c.identity {
						p = pos[t*K+k]
					}
					if p >= 0 {
						acc += w[t*K+k] * out.load(int(p)*H+h)
					}
				}
			}
			if c.hasShared {
				acc += sg * shared.load(row+h)
			}
			y.store(row+h, acc)
		}
	}
	return nil
}
