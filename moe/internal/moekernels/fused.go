package moekernels

import (
	"fmt"
	"slices"

	"github.com/gpuctx/gpuctx/kernels"
)

// The Go twins of the fused, graph-capturable routed-expert path:
// gpuctx_moe_align (a block-aligned stable sort of the assignments by expert,
// moe.cu), the grouped expert GEMMs of moe_gemm.cu (gpuctx_moe_up_<tag>,
// gpuctx_moe_down_<tag>, one per tile config of MoEGemms) and
// gpuctx_moe_combine_rows (gpuctx_moe_combine with the routed rows in
// assignment order). Same arithmetic as the CUDA kernels: f32 dot products in
// ascending order, gate and up rounded to bf16 before SwiGLU, bf16 stores
// rounded to nearest even. The tile shape changes no result, so every config
// shares one Go body parameterised by its BM.

func roundUp(n, m int) int { return (n + m - 1) / m * m }

// moeRouteAlign is gpuctx_moe_route_align: the router logits (bf16 x [T,H]
// times bf16 router [E,H], f32 sums in ascending h), then the route and the
// align twins on them, with the arguments the CUDA kernel passes them, and
// with QuantX the quantizer's twin of x into Xq and Xs. The ticket is left
// as the kernel leaves it: 0.
func moeRouteAlign(m kernels.Memory, a *routeAlignArgs) error {
	T, H, E := a.T, a.H, a.E
	ks, ns := a.Ks, a.Ns
	if T < 0 || H <= 0 || H%8 != 0 || E <= 0 || E > MaxExperts || int(T)*int(E) > RouteAlignMaxDots {
		return fmt.Errorf("route_align: T=%d H=%d E=%d: want T >= 0, H > 0 a multiple of 8, 0 < E <= %d, T*E <= %d",
			T, H, E, MaxExperts, RouteAlignMaxDots)
	}
	ticket, err := kernels.Slice[uint32](m, "ticket", a.Ticket, 1)
	if err != nil {
		return err
	}
	if ticket[0] != 0 {
		return fmt.Errorf("route_align: ticket is %d, want 0 (zero it once before the first launch)", ticket[0])
	}
	x, err := kernels.Slice[uint16](m, "x", a.X, int64(T)*int64(H))
	if err != nil {
		return err
	}
	router, err := kernels.Slice[uint16](m, "router", a.Router, int64(E)*int64(H))
	if err != nil {
		return err
	}
	logits, err := kernels.Slice[float32](m, "logits", a.Logits, int64(T)*int64(E))
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
	if a.QuantX != 0 {
		if err := moeFP8Quant(m, &fp8QuantArgs{X: a.X, Codes: a.Xq, Scales: a.Xs, R: T, K: H}); err != nil {
			return fmt.Errorf("route_align: %w", err)
		}
	}
	if err := moeRoute(m, &routeArgs{
		Logits: a.Logits, Bias: a.Bias, TopkIdx: a.TopkIdx, TopkW: a.TopkW, T: T, E: E,
		K: a.K, Rule: a.Rule, Ks: ks, Ns: ns,
	}); err != nil {
		return err
	}
	return moeAlign(m, &alignArgs{
		TopkIdx: a.TopkIdx, Sorted: a.Sorted, BlockExpert: a.BlockExpert, Npost: a.Npost,
		TK: T * ks, E: E + ns, BM: a.BM, Cap: a.Cap, First: routeAlignFirst(E, ns),
	})
}

// routeAlignFirst is the first segment of gpuctx_moe_route_align's sort over
// E routed experts and ns shared chunks: the chunks E..E+ns-1 when there are
// any.
func routeAlignFirst(E, ns int32) int32 {
	if ns > 0 {
		return E
	}
	return 0
}

// alignSegments lays out the aligned sort's segments for counts[e]
// assignments of each expert e: in segment order (first, first+1, ..., E-1,
// 0, ..., first-1; moe_seg_pos of moe.cu), each rounded up to BM rows. Expert
// e's rows are [starts[e], ends[e]); total is the padded row count (npost).
func alignSegments(counts []int, first, BM int) (starts, ends []int, total int) {
	E := len(counts)
	starts, ends = make([]int, E), make([]int, E)
	for i := range E {
		e := (first + i) % E
		starts[e] = total
		total += roundUp(counts[e], BM)
		ends[e] = total
	}
	return starts, ends, total
}

// fillBlocks writes the block experts of the segments [starts[e], ends[e])
// and -1 in every other block.
func fillBlocks(blockExpert []int32, starts, ends []int, BM int) {
	for b := range blockExpert {
		blockExpert[b] = -1
	}
	for e := range starts {
		for b := starts[e] / BM; b < ends[e]/BM; b++ {
			blockExpert[b] = int32(e)
		}
	}
}

// alignOutputs returns the outputs of an align kernel: sorted [cap],
// block_expert [cap/BM] and npost [1].
func alignOutputs(m kernels.Memory, sp, bp, npp Ptr, cp, BM int) (sorted, blockExpert, np []int32, err error) {
	if sorted, err = kernels.Slice[int32](m, "sorted", sp, int64(cp)); err != nil {
		return nil, nil, nil, err
	}
	if blockExpert, err = kernels.Slice[int32](m, "block_expert", bp, int64(cp/BM)); err != nil {
		return nil, nil, nil, err
	}
	if np, err = kernels.Slice[int32](m, "npost", npp, 1); err != nil {
		return nil, nil, nil, err
	}
	return sorted, blockExpert, np, nil
}

func moeAlign(m kernels.Memory, a *alignArgs) error {
	TK, E, BM, cp, first := int(a.TK), int(a.E), int(a.BM), int(a.Cap), int(a.First)
	if TK < 0 || E <= 0 || E > MaxExperts || BM <= 0 || cp < 0 || cp%BM != 0 || first < 0 || first >= E {
		return fmt.Errorf("align: TK=%d E=%d BM=%d cap=%d first=%d: want TK >= 0, 0 < E <= %d, BM > 0, cap >= 0 a multiple of BM, 0 <= first < E",
			TK, E, BM, cp, first, MaxExperts)
	}
	idx, err := kernels.Slice[int32](m, "topk_idx", a.TopkIdx, int64(TK))
	if err != nil {
		return err
	}
	counts := make([]int, E)
	for _, e := range idx {
		if e >= 0 && int(e) < E {
			counts[e]++
		}
	}
	starts, ends, npost := alignSegments(counts, first, BM) // starts[e]: then the next free row of expert e
	if cp < npost {
		return fmt.Errorf("align: cap=%d < %d, the padded rows of %d assignments in blocks of BM=%d", cp, npost, TK, BM)
	}
	sorted, blockExpert, np, err := alignOutputs(m, a.Sorted, a.BlockExpert, a.Npost, cp, BM)
	if err != nil {
		return err
	}
	for i := range sorted {
		sorted[i] = int32(TK)
	}
	fillBlocks(blockExpert, starts, ends, BM)
	for i, e := range idx {
		if e >= 0 && int(e) < E {
			sorted[starts[e]] = int32(i)
			starts[e]++
		}
	}
	np[0] = int32(npost)
	return nil
}

// AlignChunk is the assignments per block of the three-launch align
// (gpuctx_moe_align_count, _scan, _scatter): MOE_ALIGN_CHUNK of moe.cu.
const AlignChunk = 2048

// AlignBlocks is the number of chunks (blocks) the three-launch align uses for
// TK assignments.
func AlignBlocks(TK int) int { return max((TK+AlignChunk-1)/AlignChunk, 1) }

// moeAlignCount is gpuctx_moe_align_count: per-chunk expert counts.
func moeAlignCount(m kernels.Memory, a *alignCountArgs) error {
	TK, E := int(a.TK), int(a.E)
	if TK < 0 || E <= 0 || E > MaxExperts {
		return fmt.Errorf("align_count: TK=%d E=%d: want TK >= 0, 0 < E <= %d", TK, E, MaxExperts)
	}
	nb := AlignBlocks(TK)
	idx, err := kernels.Slice[int32](m, "topk_idx", a.TopkIdx, int64(TK))
	if err != nil {
		return err
	}
	bcnt, err := kernels.Slice[int32](m, "bcnt", a.Bcnt, int64(nb*E))
	if err != nil {
		return err
	}
	clear(bcnt)
	for i, e := range idx {
		if e >= 0 && int(e) < E {
			bcnt[i/AlignChunk*E+int(e)]++
		}
	}
	return nil
}

// moeAlignScan is gpuctx_moe_align_scan: chunk offsets, padding, block
// experts and npost.
func moeAlignScan(m kernels.Memory, a *alignScanArgs) error {
	TK, E, BM, cp, nb, first := int(a.TK), int(a.E), int(a.BM), int(a.Cap), int(a.NB), int(a.First)
	if TK < 0 || E <= 0 || E > MaxExperts || BM <= 0 || cp < 0 || cp%BM != 0 || nb <= 0 || first < 0 || first >= E {
		return fmt.Errorf("align_scan: TK=%d E=%d BM=%d cap=%d nb=%d first=%d: want TK >= 0, 0 < E <= %d, BM > 0, cap >= 0 a multiple of BM, nb > 0, 0 <= first < E",
			TK, E, BM, cp, nb, first, MaxExperts)
	}
	bcnt, err := kernels.Slice[int32](m, "bcnt", a.Bcnt, int64(nb*E))
	if err != nil {
		return err
	}
	boff, err := kernels.Slice[int32](m, "boff", a.Boff, int64(nb*E))
	if err != nil {
		return err
	}
	sorted, blockExpert, np, err := alignOutputs(m, a.Sorted, a.BlockExpert, a.Npost, cp, BM)
	if err != nil {
		return err
	}
	counts := make([]int, E)
	for e := range E {
		for b := range nb {
			boff[b*E+e] = int32(counts[e])
			counts[e] += int(bcnt[b*E+e])
		}
	}
	starts, ends, total := alignSegments(counts, first, BM)
	if total > cp {
		np[0] = -1
		return nil
	}
	for i := range sorted {
		sorted[i] = int32(TK)
	}
	fillBlocks(blockExpert, starts, ends, BM)
	for e := range E {
		for b := range nb {
			boff[b*E+e] += int32(starts[e])
		}
	}
	np[0] = int32(total)
	return nil
}

// moeAlignScatter is gpuctx_moe_align_scatter: the rows of each chunk's
// routed assignments, in increasing order within an expert.
func moeAlignScatter(m kernels.Memory, a *alignScatterArgs) error {
	TK, E := int(a.TK), int(a.E)
	if TK < 0 || E <= 0 || E > MaxExperts {
		return fmt.Errorf("align_scatter: TK=%d E=%d: want TK >= 0, 0 < E <= %d", TK, E, MaxExperts)
	}
	nb := AlignBlocks(TK)
	np, err := kernels.Slice[int32](m, "npost", a.Npost, 1)
	if err != nil {
		return err
	}
	if np[0] < 0 {
		return nil
	}
	idx, err := kernels.Slice[int32](m, "topk_idx", a.TopkIdx, int64(TK))
	if err != nil {
		return err
	}
	boff, err := kernels.Slice[int32](m, "boff", a.Boff, int64(nb*E))
	if err != nil {
		return err
	}
	sorted, err := kernels.Slice[int32](m, "sorted", a.Sorted, int64(np[0]))
	if err != nil {
		return err
	}
	next := slices.Clone(boff)
	for i, e := range idx {
		if e >= 0 && int(e) < E {
			r := &next[i/AlignChunk*E+int(e)]
			if int(*r) >= len(sorted) {
				return fmt.Errorf("align_scatter: row %d of assignment %d past npost %d", *r, i, np[0])
			}
			sorted[*r] = int32(i)
			*r++
		}
	}
	return nil
}

// fusedPlan reads the output of gpuctx_moe_align for blocks of BM rows: the
// sorted rows and block experts of the blocks below npost[0]. It checks that
// the rows of the blocks with an expert hold assignments in [0, TK] (TK is
// padding) and returns the largest expert seen (-1 if none).
func fusedPlan(m kernels.Memory, sp, bp, npp Ptr, BM, TK int) (sorted, blockExpert []int32, rows, maxE int, err error) {
	np, err := kernels.Slice[int32](m, "npost", npp, 1)
	if err != nil {
		return nil, nil, 0, 0, err
	}
	if np[0] < 0 {
		return nil, nil, 0, 0, fmt.Errorf("npost = %d < 0", np[0])
	}
	nb := (int(np[0]) + BM - 1) / BM
	rows = nb * BM
	if sorted, err = kernels.Slice[int32](m, "sorted", sp, int64(rows)); err != nil {
		return nil, nil, 0, 0, err
	}
	if blockExpert, err = kernels.Slice[int32](m, "block_expert", bp, int64(nb)); err != nil {
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

// sharedRowsFirst checks what the CUDA up kernel assumes when ns > 0
// (moe_shared_rows of moe_tile.cuh): the sort's first ns*RT rows (RT = T =
// TK/K rounded up to BM) are the fused shared chunks E0..E0+ns-1, chunk c's
// rows c*RT+j holding token j's assignment (j < T) or padding. The kernel
// computes those rows without reading the sort; a sort that put them
// elsewhere would make it write wrong act rows, so the twin refuses it.
func sharedRowsFirst(sorted, blockExpert []int32, BM, TK, K, E0, ns int) error {
	if ns < 0 || E0 < 0 || (ns > 0 && TK%K != 0) {
		return fmt.Errorf("moe_up: E0=%d ns=%d TK=%d K=%d: want E0, ns >= 0 and TK a multiple of K when ns > 0", E0, ns, TK, K)
	}
	if ns == 0 {
		return nil
	}
	T := TK / K
	rt := roundUp(T, BM)
	if ns*rt > len(sorted) {
		return fmt.Errorf("moe_up: the sort has %d rows, fewer than the %d of the %d fused shared chunks", len(sorted), ns*rt, ns)
	}
	for c := range ns {
		for j := range rt {
			p := c*rt + j
			if e := blockExpert[p/BM]; int(e) != E0+c {
				return fmt.Errorf("moe_up: block %d is expert %d, want the fused shared chunk %d (sort them first: align with first = E0)", p/BM, e, E0+c)
			}
			if s := int(sorted[p]); j < T && s/K != j {
				return fmt.Errorf("moe_up: sorted[%d] = %d, want token %d's assignment to fused shared chunk %d (sort the chunks first: align with first = E0)", p, s, j, c)
			} else if j >= T && s < TK {
				return fmt.Errorf("moe_up: sorted[%d] = %d, want padding (TK = %d) after fused shared chunk %d's %d tokens", p, s, TK, c, T)
			}
		}
	}
	return nil
}

func moeFusedUp(m kernels.Memory, a *upArgs, BM int) error {
	TK, K, H, I := int(a.TK), int(a.K), int(a.H), int(a.I)
	if TK < 0 || K <= 0 || H <= 0 || I <= 0 || H%8 != 0 || I%8 != 0 {
		return fmt.Errorf("moe_up: TK=%d K=%d H=%d I=%d: want TK >= 0, K > 0 and H, I positive multiples of 8", TK, K, H, I)
	}
	sorted, blockExpert, rows, maxE, err := fusedPlan(m, a.Sorted, a.BlockExpert, a.Npost, BM, TK)
	if err != nil {
		return err
	}
	if err := sharedRowsFirst(sorted, blockExpert, BM, TK, K, int(a.E0), int(a.Ns)); err != nil {
		return err
	}
	T := (TK + K - 1) / K
	x, err := kernels.Slice[uint16](m, "x", a.X, int64(T)*int64(H))
	if err != nil {
		return err
	}
	gu, err := kernels.Slice[uint16](m, "gu", a.Gu, int64(maxE+1)*2*int64(I)*int64(H))
	if err != nil {
		return err
	}
	act, err := kernels.Slice[uint16](m, "act", a.Act, int64(rows)*int64(I))
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

func moeFusedDown(m kernels.Memory, a *downArgs, BM int) error {
	TK, H, I := int(a.TK), int(a.H), int(a.I)
	if TK < 0 || H <= 0 || I <= 0 || H%8 != 0 || I%8 != 0 {
		return fmt.Errorf("moe_down: TK=%d H=%d I=%d: want TK >= 0 and H, I positive multiples of 8", TK, H, I)
	}
	sorted, blockExpert, rows, maxE, err := fusedPlan(m, a.Sorted, a.BlockExpert, a.Npost, BM, TK)
	if err != nil {
		return err
	}
	act, err := kernels.Slice[uint16](m, "act", a.Act, int64(rows)*int64(I))
	if err != nil {
		return err
	}
	down, err := kernels.Slice[uint16](m, "down", a.Down, int64(maxE+1)*int64(H)*int64(I))
	if err != nil {
		return err
	}
	out, err := kernels.Slice[uint16](m, "out", a.Out, int64(TK)*int64(H))
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

func moeCombineRows(m kernels.Memory, a *combineRowsArgs) error {
	return combine(m, combineOp{
		out: a.Out, w: a.W, shared: a.Shared, gate: a.Gate, y: a.Y,
		T: int(a.T), K: int(a.K), H: int(a.H),
		hasRouted: a.HasRouted != 0, hasShared: a.HasShared != 0, hasGate: a.HasGate != 0, bf: a.BF16,
		identity: true,
	})
}
