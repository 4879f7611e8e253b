package moekernels

import (
	_ "embed"
	"fmt"
	"math"
	"runtime"
	"slices"
	"strings"
	"sync"

	"github.com/gpuctx/gpuctx"
	"github.com/gpuctx/gpuctx/kernels"
	"github.com/gpuctx/gpuctx/moe/fp8"
)

// W8A8File names the registered source of the FP8 x FP8 (w8a8) expert GEMMs
// and the activation quantizer.
const W8A8File = "moe_w8a8.cu"

//go:embed moe_w8a8.cu
var w8a8Source string

// quantSource is the activation quantizer's arithmetic, compiled ahead of
// moe_w8a8.cu and of moe.cu (gpuctx_moe_route_align quantizes x with it).
//
//go:embed moe_quant.cuh
var quantSource string

// FP8QuantName is the activation quantizer of moe_w8a8.cu:
//
//	gpuctx_moe_fp8_quant (x, codes, scales, npost hal.Ptr, R, K, bounded int32)
//	    x [R, K] bf16 -> codes [R, K] E4M3 and scales [R, ceil(K/128)] f32, per
//	    row per group of 128 columns (the last partial): s = max(amax, 1e-10)
//	    / 448, code = E4M3(x / s) rounded to nearest even, saturating (moe/fp8's
//	    QuantizeActivations rule; a group of zeros gets codes 0). K a multiple
//	    of 8, R * ceil(K/128) < 2^30. With bounded != 0 only the rows below min(R, npost[0]) (the
//	    sorted rows of gpuctx_moe_align) are quantized, the others left as
//	    they are; with bounded == 0 npost is not read. Grid (FP8QuantBlocks(R,
//	    K), 1, 1), block (FP8QuantThreads, 1, 1). It calls MOE_GRID_WAIT first
//	    (it may be launched early).
const FP8QuantName = "gpuctx_moe_fp8_quant"

// FP8QuantThreads is the block of gpuctx_moe_fp8_quant: 16 half-warps, one
// (row, group) each at a time.
const FP8QuantThreads = 256

// fp8QuantMaxBlocks bounds the quantizer's grid: its blocks stride over the
// (row, group) items, so a few waves of resident blocks cover any R.
const fp8QuantMaxBlocks = 2048

// FP8QuantBlocks is the grid of gpuctx_moe_fp8_quant over R rows of K
// columns: a half-warp per row and group of 128 columns, 16 a block, at most
// fp8QuantMaxBlocks blocks (each then takes several items in turn).
func FP8QuantBlocks(R, K int) int {
	n := R * ((K + fp8.BlockSize - 1) / fp8.BlockSize)
	return min(max((n+15)/16, 1), fp8QuantMaxBlocks)
}

// W8A8Gemm is one tile of the FP8 x FP8 (w8a8) grouped expert GEMMs of
// moe_w8a8.cu, Hopper warpgroup tiles (wgmma e4m3, compute capability 9.0
// only) over E4M3 activations quantized per row per 128 columns
// (gpuctx_moe_fp8_quant) and the E4M3 weights with 128x128 block scales of
// FP8Gemm. Up tiles (Up set) compute the gate and up GEMMs and SwiGLU, down
// tiles the down projection; the rows are MoEGemm's (gpuctx_moe_align with
// the same BM):
//
//	gpuctx_moe_w8a8_up_<tag>   (xq, xs, gu, gus, sorted, blockExpert, npost, act hal.Ptr, TK, K, H, I int32)
//	    as gpuctx_moe_fp8_up_<tag> of FP8Gemm with x quantized: xq [T, H]
//	    codes and xs [T, ceil(H/128)] scales; no fused shared expert. Grid
//	    Grid(I, cap, SMs).
//	gpuctx_moe_w8a8_down_<tag> (aq, as, down, downs, sorted, blockExpert, npost, out hal.Ptr, TK, H, I int32)
//	    as gpuctx_moe_fp8_down_<tag> with act quantized: aq [cap, I] codes,
//	    as [cap, ceil(I/128)] scales. Grid Grid(H, cap, SMs).
//
// Both take block (Threads(), 1, 1) and SmemBytes() bytes of dynamic shared
// memory, run on the stream they are launched on and call MOE_GRID_WAIT
// before they read anything (they may be launched early, after the
// quantizer). Each output sums its K blocks in increasing order, acc = acc +
// p * (sa * sb) with p the block's tensor-core sum (moe_w8a8.cu states the
// contract; the twins, w8a8Up and w8a8Down, follow it). The tile changes no
// result but for the tensor core's order within a block.
type W8A8Gemm struct {
	BM, BN int // tile rows (64 per warpgroup) and columns (of each half for Up; BN divides 128, or 256 for a persistent down tile)
	Stages int // cp.async pipeline depth, one 128-column K block per stage
	// Producers > 0 makes the tile persistent and warp-specialised
	// (moe_w8a8.cu's moe_w8p): one block per multiprocessor loops over the
	// tiles, Producers warps load the stages, the consumer warpgroups
	// multiply, synchronised by mbarriers, so that one warpgroup's scaling
	// overlaps the other's wgmma. A persistent tile of 256 columns (Up with
	// BN 128, or a down tile of BN 256) is wide: it multiplies them in two
	// wgmma halves of 128 and needs Producers 4, a whole warpgroup, whose
	// registers the consumers take (setmaxnreg 56 and 224).
	Producers int
	// Trans makes the weights the wgmma's A operand (moe_w8a8.cu's moe_w8t):
	// each warpgroup multiplies 64 weight rows by the block's BM sorted rows
	// (wgmma N = BM: 8 to 64, a multiple of 8), for batches of a few rows per
	// expert; BN is then 64 or 128 (a warpgroup per 64 columns). Tag suffix
	// "t".
	Trans bool
	Up    bool // the gate/up + SwiGLU kernel, else the down kernel
}

// W8A8Gemms lists the compiled w8a8 tiles, warpgroups of 64 rows with one
// wgmma of 128 columns each: an up and a down tile of two warpgroups in
// moe_wg's form, the same as persistent tiles, wide persistent tiles (256
// columns in two wgmma halves of 128, a producer warpgroup whose registers the
// consumers take: a quarter fewer bytes from the L2 per product; on the H200,
// session 21, 11-16% faster than the narrow persistent pair at
// DeepSeek-V2-Lite 4096 tokens), and persistent tiles of one warpgroup (64
// rows: for batches of 16-64 rows per expert, where a 128-row block would be
// mostly padding; four stages, so that two blocks share a multiprocessor);
// then one-warpgroup tiles in moe_wg's form (three stages: three blocks a
// multiprocessor), the shape of vLLM's FP8 Triton kernel at 256 tokens (64
// rows, 128 columns, 4 warps); then transposed tiles of 8, 16 and 32 rows (one
// warpgroup, 64 columns) for a few rows per expert, the up tiles of 16 and 32
// rows with three stages (three blocks a multiprocessor; on the H200, session
// 14, they beat four stages in every chain the tuner timed, e.g.
// DeepSeek-V2-Lite 256 tokens 192.0 against 204.2 us for the 32-row pair) and
// the 8-row one with four. Tried in the same call and dropped: two-warpgroup
// (128-column) transposed tiles, no faster anywhere (DeepSeek-V2-Lite 64
// tokens 167.9 against 168.6 us, Qwen3-30B-A3B 64 tokens 183.5 against 180.6).
var W8A8Gemms = []W8A8Gemm{
	{BM: 128, BN: 64, Stages: 4, Up: true},
	{BM: 128, BN: 128, Stages: 4},
	{BM: 128, BN: 64, Stages: 6, Producers: 2, Up: true},
	{BM: 128, BN: 128, Stages: 6, Producers: 2},
	{BM: 128, BN: 128, Stages: 4, Producers: 4, Up: true},
	{BM: 128, BN: 256, Stages: 4, Producers: 4},
	{BM: 64, BN: 64, Stages: 4, Producers: 2, Up: true},
	{BM: 64, BN: 128, Stages: 4, Producers: 2},
	{BM: 64, BN: 64, Stages: 3, Up: true},
	{BM: 64, BN: 128, Stages: 3},
	{BM: 8, BN: 64, Stages: 4, Trans: true, Up: true},
	{BM: 8, BN: 64, Stages: 4, Trans: true},
	{BM: 16, BN: 64, Stages: 3, Trans: true, Up: true},
	{BM: 16, BN: 64, Stages: 4, Trans: true},
	{BM: 32, BN: 64, Stages: 3, Trans: true, Up: true},
	{BM: 32, BN: 64, Stages: 4, Trans: true},
}

// Tag is the suffix of the tile's kernel name, e.g. "m128n64s4",
// "m128n64s6p2" for a persistent tile with two producer warps, or
// "m16n64s4t" for a transposed one.
func (c W8A8Gemm) Tag() string {
	p := ""
	if c.Producers > 0 {
		p = fmt.Sprintf("p%d", c.Producers)
	}
	if c.Trans {
		p += "t"
	}
	return fmt.Sprintf("m%dn%ds%d%s", c.BM, c.BN, c.Stages, p)
}

// Name is the tile's kernel name.
func (c W8A8Gemm) Name() string {
	if c.Up {
		return "gpuctx_moe_w8a8_up_" + c.Tag()
	}
	return "gpuctx_moe_w8a8_down_" + c.Tag()
}

// Threads is the block size: a warpgroup per 64 rows (Trans: per 64
// columns), and the producer warps.
func (c W8A8Gemm) Threads() int {
	if c.Trans {
		return 128 * (c.BN / 64)
	}
	return 128*(c.BM/64) + 32*c.Producers
}

// Grid is the launch grid over n output columns (I for up, H for down) and
// cap sorted rows on a device of sms multiprocessors: (ceil(n/BN), cap/BM),
// or for a persistent tile (min(sms, ceil(n/BN)*(cap/BM)), 1).
func (c W8A8Gemm) Grid(n, cap, sms int) (x, y int) {
	nx, ny := (n+c.BN-1)/c.BN, cap/c.BM
	if c.Producers > 0 {
		return max(min(sms, nx*ny), 1), 1
	}
	return nx, ny
}

// width is the columns of the tile's wgmma: 2*BN for up, BN for down.
func (c W8A8Gemm) width() int {
	if c.Up {
		return 2 * c.BN
	}
	return c.BN
}

// SmemBytes is the dynamic shared memory: Stages copies of the BM x 128 code
// A tile and of the width x 128 code B tile, and 1024 bytes to align them.
func (c W8A8Gemm) SmemBytes() int { return c.Stages*(c.BM+c.width())*fp8.BlockSize + 1024 }

// staticSmem is the static shared memory: the row tables and the staged
// weight scales (Trans: and the rows' scales), or a persistent tile's
// mbarriers.
func (c W8A8Gemm) staticSmem() int {
	if c.Producers > 0 {
		return 16 * c.Stages
	}
	n := 8*c.BM + 2*4*FP8MaxK/fp8.BlockSize
	if c.Trans {
		n += 4 * c.BM * FP8MaxK / fp8.BlockSize
	}
	return n
}

// Check reports why c cannot be instantiated (moe_w8a8.cu's static
// assertions and the shared-memory limit), or nil.
func (c W8A8Gemm) Check() error {
	if c.Trans {
		return c.checkTrans()
	}
	switch {
	case c.BM < 64 || c.BM%64 != 0 || c.BM > 256:
		return fmt.Errorf("w8a8 tile %s: BM = %d, want 64, 128, 192 or 256", c.Tag(), c.BM)
	case c.BN < 8 || (fp8.BlockSize%c.BN != 0 && !c.wideDown()) || c.width() > 256:
		return fmt.Errorf("w8a8 tile %s: BN = %d, want a divisor of 128 of at least 8, or 256 for a persistent down tile (a wgmma of %d columns at most 256)", c.Tag(), c.BN, c.width())
	case c.Producers > 0 && c.width() > 128 && c.Producers != 4:
		return fmt.Errorf("w8a8 tile %s: a persistent tile of %d columns takes its registers from a producer warpgroup (Producers 4)", c.Tag(), c.width())
	case c.Stages < 2:
		return fmt.Errorf("w8a8 tile %s: %d stages, want at least 2", c.Tag(), c.Stages)
	case c.Producers != 0 && c.Producers != 1 && c.Producers != 2 && c.Producers != 4:
		return fmt.Errorf("w8a8 tile %s: %d producer warps, want 0 (not persistent), 1, 2 or 4", c.Tag(), c.Producers)
	case c.Producers > 0 && (c.BN%(4*c.Producers) != 0 || c.BM%(4*c.Producers) != 0):
		return fmt.Errorf("w8a8 tile %s: BM and BN must be multiples of %d rows (four per producer warp)", c.Tag(), 4*c.Producers)
	case c.SmemBytes()+c.staticSmem() > MoEGemmSmemLimit:
		return fmt.Errorf("w8a8 tile %s: %d bytes of shared memory, more than %d", c.Tag(), c.SmemBytes()+c.staticSmem(), MoEGemmSmemLimit)
	}
	return nil
}

// checkTrans is Check for a transposed tile (moe_w8t's static assertions).
func (c W8A8Gemm) checkTrans() error {
	switch {
	case c.BM < 8 || c.BM%8 != 0 || c.BM > 64:
		return fmt.Errorf("w8a8 tile %s: BM = %d, want a multiple of 8 from 8 to 64 (the wgmma's N)", c.Tag(), c.BM)
	case c.BN != 64 && c.BN != 128:
		return fmt.Errorf("w8a8 tile %s: BN = %d, want 64 or 128 (a warpgroup per 64 columns)", c.Tag(), c.BN)
	case c.Stages < 2:
		return fmt.Errorf("w8a8 tile %s: %d stages, want at least 2", c.Tag(), c.Stages)
	case c.Producers != 0:
		return fmt.Errorf("w8a8 tile %s: a transposed tile has no producer warps", c.Tag())
	case c.SmemBytes()+c.staticSmem() > MoEGemmSmemLimit:
		return fmt.Errorf("w8a8 tile %s: %d bytes of shared memory, more than %d", c.Tag(), c.SmemBytes()+c.staticSmem(), MoEGemmSmemLimit)
	}
	return nil
}

// wideDown reports a persistent down tile of 256 columns (BN 256: two scale
// blocks, one a wgmma half).
func (c W8A8Gemm) wideDown() bool { return !c.Up && c.BN == 256 && c.Producers > 0 }

// mmaWidth is the N of the tile's wgmma: width() (the columns), half of it
// for a wide persistent tile (moe_w8p's two halves of 128), or BM (the
// rows) for a transposed tile.
func (c W8A8Gemm) mmaWidth() int {
	switch {
	case c.Trans:
		return c.BM
	case c.Producers > 0 && c.width() > 128:
		return c.width() / 2
	}
	return c.width()
}

// W8A8Source returns moe_w8a8.cu as it is compiled: the grid-dependency
// macros, moe_tile.cuh, moe_fp8_mma.cu's helpers and templates (fp8_exp,
// FP8_MAX_KB; none of its instances), the file, then the wgmma wrappers and
// the extern "C" instances of every tile of W8A8Gemms.
func W8A8Source() string {
	return gridDeps + tileSource + fp8MMASource + quantSource + w8a8Source + w8a8Instances()
}

func w8a8Instances() string {
	var b strings.Builder
	b.WriteString("\n// ---- Generated by moekernels.w8a8Instances from moekernels.W8A8Gemms.\n")
	var ws []int
	for _, c := range W8A8Gemms {
		if !slices.Contains(ws, c.mmaWidth()) {
			ws = append(ws, c.mmaWidth())
		}
	}
	slices.Sort(ws)
	for _, n := range ws {
		b.WriteString(w8MMA(n))
	}
	for _, c := range W8A8Gemms {
		fn, t := "moe_w8", fmt.Sprintf("%d, %d, %d", c.BM, c.BN, c.Stages)
		switch {
		case c.Producers > 0:
			fn, t = "moe_w8p", t+fmt.Sprintf(", %d", c.Producers)
		case c.Trans:
			fn = "moe_w8t"
		}
		if c.Up {
			fmt.Fprintf(&b, `extern "C" __global__ __launch_bounds__(%d, 1) void %s(const unsigned char* __restrict__ xq, const float* __restrict__ xs, const unsigned char* __restrict__ gu, const float* __restrict__ gus, const int* __restrict__ sorted, const int* __restrict__ block_expert, const int* __restrict__ npost, unsigned short* __restrict__ act, int TK, int K, int H, int I) {
    %s<%s, true>(xq, xs, gu, gus, sorted, block_expert, npost, act, TK, K, H, I);
}
`, c.Threads(), c.Name(), fn, t)
			continue
		}
		fmt.Fprintf(&b, `extern "C" __global__ __launch_bounds__(%d, 1) void %s(const unsigned char* __restrict__ aq, const float* __restrict__ as, const unsigned char* __restrict__ down, const float* __restrict__ downs, const int* __restrict__ sorted, const int* __restrict__ block_expert, const int* __restrict__ npost, unsigned short* __restrict__ out, int TK, int H, int I) {
    %s<%s, false>(aq, as, down, downs, sorted, block_expert, npost, out, TK, 1, I, H);
}
`, c.Threads(), c.Name(), fn, t)
	}
	return b.String()
}

// w8MMA returns the w8_mma specialisation for an e4m3 wgmma of width n (its
// n/2 accumulator registers listed one by one; scale-d from acc).
func w8MMA(n int) string {
	regs := make([]string, n/2)
	outs := make([]string, n/2)
	for i := range regs {
		regs[i] = fmt.Sprintf("%%%d", i)
		outs[i] = fmt.Sprintf(`"+f"(d[%d])`, i)
	}
	return fmt.Sprintf(`template <>
__device__ __forceinline__ void w8_mma<%d>(float* d, unsigned long long a, unsigned long long b, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %%%d, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n%dk32.f32.e4m3.e4m3 {%s}, %%%d, %%%d, p, 1, 1;\n}\n"
        : %s
        : "l"(a), "l"(b), "r"(acc) : "memory");
}
`, n, n/2+2, n, strings.Join(regs, ", "), n/2, n/2+1, strings.Join(outs, ", "))
}

// FP8QuantArgs are the parameters of gpuctx_moe_fp8_quant.
// Bounded != 0 quantizes only the rows below min(R, *Npost); Npost is not
// read otherwise (pass any buffer).
type FP8QuantArgs[P Pointer] struct {
	X, Codes, Scales, Npost P
	R, K, Bounded           int32
}

func (a FP8QuantArgs[P]) args() []any {
	return []any{a.X, a.Codes, a.Scales, a.Npost, a.R, a.K, a.Bounded}
}

// W8A8UpArgs are the parameters of every gpuctx_moe_w8a8_up_<tag>.
type W8A8UpArgs[P Pointer] struct {
	Xq, Xs, Gu, Gus, Sorted, BlockExpert, Npost, Act P
	TK, K, H, I                                      int32
}

func (a W8A8UpArgs[P]) args() []any {
	return []any{a.Xq, a.Xs, a.Gu, a.Gus, a.Sorted, a.BlockExpert, a.Npost, a.Act, a.TK, a.K, a.H, a.I}
}

// W8A8DownArgs are the parameters of every gpuctx_moe_w8a8_down_<tag>.
type W8A8DownArgs[P Pointer] struct {
	Aq, As, Down, Downs, Sorted, BlockExpert, Npost, Out P
	TK, H, I                                             int32
}

func (a W8A8DownArgs[P]) args() []any {
	return []any{a.Aq, a.As, a.Down, a.Downs, a.Sorted, a.BlockExpert, a.Npost, a.Out, a.TK, a.H, a.I}
}

// The launch arguments (Launcher) of the quantizer and the w8a8 tiles, and
// the twins'.
type (
	FP8Quant     = FP8QuantArgs[*gpuctx.Buffer]
	W8A8Up       = W8A8UpArgs[*gpuctx.Buffer]
	W8A8Down     = W8A8DownArgs[*gpuctx.Buffer]
	fp8QuantArgs = FP8QuantArgs[Ptr]
	w8a8UpArgs   = W8A8UpArgs[Ptr]
	w8a8DownArgs = W8A8DownArgs[Ptr]
)

// NewW8A8Up looks up, on d, the kernel of up tile c (W8A8Gemm.Name),
// compiling moe_w8a8.cu on first use on CUDA (compute capability 9.0 only). A
// tile that is not an up tile of W8A8Gemms is an error wrapping
// gpuctx.ErrInvalid.
func NewW8A8Up(d *gpuctx.Device, c W8A8Gemm) (Launcher[W8A8Up], error) {
	if !c.Up || !slices.Contains(W8A8Gemms, c) {
		return Launcher[W8A8Up]{}, fmt.Errorf("moekernels: NewW8A8Up: tile %s is not a compiled up tile (W8A8Gemms): %w", c.Tag(), gpuctx.ErrInvalid)
	}
	return newLauncher[W8A8Up](d, c.Name())
}

// NewW8A8Down looks up, on d, the kernel of down tile c (W8A8Gemm.Name).
func NewW8A8Down(d *gpuctx.Device, c W8A8Gemm) (Launcher[W8A8Down], error) {
	if c.Up || !slices.Contains(W8A8Gemms, c) {
		return Launcher[W8A8Down]{}, fmt.Errorf("moekernels: NewW8A8Down: tile %s is not a compiled down tile (W8A8Gemms): %w", c.Tag(), gpuctx.ErrInvalid)
	}
	return newLauncher[W8A8Down](d, c.Name())
}

func init() {
	ks := []kernels.Kernel{kernels.Twin(FP8QuantName, moeFP8Quant)}
	for _, c := range W8A8Gemms {
		bm := c.BM
		if c.Up {
			ks = append(ks, kernels.Twin(c.Name(), func(m kernels.Memory, a *w8a8UpArgs) error { return moeW8A8Up(m, a, bm) }))
		} else {
			ks = append(ks, kernels.Twin(c.Name(), func(m kernels.Memory, a *w8a8DownArgs) error { return moeW8A8Down(m, a, bm) }))
		}
	}
	kernels.Register(kernels.Source{File: W8A8File, Text: W8A8Source(), Kernels: ks, Archs: []int{90}})
}

// fp8QuantEps is the floor of a group's absolute maximum (1e-10f of
// moe_w8a8.cu, moe/fp8's scaleEps).
const fp8QuantEps float32 = 1e-10

// QuantizeRow is gpuctx_moe_fp8_quant on one row: x (bf16 bits) into codes
// (len(x)) and scales (ceil(len(x)/128)), every operation rounded to float32
// as the kernel rounds it. For finite x it equals fp8.QuantizeActivations
// with group 128.
func QuantizeRow(codes []uint8, scales []float32, x []uint16) {
	const B = fp8.BlockSize
	for g := range scales {
		k0, k1 := g*B, min((g+1)*B, len(x))
		var amax float32
		for _, h := range x[k0:k1] {
			if a := float32(math.Abs(float64(bf16ToF32(h)))); a > amax { // fmaxf: a NaN is skipped
				amax = a
			}
		}
		s := max(amax, fp8QuantEps) / fp8.MaxE4M3
		scales[g] = s
		for k := k0; k < k1; k++ {
			codes[k] = quantCode(bf16ToF32(x[k]) / s)
		}
	}
}

// quantCode is cvt.rn.satfinite.e4m3x2.f32 on one value: fp8.E4M3, but a NaN
// gives the canonical NaN code 0x7f.
func quantCode(v float32) uint8 {
	if v != v {
		return fp8.NaNE4M3
	}
	return fp8.E4M3(v)
}

// moeFP8Quant is the twin of gpuctx_moe_fp8_quant.
func moeFP8Quant(m kernels.Memory, a *fp8QuantArgs) error {
	R, K := int(a.R), int(a.K)
	G := (K + fp8.BlockSize - 1) / fp8.BlockSize
	if R < 0 || K <= 0 || K%8 != 0 || int64(R)*int64(G) >= 1<<30 {
		return fmt.Errorf("fp8_quant: R=%d K=%d: want R >= 0, K a positive multiple of 8 and R*ceil(K/128) < 2^30", R, K)
	}
	rows := R
	if a.Bounded != 0 {
		np, err := kernels.Slice[int32](m, "npost", a.Npost, 1)
		if err != nil {
			return err
		}
		rows = min(R, max(int(np[0]), 0))
	}
	x, err := kernels.Slice[uint16](m, "x", a.X, int64(R)*int64(K))
	if err != nil {
		return err
	}
	codes, err := kernels.Slice[uint8](m, "codes", a.Codes, int64(R)*int64(K))
	if err != nil {
		return err
	}
	scales, err := kernels.Slice[float32](m, "scales", a.Scales, int64(R)*int64(G))
	if err != nil {
		return err
	}
	parallelRows(rows, func(r int) { QuantizeRow(codes[r*K:(r+1)*K], scales[r*G:(r+1)*G], x[r*K:(r+1)*K]) })
	return nil
}

// parallelRows calls fn(r) for r in [0, n) on up to GOMAXPROCS goroutines.
func parallelRows(n int, fn func(r int)) {
	workers := min(runtime.GOMAXPROCS(0), n)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := w; r < n; r += workers {
				fn(r)
			}
		}()
	}
	wg.Wait()
}

// W8A8Dot is one output of the w8a8 tiles before its bf16 rounding: x codes
// and their scales xs (one per 128 columns) times w codes and w's block
// scales ws along K = len(x), in moe_w8a8.cu's order: for each K block in
// increasing order, p = the block's products summed in ascending k (f32), s =
// xs[b] * ws[b], acc = p * s + acc (one fused multiply-add, FMA32), every
// operation rounded to float32.
func W8A8Dot(x []uint8, xs []float32, w []uint8, ws []float32) float32 {
	const B = fp8.BlockSize
	var acc float32
	for b, sw := range ws {
		var p float32
		for k := b * B; k < min((b+1)*B, len(x)); k++ {
			p += float32(fp8.FromE4M3(x[k]) * fp8.FromE4M3(w[k]))
		}
		s := float32(xs[b] * sw)
		acc = FMA32(p, s, acc)
	}
	return acc
}

// FMA32 returns x*y + z rounded once to float32, to nearest even: CUDA's
// __fmaf_rn (fma.rn.f32). The product of two float32 values is exact in
// float64; the float64 sum s is rounded, so its error e is recovered (Knuth's
// two-sum) and decides the one case where rounding s to float32 would differ
// from rounding the exact sum: s exactly halfway between two float32 values
// with e != 0 (double rounding).
func FMA32(x, y, z float32) float32 {
	p, zz := float64(x)*float64(y), float64(z)
	s := p + zz
	r := float32(s)
	if math.IsInf(s, 0) || math.IsNaN(s) || float64(r) == s {
		// Exactly representable (the exact sum is within half a float64 ulp
		// of r, far inside r's rounding interval), or not finite.
		return r
	}
	bv := s - p
	e := (p - (s - bv)) + (zz - bv)
	if e == 0 {
		return r
	}
	// The float32 neighbour of r on s's side; s halfway between them?
	o := math.Nextafter32(r, float32(math.Copysign(math.Inf(1), s-float64(r))))
	if s != (float64(r)+float64(o))/2 {
		return r
	}
	if (e > 0) == (float64(o) > float64(r)) {
		return o
	}
	return r
}

// moeW8A8Up is the twin of gpuctx_moe_w8a8_up_<tag> for tiles of BM rows.
func moeW8A8Up(m kernels.Memory, a *w8a8UpArgs, BM int) error {
	TK, K, H, I := int(a.TK), int(a.K), int(a.H), int(a.I)
	if err := fp8Dims("w8a8_up", TK, K, H, I); err != nil {
		return err
	}
	sorted, blockExpert, rows, maxE, err := fusedPlan(m, a.Sorted, a.BlockExpert, a.Npost, BM, TK)
	if err != nil {
		return fmt.Errorf("w8a8_up: %w", err)
	}
	const B = fp8.BlockSize
	nbi, kbh := (I+B-1)/B, (H+B-1)/B
	T := (TK + K - 1) / K
	xq, err := kernels.Slice[uint8](m, "xq", a.Xq, int64(T)*int64(H))
	if err != nil {
		return err
	}
	xs, err := kernels.Slice[float32](m, "xs", a.Xs, int64(T)*int64(kbh))
	if err != nil {
		return err
	}
	gu, err := kernels.Slice[uint8](m, "gu", a.Gu, int64(maxE+1)*2*int64(I)*int64(H))
	if err != nil {
		return err
	}
	gus, err := kernels.Slice[float32](m, "gus", a.Gus, int64(maxE+1)*2*int64(nbi*kbh))
	if err != nil {
		return err
	}
	act, err := kernels.Slice[uint16](m, "act", a.Act, int64(rows)*int64(I))
	if err != nil {
		return err
	}
	fp8EachRow(blockExpert, BM, func(p, e int) {
		ar := act[p*I : (p+1)*I]
		s := int(sorted[p])
		if s >= TK {
			clear(ar)
			return
		}
		t := s / K
		xr, xsr := xq[t*H:(t+1)*H], xs[t*kbh:(t+1)*kbh]
		for i := range I {
			g := W8A8Dot(xr, xsr, gu[(e*2*I+i)*H:][:H], gus[((e*2)*nbi+i/B)*kbh:][:kbh])
			u := W8A8Dot(xr, xsr, gu[(e*2*I+I+i)*H:][:H], gus[((e*2+1)*nbi+i/B)*kbh:][:kbh])
			g, u = bf16ToF32(f32ToBF16(g)), bf16ToF32(f32ToBF16(u))
			ar[i] = f32ToBF16(fp8SwiGLU(g, u))
		}
	})
	return nil
}

// moeW8A8Down is the twin of gpuctx_moe_w8a8_down_<tag> for tiles of BM rows.
func moeW8A8Down(m kernels.Memory, a *w8a8DownArgs, BM int) error {
	TK, H, I := int(a.TK), int(a.H), int(a.I)
	if err := fp8Dims("w8a8_down", TK, 1, H, I); err != nil {
		return err
	}
	sorted, blockExpert, rows, maxE, err := fusedPlan(m, a.Sorted, a.BlockExpert, a.Npost, BM, TK)
	if err != nil {
		return fmt.Errorf("w8a8_down: %w", err)
	}
	const B = fp8.BlockSize
	nbh, kbi := (H+B-1)/B, (I+B-1)/B
	aq, err := kernels.Slice[uint8](m, "aq", a.Aq, int64(rows)*int64(I))
	if err != nil {
		return err
	}
	as, err := kernels.Slice[float32](m, "as", a.As, int64(rows)*int64(kbi))
	if err != nil {
		return err
	}
	down, err := kernels.Slice[uint8](m, "down", a.Down, int64(maxE+1)*int64(H)*int64(I))
	if err != nil {
		return err
	}
	downs, err := kernels.Slice[float32](m, "downs", a.Downs, int64(maxE+1)*int64(nbh*kbi))
	if err != nil {
		return err
	}
	out, err := kernels.Slice[uint16](m, "out", a.Out, int64(TK)*int64(H))
	if err != nil {
		return err
	}
	fp8EachRow(blockExpert, BM, func(p, e int) {
		s := int(sorted[p])
		if s >= TK {
			return
		}
		ar, asr := aq[p*I:(p+1)*I], as[p*kbi:(p+1)*kbi]
		or := out[s*H : (s+1)*H]
		for h := range H {
			or[h] = f32ToBF16(W8A8Dot(ar, asr, down[(e*H+h)*I:][:I], downs[(e*nbh+h/B)*kbi:][:kbi]))
		}
	})
	return nil
}
