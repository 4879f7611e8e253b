// FP8 x FP8 (w8a8) grouped expert GEMMs for the compute-bound batches, on
// Hopper's warpgroup tensor-core instructions (wgmma.mma_async e4m3.e4m3,
// sm_90a only), and the per-token-group activation quantizer they read.
// Compiled as one unit after moe_tile.cuh and moe_fp8_mma.cu (for fp8_exp);
// the extern "C" instances and the wgmma wrappers are generated from
// moekernels.W8A8Gemms and appended when the file is loaded.
//
// Every kernel here may be launched early (gpuctx.Stream.LaunchEarly): each
// calls MOE_GRID_WAIT before it reads or writes memory the kernels ahead of it
// on its stream touch, and MOE_GRID_LAUNCH after. They run on the stream they
// are launched on and wait for nothing else.
//
//   QUANT gpuctx_moe_fp8_quant (x, codes, scales, npost, R, K, bounded): x
//   [R, K] bf16 -> codes [R, K] E4M3 and scales [R, ceil(K/128)] f32, per row
//   per group of 128 columns (the last partial), vLLM's per_token_group_quant_fp8
//   rule as moe/fp8.QuantizeActivations computes it: amax = max |x| over the
//   group, s = max(amax, 1e-10) / 448 (so a group of zeros gets codes 0 and a
//   tiny positive scale), code = E4M3(x / s), round to nearest even, saturating
//   (cvt.rn.satfinite; -0 and negative values rounding to zero give 0x80).
//   A NaN is skipped by the max and gives a NaN code; an infinity gives an
//   infinite scale (NaN and zero codes in its group). K a multiple of 8, R *
//   ceil(K/128) < 2^30. With bounded != 0 only the rows below min(R,
//   npost[0]) are quantized (the sorted rows of gpuctx_moe_align: a launch
//   sized for the cap converts only what the down tile reads) and the others
//   are left as they are; with bounded == 0 npost is not read. A half-warp
//   per (row, group), 8 columns (16 bytes) a lane, grid-stride: grid (FP8QuantBlocks(R, K), 1, 1), block (256, 1, 1), no
//   dynamic shared memory.
//
//   UP gpuctx_moe_w8a8_up_<tag> (xq, xs, gu, gus, sorted, block_expert, npost,
//   act, TK, K, H, I): A row p is token sorted[p] / K of xq [T, H] codes with
//   xs [T, ceil(H/128)] scales (QUANT of x); gu [E][2I][H] codes and gus
//   [E][2][ceil(I/128)][ceil(H/128)] as moe_fp8_mma.cu's up tile; act[p, n] =
//   bf16(fp8_swiglu(bf16(g), bf16(u))), padding rows zeros, exactly the w8a16
//   up tile's epilogue. No fused shared expert (every block waits for the
//   sort). Grid (ceil(I/BN), cap/BM).
//   DOWN gpuctx_moe_w8a8_down_<tag> (aq, as, down, downs, sorted,
//   block_expert, npost, out, TK, H, I): A row p is aq[p] ([cap, I] codes, as
//   [cap, ceil(I/128)] scales: QUANT of act); down and downs as the w8a16 down
//   tile's; out[sorted[p], n] = bf16(acc) for real rows. Grid (ceil(H/BN),
//   cap/BM).
// Both: block (128 * BM/64, 1, 1), W8A8Gemm.SmemBytes() of dynamic shared
// memory; H and I multiples of 16 of at most 128 * FP8_MAX_KB; sorted,
// block_expert and npost from gpuctx_moe_align with the tile's BM. The
// persistent tiles (moe_w8p, below) take the same arguments with grid
// (min(SMs, tiles), 1) and block (128 * BM/64 + 32 * PW, 1, 1).
//
// Accumulation order of every GEMM output (the Go twin, w8a8.go, repeats it):
//   acc = 0
//   for each K block kb (128 columns, the last partial), in increasing order:
//       p = the f32 tensor-core sum of the block's products of E4M3 values
//           (four wgmma k32 steps, the first with scale-d = 0; zeros past K)
//       s = sa[row][kb] * sb[n / 128][kb]          (__fmul_rn)
//       acc = p * s + acc                           (__fmaf_rn: one rounding)
// with sa the activation row's scale and sb the weight block's scale_inv. The
// products of two E4M3 values are exact in f32; the tensor core adds them in
// its own order and internal precision, so p equals the twin's ascending f32
// sum only when the block's products are exactly summable (small integer
// multiples of a common power of two): the CUDA tests compare such data bit
// for bit, other data within a tolerance.
//
// Layout and pipeline are moe_wgmma.cu's moe_wg: each warpgroup owns 64 tile
// rows and every column (up: the gate's BN then the up's BN columns in one
// wgmma of N = 2*BN); shared-memory tiles are K-major, 128 bytes (one K block
// of 128 codes: one 128B-swizzle row) per tile row, chunk c of row r at chunk
// c ^ (r & 7), 8-row atoms 1024 bytes apart, STAGES of them filled by
// cp.async STAGES-1 ahead. Each stage is one scale block: the four wgmma of
// the block into blk, wgmma.wait_group 0, then the scaled add into acc.

#define W8_BK 128

static __device__ __forceinline__ unsigned w8_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

static __device__ __forceinline__ void w8_cp16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

static __device__ __forceinline__ void w8_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
static __device__ __forceinline__ void w8_cpwait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Shared-memory matrix descriptor of a K-major tile with 128-byte swizzle (as
// moe_wgmma.cu's wg_desc): start address / 16, leading byte offset 16 (unused
// by this layout), stride byte offset 1024 (between 8-row atoms), swizzle
// mode 1 (128B).
static __device__ __forceinline__ unsigned long long w8_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

static __device__ __forceinline__ void w8_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void w8_commit_mma() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void w8_wait_mma0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// w8_mma<N>(d, a, b, acc): d[64 x N] = (acc ? d : 0) + A[64 x 32] * B[N x
// 32]^T, E4M3 operands, for this warpgroup (generated specialisations, one
// per N used).
template <int N>
static __device__ __forceinline__ void w8_mma(float* d, unsigned long long a, unsigned long long b, int acc);

// ---- The quantizer.

// w8_e4m3x2, w8_codes2 and w8_quant8 are in moe_quant.cuh (compiled ahead
// of this file, and of moe.cu, whose gpuctx_moe_route_align quantizes x
// for small batches with them).

extern "C" __global__ __launch_bounds__(256) void gpuctx_moe_fp8_quant(const unsigned short* __restrict__ x,
                                                                        unsigned char* __restrict__ codes,
                                                                        float* __restrict__ scales,
                                                                        const int* __restrict__ npost, int R, int K,
                                                                        int bounded) {
    MOE_GRID_WAIT();
    MOE_GRID_LAUNCH();
    const int G = (K + W8_BK - 1) / W8_BK;
    const int rows = bounded ? min(R, max(npost[0], 0)) : R;
    const int n = rows * G;  // R * G < 2^30 (the twin checks it)
    const int lane = threadIdx.x & 15;
    const unsigned mask = 0xffffu << (threadIdx.x & 16);
    const int stride = gridDim.x * 16;
    // The 16 lanes of a half-warp share every item (the two halves of a warp
    // may leave the loop one item apart), so each shuffle's mask, the half,
    // names exactly the lanes that reach it.
    const int w0 = blockIdx.x * 16 + (threadIdx.x >> 4);
    const int dr = stride / G, dg = stride - dr * G;  // the row and group steps of one stride
    int r = w0 / G, g = w0 - r * G;
    for (int w = w0; w < n; w += stride) {
        const int k = g * W8_BK + 8 * lane;
        const bool ok = k < K;
        const long long off = (long long)r * K + k;
        const uint4 h = ok ? *(const uint4*)(x + off) : make_uint4(0u, 0u, 0u, 0u);
        float s;
        const uint2 c = w8_quant8(h, mask, s);
        if (ok) *(uint2*)(codes + off) = c;
        if (lane == 0) scales[w] = s;
        r += dr;
        g += dg;
        if (g >= G) {
            g -= G;
            ++r;
        }
    }
}

// ---- The GEMM tiles.

extern __shared__ __align__(1024) unsigned char w8_dyn[];

// w8_store_half stores row half hr of this thread's accumulators d to row dst
// of C (moe_wgmma.cu's wg_store_half with the w8a16 epilogue: fp8_swiglu of
// the bf16-rounded gate and up sums for UP, or zeros for a padding row).
// UP computes every column's 1 + exp(-g) first, then the divisions: the
// exponentials are branch-free and independent, so they overlap, where one
// fp8_swiglu after another ran as a chain of dependent steps split by the
// division's slow-path branch (the same operations in the same order per
// column: the same bits).
template <int BN, bool UP>
static __device__ __forceinline__ void w8_store_half(const float* d, int hr, int dst, bool zero,
                                                     unsigned short* __restrict__ C, int N, int n0, int lane) {
    unsigned short* row = C + (long long)dst * N;
    if (UP && zero) {  // a padding row: zeros, nothing to compute
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int n = n0 + j * 8 + (lane & 3) * 2;
            if (n < N) *(unsigned*)(row + n) = 0u;
        }
        return;
    }
    if (UP) {
        float g[BN / 8][2], t[BN / 8][2];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int v = 0; v < 2; ++v) {
                g[j][v] = moe_round(d[4 * j + 2 * hr + v]);
                t[j][v] = __fadd_rn(1.0f, fp8_exp(-g[j][v]));
            }
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int n = n0 + j * 8 + (lane & 3) * 2;
            if (n >= N) continue;
            unsigned short o[2];
#pragma unroll
            for (int v = 0; v < 2; ++v) {
                const float u = moe_round(d[4 * (BN / 8 + j) + 2 * hr + v]);
                o[v] = moe_f2bf(__fmul_rn(__fdiv_rn(g[j][v], t[j][v]), u));  // fp8_swiglu(g, u)
            }
            *(unsigned*)(row + n) = (unsigned)o[0] | ((unsigned)o[1] << 16);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int n = n0 + j * 8 + (lane & 3) * 2;
        if (n >= N) continue;
        const unsigned short v0 = moe_f2bf(d[4 * j + 2 * hr]), v1 = moe_f2bf(d[4 * j + 2 * hr + 1]);
        *(unsigned*)(row + n) = (unsigned)v0 | ((unsigned)v1 << 16);
    }
}

// moe_w8: the up (UP) or down kernel of tile BM x BN, BM/64 warpgroups.
// Dynamic shared memory: STAGES * (BM + NB*BN) * 128 bytes + 1024 (the tiles
// start at a 1024-byte boundary, which the swizzle needs). A: codes of the
// A rows (UP: token rows of xq; DOWN: rows of aq), AS their scales.
template <int BM, int BN, int STAGES, bool UP>
static __device__ __forceinline__ void moe_w8(const unsigned char* __restrict__ A, const float* __restrict__ AS,
                                              const unsigned char* __restrict__ B, const float* __restrict__ S,
                                              const int* __restrict__ sorted, const int* __restrict__ block_expert,
                                              const int* __restrict__ npost, unsigned short* __restrict__ C, int TK,
                                              int topk, int Kdim, int N) {
    constexpr int CH = 8;  // 128 codes = 128 bytes = 8 chunks per tile row
    constexpr int GROUPS = BM / 64;
    constexpr int THREADS = 128 * GROUPS;
    constexpr int NB = UP ? 2 : 1;
    constexpr int NW = NB * BN;  // columns of one wgmma: gate and up, or down
    constexpr unsigned A_BYTES = BM * 128, ST_BYTES = (BM + NW) * 128;
    static_assert(BM % 64 == 0 && NW % 8 == 0 && NW <= 256 && W8_BK % BN == 0,
                  "tile: BM a multiple of 64, NB*BN <= 256, BN divides 128");
    static_assert(STAGES >= 2, "at least two stages");
    constexpr int A_PER = BM * CH / THREADS;
    constexpr int B_PER = (NW * CH + THREADS - 1) / THREADS;  // the last round may be partial
    static_assert(A_PER * THREADS == BM * CH, "A tile chunks must split evenly");

    __shared__ int row_src[BM];  // A row of each tile row (-1: zero)
    __shared__ int row_dst[BM];  // C row of each tile row (-1: not stored)
    __shared__ float sc[NB][FP8_MAX_KB];

    const int mb = blockIdx.y;
    const int n0 = blockIdx.x * BN;
    if (n0 >= N) return;
    int e;
    // ns = 0: every block waits for the kernels ahead (the quantizer, which
    // waited for the sort) before it reads anything.
    if (!moe_tile_begin<BM, THREADS, UP>(sorted, block_expert, npost, TK, topk, 0, 0, mb, row_src, row_dst, e))
        return;
    const int tid = threadIdx.x;
    const int KB = (Kdim + W8_BK - 1) / W8_BK;
    const int kch = (tid % CH) * 16;  // byte column of this thread's chunk

    // Byte offsets from Ab (DOWN: the block's first row, a 64-bit offset) and
    // from this expert's B.
    const unsigned char* Ab = UP ? A : A + (long long)mb * BM * Kdim;
    int ga[A_PER];
    unsigned oa[A_PER];
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
        const int c = tid + i * THREADS, r = c / CH;
        const int src = row_src[r];  // DOWN: -1 or mb*BM + r
        ga[i] = src >= 0 ? (UP ? src : src - mb * BM) * Kdim + kch : -1;
        oa[i] = (unsigned)(r * 128 + (((c % CH) ^ (r & 7)) << 4));
    }
    const unsigned char* Be = B + (long long)e * NB * N * Kdim;
    int gb[B_PER];
    unsigned ob[B_PER];
#pragma unroll
    for (int i = 0; i < B_PER; ++i) {
        const int c = tid + i * THREADS, r = c / CH;
        const int half = UP ? r / BN : 0;
        const int n = n0 + (UP ? r % BN : r);
        gb[i] = n < N ? (half * N + n) * Kdim + kch : -1;
        ob[i] = A_BYTES + (unsigned)(r * 128 + (((c % CH) ^ (r & 7)) << 4));
        if (c >= NW * CH) ob[i] = ~0u;  // past the tile: this thread copies nothing
    }
    const unsigned sbase = (w8_smem(w8_dyn) + 1023u) & ~1023u;
    auto load = [&](int slot, int kb) {
        const unsigned st = sbase + (unsigned)slot * ST_BYTES;
        const int k0 = kb * W8_BK;
        const bool kok = k0 + kch < Kdim;  // Kdim is a multiple of 16: whole chunks
#pragma unroll
        for (int i = 0; i < A_PER; ++i) {
            const bool ok = kok && ga[i] >= 0;
            w8_cp16(st + oa[i], Ab + (ok ? ga[i] + k0 : 0), ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < B_PER; ++i) {
            if ((NW * CH) % THREADS != 0 && i == B_PER - 1 && ob[i] == ~0u) break;
            const bool ok = kok && gb[i] >= 0;
            w8_cp16(st + ob[i], Be + (ok ? gb[i] + k0 : 0), ok ? 16 : 0);
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KB) load(s, s);
        w8_commit();
    }
    // The weight block scales of this tile's columns (BN divides 128: one
    // block row), staged once the first loads are in flight; the loop's first
    // barrier orders these stores before their reads.
    const int NBR = (N + W8_BK - 1) / W8_BK;
    for (int i = tid; i < NB * KB; i += THREADS) {
        const int q = i / KB, kb = i - q * KB;
        sc[q][kb] = S[((long long)(e * NB + q) * NBR + n0 / W8_BK) * KB + kb];
    }

    // This thread's two accumulator rows (warp w of the group: rows 16w +
    // lane/4 and + 8) and their activation scales' rows (nullptr: padding).
    const int grp = tid >> 7, lane = tid & 31, w = (tid >> 5) & 3;
    const int r0 = grp * 64 + w * 16 + (lane >> 2);
    const float* arow[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int src = row_src[r0 + hr * 8];
        arow[hr] = src >= 0 ? AS + (long long)src * KB : nullptr;
    }

    // blk is written whole by each block's first wgmma (scale-d = 0); it is
    // zeroed once only so that no register is read undefined.
    float acc[NW / 2], blk[NW / 2];
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) acc[i] = blk[i] = 0.0f;
    for (int kb = 0; kb < KB; ++kb) {
        const float sa0 = arow[0] ? __ldg(arow[0] + kb) : 0.0f;
        const float sa1 = arow[1] ? __ldg(arow[1] + kb) : 0.0f;
        w8_cpwait<STAGES - 2>();
        // cp.async wrote through the generic proxy; wgmma reads through the
        // async proxy.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        // Every warpgroup finished stage kb-1 (wgmma.wait_group 0 before the
        // barrier): refill its buffer while this stage multiplies.
        const int nk = kb + STAGES - 1;
        if (nk < KB) load(nk % STAGES, nk);
        w8_commit();
        const unsigned st = sbase + (unsigned)(kb % STAGES) * ST_BYTES;
        const unsigned sa = st + (unsigned)grp * 64u * 128u, sb = st + A_BYTES;
        w8_fence();
#pragma unroll
        for (int kk = 0; kk < W8_BK / 32; ++kk) w8_mma<NW>(blk, w8_desc(sa + kk * 32), w8_desc(sb + kk * 32), kk);
        w8_commit_mma();
        w8_wait_mma0();
#pragma unroll
        for (int i = 0; i < NW / 2; ++i) asm volatile("" : "+f"(blk[i])::"memory");
        float s[NB][2];
#pragma unroll
        for (int h = 0; h < NB; ++h) {
            s[h][0] = __fmul_rn(sa0, sc[h][kb]);
            s[h][1] = __fmul_rn(sa1, sc[h][kb]);
        }
        // Register 4j + 2hr + v: row half hr, column 8j + 2*(lane%4) + v (for
        // UP, j < BN/8 the gate's columns, then the up's).
#pragma unroll
        for (int i = 0; i < NW / 2; ++i) {
            const int h = UP && (i / 4) >= BN / 8 ? 1 : 0;
            acc[i] = __fmaf_rn(blk[i], s[h][(i >> 1) & 1], acc[i]);
        }
    }
    w8_cpwait<0>();

#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int r = r0 + hr * 8;
        const int dst = row_dst[r];
        if (dst >= 0) w8_store_half<BN, UP>(acc, hr, dst, UP && row_src[r] < 0, C, N, n0, lane);
    }
}

// ---- Persistent, warp-specialised tiles (W8A8Gemm.Producers > 0).
//
// moe_w8p: moe_w8's kernel (same arguments, rows, padding, outputs and
// accumulation order: the same bits but for the tensor core's order within a
// block, which does not depend on the tile) as a persistent grid with PW
// producer warps and BM/64 consumer warpgroups per block, on moe_wgmma.cu's
// moe_wgp pattern: grid (min(SMs, tiles), 1), block b runs tiles t = b, b +
// gridDim.x, ... of the ceil(N/BN) * (npost[0]/BM) tiles (column block t %
// ceil(N/BN) of row block t / ceil(N/BN)), skipping those of no expert. Every
// thread calls MOE_GRID_WAIT before it reads anything.
//
// A wide tile (NB*BN = 256 columns: the up's 128 gate and 128 up columns, or
// 256 down columns) keeps 128 accumulators a thread and one block
// accumulator of 64: each stage multiplies the first 128 columns, scales
// them in, then the other 128. Its producers are a warpgroup (PW = 4) that
// gives up registers (setmaxnreg.dec 56) for the consumers' (setmaxnreg.inc
// 224: 56 * 128 + 224 * 256 is the 168 * 384 the launch allocates). At 40
// and 232, session 21's split, ptxas spilled 12 (up) and 24 (down) bytes of
// the producers' code; at 56 and 224 neither side spills (nvcc 13.0
// -Xptxas -v, cuobjdump), and the kernels are 2-4% faster (H200). The
// second half of a down tile past N reads no scale (its columns
// are not stored).
//
// Shared memory is a ring of STAGES stages (moe_w8's tiles, one K block of
// 128 codes each) with two mbarriers per stage: full[s] (count 32*PW: each
// producer thread arrives through cp.async.mbarrier.arrive.noinc when its
// copies of the stage have landed) and empty[s] (count 4*BM/64: lane 0 of
// every consumer warp arrives once its wgmma of the stage completed). The
// consumer warpgroups meet at no barrier: each multiplies a stage, releases
// it, then scales the block into its accumulators while the other
// warpgroup's wgmma run. Every mbarrier wait gives up with __trap() after
// 2^28 failed try_waits or about 5 seconds.

static __device__ __forceinline__ void w8p_bar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

static __device__ __forceinline__ void w8p_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}

static __device__ __forceinline__ void w8p_cp_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

static __device__ __forceinline__ bool w8p_try(unsigned bar, unsigned parity) {
    unsigned ok;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok != 0;
}

static __device__ __forceinline__ unsigned long long w8p_clock() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}

static __device__ __forceinline__ void w8p_wait(unsigned bar, unsigned parity) {
    if (w8p_try(bar, parity)) return;
    const unsigned long long t0 = w8p_clock();
    for (unsigned n = 1;; ++n) {
        if (w8p_try(bar, parity)) return;
        if (n >= (1u << 28) || ((n & 255u) == 0 && w8p_clock() - t0 > 5000000000ull)) __trap();
    }
}

// w8p_produce is the producers' loop of moe_w8p: lane l of the PW warps
// (pt = l) copies 16-byte chunk pt%8 of tile rows pt/8 + RSTEP*i of every
// stage (A rows, then B rows).
template <int BM, int BN, int STAGES, int PW, bool UP>
static __device__ __forceinline__ void w8p_produce(const unsigned char* __restrict__ A,
                                                   const unsigned char* __restrict__ B,
                                                   const int* __restrict__ sorted,
                                                   const int* __restrict__ block_expert, int TK, int topk, int Kdim,
                                                   int N, int ntiles, int pt, unsigned sbase, unsigned full0,
                                                   unsigned empty0) {
    constexpr int CH = 8;
    constexpr int RSTEP = 32 * PW / CH;
    constexpr int NB = UP ? 2 : 1;
    constexpr unsigned A_BYTES = BM * 128, ST_BYTES = (BM + NB * BN) * 128;
    constexpr int A_PER = BM / RSTEP, B_HALF = BN / RSTEP;
    constexpr int SW = RSTEP % 8 == 0 ? 1 : 2;  // period of a lane's swizzle over its rows
    const int NBLK = (N + BN - 1) / BN;
    const int KB = (Kdim + W8_BK - 1) / W8_BK;
    const int q = pt / CH, kch = (pt % CH) * 16;  // byte column of this lane's chunk
    unsigned so[SW];  // shared offset of row q + RSTEP*i's chunk: so[i % SW] + i*RSTEP*128
#pragma unroll
    for (int j = 0; j < SW; ++j) so[j] = (unsigned)(q * 128 + (((pt % CH) ^ ((q + j * RSTEP) & 7)) << 4));
    int slot = 0, fills = 0;
    unsigned ph = 0;
    for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const int mb = t / NBLK, n0 = (t - mb * NBLK) * BN;
        const int e = block_expert[mb];
        if (e < 0) continue;
        // Byte offset of row q + RSTEP*i's chunk from At, a multiple of 16;
        // bit 0 set: a padding row (zeros). 32-bit: UP's rows are tokens (T*H
        // bytes), DOWN's this tile's rows from At (a 64-bit offset).
        const unsigned char* At = UP ? A : A + (long long)mb * BM * Kdim;
        unsigned ga[A_PER];
#pragma unroll
        for (int i = 0; i < A_PER; ++i) {
            const int a = sorted[mb * BM + q + RSTEP * i];
            const bool real = a >= 0 && a < TK;
            ga[i] = real ? (unsigned)((UP ? a / topk : q + RSTEP * i) * Kdim + kch) : ((unsigned)kch | 1u);
        }
        const long long b_base = UP ? (long long)e * 2 * N : (long long)e * N;
        const unsigned char* Bt = B + (b_base + n0 + q) * Kdim + kch;
        const int nlim = N - n0 - q;  // rows RSTEP*i' < nlim exist
        for (int kb = 0; kb < KB; ++kb) {
            if (fills >= STAGES) w8p_wait(empty0 + 8u * slot, ph ^ 1u);  // the slot's previous use is released
            const unsigned st = sbase + (unsigned)slot * ST_BYTES;
            const int k0 = kb * W8_BK;
            const bool kok = k0 + kch < Kdim;
            if (kok) {
#pragma unroll
                for (int i = 0; i < A_PER; ++i)
                    w8_cp16(st + so[i % SW] + i * RSTEP * 128, At + k0 + (ga[i] & ~1u), (ga[i] & 1u) ? 0 : 16);
            } else {
#pragma unroll
                for (int i = 0; i < A_PER; ++i) w8_cp16(st + so[i % SW] + i * RSTEP * 128, A, 0);
            }
            // Opaque to the compiler, so that it walks the rows stage by stage
            // instead of keeping every row's address in registers.
            long long hs = (long long)N * Kdim;
            int rs = RSTEP * Kdim;
            asm volatile("" : "+l"(hs), "+r"(rs));
#pragma unroll
            for (int h = 0; h < NB; ++h) {
                const unsigned char* src = Bt + k0 + h * hs;
#pragma unroll
                for (int i = h * B_HALF; i < (h + 1) * B_HALF; ++i, src += rs) {
                    const bool ok = kok && RSTEP * (i - h * B_HALF) < nlim;
                    w8_cp16(st + A_BYTES + so[i % SW] + i * RSTEP * 128, ok ? (const void*)src : (const void*)B, ok ? 16 : 0);
                }
            }
            w8p_cp_arrive(full0 + 8u * slot);
            ++fills;
            if (++slot == STAGES) {
                slot = 0;
                ph ^= 1u;
            }
        }
    }
    // Every fill is consumed (the consumers run the same tiles), but leave no
    // copy in flight behind the warp.
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

template <int BM, int BN, int STAGES, int PW, bool UP>
static __device__ __forceinline__ void moe_w8p(const unsigned char* __restrict__ A, const float* __restrict__ AS,
                                               const unsigned char* __restrict__ B, const float* __restrict__ S,
                                               const int* __restrict__ sorted, const int* __restrict__ block_expert,
                                               const int* __restrict__ npost, unsigned short* __restrict__ C, int TK,
                                               int topk, int Kdim, int N) {
    constexpr int GROUPS = BM / 64;
    constexpr int CONSUMERS = 128 * GROUPS;
    constexpr int PT = 32 * PW;  // producer threads
    constexpr int RSTEP = PT / 8;
    constexpr int NB = UP ? 2 : 1;
    constexpr int NW = NB * BN;
    constexpr unsigned A_BYTES = BM * 128, ST_BYTES = (BM + NW) * 128;
    // A wide tile (NW = 256: up BN = 128, down BN = 256) multiplies its
    // columns in two halves of 128 (NH), one wgmma accumulator of 64
    // registers for both: 128 + 64 accumulator registers, which the
    // consumers take from a producer warpgroup with setmaxnreg.
    constexpr bool WIDE = NW > 128;
    constexpr int NH = WIDE ? 2 : 1, WN = NW / NH;
    static_assert(BM % 64 == 0 && NW % 8 == 0 && NW <= 256 && (W8_BK % BN == 0 || (!UP && BN == 256)),
                  "tile: BM a multiple of 64, NB*BN <= 256, BN divides 128 (or a down tile of 256)");
    static_assert(STAGES >= 2, "at least two stages");
    static_assert(RSTEP % 4 == 0 && BM % RSTEP == 0 && BN % RSTEP == 0, "producer rows");
    static_assert(!WIDE || PW == 4, "a wide tile: a producer warpgroup (setmaxnreg)");

    __shared__ __align__(8) unsigned long long w8p_bars[2 * STAGES];  // full[STAGES], then empty[STAGES]

    const int tid = threadIdx.x;
    const unsigned full0 = w8_smem(w8p_bars), empty0 = full0 + 8u * STAGES;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            w8p_bar_init(full0 + 8u * s, PT);
            w8p_bar_init(empty0 + 8u * s, CONSUMERS / 32);
        }
    }
    __syncthreads();
    MOE_GRID_WAIT();  // launched early: the quantizer (and the sort before it)
    MOE_GRID_LAUNCH();

    const int NBLK = (N + BN - 1) / BN;
    const int ntiles = NBLK * (max(npost[0], 0) / BM);
    const int KB = (Kdim + W8_BK - 1) / W8_BK;
    const int NBR = (N + W8_BK - 1) / W8_BK;
    const unsigned sbase = (w8_smem(w8_dyn) + 1023u) & ~1023u;
    if (tid >= CONSUMERS) {
        if constexpr (WIDE) asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
        w8p_produce<BM, BN, STAGES, PW, UP>(A, B, sorted, block_expert, TK, topk, Kdim, N, ntiles, tid - CONSUMERS,
                                            sbase, full0, empty0);
        return;
    }

    if constexpr (WIDE) asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
    const unsigned long long d0 = w8_desc(sbase);

    // Consumers: warpgroup grp multiplies tile rows 64*grp .. 64*grp+63;
    // this thread holds rows r0 and r0 + 8.
    const int grp = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31;
    const int r0 = grp * 64 + w * 16 + (lane >> 2);
    int slot = 0;
    unsigned ph = 0;
    float acc[NW / 2], blk[WN / 2];
#pragma unroll
    for (int i = 0; i < WN / 2; ++i) blk[i] = 0.0f;
    for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const int mb = t / NBLK, n0 = (t - mb * NBLK) * BN;
        const int e = block_expert[mb];
        if (e < 0) continue;
        int a[2];
        const float* arow[2];  // the rows' activation scales (nullptr: padding)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int r = r0 + hr * 8;
            a[hr] = sorted[mb * BM + r];
            const bool real = a[hr] >= 0 && a[hr] < TK;
            arow[hr] = real ? AS + (long long)(UP ? a[hr] / topk : mb * BM + r) * KB : nullptr;
        }
        // The weight block scales of this tile's columns: the gate's (or the
        // down's) and the up's block row; a wide down tile's second half
        // the next block row (none past N: its columns are not stored).
        const float* sg = S + ((long long)(e * NB) * NBR + n0 / W8_BK) * KB;
        const float* su = WIDE && !UP ? (n0 / W8_BK + 1 < NBR ? sg + KB : nullptr)
                                      : S + ((long long)(e * NB + NB - 1) * NBR + n0 / W8_BK) * KB;
#pragma unroll
        for (int i = 0; i < NW / 2; ++i) acc[i] = 0.0f;
        for (int kb = 0; kb < KB; ++kb) {
            const float sa0 = arow[0] ? __ldg(arow[0] + kb) : 0.0f;
            const float sa1 = arow[1] ? __ldg(arow[1] + kb) : 0.0f;
            const float sbg = __ldg(sg + kb), sbu = su ? __ldg(su + kb) : 0.0f;
            w8p_wait(full0 + 8u * slot, ph);
            // The stage's cp.async writes went through the generic proxy;
            // wgmma reads through the async proxy.
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            // The stage's descriptors: w8_desc of an address plus a multiple
            // of 16 bytes is the descriptor plus the bytes / 16 (the address
            // field holds the whole shared window), so that no descriptor is
            // kept per wgmma.
            const unsigned long long da = d0 + (((unsigned)slot * ST_BYTES + (unsigned)grp * 64u * 128u) >> 4);
            const unsigned long long db = d0 + (((unsigned)slot * ST_BYTES + A_BYTES) >> 4);
            const float s[2][2] = {{__fmul_rn(sa0, sbg), __fmul_rn(sa1, sbg)}, {__fmul_rn(sa0, sbu), __fmul_rn(sa1, sbu)}};
            // Half hh (a wide tile's columns 128hh ..; else the whole tile):
            // its wgmma, then its scaled add into acc[hh * WN/2 ..]; the
            // stage is released after the last half's wgmma.
#pragma unroll
            for (int hh = 0; hh < NH; ++hh) {
                w8_fence();
#pragma unroll
                for (int kk = 0; kk < W8_BK / 32; ++kk)
                    w8_mma<WN>(blk, da + kk * 2, db + hh * WN * 8 + kk * 2, kk);
                w8_commit_mma();
                w8_wait_mma0();
                if (hh == NH - 1) {
                    // This warp's wgmma of the stage are done: release it.
                    if (lane == 0) w8p_arrive(empty0 + 8u * slot);
                    if (++slot == STAGES) {
                        slot = 0;
                        ph ^= 1u;
                    }
                }
#pragma unroll
                for (int i = 0; i < WN / 2; ++i) asm volatile("" : "+f"(blk[i])::"memory");
#pragma unroll
                for (int i = 0; i < WN / 2; ++i) {
                    const int h = WIDE ? hh : (UP && (i / 4) >= BN / 8 ? 1 : 0);
                    acc[hh * (WN / 2) + i] = __fmaf_rn(blk[i], s[h][(i >> 1) & 1], acc[hh * (WN / 2) + i]);
                }
            }
        }
        // Epilogue (moe_w8's): register 4j + 2h + v is column 8j + 2*(lane%4)
        // + v of row half h.
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const bool real = a[hr] >= 0 && a[hr] < TK;
            const int dst = UP ? mb * BM + r0 + hr * 8 : (real ? a[hr] : -1);
            if (dst >= 0) w8_store_half<BN, UP>(acc, hr, dst, UP && !real, C, N, n0, lane);
        }
    }
}

// ---- Transposed tiles (W8A8Gemm.Trans): the weights as wgmma's A operand.
//
// moe_w8t: moe_w8's kernel (same arguments, grid (ceil(N/BN), cap/BM), rows,
// padding, outputs and accumulation order) for batches of a few rows per
// expert, as the transposed w8a16 tiles: each warpgroup multiplies 64 weight
// rows (64 output columns; for UP the gate's and the same columns of the
// up's, two wgmma) by the block's BM sorted rows, wgmma m64nBMk32 with the
// weight tile as A and the row tile as B (both K-major in shared memory,
// moe_w8's swizzled layout). A block of a few rows then costs wgmma of BM
// columns, not of 64 padded rows, and each weight byte is read once per
// row block. Block (128 * BN/64, 1, 1); dynamic shared memory STAGES * (NB*BN
// + BM) * 128 + 1024 (W8A8Gemm.SmemBytes); static: the row tables, the
// weight block scales of the tile's columns and the row scales [KB][BM].
//
// Register 4j + 2hr + v of a warp's wgmma accumulator is weight row 16w +
// lane/4 + 8hr of its warpgroup's 64 and tile row (token) 8j + 2(lane%4) + v.
template <int BM, int BN, int STAGES, bool UP>
static __device__ __forceinline__ void moe_w8t(const unsigned char* __restrict__ A, const float* __restrict__ AS,
                                               const unsigned char* __restrict__ B, const float* __restrict__ S,
                                               const int* __restrict__ sorted, const int* __restrict__ block_expert,
                                               const int* __restrict__ npost, unsigned short* __restrict__ C, int TK,
                                               int topk, int Kdim, int N) {
    constexpr int CH = 8;  // 16-byte chunks per 128-code tile row
    constexpr int GROUPS = BN / 64;
    constexpr int THREADS = 128 * GROUPS;
    constexpr int NB = UP ? 2 : 1;
    constexpr int WR = NB * BN;  // weight rows of a stage: the gate's BN then the up's, or the down's
    constexpr unsigned W_BYTES = WR * 128, ST_BYTES = (WR + BM) * 128;
    static_assert(BN % 64 == 0 && W8_BK % BN == 0, "tile: BN 64 or 128 (a warpgroup per 64 columns, one scale block)");
    static_assert(BM % 8 == 0 && BM >= 8 && BM <= 64, "tile: BM a multiple of 8 of at most 64 (the wgmma's N)");
    static_assert(STAGES >= 2, "at least two stages");
    constexpr int W_PER = WR * CH / THREADS;
    constexpr int A_PER = (BM * CH + THREADS - 1) / THREADS;  // the last round may be partial
    static_assert(W_PER * THREADS == WR * CH, "weight tile chunks must split evenly");

    __shared__ int row_src[BM];
    __shared__ int row_dst[BM];
    __shared__ float sc[NB][FP8_MAX_KB];
    __shared__ float rsc[FP8_MAX_KB][BM];  // the rows' scales (0: padding)

    const int mb = blockIdx.y;
    const int n0 = blockIdx.x * BN;
    if (n0 >= N) return;
    // The block's expert first, then the first stages' weight loads, and
    // only then the sort's rows and the row loads: the weights' DRAM round
    // trip starts one L2 round trip (the rows) earlier.
    int e;
    if (!moe_tile_expert<BM>(block_expert, npost, mb, e)) return;
    const int tid = threadIdx.x;
    const int KB = (Kdim + W8_BK - 1) / W8_BK;
    const int kch = (tid % CH) * 16;

    // Weight chunks: tile row r (UP: r / BN the gate or the up, column n0 +
    // r % BN): the chunk's address at k = 0 (this expert's B for a row past
    // N, which reads nothing) and its shared-memory offset.
    const unsigned char* Be = B + (long long)e * NB * N * Kdim;
    const unsigned char* pw[W_PER];
    unsigned ow[W_PER];
    bool wall = true;  // every chunk's row is below N
#pragma unroll
    for (int i = 0; i < W_PER; ++i) {
        const int c = tid + i * THREADS, r = c / CH;
        const int half = UP ? r / BN : 0;
        const int n = n0 + (UP ? r % BN : r);
        pw[i] = n < N ? Be + ((long long)half * N + n) * Kdim + kch : nullptr;
        wall &= n < N;
        ow[i] = (unsigned)(r * 128 + (((c % CH) ^ (r & 7)) << 4));
    }
    const unsigned sbase = (w8_smem(w8_dyn) + 1023u) & ~1023u;
    auto loadW = [&](int slot, int kb) {
        const unsigned st = sbase + (unsigned)slot * ST_BYTES;
        const int k0 = kb * W8_BK;
        if (wall && k0 + W8_BK <= Kdim) {  // a whole K block of rows below N: no zeros
#pragma unroll
            for (int i = 0; i < W_PER; ++i) w8_cp16(st + ow[i], pw[i] + k0, 16);
            return;
        }
        const bool kok = k0 + kch < Kdim;  // Kdim is a multiple of 16: whole chunks
#pragma unroll
        for (int i = 0; i < W_PER; ++i) {
            const bool ok = kok && pw[i] != nullptr;
            w8_cp16(st + ow[i], ok ? pw[i] + k0 : Be, ok ? 16 : 0);
        }
    };
    // The first stages' weights; their copies join the commit group of the
    // first stage's rows below (the loop waits for stage 0's group first).
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < KB) loadW(s, s);

    moe_tile_rows<BM, THREADS, UP>(sorted, TK, topk, mb, row_src, row_dst);
    // Row chunks (the A rows of moe_w8: UP token rows of xq, DOWN rows of aq).
    const unsigned char* Ab = UP ? A : A + (long long)mb * BM * Kdim;
    int ga[A_PER];
    unsigned oa[A_PER];
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
        const int c = tid + i * THREADS, r = c / CH;
        const int src = c < BM * CH ? row_src[r] : -1;
        ga[i] = src >= 0 ? (UP ? src : src - mb * BM) * Kdim + kch : -1;
        oa[i] = c < BM * CH ? W_BYTES + (unsigned)(r * 128 + (((c % CH) ^ (r & 7)) << 4)) : ~0u;
    }
    auto loadA = [&](int slot, int kb) {
        const unsigned st = sbase + (unsigned)slot * ST_BYTES;
        const int k0 = kb * W8_BK;
        const bool kok = k0 + kch < Kdim;
#pragma unroll
        for (int i = 0; i < A_PER; ++i) {
            if ((BM * CH) % THREADS != 0 && oa[i] == ~0u) break;
            const bool ok = kok && ga[i] >= 0;
            w8_cp16(st + oa[i], Ab + (ok ? ga[i] + k0 : 0), ok ? 16 : 0);
        }
    };
    auto load = [&](int slot, int kb) {
        loadW(slot, kb);
        loadA(slot, kb);
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KB) loadA(s, s);
        w8_commit();
    }
    // The weight block scales of the tile's columns (one block row) and the
    // rows' scales, staged once the first loads are in flight; the loop's
    // first barrier orders these stores before their reads.
    const int NBR = (N + W8_BK - 1) / W8_BK;
    for (int i = tid; i < NB * KB; i += THREADS) {
        const int q = i / KB, kb = i - q * KB;
        sc[q][kb] = S[((long long)(e * NB + q) * NBR + n0 / W8_BK) * KB + kb];
    }
    for (int i = tid; i < BM * KB; i += THREADS) {
        const int r = i / KB, kb = i - r * KB;
        const int src = row_src[r];
        rsc[kb][r] = src >= 0 ? AS[(long long)src * KB + kb] : 0.0f;
    }

    const int grp = GROUPS == 1 ? 0 : tid >> 7, lane = tid & 31, w = (tid >> 5) & 3;
    const int c0 = 2 * (lane & 3);  // this thread's first tile row (token) of each 8
    constexpr int R = BM / 2;       // accumulator registers of one wgmma
    float acc[NB][R], blk[NB][R];
#pragma unroll
    for (int h = 0; h < NB; ++h)
#pragma unroll
        for (int i = 0; i < R; ++i) acc[h][i] = blk[h][i] = 0.0f;
    // The K loop runs STAGES stages per trip, unrolled, so that each stage's
    // buffer (kb % STAGES) is a constant: its shared-memory addresses and
    // wgmma descriptors are the base's plus constants (a descriptor's
    // address field is the address / 16, and no stage crosses 256 KiB), not
    // computed again every stage (ncu, H200, the 8-row pair at one token: 219
    // instructions issued per warp per stage before, about 60 of them
    // building descriptors; one warp a scheduler). Measured: the 8-row chain
    // 1-2% faster at 8-64 tokens, no change at one token (bench/RESULTS.md,
    // session 20).
    const unsigned long long d0 = w8_desc(sbase);
    for (int kb0 = 0; kb0 < KB; kb0 += STAGES) {
#pragma unroll
      for (int s = 0; s < STAGES; ++s) {
        const int kb = kb0 + s;
        if (kb >= KB) break;
        w8_cpwait<STAGES - 2>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        const int nk = kb + STAGES - 1;
        if (nk < KB) load((s + STAGES - 1) % STAGES, nk);
        w8_commit();
        const unsigned so = (unsigned)s * ST_BYTES;  // this stage's buffer from sbase
        w8_fence();
#pragma unroll
        for (int h = 0; h < NB; ++h) {
            const unsigned sw = so + (unsigned)(h * BN + grp * 64) * 128u;
#pragma unroll
            for (int kk = 0; kk < W8_BK / 32; ++kk)
                w8_mma<BM>(blk[h], d0 + ((sw + kk * 32) >> 4), d0 + ((so + W_BYTES + kk * 32) >> 4), kk);
        }
        w8_commit_mma();
        w8_wait_mma0();
#pragma unroll
        for (int h = 0; h < NB; ++h)
#pragma unroll
            for (int i = 0; i < R; ++i) asm volatile("" : "+f"(blk[h][i])::"memory");
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
            for (int v = 0; v < 2; ++v) {
                const float sa = rsc[kb][8 * j + c0 + v];
#pragma unroll
                for (int h = 0; h < NB; ++h) {
                    const float sab = __fmul_rn(sa, sc[h][kb]);
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {
                        const int i = 4 * j + 2 * hr + v;
                        acc[h][i] = __fmaf_rn(blk[h][i], sab, acc[h][i]);
                    }
                }
            }
        }
      }
    }
    w8_cpwait<0>();

    // Epilogue: column n of tile row (token) r, as moe_w8's w8_store_half
    // (UP: every 1 + exp(-g) first, then the divisions).
    float tg[UP ? BM / 2 : 1];
    if (UP) {
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) tg[i] = __fadd_rn(1.0f, fp8_exp(-moe_round(acc[0][i])));
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int n = n0 + grp * 64 + w * 16 + (lane >> 2) + 8 * hr;
        if (n >= N) continue;
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
            for (int v = 0; v < 2; ++v) {
                const int r = 8 * j + c0 + v, i = 4 * j + 2 * hr + v;
                const int dst = row_dst[r];
                if (dst < 0) continue;
                unsigned short o;
                if (UP) {
                    const float g = moe_round(acc[0][i]), u = moe_round(acc[NB - 1][i]);
                    o = row_src[r] < 0 ? 0 : moe_f2bf(__fmul_rn(__fdiv_rn(g, tg[i]), u));  // fp8_swiglu(g, u)
                } else {
                    o = moe_f2bf(acc[0][i]);
                }
                C[(long long)dst * N + n] = o;
            }
        }
    }
}
