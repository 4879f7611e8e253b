// Package moekernels registers the Mixture-of-Experts kernels that package moe
// drives: their CUDA C sources (moe.cu, moe_gemm.cu, moe_wgmma.cu,
// moe_fp8_mma.cu, moe_w8a8.cu, embedded here), their Go twins (the CPU backend runs them), their typed arguments (one
// struct per kernel, whose fields are the launch arguments in order: args.go),
// the typed launchers package moe queues them with (Launcher: NewLauncher,
// NewUp, NewDown) and their limits (MaxExperts, MaxTopK: the CUDA source gets
// them as #define through a generated prelude). Registration happens in init,
// through package kernels; the backends hold no MoE code.
//
// The kernels take int32 dimensions and flags (0/1), and some need a fixed
// launch shape. Row counts and most element offsets are 32-bit; those whose
// products can pass 2^31 for a batch moe.Config.CheckTokens accepts are
// 64-bit, and CheckLimits bounds the rest (limits.go). "act" pointers hold f32, or bf16 bits when bf16 = 1
// (elem_bytes 4 or 2); all math is f32 with a fixed summation order, bf16
// stores round to nearest even. E <= MaxExperts experts, K <= MaxTopK per
// token. Launch arguments are passed in the order listed:
//
//	gpuctx_moe_route    (logits, bias, topk_idx, topk_w hal.Ptr, T, E, K, scoring, method,
//	                     groups, topk_groups, has_bias, norm int32, norm_eps, scale float32,
//	                     ks, ns int32)
//	    per token: scores = softmax (scoring 0) or sigmoid (1) of logits [T,E] f32;
//	    choice = scores + bias[E] f32 if has_bias; method 1 (group_limited_greedy):
//	    group score = max choice, method 2 (noaux_tc): sum of the top 2; keep
//	    topk_groups groups, other choices = 0; top-K of choice (ties: lower index)
//	    -> topk_idx [T,K] i32; weight = score (method 2) or choice, / (sum+norm_eps)
//	    if norm, * scale -> topk_w [T,K] f32. Rows have stride ks >= K+ns; slots
//	    K..K+ns-1 get the shared experts E..E+ns-1 with weight 1. Block (32,1,1), any grid.
//	gpuctx_moe_plan     (topk_idx, counts, offsets, pos hal.Ptr, TK, E int32)
//	    stable counting sort of TK assignments by expert: counts [E], offsets
//	    [E+1] (exclusive prefix), pos [TK] = row of assignment t*K+k (-1 if its
//	    expert is out of range). Grid (1,1,1), block (256,1,1).
//	gpuctx_moe_gather   (x, pos, xp hal.Ptr, TK, K, H, elem_bytes int32)
//	    xp[pos[a], :] = x[a/K, :] for rows of H elements. Any grid and block.
//	gpuctx_moe_swiglu   (h, act hal.Ptr, rows, I, bf16 int32)
//	    act[r,i] = silu(h[r,i]) * h[r,I+i], h [rows,2I] -> act [rows,I]. Any shape.
//	gpuctx_moe_combine  (out, pos, w, shared, gate, y hal.Ptr, T, K, H, has_routed,
//	                     has_shared, has_gate, bf16 int32)
//	    y[t,:] = sum_k w[t,k]*out[pos[t,k],:] (k ascending, pos -1 skipped) +
//	    sigmoid(gate[t]) (or 1 without has_gate) * shared[t,:]; gate f32 [T].
//	    Pointers of absent parts are not read. Any grid and block.
//	gpuctx_moe_expert_up   (xp, gu, counts, offsets, act hal.Ptr, E, H, I, bf16 int32)
//	    for each expert e and row r of its plan rows: act[r,i] = silu(g)*u with
//	    g = xp[r,:].gu[e,i,:], u = xp[r,:].gu[e,I+i,:], both rounded to the dtype.
//	    H, I multiples of 8. Grid (ceil(I/8), E), block 256.
//	gpuctx_moe_expert_down (act, down, counts, offsets, out hal.Ptr, E, H, I, bf16 int32)
//	    out[r,h] = act[r,:].down[e,h,:] for each expert's plan rows. Grid
//	    (ceil(H/8), E), block 256.
//
// The fused routed path (graph-capturable: no host round trip) sorts the
// assignments into blocks of BM rows per expert, runs the grouped expert GEMMs
// of moe_gemm.cu on them (gpuctx_moe_up_<tag>, gpuctx_moe_down_<tag>, one pair
// per tile config; see MoEGemm) and combines the rows in assignment order:
//
//	gpuctx_moe_align    (topk_idx, sorted, block_expert, npost hal.Ptr, TK, E, BM, cap, first int32)
//	    stable sort of the TK assignments (topk_idx [TK] i32; out-of-range experts
//	    skipped) into per-expert segments, experts in order from first (0 <=
//	    first < E) wrapping round to first-1 (FusedShared: the shared chunks
//	    first), each padded to a
//	    multiple of BM rows (empty experts get none): sorted [cap] = assignment
//	    of each row, TK for padding and for every row from npost to cap;
//	    block_expert [cap/BM] = expert of each block, -1 from npost/BM on;
//	    npost [1] = padded row count. E <= MaxExperts, cap a multiple of BM and
//	    at least npost; size it roundup(TK + min(E,TK)*(BM-1), BM). Grid
//	    (1,1,1), block (512,1,1).
//	gpuctx_moe_align_count (topk_idx, bcnt hal.Ptr, TK, E int32)
//	gpuctx_moe_align_scan  (bcnt, boff, sorted, block_expert, npost hal.Ptr, TK, E, BM, cap, nb, first int32)
//	gpuctx_moe_align_scatter (topk_idx, boff, npost, sorted hal.Ptr, TK, E int32)
//	    gpuctx_moe_align in three launches for large TK (same outputs): nb =
//	    AlignBlocks(TK) chunks of AlignChunk assignments; count writes bcnt
//	    [nb, E] (grid nb), scan writes boff [nb, E] (each chunk's first row per
//	    expert), sorted padding, block_expert and npost (grid 1), scatter
//	    writes the routed rows (grid nb). Block (512,1,1) each.
//	gpuctx_moe_route_align (x, router, bias, logits, topk_idx, topk_w, sorted,
//	                     block_expert, npost, ticket hal.Ptr, T, H, E, K, scoring,
//	                     method, groups, topk_groups, has_bias, norm int32,
//	                     norm_eps, scale float32, ks, ns, BM, cap int32,
//	                     xq, xs hal.Ptr, quant_x int32)
//	    the router logits (bf16 x [T,H] times bf16 router [E,H], f32 sums) ->
//	    logits, then gpuctx_moe_route and gpuctx_moe_align on them (the align
//	    over T*ks assignments of E+ns experts, first = E when ns > 0). T*E <= RouteAlignMaxDots. Every
//	    block computes logits (one warp each, the same sums whatever the grid);
//	    the last block to finish, found with a ticket (uint32, 0 before the
//	    first launch, left 0 by every launch), routes (a warp per token) and
//	    sorts. With quant_x != 0 the blocks also quantize x for the w8a8
//	    tiles into xq [T,H] codes and xs [T,ceil(H/128)] scales, as
//	    gpuctx_moe_fp8_quant would (sm_89 and later; elsewhere the kernel
//	    writes nothing). Grid (RouteAlignBlocks(T*E),1,1), block (512,1,1),
//	    dynamic shared memory RouteAlignSmem(T, E) bytes.
//	gpuctx_moe_combine_rows (out, w, shared, gate, y hal.Ptr, T, K, H, has_routed,
//	                     has_shared, has_gate, bf16 int32)
//	    gpuctx_moe_combine with pos[t,k] = t*K+k: y[t,:] = sum_k w[t,k]*out[t*K+k,:]
//	    + sigmoid(gate[t]) (or 1) * shared[t,:]. Any grid and block.
//
// The FP8 expert GEMMs run on the same aligned sort: FP8Gemm's w8a16 tiles
// (moe_fp8_mma.cu: bf16 activations, E4M3 weights with 128x128 block
// scales) and, on compute capability 9.0 only, W8A8Gemm's w8a8 tiles
// (moe_w8a8.cu: wgmma e4m3 x e4m3) over activations quantized per row per
// 128 columns by gpuctx_moe_fp8_quant (FP8QuantName): quantize x [T,H], up
// tile into act, quantize act [cap,I], down tile into out. Every one of
// these kernels runs on the stream it is launched on, may be launched early
// and calls MOE_GRID_WAIT before it touches memory the kernels ahead of it
// write (the sort, x, act); each output sums its 128-column K blocks in
// increasing order, acc = acc + p*s with p the block's f32 tensor-core sum
// and s its scales' product (w8a8: sa*sb; w8a16: sb), no FMA, as the twins
// do; the tensor core's order within a block is the one part the twins
// match only for exactly summable data (see the two .cu files' headers).
//
// The Go twins compute the same results with the same arithmetic (f32 math,
// fixed summation orders, bf16 stores rounded to nearest even), up to f32
// rounding of exp and of the order of the softmax sum; the integer outputs
// match exactly. Grid and block are ignored.
package moekernels

import (
	_ "embed"
	"fmt"
	"sync"

	"github.com/gpuctx/gpuctx/kernels"
)

// Limits of the kernels, the one place they are written: moe.cu gets them
// through Prelude, the Go twins and package moe (moe.MaxExperts,
// moe.MaxTopK) use these constants.
const (
	// MaxExperts bounds the experts of a layer (routed plus shared slots for
	// gpuctx_moe_align): shared-memory arrays of the route and align kernels.
	MaxExperts = 512
	// MaxTopK bounds the experts per token, and the shared-expert slots
	// gpuctx_moe_route may append.
	MaxTopK = 16
	// RouteAlignMaxDots bounds T*E, the router logits of one
	// gpuctx_moe_route_align (its last block keeps them in shared memory).
	RouteAlignMaxDots = 2048
)

// RouteAlignBlocks is the grid of gpuctx_moe_route_align for dots = T*E
// router logits: one warp per logit, 16 warps per block.
func RouteAlignBlocks(dots int) int { return max((dots+15)/16, 1) }

// RouteAlignSmem is the dynamic shared memory of gpuctx_moe_route_align for T
// tokens over E routed experts (moe_ra_smem of moe.cu): min(T, 16) routing
// warps' arrays and the small sort's, or the align's counters if larger
// (they are for every T*E <= RouteAlignMaxDots). It is under 48 KiB.
func RouteAlignSmem(T, E int) int {
	const alignWarps = 16 // MOE_ALIGN_WARPS
	const smallTK = 128   // MOE_RA_SMALL_TK
	rw := min(max(T, 1), alignWarps)
	route := rw*((9*E+15)/16*16) + 4*(smallTK+2*MaxExperts+1)
	return max(route, alignWarps*MaxExperts*4+(MaxExperts+1)*4)
}

// File names of the sources: moe.cu is registered as it is, the two GEMM
// families once per tile (MoEGemm.File, TileSource).
const (
	RouteFile = "moe.cu"
	GemmFile  = "moe_gemm.cu"
	WgmmaFile = "moe_wgmma.cu"
)

//go:embed moe.cu
var routeSource string

//go:embed moe_gemm.cu
var gemmSource string

//go:embed moe_wgmma.cu
var wgmmaSource string

//go:embed moe_tile.cuh
var tileSource string

// Prelude is the generated head of moe.cu: the limits as #define.
func Prelude() string {
	return fmt.Sprintf("// ---- Generated by moekernels.Prelude from moekernels.MaxExperts, MaxTopK and RouteAlignMaxDots.\n"+
		"#define MOE_MAX_E %d\n#define MOE_MAX_K %d\n#define MOE_RA_MAX_DOTS %d\n\n", MaxExperts, MaxTopK, RouteAlignMaxDots)
}

// gridDeps is the head of every file: MOE_GRID_WAIT() and MOE_GRID_LAUNCH(),
// the two halves of a programmatic dependent launch (gpuctx.Stream.LaunchEarly)
// on sm_90 and later, and nothing before. A kernel that may be launched early
// calls MOE_GRID_WAIT() before it reads what the kernels ahead of it on its
// stream write (it returns when they have completed and their writes are
// visible), and MOE_GRID_LAUNCH() after it, so that the kernel behind it may be
// scheduled while this one runs. Launched normally, both do nothing.
const gridDeps = `// ---- Programmatic dependent launch (moekernels.gridDeps).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MOE_GRID_WAIT() asm volatile("griddepcontrol.wait;\n" ::: "memory")
#define MOE_GRID_LAUNCH() asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory")
#else
#define MOE_GRID_WAIT() do { } while (0)
#define MOE_GRID_LAUNCH() do { } while (0)
#endif

`

// earlyKernels are the kernels of moe.cu that call MOE_GRID_WAIT() before
// they touch memory.
var earlyKernels = []string{
	"gpuctx_moe_route", "gpuctx_moe_align", "gpuctx_moe_align_count", "gpuctx_moe_align_scan",
	"gpuctx_moe_align_scatter", "gpuctx_moe_route_align", "gpuctx_moe_combine_rows",
}

// WaitsFirst reports whether kernel name waits for the kernels ahead of it on
// its stream (MOE_GRID_WAIT()) before it touches memory, so that it may be
// queued with gpuctx.Stream.LaunchEarly: the routing, sorting and row-combine
// kernels of the fused path and every expert GEMM tile of MoEGemms.
func WaitsFirst(name string) bool { return waitsFirst()[name] }

var waitsFirst = sync.OnceValue(func() map[string]bool {
	m := make(map[string]bool)
	for _, n := range earlyKernels {
		m[n] = true
	}
	for _, c := range MoEGemms {
		m[c.UpName()], m[c.DownName()] = true, true
	}
	for _, c := range FP8Gemms { // moe_tile_begin: MOE_GRID_WAIT before the sort is read
		m[c.UpName()], m[c.DownName()] = true, true
	}
	m[FP8QuantName] = true // MOE_GRID_WAIT first
	for _, c := range W8A8Gemms {
		m[c.Name()] = true
	}
	return m
})

// RouteSource returns moe.cu as it is compiled: Prelude, the
// grid-dependency macros and the activation quantizer (moe_quant.cuh), then
// the file.
func RouteSource() string { return Prelude() + gridDeps + quantSource + routeSource }

// GemmSource returns moe_gemm.cu with every mma.sync tile: the
// grid-dependency macros, moe_tile.cuh (shared with moe_wgmma.cu), the file,
// then the extern "C" instances of its templates for every config of
// MoEGemms. No unit compiles it whole (see TileSource); tests scan it.
func GemmSource() string { return gridDeps + tileSource + gemmSource + moeGemmInstances() }

// WgmmaSource returns moe_wgmma.cu with every warpgroup tile: the
// grid-dependency macros, moe_tile.cuh, the file, then its generated wgmma
// wrappers and the instances of every warpgroup tile. No unit compiles it
// whole (see TileSource); tests scan it.
func WgmmaSource() string { return gridDeps + tileSource + wgmmaSource + wgmmaInstances(MoEGemms) }

// TileSource returns the compilation unit of tile c, registered as c.File():
// the text of its family (GemmSource or WgmmaSource) with only c's instances
// (and the wgmma widths c uses). NVRTC takes seconds per unit and most of a
// whole family's time went to the ~35 instances a run never launches: a run
// compiles the units of the tiles it uses, and the tuner the candidates it
// times, in parallel (moe's tuner requests them concurrently).
func TileSource(c MoEGemm) string {
	if c.Warpgroups > 0 {
		return gridDeps + tileSource + wgmmaSource + wgmmaInstances([]MoEGemm{c})
	}
	return gridDeps + tileSource + gemmSource + gemmInstancesHead + gemmInstance(c)
}

func init() {
	kernels.Register(kernels.Source{File: RouteFile, Text: RouteSource(), Kernels: []kernels.Kernel{
		kernels.Twin("gpuctx_moe_route", moeRoute),
		kernels.Twin("gpuctx_moe_plan", moePlan),
		kernels.Twin("gpuctx_moe_gather", moeGather),
		kernels.Twin("gpuctx_moe_swiglu", moeSwiglu),
		kernels.Twin("gpuctx_moe_combine", moeCombine),
		kernels.Twin("gpuctx_moe_expert_up", moeExpertUp),
		kernels.Twin("gpuctx_moe_expert_down", moeExpertDown),
		kernels.Twin("gpuctx_moe_align", moeAlign),
		kernels.Twin("gpuctx_moe_align_count", moeAlignCount),
		kernels.Twin("gpuctx_moe_align_scan", moeAlignScan),
		kernels.Twin("gpuctx_moe_align_scatter", moeAlignScatter),
		kernels.Twin("gpuctx_moe_route_align", moeRouteAlign),
		kernels.Twin("gpuctx_moe_combine_rows", moeCombineRows),
	}})
	for _, c := range MoEGemms {
		kernels.Register(tileUnit(c))
	}
}

// tileUnit is the registration of tile c's compilation unit: TileSource and
// the Go twins of its kernels (the tile shape changes no result: one body
// per BM); a warpgroup tile compiles for compute capability 9.0 only.
func tileUnit(c MoEGemm) kernels.Source {
	bm := c.BM
	var ks []kernels.Kernel
	if c.HasUp() {
		ks = append(ks, kernels.Twin(c.UpName(), func(m kernels.Memory, a *upArgs) error { return moeFusedUp(m, a, bm) }))
	}
	ks = append(ks, kernels.Twin(c.DownName(), func(m kernels.Memory, a *downArgs) error { return moeFusedDown(m, a, bm) }))
	s := kernels.Source{File: c.File(), Text: TileSource(c), Kernels: ks}
	if c.Warpgroups > 0 {
		s.Archs = []int{90}
	}
	return s
}
