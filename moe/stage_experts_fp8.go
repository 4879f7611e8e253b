package moe

import (
	"fmt"
	"runtime"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/moe/fp8"
	"github.com/gpuctx/gpuctx/moe/internal/moekernels"
	"golang.org/x/sync/errgroup"
)

// fp8Experts is the FP8 form of the routed experts (LayerOptions.FP8): their
// weights as E4M3 codes with the float32 scale_inv of every 128x128 block
// beside them, never expanded to bf16 in device memory, and the launchers of
// the tiles that read them, on the fused path's aligned sort as the bf16
// tiles run:
//
//   - w8a16 (moe_fp8_mma.cu, moekernels.FP8Gemm): bf16 activations, the codes
//     converted in registers (mma.sync); the rule's tiles below w8a8MinRows
//     rows per touched expert.
//   - w8a8 (moe_w8a8.cu, moekernels.W8A8Gemm; compute capability 9.0, and the
//     CPU backend's twins): x and act quantized per token per 128 columns
//     (gpuctx_moe_fp8_quant) into the expert stage's xq/xs and aq/as, E4M3 x
//     E4M3 wgmma: transposed tiles for a few rows per expert (bytes-bound),
//     64- and 128-row tiles for the compute-bound batches. Not loaded for
//     LayerOptions.FP8WeightOnly.
//
// Which tiles a batch runs is timed per token bucket where the layer
// autotunes (tuneFP8), else picked by a rule (fp8Tiles).
//
// act and out stay bf16 in the expert stage's scratch. Layout, for routed
// experts [lo, hi) at index e-lo, and after them the ns chunks of the shared
// expert that FusedShared runs as experts hi-lo .. hi-lo+ns-1
// (uploadShared), E' = hi-lo+ns:
//
//	gu    [E'][2I][H] codes (gate rows, then up rows)
//	gus   [E'][2][ceil(I/128)][ceil(H/128)] f32 (the gate's, then the up's)
//	down  [E'][H][I] codes
//	downs [E'][ceil(H/128)][ceil(I/128)] f32
type fp8Experts struct {
	gu, gus, down, downs *gpuctx.Buffer
	kUp                  map[moekernels.FP8Gemm]moekernels.Launcher[moekernels.FP8Up]
	kDown                map[moekernels.FP8Gemm]moekernels.Launcher[moekernels.FP8Down]
	// w8 reports that the w8a8 kernels below are loaded: a CUDA device of
	// compute capability 9.0, or the CPU backend (the twins).
	w8 bool
	// quantInRoute lets the one-launch routing quantize x for the w8a8
	// tiles (Layer.xQuantInRoute); set with w8. Tests clear it to compare
	// with the quantizer launch it replaces.
	quantInRoute bool
	kQuant       moekernels.Launcher[moekernels.FP8Quant]
	kW8Up        map[moekernels.W8A8Gemm]moekernels.Launcher[moekernels.W8A8Up]
	kW8Down      map[moekernels.W8A8Gemm]moekernels.Launcher[moekernels.W8A8Down]
}

// fp8Pair is the FP8 tiles of a forward: the w8a16 tile of the up and of the
// down kernel (the same BM: they share the sort), or with w8 the w8a8 tiles
// w8up and w8down (the same BM) and up, down unused.
type fp8Pair struct {
	up, down     moekernels.FP8Gemm
	w8           bool
	w8up, w8down moekernels.W8A8Gemm
}

// bm is the tile rows of the pair's kernels, the sort's BM.
func (tp fp8Pair) bm() int {
	if tp.w8 {
		return tp.w8up.BM
	}
	return tp.up.BM
}

// tags names the pair's tiles, e.g. "w8a16 m16n64w4s4/m16n128w8s3".
func (tp fp8Pair) tags() string {
	if tp.w8 {
		return "w8a8 " + tp.w8up.Tag() + "/" + tp.w8down.Tag()
	}
	return "w8a16 " + tp.up.Tag() + "/" + tp.down.Tag()
}

// The FP8 tiles the rule (fp8Tiles) picks.
var (
	// The transposed w8a16 tiles (moekernels.FP8Gemm.Trans) won every cell
	// of BenchmarkFP8Expert's sweep on the H200 (session 11, call 3:
	// DeepSeek-V2-Lite and Qwen3-30B-A3B at 1, 8, 64 and 256 tokens), e.g.
	// DeepSeek-V2-Lite at 64 tokens up 104.4 against 113.2 us for the plain
	// m16n128w8s3, down 55.0 against 59.6. The 64-column up tile wins while
	// a batch touches so few experts that the 128-column one leaves
	// multiprocessors idle (one token of Qwen3-30B-A3B: 16.5 against 20.0
	// us), the 128-column tile from there, up to 256 tokens (DeepSeek-V2-Lite:
	// 292.8 us for the pair against 314.0 for the 32-row m32n64w4s4).
	fp8FewUp     = moekernels.FP8Gemm{BM: 16, BN: 64, WarpsN: 4, Stages: 4, Trans: true}
	fp8SmallUp   = moekernels.FP8Gemm{BM: 16, BN: 128, WarpsN: 8, Stages: 3, Trans: true}
	fp8SmallDown = moekernels.FP8Gemm{BM: 16, BN: 128, WarpsN: 8, Stages: 3, Trans: true}
	fp8Large     = fp8SmallDown
	// The persistent warp-specialised w8a8 tiles: on the H200 (DeepSeek-V2-Lite,
	// BenchmarkW8A8Expert, 2026-12-02) up 750 vs 839 us and down 266 vs 334 us at
	// 4096 tokens against the plain tiles, faster at 1024 and 8192 too.
	// Tried and dropped (session 11, commit 96e5288, then reverted): the same
	// tiles multiplying each stage in two halves of 64 columns, each half
	// scaled under the other's wgmma: slower everywhere on the H200 (up 912
	// vs 752 us, down 338 vs 268 at DeepSeek-V2-Lite 4096; the one-warpgroup
	// pair 1413 + 502 vs 1114 + 358), so the wgmma of a stage stay whole.
	// Tried and dropped (session 13, commit 3c56e2f): double-buffered tiles
	// (a producer warpgroup, setmaxnreg 40/232 for the consumers, block kb+1's
	// wgmma issued before block kb is scaled, wgmma.wait_group 1): correct on
	// the H200 but slower, up 743.9 vs 705.8 us and down 263.1 vs 245.9 at
	// DeepSeek-V2-Lite 4096, and the 64-row ones (one block per SM) 1198 +
	// 370 vs 1068 + 339. What did pay in the same call: the scaled add as one
	// FMA (705.8 + 245.9 against 752.5 + 267.6 in session 11).
	// Tried and dropped (session 13, commit f86dcb5, reverted): mma.sync
	// m16n8k32 e4m3 tiles of 16 and 32 rows for a few rows per expert
	// (weights as the A operand, as the transposed w8a16 tiles): correct on
	// the H200 but slower than the tiles the tuner kept, every time it timed
	// them (their chains with both quantizers, µs: Qwen3-30B-A3B 64 tokens
	// 198.4 against the w8a16 pair's 174.3, 256 tokens 298.4 against 264.0;
	// DeepSeek-V2-Lite 256 tokens 371.0 against the m64 wgmma pair's 255.4).
	// Likely cause, not checked in the SASS: sm_90 runs FP8 on its tensor
	// cores through wgmma only, so mma.sync e4m3 pays conversions as well.
	// Tried and dropped (session 15): four producer warps instead of two (up
	// 698.5 vs 709.4 us, down 245.7 vs 246.8 at DeepSeek-V2-Lite 4096: the
	// producers are not the limit), and each K block's scales loaded a block
	// ahead, after the proxy fence (commit 8d4395f, reverted: 735.5 + 255.9
	// us, no faster). What paid: the up epilogue's exponentials first, then
	// its divisions (moe_w8a8.cu's w8_store_half). On random activations the
	// persistent up tile spends 31% of its warps' stall samples in that
	// epilogue, while the tensor cores idle (ncu, 4096 tokens: 527.7 us).
	// Tried and dropped (session 16, never committed): deferring each tile's
	// SwiGLU into the stages of the block's next tile (the bf16 gate and up
	// sums stashed in 32 KB of shared memory, one pair of columns a stage),
	// so that it would run under the next tile's wgmma. Bitwise correct on
	// the H200 but slower wherever the pairs went: up 601-617 us against
	// 524-529 at DeepSeek-V2-Lite 4096 tokens, 188-194 against 161 at 1024
	// and 2801-2885 against 2421 at DeepSeek-V3 1024, whether a pair ran
	// between issuing a stage's wgmma and waiting for them, after the
	// stage's scaling, or two every other stage with the warpgroups
	// alternating; the same with five stages (as much shared memory, so as
	// much L1, as the plain six-stage tile: not the cause) or four. The
	// consumers' time in the epilogue is not spare time under the tensor
	// cores, so ping-pong warpgroups would have to be judged by a
	// measurement first.
	w8a8Up   = moekernels.W8A8Gemm{BM: 128, BN: 64, Stages: 6, Producers: 2, Up: true}
	w8a8Down = moekernels.W8A8Gemm{BM: 128, BN: 128, Stages: 6, Producers: 2}
	// Tried in session 21 and dropped (commit 8cf14ff): this pair with two
	// more warps that took each tile's epilogue from the consumers (the
	// sums staged as bf16 in 32 KB of shared memory, so that the consumers
	// went on to the next tile's wgmma). Bitwise correct on the H200, and a
	// test without the staging's release barrier failed, but the up tile
	// got slower: BenchmarkW8A8Expert, DeepSeek-V2-Lite 4096 tokens, up
	// 563-567 against 526-528 us, down 240-242 against 250-252; the tuner's
	// chains at 4096 tokens 849.7 against 812.1 (DeepSeek-V2-Lite) and 733.9
	// against 681.3 (Qwen3-30B-A3B). Two warps took the SwiGLU of eight; the
	// down tile, whose epilogue is its stores alone, gained 4%.
	//
	// The wide 128-row pair (session 21): 256 columns a tile (the up's 128
	// gate and 128 up columns), multiplied in two halves of 128, four
	// stages of 48 KB, a producer warpgroup giving its registers to the
	// consumers. A stage's 48 KB feed twice the products of the narrow
	// pair's 32 KB: ncu (DeepSeek-V2-Lite, 4096 tokens) counts 19% fewer L2
	// read sectors for the up tile (52.7M against 65.1M) and 18% fewer for
	// the down (26.4M against 32.2M), and they take 16% and 11% less time
	// (449 against 534 us, 228 against 257). Neither pair has a unit at its
	// peak: L2 45-57%, DRAM 19-29%, SM 39-47%, 4.1-4.7 TB/s from the L2 to
	// the multiprocessors.
	//
	// Tried in session 21 and dropped (commit 28330f2, reverted in d236ee0): a
	// wide up tile that quantized its act rows itself (a tile of 128 columns
	// holds one scale group of each row: the amax over the row's four lanes, the
	// quantizer's rule), so that the chain wrote no bf16 act and launched no act
	// quantizer. Bit for bit the quantizer's twin over the plain wide tile's act
	// on the H200, but the up tile got slower by more than the quantizer took:
	// BenchmarkW8A8Expert, DeepSeek-V2-Lite, up 507.3 against 446.3 us at 4096
	// tokens (the quantizer 40.7) and 181.2 against 160.5 at 1024 (13.6); the
	// tuner's chains 744.0 against 705.8 (DeepSeek-V2-Lite 4096), 644.7 against
	// 612.7 (Qwen3-30B-A3B 4096).
	//
	// Tried in session 22 and dropped (commit 892162b, reverted in the next
	// one): the wide tiles as two-block clusters, the blocks multiplying the
	// same 128 rows by adjacent column blocks, each copying half of every
	// stage's A rows from global memory and handing it to the other with a
	// bulk copy between their shared memories (40 KB a stage from the L2 per
	// block instead of 48). Bit for bit their twins' on the H200, but ptxas
	// spilled 396-420 bytes in the consumers' code (at 224 and at 232
	// registers, where the plain wide tiles spill none) and the kernels ran
	// 2.4x slower: BenchmarkW8A8Expert, DeepSeek-V2-Lite 4096 tokens, up 1051
	// against 427 us, down 515 against 223. Not pursued: the spills' cause was
	// not found, and the A rows are a third of a stage's bytes (the weights,
	// shared by TMA multicast in DeepGEMM, are two thirds).
	w8a8WideUp   = moekernels.W8A8Gemm{BM: 128, BN: 128, Stages: 4, Producers: 4, Up: true}
	w8a8WideDown = moekernels.W8A8Gemm{BM: 128, BN: 256, Stages: 4, Producers: 4}
	// The persistent one-warpgroup w8a8 tiles (timed by the tuner; the rule
	// ran them at 17-63 rows per touched expert until session 14): on the
	// H200 (BenchmarkW8A8Expert, session 9's call 2, the whole chain with the
	// quantizer) DeepSeek-V3 at 1024 tokens (32 rows) 3669 us against 4298 for
	// the 128-row pair, 7233 for the best w8a16 pair and 5307 for bf16;
	// DeepSeek-V2-Lite at 256 tokens (24 rows) 285 against 334, 310 and 295.
	// At 1024 tokens of DeepSeek-V2-Lite (96 rows) the 128-row pair wins
	// (357 against 520 us).
	w8a8SmallUp   = moekernels.W8A8Gemm{BM: 64, BN: 64, Stages: 4, Producers: 2, Up: true}
	w8a8SmallDown = moekernels.W8A8Gemm{BM: 64, BN: 128, Stages: 4, Producers: 2}
	// The one-warpgroup tiles not persistent (three blocks a multiprocessor),
	// the shape of the FP8 peer's kernel where it beat gpuctx (256 tokens,
	// 16-24 rows per touched expert). On the H200 (session 13, call 6) the
	// tuner kept them at DeepSeek-V2-Lite 256 tokens (chain 217.3 us against
	// 256.0 for the persistent m64 pair; the layer went from 0.87x to 1.02x
	// of the FP8 peer) and Qwen3-30B-A3B 1024 (287.9 against 306.0 for the
	// m128 pair; 1.05x to 1.12x). The rule runs them at 25-64 rows per
	// touched expert (w8a8TransRows, w8a8LargeRows).
	w8a8PlainSmallUp   = moekernels.W8A8Gemm{BM: 64, BN: 64, Stages: 3, Up: true}
	w8a8PlainSmallDown = moekernels.W8A8Gemm{BM: 64, BN: 128, Stages: 3}
	// The transposed w8a8 tiles (moekernels.W8A8Gemm.Trans: the weights as
	// wgmma's A operand, 64 columns a warpgroup by 8, 16 or 32 rows), for a
	// few rows per touched expert, where the w8a16 tiles convert every
	// weight in registers. The rule runs the 32-row pair at
	// w8a8MinRows-w8a8TransRows rows; the tuner times all three
	// (fp8Pair.timedAt). An 8-row pair that quantized its own rows (no
	// quantizer launches) was dropped in session 19: no faster than the
	// w8a16 tiles in the layer at 1 token, and close enough that the
	// tuner's pick between w8a16 and w8a8 accuracy followed the timing's
	// noise (docs/tuning-history.md). Session 20 measured three more 8-row
	// pairs for one token and dropped them, slower in the tuner's chains
	// on the H200 (Qwen3-30B-A3B, 1 token, plain pair 23.7-24.1 us): one
	// that asked the L2 for all of its weights before its grid wait (25.5),
	// eight stages (24.5), and wgmma overlapped with the previous block's
	// scaling (25.2-26.8); the plain pair is bound neither by its bytes in
	// flight nor by its per-stage waits there (bench/RESULTS.md).
	w8a8T8Up    = moekernels.W8A8Gemm{BM: 8, BN: 64, Stages: 4, Trans: true, Up: true}
	w8a8T8Down  = moekernels.W8A8Gemm{BM: 8, BN: 64, Stages: 4, Trans: true}
	w8a8T16Up   = moekernels.W8A8Gemm{BM: 16, BN: 64, Stages: 3, Trans: true, Up: true}
	w8a8T16Down = moekernels.W8A8Gemm{BM: 16, BN: 64, Stages: 4, Trans: true}
	w8a8T32Up   = moekernels.W8A8Gemm{BM: 32, BN: 64, Stages: 3, Trans: true, Up: true}
	w8a8T32Down = moekernels.W8A8Gemm{BM: 32, BN: 64, Stages: 4, Trans: true}
)

// w8a8MinRows is the average rows per touched expert from which a batch runs
// the w8a8 tiles where they are loaded (fp8Experts.w8): the transposed
// 32-row pair up to w8a8TransRows, the plain one-warpgroup pair (64 rows,
// three blocks a multiprocessor) up to w8a8LargeRows and the wide
// persistent 128-row pair above. The H200's tuner (session 14; every chain
// with both quantizers, µs):
//   - 1-8 rows: the transposed 8-row pair and the best w8a16 pair within a
//     few percent of each other, either way; the rule keeps w8a16 (the more
//     accurate, bf16 activations).
//   - 16 rows (Qwen3-30B-A3B, 256 tokens): transposed 32-row 205.0, plain
//     m64 236.0, best w8a16 263.6.
//   - 24 rows (DeepSeek-V2-Lite, 256 tokens): transposed 32-row 192.0, plain
//     m64 221.0, persistent m64 250.6.
//   - 32 rows (DeepSeek-V3, 1024 tokens): plain m64 3090.8, transposed 32-row
//     3582.2, persistent m128 3656.8, persistent m64 3873.5.
//   - 64 rows (Qwen3-30B-A3B, 1024 tokens, session 13): plain m64 287.9,
//     persistent m128 306.0; 96 rows (DeepSeek-V2-Lite, 1024): the
//     persistent m128 pair.
//   - Session 21, with the wide pair: 64 rows (Qwen3-30B-A3B, 1024 tokens)
//     wide 262.5-264.6, plain m64 268.3, persistent m128 282.0; 96 rows
//     (DeepSeek-V2-Lite, 1024) wide 249.1-254.3, persistent m128 257.3;
//     at 4096 tokens (256 and 384 rows) wide 609.8-620.2 against 681.3
//     and 714.2-716.2 against 812.1.
const (
	w8a8MinRows   = 9
	w8a8TransRows = 24
	w8a8LargeRows = 64
)

// fp8Tiles picks the FP8 tiles of a batch of T tokens by a rule, by the rows
// each touched expert gets on average: with w8 (the w8a8 tiles are loaded)
// the w8a8 tiles from w8a8MinRows rows (the transposed 32-row pair up to
// w8a8TransRows, the plain 64-row pair up to w8a8LargeRows, the wide
// persistent 128-row pair above); else the transposed 16-row w8a16 tiles (the
// sweep winners of BenchmarkFP8Expert on the H200 at 1-256 tokens,
// bench/RESULTS.md), with the 64-column up tile for at most fp8FewAssignments
// assignments. The w8a16 tile changes no result; the w8a8 tiles quantize the
// activations.
func fp8Tiles(T, K, E int, w8 bool) fp8Pair {
	m := rowsPerExpert(T, K, E)
	switch {
	case w8 && m > w8a8LargeRows:
		return fp8Pair{w8: true, w8up: w8a8WideUp, w8down: w8a8WideDown}
	case w8 && m > w8a8TransRows:
		return fp8Pair{w8: true, w8up: w8a8PlainSmallUp, w8down: w8a8PlainSmallDown}
	case w8 && m >= w8a8MinRows:
		return fp8Pair{w8: true, w8up: w8a8T32Up, w8down: w8a8T32Down}
	case m > 16:
		return fp8Pair{up: fp8Large, down: fp8Large}
	case T*K <= fp8FewAssignments:
		return fp8Pair{up: fp8FewUp, down: fp8SmallDown}
	}
	return fp8Pair{up: fp8SmallUp, down: fp8SmallDown}
}

// fp8FewAssignments is the most routed assignments (tokens times top-k) for
// which the rule runs the 64-column up tile: about one token's, whose few
// touched experts give the 128-column tile too few blocks.
const fp8FewAssignments = 16

// checkFP8 checks the options of an FP8 layer of cfg; the error has no
// prefix. The FP8 tiles run on the fused path only (bf16 activations) and
// need H and I multiples of 16 of at most moekernels.FP8MaxK: a forced bf16
// tile, NoFused and a small-batch path are refused. FusedShared runs the
// shared expert's chunks in FP8 in the w8a16 tiles (uploadShared).
func checkFP8(cfg *Config, o LayerOptions) error {
	H, I := cfg.HiddenSize, cfg.Intermediate
	switch {
	case o.DType != gpuctx.BF16:
		return fmt.Errorf("LayerOptions.FP8 needs DType bf16 (the activations and the other weights), not %v: %w", o.DType, gpuctx.ErrInvalid)
	case H%16 != 0 || I%16 != 0 || H > moekernels.FP8MaxK || I > moekernels.FP8MaxK:
		return fmt.Errorf("FP8 experts: hidden_size %d and moe_intermediate_size %d must be multiples of 16 of at most %d (the FP8 tiles): %w", H, I, moekernels.FP8MaxK, gpuctx.ErrInvalid)
	case o.NoFused:
		return fmt.Errorf("LayerOptions.NoFused: FP8 experts run on the fused path only: %w", gpuctx.ErrInvalid)
	case o.SmallBatchTokens > 0:
		return fmt.Errorf("SmallBatchTokens = %d: FP8 experts have no small-batch kernels; leave it 0: %w", o.SmallBatchTokens, gpuctx.ErrInvalid)
	case o.Tile != "":
		return fmt.Errorf("LayerOptions.Tile %q names a bf16 tile; FP8 layers pick their own tiles (timed, or by rule under NoAutotune): %w", o.Tile, gpuctx.ErrInvalid)
	}
	return nil
}

// fp8Sizes returns the bytes of the buffers of fp8Experts for n experts:
// gu, gus, down, downs.
func fp8Sizes(cfg *Config, n int) [4]int {
	H, I := cfg.HiddenSize, cfg.Intermediate
	bh, bi := ceilBlocks(H), ceilBlocks(I)
	return [4]int{n * 2 * I * H, n * 2 * bi * bh * 4, n * H * I, n * bh * bi * 4}
}

func ceilBlocks(n int) int { return (n + fp8.BlockSize - 1) / fp8.BlockSize }

// alloc allocates q's weight buffers for n experts (recorded in e.weightBufs).
func (q *fp8Experts) alloc(e *env, n int) error {
	sz := fp8Sizes(&e.cfg, n)
	for i, dst := range []**gpuctx.Buffer{&q.gu, &q.gus, &q.down, &q.downs} {
		b, err := e.dev.Alloc(sz[i])
		if err != nil {
			return err
		}
		e.weightBufs = append(e.weightBufs, b)
		*dst = b
	}
	return nil
}

// upload fills q with routed experts [lo, hi) from src (FP8 as stored, or
// quantized in 128x128 blocks: weightSource.fp8Weight), expert by expert on
// up to GOMAXPROCS goroutines, with synchronous copies that wait for nothing
// queued on any stream.
func (q *fp8Experts) upload(e *env, src weightSource, lo, hi int) error {
	H, I := e.cfg.HiddenSize, e.cfg.Intermediate
	bh, bi := ceilBlocks(H), ceilBlocks(I)
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for x := lo; x < hi; x++ {
		g.Go(func() error {
			k := x - lo
			for _, pc := range []struct {
				part         weightPart
				rows, cols   int
				codes, scale *gpuctx.Buffer
				coff, soff   int // bytes
			}{
				{wGate, I, H, q.gu, q.gus, k * 2 * I * H, k * 2 * bi * bh * 4},
				{wUp, I, H, q.gu, q.gus, (k*2 + 1) * I * H, (k*2 + 1) * bi * bh * 4},
				{wDown, H, I, q.down, q.downs, k * H * I, k * bh * bi * 4},
			} {
				w, err := src.fp8Weight(pc.part, x, pc.rows, pc.cols)
				if err != nil {
					return err
				}
				if err := copyAt(pc.codes, pc.coff, w.Codes); err != nil {
					return err
				}
				if err := copyAt(pc.scale, pc.soff, f32Bytes(w.Scales)); err != nil {
					return err
				}
			}
			return nil
		})
	}
	return g.Wait()
}

// uploadShared fills experts n0 .. n0+ns-1 of q (after the n0 routed ones;
// E0 of the w8a16 up kernel) with the ns chunks of the routed width I that
// the shared expert runs as in FusedShared, where the bf16 layer puts them
// (core.weightCopies): chunk j is rows j*I .. (j+1)*I-1 of gate_proj and
// up_proj and columns j*I .. (j+1)*I-1 of down_proj, cut by fp8Chunk from
// the shared expert in FP8 (src.fp8Weight: the checkpoint's codes and
// scales, or quantized in 128x128 blocks). Synchronous copies that wait for
// nothing queued on any stream, on the calling goroutine.
func (q *fp8Experts) uploadShared(e *env, src weightSource, n0, ns int) error {
	if ns == 0 {
		return nil
	}
	H, I, Is := e.cfg.HiddenSize, e.cfg.Intermediate, e.cfg.SharedIntermediate
	bh, bi := ceilBlocks(H), ceilBlocks(I)
	for _, pc := range []struct {
		part         weightPart
		rows, cols   int
		codes, scale *gpuctx.Buffer
		coff, soff   int // bytes, of chunk 0
		cstep, sstep int // bytes from one chunk to the next
	}{
		{wSharedGateProj, Is, H, q.gu, q.gus, n0 * 2 * I * H, n0 * 2 * bi * bh * 4, 2 * I * H, 2 * bi * bh * 4},
		{wSharedUpProj, Is, H, q.gu, q.gus, (n0*2 + 1) * I * H, (n0*2 + 1) * bi * bh * 4, 2 * I * H, 2 * bi * bh * 4},
		{wSharedDownProj, H, Is, q.down, q.downs, n0 * H * I, n0 * bh * bi * 4, H * I, bh * bi * 4},
	} {
		w, err := src.fp8Weight(pc.part, 0, pc.rows, pc.cols)
		if err != nil {
			return err
		}
		for j := range ns {
			r0, r1, c0, c1 := j*I, (j+1)*I, 0, H
			if pc.part == wSharedDownProj {
				r0, r1, c0, c1 = 0, H, j*I, (j+1)*I
			}
			c, err := fp8Chunk(w, r0, r1, c0, c1)
			if err != nil {
				return fmt.Errorf("%s, chunk %d of the fused shared expert: %w", pc.part, j, err)
			}
			if err := copyAt(pc.codes, pc.coff+j*pc.cstep, c.Codes); err != nil {
				return err
			}
			if err := copyAt(pc.scale, pc.soff+j*pc.sstep, f32Bytes(c.Scales)); err != nil {
				return err
			}
		}
	}
	return nil
}

// uploadFP8 fills the shared expert's dense weights of an FP8 layer (Single
// and Dual run them with BLAS) with the values of its FP8 weights, in the
// layer's dtype: an FP8 checkpoint's codes times their block scales, or a
// bf16/f32 source quantized in 128x128 blocks (fp8.Quantize) and
// dequantized. So every mode computes with the same shared-expert weights as
// the FusedShared chunks, which hold those codes (requantized only where a
// chunk's cut is not on a block edge: fp8Chunk). Synchronous copies, as
// weightSource.upload's.
func (s *sharedStage) uploadFP8(e *env, src weightSource) error {
	H, Is := e.cfg.HiddenSize, e.cfg.SharedIntermediate
	if Is == 0 {
		return nil
	}
	for _, pc := range []struct {
		part       weightPart
		rows, cols int
		dst        *gpuctx.Buffer
		off        int // elements
	}{
		{wSharedGateProj, Is, H, s.gu, 0},
		{wSharedUpProj, Is, H, s.gu, Is * H},
		{wSharedDownProj, H, Is, s.down, 0},
	} {
		w, err := src.fp8Weight(pc.part, 0, pc.rows, pc.cols)
		if err != nil {
			return err
		}
		v, err := w.Dequantize()
		if err != nil {
			return fmt.Errorf("%s: %w", pc.part, err)
		}
		if err := copyAt(pc.dst, pc.off*e.es, e.encode(v)); err != nil {
			return err
		}
	}
	return nil
}

// fp8Chunk returns rows [r0, r1) and columns [c0, c1) of w as a Weight in
// w's blocks. Where r0 and c0 are multiples of the block (always when the
// routed width I is a multiple of 128; chunk 0 always) every block of the
// chunk lies inside one block of w, and the chunk keeps w's codes and
// scales as they are: the same real weights. Elsewhere (I not a multiple of
// 128: DeepSeek-V2-style widths) a block of the chunk would straddle two of
// w's blocks, which have their own scales, so the chunk is requantized:
// dequantized (code * scale_inv in float32, as fp8.Weight.Dequantize) and
// quantized again per 128x128 block of the chunk (fp8.Quantize), one more
// E4M3 rounding of those weights (from a bf16 or f32 source the weights are
// then rounded twice: quantized whole, then per chunk).
func fp8Chunk(w *fp8.Weight, r0, r1, c0, c1 int) (*fp8.Weight, error) {
	br, bc := w.Block[0], w.Block[1]
	sc := (w.Cols + bc - 1) / bc
	rows, cols := r1-r0, c1-c0
	if r0%br == 0 && c0%bc == 0 {
		out := &fp8.Weight{Rows: rows, Cols: cols, Block: w.Block, Codes: make([]uint8, 0, rows*cols)}
		for r := r0; r < r1; r++ {
			out.Codes = append(out.Codes, w.Codes[r*w.Cols+c0:r*w.Cols+c1]...)
		}
		for b := r0 / br; b < (r1+br-1)/br; b++ {
			out.Scales = append(out.Scales, w.Scales[b*sc+c0/bc:b*sc+(c1+bc-1)/bc]...)
		}
		return out, out.Check()
	}
	v := make([]float32, 0, rows*cols)
	for r := r0; r < r1; r++ {
		for j := c0; j < c1; j++ {
			v = append(v, fp8.FromE4M3(w.Codes[r*w.Cols+j])*w.Scales[(r/br)*sc+j/bc])
		}
	}
	return fp8.Quantize(v, rows, cols, w.Block)
}

// copyAt copies b to dst at byte offset off (synchronous).
func copyAt(dst *gpuctx.Buffer, off int, b []byte) error {
	v, err := dst.Slice(off, len(b))
	if err != nil {
		return err
	}
	return v.CopyFromHost(b)
}

// loadKernels looks up (on CUDA: compiles moe_fp8_mma.cu) the kernels of
// every w8a16 tile (moekernels.FP8Gemms: the rule's and the tuner's), so
// that a device that cannot run them fails at load; and, unless w16only
// (LayerOptions.FP8WeightOnly), on a CUDA device of compute capability 9.0
// or the CPU backend the quantizer and the w8a8 tiles of w8a8Pairs
// (moe_w8a8.cu), setting q.w8.
func (q *fp8Experts) loadKernels(dev *gpuctx.Device, w16only bool) error {
	q.kUp = map[moekernels.FP8Gemm]moekernels.Launcher[moekernels.FP8Up]{}
	q.kDown = map[moekernels.FP8Gemm]moekernels.Launcher[moekernels.FP8Down]{}
	for _, c := range moekernels.FP8Gemms {
		up, err := moekernels.NewFP8Up(dev, c)
		if err != nil {
			return fmt.Errorf("FP8 tile %s: %w", c.Tag(), err)
		}
		down, err := moekernels.NewFP8Down(dev, c)
		if err != nil {
			return fmt.Errorf("FP8 tile %s: %w", c.Tag(), err)
		}
		q.kUp[c], q.kDown[c] = up, down
	}
	info := dev.Info()
	if w16only || dev.Backend() != "cpu" && (dev.Backend() != "cuda" || info.ComputeMajor != 9 || info.ComputeMinor != 0) {
		return nil
	}
	var err error
	if q.kQuant, err = moekernels.NewLauncher[moekernels.FP8Quant](dev); err != nil {
		return fmt.Errorf("FP8 activation quantizer: %w", err)
	}
	q.kW8Up = map[moekernels.W8A8Gemm]moekernels.Launcher[moekernels.W8A8Up]{}
	q.kW8Down = map[moekernels.W8A8Gemm]moekernels.Launcher[moekernels.W8A8Down]{}
	for _, tp := range w8a8Pairs {
		if q.kW8Up[tp.w8up], err = moekernels.NewW8A8Up(dev, tp.w8up); err != nil {
			return fmt.Errorf("w8a8 tile %s: %w", tp.w8up.Tag(), err)
		}
		if q.kW8Down[tp.w8down], err = moekernels.NewW8A8Down(dev, tp.w8down); err != nil {
			return fmt.Errorf("w8a8 tile %s: %w", tp.w8down.Tag(), err)
		}
	}
	q.w8, q.quantInRoute = true, true
	return nil
}

// w8a8Needs returns the w8a8 form's scratch for T tokens and cp sorted rows:
// x's codes and scales, act's codes and scales.
func (x *expertStage) w8a8Needs(T, cp int) []need {
	H, I := x.e.cfg.HiddenSize, x.e.cfg.Intermediate
	return []need{{&x.xq, T * H}, {&x.xs, 4 * T * ceilBlocks(H)}, {&x.aq, cp * I}, {&x.as, 4 * cp * ceilBlocks(I)}}
}

// fusedFP8 queues the FP8 tiles of p.fp8 on the main stream over p's
// aligned sort in d, which must have run (or be queued just ahead: the
// kernels wait on the device, LaunchEarly) with the tiles' BM: the w8a8
// chain (fusedW8A8), or the w8a16 up kernel (fp8Up) and down kernel
// (fp8Down). Nothing waits for the host.
func (x *expertStage) fusedFP8(in *gpuctx.Buffer, d *dispatchStage, p *plan) error {
	if p.fp8.w8 {
		return x.fusedW8A8(in, d, p)
	}
	if err := x.fp8Up(p.fp8.up, in, d, p); err != nil {
		return err
	}
	return x.fp8Down(p.fp8.down, d, p)
}

// fp8Up queues the w8a16 up kernel of tile c (gather, gate/up GEMM, SwiGLU
// into act) on the main stream over p's aligned sort in d with c's BM (run,
// or queued just ahead). With the shared expert fused (FusedShared: p.early
// chunks, experts E .. E+p.early-1 of q, sorted first) its blocks of their
// rows start without waiting for the sort (moe_shared_rows); the w8a8 tiles
// never run such a plan. Nothing waits for the host.
func (x *expertStage) fp8Up(c moekernels.FP8Gemm, in *gpuctx.Buffer, d *dispatchStage, p *plan) error {
	e, q := x.e, x.q
	H, I, K := e.cfg.HiddenSize, e.cfg.Intermediate, p.ks
	TK := p.T * K
	up, ok := q.kUp[c]
	if !ok {
		return fmt.Errorf("moe: FP8 tile %s was not loaded: %w", c.Tag(), gpuctx.ErrInvalid)
	}
	gx, gy := c.Grid(I, moekernels.AlignCap(TK, p.experts, c.BM))
	return up.LaunchEarly(e.main, gpuctx.Dim3{X: gx, Y: gy, Z: 1}, gpuctx.Dim3{X: c.Threads(), Y: 1, Z: 1}, c.SmemBytes(true), moekernels.FP8Up{
		X: in, Gu: q.gu, Gus: q.gus, Sorted: d.sorted, BlockExpert: d.bexp, Npost: d.npost, Act: x.act,
		TK: int32(TK), K: int32(K), H: int32(H), I: int32(I), E0: int32(e.cfg.NumExperts), Ns: int32(p.early)})
}

// fp8Down queues the w8a16 down kernel of tile c (act into out, in
// assignment order) on the main stream over p's aligned sort in d with c's
// BM, after the up kernel. Nothing waits for the host.
func (x *expertStage) fp8Down(c moekernels.FP8Gemm, d *dispatchStage, p *plan) error {
	e, q := x.e, x.q
	H, I := e.cfg.HiddenSize, e.cfg.Intermediate
	TK := p.T * p.ks
	down, ok := q.kDown[c]
	if !ok {
		return fmt.Errorf("moe: FP8 tile %s was not loaded: %w", c.Tag(), gpuctx.ErrInvalid)
	}
	gx, gy := c.Grid(H, moekernels.AlignCap(TK, p.experts, c.BM))
	return down.LaunchEarly(e.main, gpuctx.Dim3{X: gx, Y: gy, Z: 1}, gpuctx.Dim3{X: c.Threads(), Y: 1, Z: 1}, c.SmemBytes(false), moekernels.FP8Down{
		Act: x.act, Down: q.down, Downs: q.downs, Sorted: d.sorted, BlockExpert: d.bexp, Npost: d.npost, Out: x.out,
		TK: int32(TK), H: int32(H), I: int32(I)})
}

// fusedW8A8 queues the w8a8 form of p's tiles on the main stream over p's
// aligned sort in d (with the tiles' BM; run, or queued just ahead):
// gpuctx_moe_fp8_quant of x into xq/xs (unless p.xInRoute: this forward's
// gpuctx_moe_route_align, queued ahead, wrote them), the w8a8 up tile (gate/up GEMM,
// SwiGLU into act, bf16), the quantizer of act's sorted rows (below the
// sort's npost, read on the device; a grid sized for the cap) into aq/as,
// and the w8a8 down tile into out. Each kernel waits on the device for the
// one ahead (LaunchEarly); nothing waits for the host.
func (x *expertStage) fusedW8A8(in *gpuctx.Buffer, d *dispatchStage, p *plan) error {
	e, q, tp := x.e, x.q, p.fp8
	H, I, K := e.cfg.HiddenSize, e.cfg.Intermediate, p.ks
	TK := p.T * K
	up, ok := q.kW8Up[tp.w8up]
	down, ok2 := q.kW8Down[tp.w8down]
	if !ok || !ok2 {
		return fmt.Errorf("moe: w8a8 tiles %s were not loaded: %w", tp.tags(), gpuctx.ErrInvalid)
	}
	cp := moekernels.AlignCap(TK, p.experts, tp.w8up.BM)
	qb := gpuctx.Dim3{X: moekernels.FP8QuantThreads, Y: 1, Z: 1}
	if !p.xInRoute { // else gpuctx_moe_route_align quantized x
		if err := q.kQuant.LaunchEarly(e.main, gpuctx.Dim3{X: moekernels.FP8QuantBlocks(p.T, H), Y: 1, Z: 1}, qb, 0, moekernels.FP8Quant{
			X: in, Codes: x.xq, Scales: x.xs, Npost: d.npost, R: int32(p.T), K: int32(H)}); err != nil {
			return err
		}
	}
	sms := e.dev.Info().SMCount
	gx, gy := tp.w8up.Grid(I, cp, sms)
	if err := up.LaunchEarly(e.main, gpuctx.Dim3{X: gx, Y: gy, Z: 1}, gpuctx.Dim3{X: tp.w8up.Threads(), Y: 1, Z: 1}, tp.w8up.SmemBytes(), moekernels.W8A8Up{
		Xq: x.xq, Xs: x.xs, Gu: q.gu, Gus: q.gus, Sorted: d.sorted, BlockExpert: d.bexp, Npost: d.npost, Act: x.act,
		TK: int32(TK), K: int32(K), H: int32(H), I: int32(I)}); err != nil {
		return err
	}
	if err := q.kQuant.LaunchEarly(e.main, gpuctx.Dim3{X: moekernels.FP8QuantBlocks(cp, I), Y: 1, Z: 1}, qb, 0, moekernels.FP8Quant{
		X: x.act, Codes: x.aq, Scales: x.as, Npost: d.npost, R: int32(cp), K: int32(I), Bounded: 1}); err != nil {
		return err
	}
	gx, gy = tp.w8down.Grid(H, cp, sms)
	return down.LaunchEarly(e.main, gpuctx.Dim3{X: gx, Y: gy, Z: 1}, gpuctx.Dim3{X: tp.w8down.Threads(), Y: 1, Z: 1}, tp.w8down.SmemBytes(), moekernels.W8A8Down{
		Aq: x.aq, As: x.as, Down: q.down, Downs: q.downs, Sorted: d.sorted, BlockExpert: d.bexp, Npost: d.npost, Out: x.out,
		TK: int32(TK), H: int32(H), I: int32(I)})
}
