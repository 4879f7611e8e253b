package moekernels

import (
	"fmt"
	"slices"
	"strings"
)

// MoEGemm is one tile configuration of the fused expert GEMM kernels of
// moe_gemm.cu (mma.sync) or moe_wgmma.cu (warpgroup tiles, compute capability
// 9.0 only), bf16 operands, f32 accumulation on tensor cores; both families
// compute the same bits:
//
//	gpuctx_moe_up_<tag>   (x, gu, sorted, blockExpert, npost, act hal.Ptr, TK, K, H, I, E0, ns int32)
//	    for every block b of BM sorted rows with e = blockExpert[b] >= 0 and
//	    b*BM < npost[0], and every row p of it with a = sorted[p] < TK (the
//	    token is t = a/K): g = x[t,:].gu[e,i,:], u = x[t,:].gu[e,I+i,:] (f32
//	    sums, each rounded to bf16), act[p,i] = bf16(silu(g)*u) for i < I;
//	    padding rows (a >= TK) get act[p,:] = 0. Grid (ceil(I/BN), cap/BM).
//	    ns > 0: the sort must put the ns fused shared chunks E0..E0+ns-1
//	    first (align with first = E0), each one segment of all T = TK/K
//	    tokens in order; those blocks run before the sort is done
//	    (moe_shared_rows, moe_tile.cuh). ns = 0: no such blocks.
//	gpuctx_moe_down_<tag> (act, down, sorted, blockExpert, npost, out hal.Ptr, TK, H, I int32)
//	    for the same rows with a < TK: out[a,h] = bf16(act[p,:].down[e,h,:]) for
//	    h < H; padding rows write nothing. Grid (ceil(H/BN), cap/BM).
//
// A persistent tile's grid is (min(SMs, ceil(n/BN)*(cap/BM)), 1) instead (see
// Grid), for n = I or H. All take block (Threads(), 1, 1) and SmemBytes(up)
// bytes of dynamic shared memory; H and I must be multiples of 8 and every matrix 16-byte aligned. A
// down-only tile (HasUp false) has no up kernel.
// sorted, blockExpert and npost come from gpuctx_moe_align with the same BM.
type MoEGemm struct {
	BM, BN         int // tile rows (sorted token rows) and columns (output features)
	BK             int // K depth of one pipeline stage: 64, 128 or 256 (64 for warpgroup tiles)
	WarpsM, WarpsN int // warp grid; each warp owns a (BM/WarpsM) x (BN/WarpsN) tile
	Stages         int // cp.async pipeline depth
	// Warpgroups > 0 makes a warpgroup tile of moe_wgmma.cu (wgmma, sm_90a
	// only): BM = 64*Warpgroups, each warpgroup of 128 threads owns 64 rows
	// and all columns; WarpsM and WarpsN are unused (zero).
	Warpgroups int
	// Producers > 0 makes a warpgroup tile persistent and warp-specialised
	// (moe_wgmma.cu's moe_wgp): one block per multiprocessor loops over the
	// tiles, Producers warps load the stages and the Warpgroups consumer
	// warpgroups multiply, synchronised by mbarriers.
	Producers int
}

// Tag is the suffix of the config's kernel names, e.g. "m16n64k64w1x4s4", or
// "m128n128k64g2s4" for a warpgroup tile and "m128n128k64g2s4p4" for a
// persistent one with four producer warps.
func (c MoEGemm) Tag() string {
	if c.Warpgroups > 0 {
		p := ""
		if c.Producers > 0 {
			p = fmt.Sprintf("p%d", c.Producers)
		}
		return fmt.Sprintf("m%dn%dk%dg%ds%d%s", c.BM, c.BN, c.BK, c.Warpgroups, c.Stages, p)
	}
	return fmt.Sprintf("m%dn%dk%dw%dx%ds%d", c.BM, c.BN, c.BK, c.WarpsM, c.WarpsN, c.Stages)
}

// Grid is the launch grid of the config's up (n = I) or down (n = H) kernel
// over cap sorted rows on a device of sms multiprocessors: one block per
// BM x BN tile, (ceil(n/BN), cap/BM), or for a persistent tile one block per
// multiprocessor (at least one), no more than the tiles:
// (min(sms, ceil(n/BN)*(cap/BM)), 1).
func (c MoEGemm) Grid(n, cap, sms int) (x, y int) {
	nx, ny := (n+c.BN-1)/c.BN, cap/c.BM
	if c.Producers > 0 {
		return min(max(sms, 1), nx*ny), 1
	}
	return nx, ny
}

// MaxGridY is CUDA's limit on a grid's y dimension, which holds the row
// blocks of a tile that is not persistent.
const MaxGridY = 65535

// Fits reports whether the config's kernels can run over cap sorted rows: a
// persistent tile always can; another needs cap/BM <= MaxGridY row blocks
// (16-row tiles stop at about a million sorted rows, e.g. DeepSeek-V3's
// 131072 tokens times 8). The tuner skips the tiles that do not fit.
func (c MoEGemm) Fits(cap int) bool { return c.Producers > 0 || cap/c.BM <= MaxGridY }

// HasUp reports whether the config has an up kernel: every mma.sync tile, and
// the warpgroup tiles whose gate and up columns fit one wgmma (2*BN <= 256).
// The others are down-only tiles.
func (c MoEGemm) HasUp() bool { return c.Warpgroups == 0 || 2*c.BN <= 256 }

// File is the compilation unit that defines the config's kernels, registered
// on its own so that a run compiles only the tiles it launches:
// "moe_gemm_<tag>.cu" for an mma.sync tile, "moe_wgmma_<tag>.cu" for a
// warpgroup tile (see TileSource).
func (c MoEGemm) File() string {
	return strings.TrimSuffix(c.Family(), ".cu") + "_" + c.Tag() + ".cu"
}

// Family is the source file the config's templates come from: GemmFile or
// WgmmaFile.
func (c MoEGemm) Family() string {
	if c.Warpgroups > 0 {
		return WgmmaFile
	}
	return GemmFile
}

// UpName is the name of the config's gate/up + SwiGLU kernel.
func (c MoEGemm) UpName() string { return "gpuctx_moe_up_" + c.Tag() }

// DownName is the name of the config's down-projection kernel.
func (c MoEGemm) DownName() string { return "gpuctx_moe_down_" + c.Tag() }

// Threads is the block size: for a persistent tile, its consumer warpgroups
// and its producer warps.
func (c MoEGemm) Threads() int {
	if c.Producers > 0 {
		return 128*c.Warpgroups + 32*c.Producers
	}
	if c.Warpgroups > 0 {
		return 128 * c.Warpgroups
	}
	return 32 * c.WarpsM * c.WarpsN
}

// SmemBytes is the dynamic shared memory of the up (gate and up tiles) or
// down kernel: Stages copies of an A tile and one or two B tiles, and for a
// warpgroup tile 1024 bytes more (its tiles start at a 1024-byte boundary).
// A persistent tile's mbarriers are static (see staticSmem).
func (c MoEGemm) SmemBytes(up bool) int {
	b := c.BN
	if up && c.HasUp() {
		b = 2 * c.BN
	}
	n := c.Stages * (c.BM + b) * c.BK * 2
	if c.Warpgroups > 0 {
		n += 1024
	}
	return n
}

// MoEGemms lists the compiled tile configurations, smallest tiles first.
// Package moe picks one per batch size; every config's kernels share one Go
// twin per direction (the tile shape changes no result).
var MoEGemms = []MoEGemm{
	{BM: 16, BN: 16, BK: 128, WarpsM: 1, WarpsN: 1, Stages: 4}, // one warp: the most blocks for 1-8 tokens
	{BM: 16, BN: 16, BK: 64, WarpsM: 1, WarpsN: 1, Stages: 8},
	{BM: 16, BN: 32, BK: 64, WarpsM: 1, WarpsN: 2, Stages: 8},
	{BM: 16, BN: 32, BK: 128, WarpsM: 1, WarpsN: 2, Stages: 4},
	// 512-byte row segments per stage: longer contiguous weight reads for
	// 1-64 tokens (the tuner picked them for Qwen3-30B-A3B's up at 1 token and
	// DeepSeek-V2-Lite's down at 1 token on the H200, s4_run3).
	{BM: 16, BN: 32, BK: 256, WarpsM: 1, WarpsN: 2, Stages: 3},
	{BM: 16, BN: 64, BK: 256, WarpsM: 1, WarpsN: 4, Stages: 3},
	{BM: 16, BN: 64, BK: 64, WarpsM: 1, WarpsN: 4, Stages: 6},
	{BM: 16, BN: 64, BK: 128, WarpsM: 1, WarpsN: 4, Stages: 4},
	{BM: 16, BN: 128, BK: 64, WarpsM: 1, WarpsN: 4, Stages: 4},
	{BM: 32, BN: 128, BK: 64, WarpsM: 1, WarpsN: 8, Stages: 4},
	{BM: 32, BN: 64, BK: 64, WarpsM: 1, WarpsN: 4, Stages: 6},
	{BM: 64, BN: 64, BK: 64, WarpsM: 2, WarpsN: 2, Stages: 3},
	{BM: 64, BN: 64, BK: 64, WarpsM: 2, WarpsN: 2, Stages: 4},
	{BM: 64, BN: 128, BK: 64, WarpsM: 2, WarpsN: 2, Stages: 3},
	{BM: 64, BN: 128, BK: 64, WarpsM: 2, WarpsN: 2, Stages: 4},
	{BM: 128, BN: 64, BK: 64, WarpsM: 2, WarpsN: 2, Stages: 3},
	{BM: 128, BN: 64, BK: 64, WarpsM: 2, WarpsN: 2, Stages: 4},
	{BM: 128, BN: 64, BK: 64, WarpsM: 2, WarpsN: 4, Stages: 3},
	{BM: 128, BN: 128, BK: 64, WarpsM: 2, WarpsN: 4, Stages: 3},
	// Warpgroup tiles (moe_wgmma.cu, compute capability 9.0 only).
	{BM: 64, BN: 64, BK: 64, Warpgroups: 1, Stages: 4},
	{BM: 64, BN: 128, BK: 64, Warpgroups: 1, Stages: 4},
	{BM: 128, BN: 64, BK: 64, Warpgroups: 2, Stages: 3}, // two blocks per SM
	{BM: 128, BN: 64, BK: 64, Warpgroups: 2, Stages: 4},
	{BM: 128, BN: 64, BK: 64, Warpgroups: 2, Stages: 6},
	{BM: 128, BN: 128, BK: 64, Warpgroups: 2, Stages: 3},
	{BM: 128, BN: 128, BK: 64, Warpgroups: 2, Stages: 4},
	{BM: 192, BN: 128, BK: 64, Warpgroups: 3, Stages: 3},
	{BM: 192, BN: 128, BK: 64, Warpgroups: 3, Stages: 4},
	{BM: 128, BN: 256, BK: 64, Warpgroups: 2, Stages: 3}, // down only
	{BM: 128, BN: 256, BK: 64, Warpgroups: 2, Stages: 4}, // down only
	{BM: 192, BN: 256, BK: 64, Warpgroups: 3, Stages: 3}, // down only
	// Persistent, warp-specialised warpgroup tiles: as many stages as fit.
	// One producer warp was the bottleneck (m128n128k64g2s4p1: 2.1x the time
	// of m128n128k64g2s4 at 4096 tokens on the H200, s5_persist.sh).
	{BM: 128, BN: 128, BK: 64, Warpgroups: 2, Stages: 4, Producers: 2},
	{BM: 128, BN: 128, BK: 64, Warpgroups: 2, Stages: 4, Producers: 4},
	{BM: 128, BN: 256, BK: 64, Warpgroups: 2, Stages: 4, Producers: 2}, // down only
	{BM: 128, BN: 256, BK: 64, Warpgroups: 2, Stages: 4, Producers: 4}, // down only
}

// MoEGemmSmemLimit is the shared memory one block may use on the GPUs the
// fused kernels target (sm_80 and sm_90: 227 KiB), static part included.
const MoEGemmSmemLimit = 227 << 10

// staticSmem is the static shared memory of the config's kernels (the larger
// of up and down): the row arrays (two ints per tile row), or for a persistent
// tile its 2*Stages mbarriers (8 bytes each). A warpgroup tile's dynamic
// shared memory is declared 1024-byte aligned, which rounds its static part
// up to a multiple of 1024 (ptxas -v reports 1024 bytes for BM 128, 2048 for
// BM 192).
func (c MoEGemm) staticSmem() int {
	n := 8 * c.BM
	if c.Producers > 0 {
		n = 16 * c.Stages
	}
	if c.Warpgroups > 0 {
		n = (n + 1023) &^ 1023
	}
	return n
}

// Check reports why c cannot be instantiated (the static assertions of
// moe_gemm.cu or moe_wgmma.cu and the shared-memory limit), or nil.
func (c MoEGemm) Check() error {
	var err error
	if c.Warpgroups > 0 {
		err = c.checkWarpgroup()
	} else {
		err = c.checkMMA()
	}
	if err != nil {
		return err
	}
	if n := c.SmemBytes(true) + c.staticSmem(); n > MoEGemmSmemLimit {
		return fmt.Errorf("tile %s: %d bytes of shared memory, more than %d", c.Tag(), n, MoEGemmSmemLimit)
	}
	return nil
}

// checkWarpgroup checks the static assertions of moe_wgmma.cu.
func (c MoEGemm) checkWarpgroup() error {
	switch {
	case c.BK != 64:
		return fmt.Errorf("tile %s: BK = %d, a warpgroup tile needs 64 (one 128-byte swizzle row)", c.Tag(), c.BK)
	case c.BM != 64*c.Warpgroups:
		return fmt.Errorf("tile %s: BM = %d, want 64 rows per warpgroup (%d)", c.Tag(), c.BM, 64*c.Warpgroups)
	case c.WarpsM != 0 || c.WarpsN != 0:
		return fmt.Errorf("tile %s: a warpgroup tile has no warp grid", c.Tag())
	case c.BN%8 != 0 || c.BN > 256:
		return fmt.Errorf("tile %s: BN = %d, want a multiple of 8 up to 256 (one wgmma; above 128 the tile is down-only)", c.Tag(), c.BN)
	case c.Producers == 0 && c.Stages < 3:
		return fmt.Errorf("tile %s: %d stages, a warpgroup tile needs at least 3", c.Tag(), c.Stages)
	case c.Producers > 0:
		return c.checkPersistent()
	}
	return nil
}

// checkPersistent checks the static assertions of moe_wgmma.cu's moe_wgp.
func (c MoEGemm) checkPersistent() error {
	switch {
	case c.Stages < 2:
		return fmt.Errorf("tile %s: %d stages, a persistent tile needs at least 2", c.Tag(), c.Stages)
	case c.Producers != 1 && c.Producers != 2 && c.Producers != 4:
		return fmt.Errorf("tile %s: %d producer warps, want 1, 2 or 4", c.Tag(), c.Producers)
	case c.BN%(c.Producers*4) != 0 || c.BM%(c.Producers*4) != 0:
		return fmt.Errorf("tile %s: BM and BN must be multiples of %d rows (four per producer warp)", c.Tag(), c.Producers*4)
	}
	return nil
}

// checkMMA checks the static assertions of moe_gemm.cu.
func (c MoEGemm) checkMMA() error {
	th := c.Threads()
	switch {
	case c.Producers != 0:
		return fmt.Errorf("tile %s: only a warpgroup tile can be persistent", c.Tag())
	case c.BK != 64 && c.BK != 128 && c.BK != 256:
		return fmt.Errorf("tile %s: BK = %d, want 64, 128 or 256", c.Tag(), c.BK)
	case c.WarpsM < 1 || c.WarpsN < 1 || c.BM%(16*c.WarpsM) != 0 || c.BN%(16*c.WarpsN) != 0:
		return fmt.Errorf("tile %s: each warp's tile must be a multiple of 16x16", c.Tag())
	case c.BM*c.BK/8 < th || (c.BM*c.BK/8)%th != 0:
		return fmt.Errorf("tile %s: the A tile's %d 16-byte chunks do not split evenly over %d threads", c.Tag(), c.BM*c.BK/8, th)
	case c.BN*c.BK/8 < th || (c.BN*c.BK/8)%th != 0:
		return fmt.Errorf("tile %s: the B tile's %d 16-byte chunks do not split evenly over %d threads", c.Tag(), c.BN*c.BK/8, th)
	case c.Stages < 2:
		return fmt.Errorf("tile %s: %d stages, want at least 2", c.Tag(), c.Stages)
	}
	return nil
}

// moeGemmInstances returns the extern "C" wrappers that instantiate the
// templates of moe_gemm.cu for every config in MoEGemms (GemmSource). The
// header line is the one the kernels package generated before the MoE kernels
// moved here.
func moeGemmInstances() string {
	var b strings.Builder
	b.WriteString(gemmInstancesHead)
	for _, c := range MoEGemms {
		if c.Warpgroups == 0 {
			b.WriteString(gemmInstance(c))
		}
	}
	return b.String()
}

const gemmInstancesHead = "\n// ---- Generated by kernels.moeGemmInstances from kernels.MoEGemms.\n"

// gemmInstance returns the extern "C" up and down wrappers of the mma.sync
// tile c.
func gemmInstance(c MoEGemm) string {
	var b strings.Builder
	t := fmt.Sprintf("%d, %d, %d, %d, %d, %d", c.BM, c.BN, c.BK, c.WarpsM, c.WarpsN, c.Stages)
	fmt.Fprintf(&b, `extern "C" __global__ __launch_bounds__(%d) void %s(const unsigned short* __restrict__ x, const unsigned short* __restrict__ gu, const int* __restrict__ sorted, const int* __restrict__ block_expert, const int* __restrict__ npost, unsigned short* __restrict__ act, int TK, int K, int H, int I, int E0, int ns) {
    moe_gemm<%s, true>(x, gu, sorted, block_expert, npost, act, TK, K, H, I, E0, ns);
}
`, c.Threads(), c.UpName(), t)
	fmt.Fprintf(&b, `extern "C" __global__ __launch_bounds__(%d) void %s(const unsigned short* __restrict__ act, const unsigned short* __restrict__ down, const int* __restrict__ sorted, const int* __restrict__ block_expert, const int* __restrict__ npost, unsigned short* __restrict__ out, int TK, int H, int I) {
    moe_gemm<%s, false>(act, down, sorted, block_expert, npost, out, TK, 1, I, H, 0, 0);
}
`, c.Threads(), c.DownName(), t)
	return b.String()
}

// wgmmaInstances returns the generated tail of moe_wgmma.cu for the
// warpgroup tiles among cs: one wg_mma specialisation per wgmma width they use
// (the instruction lists its N/2 accumulator registers one by one), then the
// extern "C" instances of each tile (moe_wg, or moe_wgp for a persistent tile,
// at most one block per multiprocessor).
func wgmmaInstances(cs []MoEGemm) string {
	var b strings.Builder
	b.WriteString("\n// ---- Generated by moekernels.wgmmaInstances from moekernels.MoEGemms.\n")
	var ws []int
	for _, c := range cs {
		if c.Warpgroups == 0 {
			continue
		}
		for _, n := range []int{c.BN, 2 * c.BN} {
			if n <= 256 && !slices.Contains(ws, n) { // above 256: a down-only tile
				ws = append(ws, n)
			}
		}
	}
	slices.Sort(ws)
	for _, n := range ws {
		b.WriteString(wgMMA(n))
	}
	for _, c := range cs {
		if c.Warpgroups > 0 {
			b.WriteString(wgmmaInstance(c))
		}
	}
	return b.String()
}

// wgMMA returns the wg_mma specialisation for a wgmma of width n.
func wgMMA(n int) string {
	regs := make([]string, n/2)
	outs := make([]string, n/2)
	for i := range regs {
		regs[i] = fmt.Sprintf("%%%d", i)
		outs[i] = fmt.Sprintf(`"+f"(d[%d])`, i)
	}
	return fmt.Sprintf(`template <>
__device__ __forceinline__ void wg_mma<%d>(float* d, unsigned long long a, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %%%d, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n%dk16.f32.bf16.bf16 {%s}, %%%d, %%%d, p, 1, 1, 0, 0;\n}\n"
        : %s
        : "l"(a), "l"(b), "r"(1) : "memory");
}
`, n, n/2+2, n, strings.Join(regs, ", "), n/2, n/2+1, strings.Join(outs, ", "))
}

// wgmmaInstance returns the extern "C" up (if any) and down wrappers of the
// warpgroup tile c.
func wgmmaInstance(c MoEGemm) string {
	var b strings.Builder
	t := fmt.Sprintf("%d, %d, %d", c.BM, c.BN, c.Stages)
	fn, bounds := "moe_wg", fmt.Sprint(c.Threads())
	if c.Producers > 0 {
		t += fmt.Sprintf(", %d", c.Producers)
		fn, bounds = "moe_wgp", fmt.Sprintf("%d, 1", c.Threads())
	}
	if c.HasUp() {
		fmt.Fprintf(&b, `extern "C" __global__ __launch_bounds__(%s) void %s(const unsigned short* __restrict__ x, const unsigned short* __restrict__ gu, const int* __restrict__ sorted, const int* __restrict__ block_expert, const int* __restrict__ npost, unsigned short* __restrict__ act, int TK, int K, int H, int I, int E0, int ns) {
    %s<%s, true>(x, gu, sorted, block_expert, npost, act, TK, K, H, I, E0, ns);
}
`, bounds, c.UpName(), fn, t)
	}
	fmt.Fprintf(&b, `extern "C" __global__ __launch_bounds__(%s) void %s(const unsigned short* __restrict__ act, const unsigned short* __restrict__ down, const int* __restrict__ sorted, const int* __restrict__ block_expert, const int* __restrict__ npost, unsigned short* __restrict__ out, int TK, int H, int I) {
    %s<%s, false>(act, down, sorted, block_expert, npost, out, TK, 1, I, H, 0, 0);
}
`, bounds, c.DownName(), fn, t)
	return b.String()
}
