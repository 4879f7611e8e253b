// Fused expert GEMMs for Mixture-of-Experts layers: bf16 operands, f32
// accumulation on tensor cores (mma.sync m16n8k16, ldmatrix, a cp.async
// pipeline STAGES deep), the per-expert token sort read from device memory.
//
// The rows of one launch are the sorted, block-aligned assignments of
// gpuctx_moe_align: block b of BM rows belongs to expert block_expert[b] and
// holds assignment ids sorted[p] (a = token*topk + slot; TK marks padding).
// Blocks at or past npost[0] exit at once, so a launch sized for the worst case
// (cap rows) is correct for any routing and can be captured in a graph.
//
//   UP (gate/up + SwiGLU): A row p is x[sorted[p] / topk] ([T, Kdim]), the B
//   tiles are rows n of the expert's gate block and of its up block of
//   gu [E, 2N, Kdim]; act[p, n] = bf16(silu(bf16(g)) * bf16(u)); padding rows
//   get zeros. With ns > 0 the first row blocks are the fused shared expert's
//   chunks E0 .. E0+ns-1 (moe_shared_rows), run before the sort is done.
//   DOWN: A row p is act[p] ([cap, Kdim]), B rows n of down [E, N, Kdim];
//   out[sorted[p], n] = bf16(acc) for real rows (out is [TK, N]).
//
// Every output element sums its K dimension in the same order whatever the tile
// shape (BK-wide stages in increasing k, each through the same mma sequence), so
// results do not depend on the config. Kdim and N must be multiples of 8 and
// the matrices 16-byte aligned; partial tiles are zero-filled.
//
// The extern "C" instances are generated from kernels.MoEGemms (moe_gemm.go)
// and appended to this file when it is loaded.

static __device__ __forceinline__ unsigned mg_smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void mg_cp16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

static __device__ __forceinline__ void mg_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
static __device__ __forceinline__ void mg_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

static __device__ __forceinline__ void mg_ldsm4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

static __device__ __forceinline__ void mg_mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}


// Element offset of 16-byte chunk ch of row r in a [rows][BK] bf16 tile, with
// the low three bits of the chunk index XOR-swizzled by the row so that
// ldmatrix's eight row addresses fall in eight different bank groups.
template <int BK>
static __device__ __forceinline__ int mg_swz(int r, int ch) {
    return r * BK + ((ch ^ (r & 7)) << 3);
}

extern __shared__ __align__(128) unsigned char mg_dyn[];

template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, bool UP>
static __device__ __forceinline__ void moe_gemm(const unsigned short* __restrict__ A,
                                                const unsigned short* __restrict__ B,
                                                const int* __restrict__ sorted,
                                                const int* __restrict__ block_expert,
                                                const int* __restrict__ npost, unsigned short* __restrict__ C,
                                                int TK, int topk, int Kdim, int N, int E0, int ns) {
    constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int WM = BM / WARPS_M;
    constexpr int WN = BN / WARPS_N;
    constexpr int MT = WM / 16;
    constexpr int NT = WN / 8;
    constexpr int NB = UP ? 2 : 1;  // B tiles per stage: gate and up, or down
    constexpr int A_EL = BM * BK;
    constexpr int B_EL = NB * BN * BK;
    constexpr int ST_EL = A_EL + B_EL;
    constexpr int CH = BK / 8;  // 16-byte chunks per tile row
    static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile must be a multiple of 16x16");
    static_assert(BK == 64 || BK == 128 || BK == 256, "BK must be 64, 128 or 256");

    __shared__ int row_src[BM];  // A row of each tile row (-1: zero)
    __shared__ int row_dst[BM];  // C row of each tile row (-1: not stored)

    // Launched early (LaunchEarly): moe_tile_begin waits for the kernels ahead
    // where the block needs them.
    const int mb = blockIdx.y;
    const int n0 = blockIdx.x * BN;
    if (n0 >= N) return;
    int e;
    if (!moe_tile_begin<BM, THREADS, UP>(sorted, block_expert, npost, TK, topk, E0, ns, mb, row_src, row_dst, e)) return;
    const int tid = threadIdx.x;

    unsigned short* sm = (unsigned short*)mg_dyn;
    const long long b_base = UP ? (long long)e * 2 * N : (long long)e * N;
    const int KT = (Kdim + BK - 1) / BK;

    // Each thread copies the same chunk column (kch) of fixed tile rows at every
    // stage: their source pointers and shared-memory offsets are computed once,
    // so a stage costs one predicate and one cp.async per chunk.
    constexpr int A_PER = BM * CH / THREADS;
    constexpr int B_PER = NB * BN * CH / THREADS;
    static_assert(A_PER >= 1 && (BM * CH) % THREADS == 0, "A tile chunks must split evenly over the threads");
    static_assert(B_PER >= 1 && (NB * BN * CH) % THREADS == 0, "B tile chunks must split evenly over the threads");
    const int kch = (tid % CH) * 8;
    // Element offsets from Ab and from this expert's B; -1: a zero row. They
    // stay 32-bit (registers): UP's A rows are tokens (x is [T, Kdim], T*H <
    // 2^31) and one expert's weights hold under 2^31 elements (moekernels'
    // CheckLimits); DOWN's A rows are sorted rows, up to T*K*I elements in
    // all, so Ab starts at the block's first row, a 64-bit offset.
    const unsigned short* Ab = UP ? A : A + (long long)mb * BM * Kdim;
    int ga[A_PER];
    unsigned oa[A_PER];
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
        const int c = tid + i * THREADS, r = c / CH;
        const int src = row_src[r];  // DOWN: -1 or mb*BM + r
        ga[i] = src >= 0 ? (UP ? src : src - mb * BM) * Kdim + kch : -1;
        oa[i] = 2u * (unsigned)mg_swz<BK>(r, c % CH);
    }
    const unsigned short* Be = B + b_base * Kdim;
    int gb[B_PER];
    unsigned ob[B_PER];
#pragma unroll
    for (int i = 0; i < B_PER; ++i) {
        const int c = tid + i * THREADS, r = c / CH;
        const int half = UP ? r / BN : 0;
        const int n = n0 + (UP ? r % BN : r);
        gb[i] = n < N ? (half * N + n) * Kdim + kch : -1;
        ob[i] = 2u * (unsigned)(A_EL + mg_swz<BK>(r, c % CH));
    }
    const unsigned sbase = mg_smem(sm);
    auto load = [&](int slot, int kt) {
        const unsigned st = sbase + 2u * (unsigned)(slot * ST_EL);
        const int k0 = kt * BK;
        const bool kok = k0 + kch < Kdim;
#pragma unroll
        for (int i = 0; i < A_PER; ++i) {
            const bool ok = kok && ga[i] >= 0;
            mg_cp16(st + oa[i], Ab + (ok ? ga[i] + k0 : 0), ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < B_PER; ++i) {
            const bool ok = kok && gb[i] >= 0;
            mg_cp16(st + ob[i], Be + (ok ? gb[i] + k0 : 0), ok ? 16 : 0);
        }
    };

    const int warp = tid >> 5, lane = tid & 31;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    float acc[NB][MT][NT][4];
#pragma unroll
    for (int q = 0; q < NB; ++q)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int v = 0; v < 4; ++v) acc[q][i][j][v] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load(s, s);
        mg_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        mg_wait<STAGES - 2>();
        __syncthreads();
        const int nk = kt + STAGES - 1;
        if (nk < KT) load(nk % STAGES, nk);
        mg_commit();
        const unsigned short* sa = sm + (kt % STAGES) * ST_EL;
        const unsigned short* sb = sa + A_EL;
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            unsigned af[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int r = wm * WM + i * 16 + (lane & 15);
                mg_ldsm4(af[i], mg_smem(sa + mg_swz<BK>(r, kk * 2 + (lane >> 4))));
            }
#pragma unroll
            for (int q = 0; q < NB; ++q) {
#pragma unroll
                for (int j = 0; j < NT; j += 2) {
                    unsigned bf[4];
                    const int r = q * BN + wn * WN + j * 8 + (lane & 7) + ((lane >> 4) << 3);
                    mg_ldsm4(bf, mg_smem(sb + mg_swz<BK>(r, kk * 2 + ((lane >> 3) & 1))));
#pragma unroll
                    for (int i = 0; i < MT; ++i) {
                        mg_mma(acc[q][i][j], af[i], bf[0], bf[1]);
                        mg_mma(acc[q][i][j + 1], af[i], bf[2], bf[3]);
                    }
                }
            }
        }
    }
    mg_wait<0>();

    // Epilogue: thread holds rows g and g+8 of each 16x8 tile, columns 2c, 2c+1.
    // UP computes a row half's 1 + exp(-g) of every column first, then the
    // divisions, so that the exponentials overlap instead of running one
    // after another between the division's slow-path branches (the same
    // operations per column: the same bits); a padding row stores zeros.
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int r = wm * WM + i * 16 + (lane >> 2) + hr * 8;
            const int dst = row_dst[r];
            if (dst < 0) continue;
            const bool zero = UP && row_src[r] < 0;
            float g[NT][2], t[NT][2];
            if (UP && !zero) {
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int v = 0; v < 2; ++v) {
                        g[j][v] = moe_round(acc[0][i][j][hr * 2 + v]);
                        t[j][v] = 1.0f + expf(-g[j][v]);
                    }
            }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int n = n0 + wn * WN + j * 8 + (lane & 3) * 2;
                if (n >= N) continue;
                unsigned short v[2] = {0, 0};
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    if (!UP)
                        v[q] = moe_f2bf(acc[0][i][j][hr * 2 + q]);
                    else if (!zero)
                        v[q] = moe_f2bf((g[j][q] / t[j][q]) * moe_round(acc[NB - 1][i][j][hr * 2 + q]));  // silu(g) * u
                }
                *(unsigned*)(C + (long long)dst * N + n) = (unsigned)v[0] | ((unsigned)v[1] << 16);
            }
        }
    }
}
