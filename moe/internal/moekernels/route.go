package moekernels

import (
	"fmt"
	"math"

	"github.com/gpuctx/gpuctx/half"
	"github.com/gpuctx/gpuctx/kernels"
)

// The Go twins of the routing, permutation, SwiGLU and combine kernels of
// moe.cu, with the same arithmetic: f32 math, fixed summation orders, bf16
// stores rounded to nearest even. Results match the CUDA kernels up to f32
// rounding of exp and of the order of the softmax sum (the integer outputs of
// the plan kernel match exactly). Grid and block are ignored.

// maxShared bounds the shared-expert slots gpuctx_moe_route may append (moe.cu
// checks ns against MOE_MAX_K).
const maxShared = MaxTopK

// Ptr is a device address argument.
type Ptr = kernels.Ptr

func bf16ToF32(h uint16) float32 { return half.FromBF16(h) }
func f32ToBF16(f float32) uint16 { return half.BF16(f) }

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

func actView(m kernels.Memory, what string, p Ptr, n int64, bf16 int32) (actSlice, error) {
	if bf16 != 0 {
		h, err := kernels.Slice[uint16](m, what, p, n)
		return actSlice{h: h}, err
	}
	f, err := kernels.Slice[float32](m, what, p, n)
	return actSlice{f: f}, err
}

func moeRoute(m kernels.Memory, a *routeArgs) error {
	T, E, K := int(a.T), int(a.E), int(a.K)
	ks, ns := int(a.Ks), int(a.Ns)
	if err := checkRoute(T, E, K, ks, ns, a.Rule); err != nil {
		return err
	}
	logits, err := kernels.Slice[float32](m, "logits", a.Logits, int64(T)*int64(E))
	if err != nil {
		return err
	}
	var bias []float32
	if a.Rule.HasBias != 0 {
		if bias, err = kernels.Slice[float32](m, "bias", a.Bias, int64(E)); err != nil {
			return err
		}
	}
	idx, err := kernels.Slice[int32](m, "topk_idx", a.TopkIdx, int64(T)*int64(ks))
	if err != nil {
		return err
	}
	wt, err := kernels.Slice[float32](m, "topk_w", a.TopkW, int64(T)*int64(ks))
	if err != nil {
		return err
	}
	ro := newRouter(E, K, a.Rule, bias)
	for t := 0; t < T; t++ {
		ro.token(logits[t*E:(t+1)*E], idx[t*ks:(t+1)*ks], wt[t*ks:(t+1)*ks])
		for j := 0; j < ns; j++ { // shared experts: ids E.., weight 1
			idx[t*ks+K+j], wt[t*ks+K+j] = int32(E+j), 1
		}
	}
	return nil
}

// checkRoute checks gpuctx_moe_route's dimensions and rule as moe.cu does.
func checkRoute(T, E, K, ks, ns int, r RouteRule) error {
	groups, topkGroups := int(r.Groups), int(r.TopkGroups)
	if T < 0 || E <= 0 || E > MaxExperts || K <= 0 || K > MaxTopK || K > E {
		return fmt.Errorf("route: T=%d E=%d K=%d: want T >= 0, 0 < E <= %d, 0 < K <= min(E, %d)", T, E, K, MaxExperts, MaxTopK)
	}
	if ns < 0 || ns > maxShared || ks < K+ns {
		return fmt.Errorf("route: ks=%d ns=%d: want 0 <= ns <= %d and ks >= K+ns = %d", ks, ns, maxShared, K+ns)
	}
	if r.Method < 0 || r.Method > 2 || r.Scoring < 0 || r.Scoring > 1 {
		return fmt.Errorf("scoring %d (want 0 softmax, 1 sigmoid), method %d (want 0 greedy, 1 group max, 2 group top-2 sum)", r.Scoring, r.Method)
	}
	if r.Method != 0 && (groups <= 0 || groups > E || E%groups != 0 || topkGroups > groups) {
		return fmt.Errorf("groups=%d topk_groups=%d do not divide E=%d experts into kept groups", groups, topkGroups, E)
	}
	return nil
}

// router routes one token at a time as a warp of gpuctx_moe_route does, with
// scratch for E experts.
type router struct {
	K         int
	rule      RouteRule
	bias      []float32 // nil without HasBias
	sc, ch    []float32 // scores and choice values
	taken     []bool    // experts chosen so far
	gs        []float32 // group scores
	keep      []bool    // kept groups
	wsel      []float32 // weights of the chosen experts
	negInf    float32
	perGroup  int
	topGroups int
}

func newRouter(E, K int, r RouteRule, bias []float32) *router {
	groups := max(int(r.Groups), 1)
	return &router{
		K: K, rule: r, bias: bias,
		sc: make([]float32, E), ch: make([]float32, E), taken: make([]bool, E),
		gs: make([]float32, groups), keep: make([]bool, groups), wsel: make([]float32, K),
		negInf: float32(math.Inf(-1)), perGroup: E / groups, topGroups: int(r.TopkGroups),
	}
}

// token routes the token of logits lg [E]: its experts to idx[:K], their
// weights to wt[:K].
func (ro *router) token(lg []float32, idx []int32, wt []float32) {
	ro.score(lg)
	for e := range ro.ch {
		ro.ch[e] = ro.sc[e]
		if ro.bias != nil {
			ro.ch[e] = ro.sc[e] + ro.bias[e]
		}
		ro.taken[e] = false
	}
	if ro.rule.Method != MethodGreedy {
		ro.maskGroups()
	}
	for k := 0; k < ro.K; k++ {
		bi := ro.best()
		ro.taken[bi] = true
		idx[k] = int32(bi)
		if ro.rule.Method == MethodGroupTop2 {
			ro.wsel[k] = ro.sc[bi]
		} else {
			ro.wsel[k] = ro.ch[bi]
		}
	}
	ro.weights(wt)
}

// score sets sc to the softmax (Scoring 0) or the sigmoids (1) of lg.
func (ro *router) score(lg []float32) {
	sc := ro.sc
	if ro.rule.Scoring == ScoreSigmoid {
		for e, v := range lg {
			sc[e] = 1 / (1 + expf(-v))
		}
		return
	}
	m := ro.negInf
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

// maskGroups scores the groups of perGroup experts (Method 1: the largest
// choice, 2: the sum of the two largest), keeps the topGroups best (ties:
// lower index) and zeroes the choices of the others.
func (ro *router) maskGroups() {
	per, ch := ro.perGroup, ro.ch
	for g := range ro.gs {
		x, y := ro.negInf, ro.negInf
		for _, v := range ch[g*per : (g+1)*per] {
			if v > x {
				x, y = v, x
			} else if v > y {
				y = v
			}
		}
		if ro.rule.Method == MethodGroupMax {
			ro.gs[g] = x
		} else {
			ro.gs[g] = x + y
		}
		ro.keep[g] = false
	}
	for r := 0; r < ro.topGroups; r++ {
		bv, bi := ro.negInf, -1
		for g, v := range ro.gs {
			if !ro.keep[g] && moeBetter(v, g, bv, bi) {
				bv, bi = v, g
			}
		}
		if bi >= 0 {
			ro.keep[bi] = true
		}
	}
	for e := range ch {
		if !ro.keep[e/per] {
			ch[e] = 0
		}
	}
}

// best returns the best expert not taken yet (0 if none beats -inf).
func (ro *router) best() int {
	bv, bi := ro.negInf, -1
	for e, v := range ro.ch {
		if !ro.taken[e] && moeBetter(v, e, bv, bi) {
			bv, bi = v, e
		}
	}
	return max(bi, 0)
}

// weights writes the chosen experts' weights to wt[:K]: divided by their sum
// plus NormEps with Norm, times Scale.
func (ro *router) weights(wt []float32) {
	var s float32
	norm := ro.rule.Norm != 0
	if norm {
		for _, v := range ro.wsel {
			s += v
		}
		s += ro.rule.NormEps
	}
	for k, v := range ro.wsel {
		if norm {
			v /= s
		}
		wt[k] = v * ro.rule.Scale
	}
}

func moePlan(m kernels.Memory, a *planArgs) error {
	TK, E := int(a.TK), int(a.E)
	if TK < 0 || E <= 0 || E > MaxExperts {
		return fmt.Errorf("TK=%d E=%d: want TK >= 0 and 0 < E <= %d", TK, E, MaxExperts)
	}
	idx, err := kernels.Slice[int32](m, "topk_idx", a.TopkIdx, int64(TK))
	if err != nil {
		return err
	}
	counts, err := kernels.Slice[int32](m, "counts", a.Counts, int64(E))
	if err != nil {
		return err
	}
	offsets, err := kernels.Slice[int32](m, "offsets", a.Offsets, int64(E)+1)
	if err != nil {
		return err
	}
	pos, err := kernels.Slice[int32](m, "pos", a.Pos, int64(TK))
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

func moeGather(m kernels.Memory, a *gatherArgs) error {
	TK, K, H, eb := int(a.TK), int(a.K), int(a.H), a.ElemBytes
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
	x, err := actView(m, "x", a.X, int64(T)*int64(H), bf)
	if err != nil {
		return err
	}
	pos, err := kernels.Slice[int32](m, "pos", a.Pos, int64(TK))
	if err != nil {
		return err
	}
	xp, err := actView(m, "xp", a.Xp, int64(TK)*int64(H), bf)
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

func moeSwiglu(m kernels.Memory, a *swigluArgs) error {
	rows, I, bf := int(a.Rows), int(a.I), a.BF16
	if rows < 0 || I <= 0 {
		return fmt.Errorf("rows=%d I=%d: want rows >= 0 and I > 0", rows, I)
	}
	h, err := actView(m, "h", a.H, int64(rows)*2*int64(I), bf)
	if err != nil {
		return err
	}
	act, err := actView(m, "act", a.Act, int64(rows)*int64(I), bf)
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

func moeCombine(m kernels.Memory, a *combineArgs) error {
	return combine(m, combineOp{
		out: a.Out, pos: a.Pos, w: a.W, shared: a.Shared, gate: a.Gate, y: a.Y,
		T: int(a.T), K: int(a.K), H: int(a.H),
		hasRouted: a.HasRouted != 0, hasShared: a.HasShared != 0, hasGate: a.HasGate != 0, bf: a.BF16,
	})
}

// combineOp is the work of gpuctx_moe_combine and gpuctx_moe_combine_rows;
// identity replaces pos by pos[i] = i (the routed rows of out are in
// assignment order).
type combineOp struct {
	out, pos, w, shared, gate, y            Ptr
	T, K, H                                 int
	hasRouted, hasShared, hasGate, identity bool
	bf                                      int32
}

func combine(m kernels.Memory, c combineOp) error {
	T, K, H := c.T, c.K, c.H
	if T < 0 || K < 0 || H <= 0 || (c.hasRouted && K == 0) {
		return fmt.Errorf("combine: T=%d K=%d H=%d: want T >= 0, H > 0 and K > 0 when routed", T, K, H)
	}
	var v combineViews
	var err error
	if v.y, err = actView(m, "y", c.y, int64(T)*int64(H), c.bf); err != nil {
		return err
	}
	if c.hasRouted {
		if err := c.routedViews(m, &v); err != nil {
			return err
		}
	}
	if c.hasShared {
		if v.shared, err = actView(m, "shared", c.shared, int64(T)*int64(H), c.bf); err != nil {
			return err
		}
		if c.hasGate {
			if v.gate, err = kernels.Slice[float32](m, "gate", c.gate, int64(T)); err != nil {
				return err
			}
		}
	}
	for t := 0; t < T; t++ {
		c.token(&v, t)
	}
	return nil
}

// combineViews are the memory a combine reads and writes; the parts c does
// not have are nil.
type combineViews struct {
	y, out, shared actSlice
	pos            []int32 // nil for identity
	w, gate        []float32
}

// routedViews sets v's routed rows, positions and weights, and checks the
// positions.
func (c combineOp) routedViews(m kernels.Memory, v *combineViews) error {
	T, K, H := c.T, c.K, c.H
	var err error
	if v.out, err = actView(m, "out", c.out, int64(T)*int64(K)*int64(H), c.bf); err != nil {
		return err
	}
	if !c.identity {
		if v.pos, err = kernels.Slice[int32](m, "pos", c.pos, int64(T)*int64(K)); err != nil {
			return err
		}
	}
	if v.w, err = kernels.Slice[float32](m, "w", c.w, int64(T)*int64(K)); err != nil {
		return err
	}
	for i, p := range v.pos {
		if int(p) >= T*K {
			return fmt.Errorf("pos[%d] = %d is outside the %d rows of out", i, p, T*K)
		}
	}
	return nil
}

// token writes token t's row of y: its routed rows (k ascending, pos -1
// skipped) weighted, plus the (gated) shared row.
func (c combineOp) token(v *combineViews, t int) {
	K, H := c.K, c.H
	sg := float32(1)
	if c.hasShared && c.hasGate {
		sg = 1 / (1 + expf(-v.gate[t]))
	}
	row := t * H
	for h := 0; h < H; h++ {
		var acc float32
		if c.hasRouted {
			for k := 0; k < K; k++ {
				p := t*K + k
				if !c.identity {
					p = int(v.pos[t*K+k])
				}
				if p >= 0 {
					acc += v.w[t*K+k] * v.out.load(p*H+h)
				}
			}
		}
		if c.hasShared {
			acc += sg * v.shared.load(row+h)
		}
		v.y.store(row+h, acc)
	}
}
