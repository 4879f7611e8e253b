// Weight-only FP8 (w8a16) grouped expert GEMMs for the bytes-bound batches:
// bf16 activations, E4M3 weight codes with 128x128 block scales (the DeepSeek-V3
// and Qwen3-FP8 checkpoint format), converted to bf16 in registers (every E4M3
// value is exact in bf16) and multiplied on tensor cores (mma.sync m16n8k16
// bf16, f32 accumulation), with the row layout of moe_gemm.cu's tiles: the
// sorted, block-aligned assignments of gpuctx_moe_align (BM rows per block,
// block_expert, npost), so a launch sized for cap rows is correct for any
// routing and can be captured in a graph.
//
//   UP (gate/up + SwiGLU): A row p is x[sorted[p] / topk] (x [T, H] bf16); the
//   expert's weights gu [E][2I][H] hold the gate rows 0..I-1 then the up rows
//   (E4M3 codes), gus [E][2][ceil(I/128)][ceil(H/128)] f32 the scale_inv of the
//   gate's and then of the up's block grid (each half keeps its checkpoint's
//   blocks, so I need not be a multiple of 128). act[p, n] = bf16(silu(bf16(g))
//   * bf16(u)) with fp8_silu below; padding rows get zeros. With ns > 0 the
//   first row blocks are the fused shared expert's chunks (moe_shared_rows).
//   DOWN: A row p is act[p] ([cap, I]); down [E][H][I] codes, downs
//   [E][ceil(H/128)][ceil(I/128)] f32; out[sorted[p], n] = bf16(acc) for real
//   rows (out [TK, H]); like moe_gemm.cu's down tile it does not weight the rows
//   (the combine does).
//
// H and I are multiples of 16, H and I at most 128 * FP8_MAX_KB; partial 128
// blocks in N and K are zero-filled.
//
// Accumulation order of every output (the Go twin, fp8_mma.go, repeats it):
//   acc = 0
//   for each K block kb (128 columns, the last partial), in increasing order:
//       p = the f32 tensor-core sum of the block's 128 products (zeros past K)
//       acc = acc + p * scale[n / 128][kb]      (__fmul_rn, __fadd_rn: no FMA)
// and the epilogue's bf16 roundings and fp8_silu use explicitly rounded f32
// operations only. The block sum p is the one part the twin cannot repeat bit
// for bit in general: the tensor core adds the products in its own order and
// with its own internal rounding. It is exact, and then the twin's sum equals
// it, whenever the block's products are exactly summable in f32 (for example
// integer-valued activations times weights whose products are multiples of a
// common power of two and whose absolute sum stays below 2^24 of it); the CUDA
// tests use such data for the bitwise comparison and a tolerance otherwise.
//
// Within a block, the k order is permuted so that each thread reads 16
// contiguous weight bytes per 64 columns: in group q (64 columns) and mma step j,
// the thread with c = lane % 4 supplies the k slots {2c, 2c+1, 2c+8, 2c+9} from
// columns 64q + 16c + 4j + {0, 1, 2, 3}, for the activations (A) and the
// weights (B) alike; the shared-memory tiles are stored in that fragment order
// (one warp-wide 16-byte load or copy covers 512 contiguous bytes, no bank
// conflicts).
//
// The extern "C" instances are generated from moekernels.FP8Gemms and appended
// to this file when it is loaded.

#define FP8_BK 128
#define FP8_MAX_KB 64

static __device__ __forceinline__ unsigned f8_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

static __device__ __forceinline__ void f8_cp16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

// f8_cp16w is f8_cp16 for weight bytes, with an L2 prefetch of the 256-byte
// segment (the row's next K block, read by the next stage).
static __device__ __forceinline__ void f8_cp16w(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

static __device__ __forceinline__ void f8_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
static __device__ __forceinline__ void f8_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

static __device__ __forceinline__ void f8_mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                              unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 890
// The value of E4M3 code b (bits 0..7), exact, for devices without the FP8
// conversion instructions: the magnitude bits placed in an f32's exponent and
// mantissa are the value times 2^-120 (a subnormal f32 for the E4M3
// subnormals), and the product by 2^120 is exact; 0x7f and 0xff are NaN.
static __device__ __forceinline__ float f8_value(unsigned b) {
    const unsigned m = b & 0x7fu;
    float v = __fmul_rn(__uint_as_float(m << 20), __uint_as_float(0x7b800000u));
    if (m == 0x7fu) v = __uint_as_float(0x7fc00000u);
    return (b & 0x80u) ? -v : v;
}
#endif

// f8_bf16x4 converts the four E4M3 codes of w (byte i is code i) to bf16:
// lo = {code 0, code 1}, hi = {code 2, code 3} (the lower-index code in the
// lower half). Exact: E4M3 -> f16 (cvt, sm_89+) -> f32 -> the f32's upper
// half, whose lower half is zero.
static __device__ __forceinline__ void f8_bf16x4(unsigned w, unsigned& lo, unsigned& hi) {
    float f0, f1, f2, f3;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned h0, h1;
    asm("{\n.reg .b16 f8c0, f8c1;\nmov.b32 {f8c0, f8c1}, %2;\n"
        "cvt.rn.f16x2.e4m3x2 %0, f8c0;\ncvt.rn.f16x2.e4m3x2 %1, f8c1;\n}\n"
        : "=r"(h0), "=r"(h1)
        : "r"(w));
    asm("{\n.reg .f16 f8h0, f8h1, f8h2, f8h3;\nmov.b32 {f8h0, f8h1}, %4;\nmov.b32 {f8h2, f8h3}, %5;\n"
        "cvt.f32.f16 %0, f8h0;\ncvt.f32.f16 %1, f8h1;\ncvt.f32.f16 %2, f8h2;\ncvt.f32.f16 %3, f8h3;\n}\n"
        : "=f"(f0), "=f"(f1), "=f"(f2), "=f"(f3)
        : "r"(h0), "r"(h1));
#else
    f0 = f8_value(w & 0xffu);
    f1 = f8_value((w >> 8) & 0xffu);
    f2 = f8_value((w >> 16) & 0xffu);
    f3 = f8_value(w >> 24);
#endif
    lo = __byte_perm(__float_as_uint(f0), __float_as_uint(f1), 0x7632);
    hi = __byte_perm(__float_as_uint(f2), __float_as_uint(f3), 0x7632);
}

// fp8_exp is exp(v) with explicitly rounded f32 operations (the Go twin's
// fp8Exp repeats them): v clamped to [-87, 88], n = rint(v * log2(e)), r = v -
// n * ln2 (Cody-Waite, two parts), a degree-6 Taylor polynomial in r (Horner),
// times 2^n. Within a few ulp of exp; NaN stays NaN.
static __device__ __forceinline__ float fp8_exp(float v) {
    v = v < -87.0f ? -87.0f : (v > 88.0f ? 88.0f : v);
    const float n = rintf(__fmul_rn(v, 1.44269502f));
    float r = __fsub_rn(v, __fmul_rn(n, 0.693145751953125f));
    r = __fsub_rn(r, __fmul_rn(n, 1.428606765330187e-06f));
    float p = 1.0f / 720.0f;
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 120.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 24.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 6.0f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    // NaN stays NaN by a select, not a branch, so that the exponentials of
    // an epilogue's columns can overlap (a NaN v makes n NaN and (int)n 0).
    const float e = __fmul_rn(p, __int_as_float(((int)n + 127) << 23));
    return v != v ? v : e;
}

// fp8_swiglu(g, u), the SwiGLU of every FP8 up epilogue (the Go twin's
// fp8SwiGLU): silu(g) * u = g / (1 + exp(-g)) * u, each operation rounded,
// __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, fp8_exp(-g))), u). The epilogues
// write it out in two passes, every column's __fadd_rn(1.0f, fp8_exp(-g))
// first, then the divisions, so that the exponentials of a thread's columns
// overlap instead of running one after another (w8_store_half of
// moe_w8a8.cu); it is not a function of its own.

extern __shared__ __align__(128) unsigned char f8_dyn[];

// Shared-memory stage: the A tile (BM rows x 128 bf16) then the B tile (NB*BN
// rows x 128 codes), both in fragment order, 16-byte chunks:
//   A chunk (row r, column chunk ch = 0..15 of 8 bf16): m-tile i = r/16, row half
//   rh = r/8 % 2, g = r % 8, group q = ch/8, c = ch/2 % 4, h = ch % 2 ->
//   (((i*2 + q)*2 + rh)*2 + h)*32 + 4g + c.
//   B chunk (row R, column chunk ch = 0..7 of 16 codes): n-tile t = R/8, g = R %
//   8, q = ch/4, c = ch % 4 -> (t*2 + q)*32 + 4g + c.
// Thread tid copies the chunks tid + j*THREADS of each tile, so a warp writes
// 512 contiguous bytes (no bank conflicts) and reads 64 contiguous bytes of
// each of 8 weight rows; f8_arow, f8_brow invert the layout.
static __device__ __forceinline__ void f8_arow(int d, int& r, int& ch) {
    const int lane = d & 31, rest = d >> 5;
    r = 16 * (rest >> 3) + 8 * ((rest >> 1) & 1) + (lane >> 2);
    ch = 8 * ((rest >> 2) & 1) + 2 * (lane & 3) + (rest & 1);
}

static __device__ __forceinline__ void f8_brow(int d, int& R, int& ch) {
    const int lane = d & 31, rest = d >> 5;
    R = 8 * (rest >> 1) + (lane >> 2);
    ch = 4 * (rest & 1) + (lane & 3);
}

// f8_block multiplies one K block held in shared memory (st) into the block
// sums p of the warp's tiles: MT m-tiles, NT n-tiles of each of the NB halves
// starting at B row R0 + nb*BN.
template <int MT, int NT, int NB, int BN>
static __device__ __forceinline__ void f8_block(const unsigned char* st, int a_bytes, int R0, int lane,
                                                float (&p)[NB][MT][NT][4]) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        uint4 bw[NB][NT];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const int tile = (R0 + nb * BN) / 8 + t;
                bw[nb][t] = *(const uint4*)(st + a_bytes + ((tile * 2 + q) * 32 + lane) * 16);
            }
        unsigned xa[MT][2][8];  // [m-tile][row g, g+8][column pairs 16c + 2k]
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int rh = 0; rh < 2; ++rh)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint4 v = *(const uint4*)(st + ((((i * 2 + q) * 2 + rh) * 2 + h) * 32 + lane) * 16);
                    xa[i][rh][4 * h] = v.x;
                    xa[i][rh][4 * h + 1] = v.y;
                    xa[i][rh][4 * h + 2] = v.z;
                    xa[i][rh][4 * h + 3] = v.w;
                }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    const unsigned w = j == 0 ? bw[nb][t].x : j == 1 ? bw[nb][t].y : j == 2 ? bw[nb][t].z : bw[nb][t].w;
                    unsigned b0, b1;
                    f8_bf16x4(w, b0, b1);
#pragma unroll
                    for (int i = 0; i < MT; ++i)
                        f8_mma(p[nb][i][t], xa[i][0][2 * j], xa[i][1][2 * j], xa[i][0][2 * j + 1], xa[i][1][2 * j + 1], b0,
                               b1);
                }
        }
    }
}

// f8_block_t is f8_block for the transposed tiles (FP8Gemm.Trans): the
// weights are mma.sync's A operand (16 weight rows, that is output columns,
// by 16 k) and the activations its B operand (16 k by 8 token rows), so that
// one mma covers 256 weights instead of 128, the converted weights go
// straight into the A registers, and a group of 8 token rows without data
// (live[rg] false: warp-uniform) costs no mma. The k order within a block is
// f8_block's (each thread's slots {2c, 2c+1, 2c+8, 2c+9} of step j are
// columns 16c + 4j + {0..3} of group q), read from the same shared-memory
// layout. p[nb][mt][rg][v]: weight rows R0 + nb*BN + 16*mt + g + 8*(v/2),
// token rows 8*rg + 2c + v%2.
template <int MW, int RG, int NB, int BN>
static __device__ __forceinline__ void f8_block_t(const unsigned char* st, int a_bytes, int R0, int lane,
                                                  const bool (&live)[RG], float (&p)[NB][MW][RG][4]) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        unsigned xb[RG][8];  // [token group][column pairs 16c + 2k], k = 0..7
#pragma unroll
        for (int rg = 0; rg < RG; ++rg) {
            if (!live[rg]) continue;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint4 v = *(const uint4*)(st + (((((rg >> 1) * 2 + q) * 2 + (rg & 1)) * 2 + h) * 32 + lane) * 16);
                xb[rg][4 * h] = v.x;
                xb[rg][4 * h + 1] = v.y;
                xb[rg][4 * h + 2] = v.z;
                xb[rg][4 * h + 3] = v.w;
            }
        }
        uint4 bw[NB][MW][2];  // weight rows g and g + 8 of each m-tile
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int mt = 0; mt < MW; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int tile = (R0 + nb * BN) / 8 + 2 * mt + hh;
                    bw[nb][mt][hh] = *(const uint4*)(st + a_bytes + ((tile * 2 + q) * 32 + lane) * 16);
                }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                for (int mt = 0; mt < MW; ++mt) {
                    const uint4 w0 = bw[nb][mt][0], w1 = bw[nb][mt][1];
                    const unsigned c0 = j == 0 ? w0.x : j == 1 ? w0.y : j == 2 ? w0.z : w0.w;
                    const unsigned c1 = j == 0 ? w1.x : j == 1 ? w1.y : j == 2 ? w1.z : w1.w;
                    unsigned a0, a1, a2, a3;
                    f8_bf16x4(c0, a0, a2);
                    f8_bf16x4(c1, a1, a3);
#pragma unroll
                    for (int rg = 0; rg < RG; ++rg)
                        if (live[rg]) f8_mma(p[nb][mt][rg], a0, a1, a2, a3, xb[rg][2 * j], xb[rg][2 * j + 1]);
                }
        }
    }
}

// fp8_main_t is fp8_gemm's loop and epilogue for the transposed tiles
// (f8_block_t): the same stages, scaling order and stores, with the
// accumulators of f8_block_t's layout.
template <int BM, int BN, int WARPS_N, int STAGES, bool UP, typename Load>
static __device__ __forceinline__ void fp8_main_t(Load& load, const float (*sc)[FP8_MAX_KB], const int* row_src,
                                                  const int* row_dst, unsigned short* __restrict__ C, int KB, int N,
                                                  int n0) {
    constexpr int WN = BN / WARPS_N, MW = WN / 16, RG = BM / 8;
    constexpr int NB = UP ? 2 : 1;
    constexpr int A_BYTES = BM * 16 * 16;
    constexpr int ST_BYTES = A_BYTES + NB * BN * 8 * 16;
    static_assert(WN % 16 == 0 && BM % 8 == 0, "transposed tiles: 16 weight rows per m-tile, 8 token rows per group");
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    bool live[RG];  // a group of 8 token rows with data (the row tables are filled: moe_tile_begin's barrier)
#pragma unroll
    for (int rg = 0; rg < RG; ++rg) {
        bool any = false;
#pragma unroll
        for (int r = 0; r < 8; ++r) any |= row_src[8 * rg + r] >= 0;
        live[rg] = any;
    }
    float acc[NB][MW][RG][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int mt = 0; mt < MW; ++mt)
#pragma unroll
            for (int rg = 0; rg < RG; ++rg)
#pragma unroll
                for (int v = 0; v < 4; ++v) acc[nb][mt][rg][v] = 0.0f;
    // The slots of stage kb and of the stage loaded during it (kb + STAGES -
    // 1), kept as counters (a modulo by 3 stages compiles to a wide multiply;
    // dropping it changed no timing measurably on the H200).
    int cur = 0, nxt = STAGES - 1;
    for (int kb = 0; kb < KB; ++kb) {
        f8_wait<STAGES - 2>();
        __syncthreads();
        if (kb + STAGES - 1 < KB) load(nxt, kb + STAGES - 1);
        f8_commit();
        float p[NB][MW][RG][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int mt = 0; mt < MW; ++mt)
#pragma unroll
                for (int rg = 0; rg < RG; ++rg)
#pragma unroll
                    for (int v = 0; v < 4; ++v) p[nb][mt][rg][v] = 0.0f;
        f8_block_t<MW, RG, NB, BN>(f8_dyn + cur * ST_BYTES, A_BYTES, warp * WN, lane, live, p);
        cur = cur + 1 == STAGES ? 0 : cur + 1;
        nxt = nxt + 1 == STAGES ? 0 : nxt + 1;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            const float s = sc[nb][kb];
#pragma unroll
            for (int mt = 0; mt < MW; ++mt)
#pragma unroll
                for (int rg = 0; rg < RG; ++rg)
#pragma unroll
                    for (int v = 0; v < 4; ++v)
                        acc[nb][mt][rg][v] = __fadd_rn(acc[nb][mt][rg][v], __fmul_rn(p[nb][mt][rg][v], s));
        }
    }
    f8_wait<0>();

    // Epilogue: register v of (mt, rg) is weight row (output column) 16*mt +
    // g + 8*(v/2) of the warp's columns and token row 8*rg + 2c + v%2. UP
    // computes every 1 + exp(-g) first, then the divisions (w8_store_half of
    // moe_w8a8.cu says why; the same bits).
    float tg[UP ? MW : 1][UP ? RG : 1][4];
    if (UP) {
#pragma unroll
        for (int mt = 0; mt < MW; ++mt)
#pragma unroll
            for (int rg = 0; rg < RG; ++rg)
#pragma unroll
                for (int v = 0; v < 4; ++v) tg[mt][rg][v] = __fadd_rn(1.0f, fp8_exp(-moe_round(acc[0][mt][rg][v])));
    }
#pragma unroll
    for (int rg = 0; rg < RG; ++rg)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const int r = 8 * rg + 2 * (lane & 3) + (v & 1);
            const int dst = row_dst[r];
            if (dst < 0) continue;
            const bool zero = UP && row_src[r] < 0;
#pragma unroll
            for (int mt = 0; mt < MW; ++mt) {
                const int n = n0 + warp * WN + 16 * mt + (lane >> 2) + 8 * (v >> 1);
                if (n >= N) continue;
                unsigned short o;
                if (UP) {
                    const float g = moe_round(acc[0][mt][rg][v]), u = moe_round(acc[NB - 1][mt][rg][v]);
                    o = zero ? 0 : moe_f2bf(__fmul_rn(__fdiv_rn(g, tg[mt][rg][v]), u));  // fp8_swiglu(g, u)
                } else {
                    o = moe_f2bf(acc[0][mt][rg][v]);
                }
                C[(long long)dst * N + n] = o;
            }
        }
}

template <int BM, int BN, int WARPS_N, int STAGES, bool UP, bool TR>
static __device__ __forceinline__ void fp8_gemm(const unsigned short* __restrict__ A, const unsigned char* __restrict__ B,
                                                const float* __restrict__ S, const int* __restrict__ sorted,
                                                const int* __restrict__ block_expert, const int* __restrict__ npost,
                                                unsigned short* __restrict__ C, int TK, int topk, int Kdim, int N, int E0,
                                                int ns) {
    constexpr int THREADS = 32 * WARPS_N;
    constexpr int MT = BM / 16;
    constexpr int WN = BN / WARPS_N;
    constexpr int NT = WN / 8;
    constexpr int NB = UP ? 2 : 1;  // weight halves: gate and up, or down
    constexpr int A_CH = BM * 16;   // 16-byte chunks of a stage's A tile
    constexpr int B_CH = NB * BN * 8;
    constexpr int A_BYTES = A_CH * 16;
    constexpr int ST_BYTES = A_BYTES + B_CH * 16;
    constexpr int A_PER = A_CH / THREADS;
    constexpr int B_PER = B_CH / THREADS;
    static_assert(BM % 16 == 0 && WN % 8 == 0 && 128 % BN == 0, "BM a multiple of 16, BN/WARPS_N of 8, BN divides 128");
    static_assert(A_PER >= 1 && A_CH % THREADS == 0 && B_PER >= 1 && B_CH % THREADS == 0,
                  "tile chunks must split evenly over the threads");

    __shared__ int row_src[BM];
    __shared__ int row_dst[BM];
    __shared__ float sc[NB][FP8_MAX_KB];

    const int mb = blockIdx.y;
    const int n0 = blockIdx.x * BN;
    if (n0 >= N) return;
    int e;
    if (!moe_tile_begin<BM, THREADS, UP>(sorted, block_expert, npost, TK, topk, E0, ns, mb, row_src, row_dst, e)) return;
    const int tid = threadIdx.x;
    const int KB = (Kdim + FP8_BK - 1) / FP8_BK;

    // Each thread copies fixed chunks of the tiles at every stage: their
    // sources (element offsets, -1 for a zero row) and columns are computed once.
    const unsigned short* Ab = UP ? A : A + (long long)mb * BM * Kdim;
    const unsigned char* Be = B + (long long)e * NB * N * Kdim;
    int ga[A_PER], gb[B_PER], ca[A_PER], cb[B_PER];
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
        int r, ch;
        f8_arow(tid + i * THREADS, r, ch);
        const int src = row_src[r];
        ca[i] = ch * 8;
        ga[i] = src >= 0 ? (UP ? src : src - mb * BM) * Kdim + ca[i] : -1;
    }
#pragma unroll
    for (int i = 0; i < B_PER; ++i) {
        int R, ch;
        f8_brow(tid + i * THREADS, R, ch);
        const int half = UP ? R / BN : 0;
        const int n = n0 + R % BN;
        cb[i] = ch * 16;
        gb[i] = n < N ? (half * N + n) * Kdim + cb[i] : -1;
    }
    const unsigned sbase = f8_smem(f8_dyn) + 16u * (unsigned)tid;
    auto load = [&](int slot, int kb) {
        const unsigned st = sbase + (unsigned)(slot * ST_BYTES);
        const int k0 = kb * FP8_BK;
        const bool whole = k0 + FP8_BK <= Kdim;  // every column of the block exists
#pragma unroll
        for (int i = 0; i < A_PER; ++i) {
            const bool ok = ga[i] >= 0 && (whole || k0 + ca[i] < Kdim);
            f8_cp16(st + 16u * (unsigned)(i * THREADS), Ab + (ok ? ga[i] + k0 : 0), ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < B_PER; ++i) {
            const bool ok = gb[i] >= 0 && (whole || k0 + cb[i] < Kdim);
            f8_cp16w(st + (unsigned)A_BYTES + 16u * (unsigned)(i * THREADS), Be + (ok ? gb[i] + k0 : 0), ok ? 16 : 0);
        }
    };

    const int warp = tid >> 5, lane = tid & 31;
    float acc[NB][MT][NT][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int v = 0; v < 4; ++v) acc[nb][i][t][v] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KB) load(s, s);
        f8_commit();
    }
    // The block scales, staged once the first loads are in flight (the first
    // barrier of the loop orders these stores before their reads).
    const int NBR = (N + FP8_BK - 1) / FP8_BK;
    for (int i = tid; i < NB * KB; i += THREADS) {
        const int q = i / KB, kb = i - q * KB;
        sc[q][kb] = S[((long long)(e * NB + q) * NBR + n0 / FP8_BK) * KB + kb];
    }
    if constexpr (TR) {
        fp8_main_t<BM, BN, WARPS_N, STAGES, UP>(load, sc, row_src, row_dst, C, KB, N, n0);
        return;
    }
    for (int kb = 0; kb < KB; ++kb) {
        f8_wait<STAGES - 2>();
        __syncthreads();
        const int nk = kb + STAGES - 1;
        if (nk < KB) load(nk % STAGES, nk);
        f8_commit();
        float p[NB][MT][NT][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int t = 0; t < NT; ++t)
#pragma unroll
                    for (int v = 0; v < 4; ++v) p[nb][i][t][v] = 0.0f;
        f8_block<MT, NT, NB, BN>(f8_dyn + (kb % STAGES) * ST_BYTES, A_BYTES, warp * WN, lane, p);
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            const float s = sc[nb][kb];
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int t = 0; t < NT; ++t)
#pragma unroll
                    for (int v = 0; v < 4; ++v) acc[nb][i][t][v] = __fadd_rn(acc[nb][i][t][v], __fmul_rn(p[nb][i][t][v], s));
        }
    }
    f8_wait<0>();

    // Epilogue: the thread holds rows g and g+8 of each 16x8 tile, columns 2c,
    // 2c+1; UP computes every 1 + exp(-g) first, then the divisions.
    float tg[UP ? MT : 1][UP ? NT : 1][4];
    if (UP) {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int v = 0; v < 4; ++v) tg[i][t][v] = __fadd_rn(1.0f, fp8_exp(-moe_round(acc[0][i][t][v])));
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int r = i * 16 + (lane >> 2) + hr * 8;
            const int dst = row_dst[r];
            if (dst < 0) continue;
            const bool zero = UP && row_src[r] < 0;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const int n = n0 + warp * WN + t * 8 + (lane & 3) * 2;
                if (n >= N) continue;
                unsigned short v0, v1;
                if (UP) {
                    const float g0 = moe_round(acc[0][i][t][hr * 2]), g1 = moe_round(acc[0][i][t][hr * 2 + 1]);
                    const float u0 = moe_round(acc[NB - 1][i][t][hr * 2]), u1 = moe_round(acc[NB - 1][i][t][hr * 2 + 1]);
                    v0 = zero ? 0 : moe_f2bf(__fmul_rn(__fdiv_rn(g0, tg[i][t][hr * 2]), u0));  // fp8_swiglu
                    v1 = zero ? 0 : moe_f2bf(__fmul_rn(__fdiv_rn(g1, tg[i][t][hr * 2 + 1]), u1));
                } else {
                    v0 = moe_f2bf(acc[0][i][t][hr * 2]);
                    v1 = moe_f2bf(acc[0][i][t][hr * 2 + 1]);
                }
                *(unsigned*)(C + (long long)dst * N + n) = (unsigned)v0 | ((unsigned)v1 << 16);
            }
        }
    }
}
