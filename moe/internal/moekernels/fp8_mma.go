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

// FP8MMAFile names the registered source of the tensor-core w8a16 expert
// GEMMs.
const FP8MMAFile = "moe_fp8_mma.cu"

//go:embed moe_fp8_mma.cu
var fp8MMASource string

// FP8Gemm is one tile configuration of the weight-only FP8 (w8a16) grouped
// expert GEMMs of moe_fp8_mma.cu: bf16 activations, E4M3 weight codes with
// 128x128 f32 block scales (scale_inv), converted to bf16 in registers and
// multiplied by mma.sync (bf16, f32 accumulation), each 128-column K block's
// sum scaled and added in increasing block order. The rows are those of
// MoEGemm's tiles (gpuctx_moe_align's sorted, blockExpert, npost with the
// same BM):
//
//	gpuctx_moe_fp8_up_<tag>   (x, gu, gus, sorted, blockExpert, npost, act hal.Ptr, TK, K, H, I, E0, ns int32)
//	    as gpuctx_moe_up_<tag> of MoEGemm with gu [E][2I][H] E4M3 codes (gate
//	    rows, then up rows) and gus [E][2][ceil(I/128)][ceil(H/128)] f32, the
//	    gate's then the up's scale_inv; act[p,i] = bf16(fp8_swiglu(bf16(g),
//	    bf16(u))). Grid (ceil(I/BN), cap/BM).
//	gpuctx_moe_fp8_down_<tag> (act, down, downs, sorted, blockExpert, npost, out hal.Ptr, TK, H, I int32)
//	    as gpuctx_moe_down_<tag> with down [E][H][I] codes and downs
//	    [E][ceil(H/128)][ceil(I/128)] f32. Grid (ceil(H/BN), cap/BM).
//
// Both take block (Threads(), 1, 1) and SmemBytes(up) bytes of dynamic
// shared memory. H and I must be multiples of 16 and at most FP8MaxK, every
// matrix 16-byte aligned. Both call MOE_GRID_WAIT before they read the sort
// (they may be launched early). The results do not depend on the tile.
type FP8Gemm struct {
	BM, BN int // tile rows (sorted token rows, 16 or 32) and columns (BN divides 128)
	WarpsN int // warps, side by side over the BN columns
	Stages int // cp.async pipeline depth, one 128-column K block per stage
	// Trans multiplies with the roles of mma.sync's operands swapped
	// (moe_fp8_mma.cu's f8_block_t): 16 weight rows as the A operand, 8
	// token rows as B, so that one mma covers 256 weights, the converted
	// weights go straight into the A registers, and 8 token rows without
	// data cost no mma. BN/WarpsN must be a multiple of 16.
	Trans bool
}

// FP8MaxK bounds H and I of the FP8 expert GEMMs (FP8_MAX_KB K blocks: the
// block scales of a tile are staged in static shared memory).
const FP8MaxK = 64 * fp8.BlockSize

// FP8Gemms lists the compiled FP8 tiles, smallest first.
var FP8Gemms = []FP8Gemm{
	{BM: 16, BN: 16, WarpsN: 2, Stages: 8}, // the most blocks for 1-8 tokens
	{BM: 16, BN: 32, WarpsN: 2, Stages: 6},
	{BM: 16, BN: 32, WarpsN: 4, Stages: 6},
	{BM: 16, BN: 64, WarpsN: 4, Stages: 4},
	{BM: 16, BN: 128, WarpsN: 8, Stages: 3},
	{BM: 32, BN: 32, WarpsN: 2, Stages: 6},
	{BM: 32, BN: 64, WarpsN: 4, Stages: 4}, // 64-256 tokens: fewer re-reads of an expert
	{BM: 16, BN: 32, WarpsN: 2, Stages: 6, Trans: true},
	{BM: 16, BN: 64, WarpsN: 4, Stages: 4, Trans: true},
	{BM: 16, BN: 128, WarpsN: 8, Stages: 3, Trans: true},
	{BM: 32, BN: 64, WarpsN: 4, Stages: 4, Trans: true},
}

// Tried on the H200 and dropped (session 11, call 5: BenchmarkFP8Expert,
// slower than m16n128w8s3t in every cell of DeepSeek-V2-Lite and
// Qwen3-30B-A3B at 1-256 tokens, e.g. DeepSeek-V2-Lite 64 tokens up 127.4
// and 173.2 us against 109.7): the transposed m16n128w4s3 (two m-tiles a
// warp) and m16n64w2s4.
//
// Also tried and dropped (session 12, commit 861564b): "F16" twins of the four
// transposed tiles, multiplying in f16 so that E4M3 codes take one
// conversion instruction per two (cvt.rn.f16x2.e4m3x2) instead of four; each
// stage's activations were converted once in shared memory to f16 times a
// power of two per row and K block, scaled back before the block scale. On
// the H200 they were bitwise equal to the twin on exact data (also with
// per-block magnitudes from 2^-30 to 2^30) and to the bf16 tiles on general
// data, but no faster: up within 2% either way (DeepSeek-V2-Lite 64 tokens
// 109.5 against 110.0 us), down 10-20% slower (62.4 against 55.4; Qwen3-30B-A3B
// 106.2 against 88.0), the extra barrier-bound conversion costing more than
// the instructions saved. The tiles are latency-bound, not issue-bound.
//
// Also tried and dropped (session 17, commit 7c6ed13, reverted): transposed
// tiles split over K inside the block (KS groups of WarpsN warps, each stage
// KS K blocks, one a group; group 0 added the others' scaled block sums
// through shared memory in block order, so the bits were KS = 1's; the
// CUDA tests passed). The point was more warps per multiprocessor for the
// few-row tiles, whose one warp a scheduler waits 3.2 cycles per
// instruction at one token. On the H200 they were no faster:
// m16n64w4k4s2t (16 warps) took 17.5 us for Qwen3-30B-A3B's one-token up
// GEMM against 17.4-19.5 for m16n64w4s4t and 17.8 for m16n64w4s4,
// m16n64w4k2s3t 20.0; the downs and every 8-token cell were slower (8
// tokens up 77.1 against 58.4 for m16n128w8s3t). ncu of the k4 up kernel:
// 18.05 us at 29% of DRAM as before, 23% occupancy instead of 6%, but 35%
// more instructions (4.78 M against 3.53 M) and 8.8 cycles per instruction
// a warp. Its 213 KB of shared memory also left no room beside it: in
// DeepSeek-V2-Lite's dual mode, where the tuner had picked it, the shared
// expert no longer overlapped (dual 72.2 us against fused 64.4). Deeper
// pipelines did not pay either (session 17, never committed): m16n64w4s6t
// and m16n64w4s8t took 18.0 and 18.4 us for that up GEMM, and 80.3 and 82.9
// at 8 tokens; m16n128w8s5t gained 1.2 us on DeepSeek-V3's one-token down
// GEMM (38.6 against 39.8) and lost elsewhere. What bounds the one-token
// tiles is still open: neither one warp's latency nor bytes in flight alone.

// Tag is the suffix of the tile's kernel names, e.g. "m16n32w2s6", or
// "m16n32w2s6t" for a transposed tile.
func (c FP8Gemm) Tag() string {
	t := ""
	if c.Trans {
		t = "t"
	}
	return fmt.Sprintf("m%dn%dw%ds%d%s", c.BM, c.BN, c.WarpsN, c.Stages, t)
}

// UpName is the name of the tile's gate/up + SwiGLU kernel.
func (c FP8Gemm) UpName() string { return "gpuctx_moe_fp8_up_" + c.Tag() }

// DownName is the name of the tile's down-projection kernel.
func (c FP8Gemm) DownName() string { return "gpuctx_moe_fp8_down_" + c.Tag() }

// Threads is the block size.
func (c FP8Gemm) Threads() int { return 32 * c.WarpsN }

// Grid is the launch grid over n output columns (I for up, H for down) and
// cap sorted rows: (ceil(n/BN), cap/BM).
func (c FP8Gemm) Grid(n, cap int) (x, y int) { return (n + c.BN - 1) / c.BN, cap / c.BM }

// SmemBytes is the dynamic shared memory of the up (gate and up tiles) or
// down kernel: Stages copies of a BM x 128 bf16 A tile and of the BN (up:
// 2*BN) x 128 code B tile.
func (c FP8Gemm) SmemBytes(up bool) int {
	nb := 1
	if up {
		nb = 2
	}
	return c.Stages * (c.BM*fp8.BlockSize*2 + nb*c.BN*fp8.BlockSize)
}

// staticSmem is the static shared memory: the row tables and the staged
// scales of both halves.
func (c FP8Gemm) staticSmem() int { return 8*c.BM + 2*4*FP8MaxK/fp8.BlockSize }

// Check reports why c cannot be instantiated (moe_fp8_mma.cu's static
// assertions and the shared-memory limit), or nil.
func (c FP8Gemm) Check() error {
	th := c.Threads()
	switch {
	case c.BM != 16 && c.BM != 32:
		return fmt.Errorf("fp8 tile %s: BM = %d, want 16 or 32", c.Tag(), c.BM)
	case c.BN < 8 || fp8.BlockSize%c.BN != 0:
		return fmt.Errorf("fp8 tile %s: BN = %d, want a divisor of 128 of at least 8", c.Tag(), c.BN)
	case c.WarpsN < 1 || c.BN%(8*c.WarpsN) != 0:
		return fmt.Errorf("fp8 tile %s: each of the %d warps needs a multiple of 8 columns", c.Tag(), c.WarpsN)
	case c.Trans && c.BN%(16*c.WarpsN) != 0:
		return fmt.Errorf("fp8 tile %s: a transposed tile's %d warps each need a multiple of 16 columns", c.Tag(), c.WarpsN)
	case (c.BM*16)%th != 0 || c.BM*16 < th:
		return fmt.Errorf("fp8 tile %s: the A tile's %d chunks do not split evenly over %d threads", c.Tag(), c.BM*16, th)
	case (c.BN*8)%th != 0 || c.BN*8 < th:
		return fmt.Errorf("fp8 tile %s: the down B tile's %d chunks do not split evenly over %d threads", c.Tag(), c.BN*8, th)
	case c.Stages < 2:
		return fmt.Errorf("fp8 tile %s: %d stages, want at least 2", c.Tag(), c.Stages)
	case c.SmemBytes(true)+c.staticSmem() > MoEGemmSmemLimit:
		return fmt.Errorf("fp8 tile %s: %d bytes of shared memory, more than %d", c.Tag(), c.SmemBytes(true)+c.staticSmem(), MoEGemmSmemLimit)
	}
	return nil
}

// FP8MMASource returns moe_fp8_mma.cu as it is compiled: the grid-dependency
// macros, moe_tile.cuh, the file, then the extern "C" instances of every
// tile of FP8Gemms.
func FP8MMASource() string { return gridDeps + tileSource + fp8MMASource + fp8MMAInstances() }

func fp8MMAInstances() string {
	var b strings.Builder
	b.WriteString("\n// ---- Generated by moekernels.fp8MMAInstances from moekernels.FP8Gemms.\n")
	for _, c := range FP8Gemms {
		t := fmt.Sprintf("%d, %d, %d, %d", c.BM, c.BN, c.WarpsN, c.Stages)
		tr := fmt.Sprint(c.Trans)
		fmt.Fprintf(&b, `extern "C" __global__ __launch_bounds__(%d) void %s(const unsigned short* __restrict__ x, const unsigned char* __restrict__ gu, const float* __restrict__ gus, const int* __restrict__ sorted, const int* __restrict__ block_expert, const int* __restrict__ npost, unsigned short* __restrict__ act, int TK, int K, int H, int I, int E0, int ns) {
    fp8_gemm<%s, true, %s>(x, gu, gus, sorted, block_expert, npost, act, TK, K, H, I, E0, ns);
}
`, c.Threads(), c.UpName(), t, tr)
		fmt.Fprintf(&b, `extern "C" __global__ __launch_bounds__(%d) void %s(const unsigned short* __restrict__ act, const unsigned char* __restrict__ down, const float* __restrict__ downs, const int* __restrict__ sorted, const int* __restrict__ block_expert, const int* __restrict__ npost, unsigned short* __restrict__ out, int TK, int H, int I) {
    fp8_gemm<%s, false, %s>(act, down, downs, sorted, block_expert, npost, out, TK, 1, I, H, 0, 0);
}
`, c.Threads(), c.DownName(), t, tr)
	}
	return b.String()
}

// FP8UpArgs are the parameters of every gpuctx_moe_fp8_up_<tag>
// (FP8Gemm.UpName).
type FP8UpArgs[P Pointer] struct {
	X, Gu, Gus, Sorted, BlockExpert, Npost, Act P
	TK, K, H, I, E0, Ns                         int32
}

func (a FP8UpArgs[P]) args() []any {
	return []any{a.X, a.Gu, a.Gus, a.Sorted, a.BlockExpert, a.Npost, a.Act, a.TK, a.K, a.H, a.I, a.E0, a.Ns}
}

// FP8DownArgs are the parameters of every gpuctx_moe_fp8_down_<tag>
// (FP8Gemm.DownName).
type FP8DownArgs[P Pointer] struct {
	Act, Down, Downs, Sorted, BlockExpert, Npost, Out P
	TK, H, I                                          int32
}

func (a FP8DownArgs[P]) args() []any {
	return []any{a.Act, a.Down, a.Downs, a.Sorted, a.BlockExpert, a.Npost, a.Out, a.TK, a.H, a.I}
}

// The launch arguments (Launcher) of the FP8 tiles, and the twins'.
type (
	FP8Up       = FP8UpArgs[*gpuctx.Buffer]
	FP8Down     = FP8DownArgs[*gpuctx.Buffer]
	fp8UpArgs   = FP8UpArgs[Ptr]
	fp8DownArgs = FP8DownArgs[Ptr]
)

// NewFP8Up looks up, on d, the up kernel of FP8 tile c (FP8Gemm.UpName),
// compiling moe_fp8_mma.cu on first use on CUDA. A tile that is not one of
// FP8Gemms is an error wrapping gpuctx.ErrInvalid.
func NewFP8Up(d *gpuctx.Device, c FP8Gemm) (Launcher[FP8Up], error) {
	if !slices.Contains(FP8Gemms, c) {
		return Launcher[FP8Up]{}, fmt.Errorf("moekernels: NewFP8Up: tile %s is not compiled (FP8Gemms): %w", c.Tag(), gpuctx.ErrInvalid)
	}
	return newLauncher[FP8Up](d, c.UpName())
}

// NewFP8Down looks up, on d, the down kernel of FP8 tile c (FP8Gemm.DownName).
func NewFP8Down(d *gpuctx.Device, c FP8Gemm) (Launcher[FP8Down], error) {
	if !slices.Contains(FP8Gemms, c) {
		return Launcher[FP8Down]{}, fmt.Errorf("moekernels: NewFP8Down: tile %s is not compiled (FP8Gemms): %w", c.Tag(), gpuctx.ErrInvalid)
	}
	return newLauncher[FP8Down](d, c.DownName())
}

func init() {
	var ks []kernels.Kernel
	for _, c := range FP8Gemms {
		bm := c.BM // the tile shape changes no result: one body per BM
		ks = append(ks,
			kernels.Twin(c.UpName(), func(m kernels.Memory, a *fp8UpArgs) error { return moeFP8Up(m, a, bm) }),
			kernels.Twin(c.DownName(), func(m kernels.Memory, a *fp8DownArgs) error { return moeFP8Down(m, a, bm) }))
	}
	kernels.Register(kernels.Source{File: FP8MMAFile, Text: FP8MMASource(), Kernels: ks})
}

// fp8Exp is fp8_exp of moe_fp8_mma.cu: exp(v) by Cody-Waite reduction and a
// degree-6 Taylor polynomial, every operation rounded to float32 (the
// conversions keep Go from fusing them), so that it gives the kernel's bits.
func fp8Exp(v float32) float32 {
	if v < -87 {
		v = -87
	} else if v > 88 {
		v = 88
	}
	n := float32(math.RoundToEven(float64(float32(v * 1.44269502))))
	r := v - float32(n*0.693145751953125)
	r -= float32(n * 1.428606765330187e-06)
	p := float32(1.0 / 720)
	p = float32(p*r) + 1.0/120
	p = float32(p*r) + 1.0/24
	p = float32(p*r) + 1.0/6
	p = float32(p*r) + 0.5
	p = float32(p*r) + 1
	p = float32(p*r) + 1
	if v != v {
		return v
	}
	return float32(p * math.Float32frombits(uint32(int32(n)+127)<<23))
}

// fp8SwiGLU is fp8_swiglu of moe_fp8_mma.cu: g / (1 + exp(-g)) * u, each
// operation rounded to float32.
func fp8SwiGLU(g, u float32) float32 {
	s := float32(g / float32(1+fp8Exp(-g)))
	return float32(s * u)
}

// fp8Dims checks the dimensions of an FP8 expert GEMM.
func fp8Dims(op string, TK, K, H, I int) error {
	if TK < 0 || K <= 0 || H <= 0 || I <= 0 || H%16 != 0 || I%16 != 0 || H > FP8MaxK || I > FP8MaxK {
		return fmt.Errorf("%s: TK=%d K=%d H=%d I=%d: want TK >= 0, K > 0 and H, I positive multiples of 16 up to %d", op, TK, K, H, I, FP8MaxK)
	}
	return nil
}

// fp8EachRow calls fn(p, e) for every row p of every block with an expert
// (e = blockExpert[b] >= 0), spread over GOMAXPROCS goroutines (fn writes
// only row p's outputs, so the results do not depend on the spread).
func fp8EachRow(blockExpert []int32, BM int, fn func(p, e int)) {
	var blocks []int
	for b, e := range blockExpert {
		if e >= 0 {
			blocks = append(blocks, b)
		}
	}
	workers := min(runtime.GOMAXPROCS(0), len(blocks))
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < len(blocks); i += workers {
				b := blocks[i]
				for p := b * BM; p < (b+1)*BM; p++ {
					fn(p, int(blockExpert[b]))
				}
			}
		}()
	}
	wg.Wait()
}

func bf16Row(h []uint16) []float32 {
	out := make([]float32, len(h))
	for i, v := range h {
		out[i] = bf16ToF32(v)
	}
	return out
}

// moeFP8Up is the twin of gpuctx_moe_fp8_up_<tag> for tiles of BM rows: each
// block sum in ascending k (fp8RowDot, moe/fp8.GemmW8A16's order).
func moeFP8Up(m kernels.Memory, a *fp8UpArgs, BM int) error {
	TK, K, H, I := int(a.TK), int(a.K), int(a.H), int(a.I)
	if err := fp8Dims("fp8_up", TK, K, H, I); err != nil {
		return err
	}
	sorted, blockExpert, rows, maxE, err := fusedPlan(m, a.Sorted, a.BlockExpert, a.Npost, BM, TK)
	if err != nil {
		return fmt.Errorf("fp8_up: %w", err)
	}
	if err := sharedRowsFirst(sorted, blockExpert, BM, TK, K, int(a.E0), int(a.Ns)); err != nil {
		return err
	}
	const B = fp8.BlockSize
	nbi, kbh := (I+B-1)/B, (H+B-1)/B
	x, err := kernels.Slice[uint16](m, "x", a.X, int64((TK+K-1)/K)*int64(H))
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
		xr := bf16Row(x[(s/K)*H : (s/K+1)*H])
		for i := range I {
			g := fp8RowDot(xr, gu[(e*2*I+i)*H:][:H], gus[((e*2)*nbi+i/B)*kbh:][:kbh])
			u := fp8RowDot(xr, gu[(e*2*I+I+i)*H:][:H], gus[((e*2+1)*nbi+i/B)*kbh:][:kbh])
			g, u = bf16ToF32(f32ToBF16(g)), bf16ToF32(f32ToBF16(u))
			ar[i] = f32ToBF16(fp8SwiGLU(g, u))
		}
	})
	return nil
}

// moeFP8Down is the twin of gpuctx_moe_fp8_down_<tag> for tiles of BM rows.
func moeFP8Down(m kernels.Memory, a *fp8DownArgs, BM int) error {
	TK, H, I := int(a.TK), int(a.H), int(a.I)
	if err := fp8Dims("fp8_down", TK, 1, H, I); err != nil {
		return err
	}
	sorted, blockExpert, rows, maxE, err := fusedPlan(m, a.Sorted, a.BlockExpert, a.Npost, BM, TK)
	if err != nil {
		return fmt.Errorf("fp8_down: %w", err)
	}
	const B = fp8.BlockSize
	nbh, kbi := (H+B-1)/B, (I+B-1)/B
	act, err := kernels.Slice[uint16](m, "act", a.Act, int64(rows)*int64(I))
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
		ar := bf16Row(act[p*I : (p+1)*I])
		or := out[s*H : (s+1)*H]
		for h := range H {
			or[h] = f32ToBF16(fp8RowDot(ar, down[(e*H+h)*I:][:I], downs[(e*nbh+h/B)*kbi:][:kbi]))
		}
	})
	return nil
}
