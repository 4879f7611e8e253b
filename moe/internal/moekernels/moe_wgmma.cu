// Fused expert GEMMs on Hopper's warpgroup tensor-core instructions
// (wgmma.mma_async, sm_90a only): the kernels of moe_gemm.cu (same arguments,
// rows, padding and outputs; see there), with the tile products issued by
// whole warpgroups from shared memory instead of per-warp ldmatrix + mma.sync.
//
// Each warpgroup (128 threads) owns 64 tile rows and every column of the
// tile: up tiles multiply by the gate and the up rows together (N = 2*BN), so
// SwiGLU pairs sit in one thread's registers; a tile with BN > 128 exists for
// the down kernel only (one wgmma is at most 256 wide). Tiles are 64 deep in K (one
// 128-byte row per tile row, the 128B-swizzle atom: 16-byte chunk c of row r
// at chunk c ^ (r & 7), atoms of 8 rows 1024 bytes apart); cp.async fills
// STAGES of them, STAGES-1 ahead, while one group of wgmma runs: after
// issuing stage kt, each warpgroup waits for its stage kt-1 and the block
// meets at a barrier, so stage kt-1's buffer is free to refill.
//
// Summation: every output element sums K in increasing 16-wide steps, each
// through the same instruction shape (m64nNk16), whatever BM, BN or STAGES,
// as the mma.sync tiles of moe_gemm.cu do with m16n8k16. On the H200 the two
// instructions round a 16-wide step the same way: every tile of both files
// gives the same bits (moe's TestLayerFusedTiles).
//
// The wgmma wrappers (one per N) and the extern "C" instances are generated
// from moekernels.MoEGemms (gemm.go) and appended to this file when it is
// loaded.

static __device__ __forceinline__ unsigned wg_smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void wg_cp16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

static __device__ __forceinline__ void wg_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
static __device__ __forceinline__ void wg_cpwait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}


// Shared-memory matrix descriptor of a K-major tile with 128-byte swizzle:
// start address / 16, leading byte offset 16 (unused by this layout), stride
// byte offset 1024 (between 8-row atoms), swizzle mode 1 (128B).
static __device__ __forceinline__ unsigned long long wg_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

static __device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void wg_commit_mma() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

template <int N>
static __device__ __forceinline__ void wg_wait_mma() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// wg_mma<N>(d, a, b): d[64 x N] += A[64 x 16] * B[N x 16]^T for this
// warpgroup (generated specialisations, one per N used).
template <int N>
static __device__ __forceinline__ void wg_mma(float* d, unsigned long long a, unsigned long long b);

// wg_store_half stores row half hr (0: rows lane/4, 1: lane/4 + 8 of the
// warp's 16) of this thread's accumulators d to row dst of C, columns n0 +
// 8j + 2*(lane%4) + {0, 1} below N (register 4j + 2*hr + v of a warpgroup's
// m64nNk16 layout): for UP, bf16(silu(g) * u) of the gate (first BN columns)
// and up halves, each rounded to bf16 first, or zeros for a padding row
// (zero); otherwise bf16(d). UP computes every column's 1 + exp(-g) first,
// then the divisions, so that the exponentials of the thread's columns
// overlap instead of running one after another between the division's
// slow-path branches (the same operations per column: the same bits).
template <int BN, bool UP>
static __device__ __forceinline__ void wg_store_half(const float* d, int hr, int dst, bool zero,
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
        // In groups of at most 8 column blocks (16 columns): BN = 128 kept
        // every column's g and 1 + exp(-g) live at once and spilled (ptxas,
        // the persistent m128n128 tile: 44 bytes).
        constexpr int GJ = BN / 8 < 8 ? BN / 8 : 8;
        static_assert((BN / 8) % GJ == 0, "up tile: BN/8 a multiple of the group");
#pragma unroll
        for (int j0 = 0; j0 < BN / 8; j0 += GJ) {
            float g[GJ][2], t[GJ][2];
#pragma unroll
            for (int j = 0; j < GJ; ++j)
#pragma unroll
                for (int v = 0; v < 2; ++v) {
                    g[j][v] = moe_round(d[4 * (j0 + j) + 2 * hr + v]);
                    t[j][v] = 1.0f + expf(-g[j][v]);
                }
#pragma unroll
            for (int j = 0; j < GJ; ++j) {
                const int n = n0 + (j0 + j) * 8 + (lane & 3) * 2;
                if (n >= N) continue;
                unsigned short o[2];
#pragma unroll
                for (int v = 0; v < 2; ++v) {
                    const float u = moe_round(d[4 * (BN / 8 + j0 + j) + 2 * hr + v]);
                    o[v] = moe_f2bf((g[j][v] / t[j][v]) * u);  // silu(g) * u
                }
                *(unsigned*)(row + n) = (unsigned)o[0] | ((unsigned)o[1] << 16);
            }
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

extern __shared__ __align__(1024) unsigned char wg_dyn[];

// moe_wg: the up (UP) or down kernel of tile BM x BN, BM/64 warpgroups.
// Dynamic shared memory: STAGES * (BM + NB*BN) * 128 bytes + 1024 (the tiles
// start at a 1024-byte boundary, which the swizzle needs).
template <int BM, int BN, int STAGES, bool UP>
static __device__ __forceinline__ void moe_wg(const unsigned short* __restrict__ A,
                                              const unsigned short* __restrict__ B,
                                              const int* __restrict__ sorted,
                                              const int* __restrict__ block_expert,
                                              const int* __restrict__ npost, unsigned short* __restrict__ C,
                                              int TK, int topk, int Kdim, int N, int E0, int ns) {
    constexpr int BK = 64, CH = 8;  // 64 bf16 = 128 bytes = 8 chunks per tile row
    constexpr int GROUPS = BM / 64;
    constexpr int THREADS = 128 * GROUPS;
    constexpr int NB = UP ? 2 : 1;
    constexpr int NW = NB * BN;  // columns of one wgmma: gate and up, or down
    constexpr unsigned A_BYTES = BM * 128, ST_BYTES = (BM + NW) * 128;
    static_assert(BM % 64 == 0 && NW % 8 == 0 && NW <= 256, "tile: BM a multiple of 64, NB*BN <= 256");
    constexpr int A_PER = BM * CH / THREADS;
    constexpr int B_PER = (NW * CH + THREADS - 1) / THREADS;  // the last round may be partial
    static_assert(A_PER * THREADS == BM * CH, "A tile chunks must split evenly");

    __shared__ int row_src[BM];  // A row of each tile row (-1: zero)
    __shared__ int row_dst[BM];  // C row of each tile row (-1: not stored)

    const int mb = blockIdx.y;  // launched early: see moe_gemm
    const int n0 = blockIdx.x * BN;
    if (n0 >= N) return;
    int e;
    if (!moe_tile_begin<BM, THREADS, UP>(sorted, block_expert, npost, TK, topk, E0, ns, mb, row_src, row_dst, e)) return;
    const int tid = threadIdx.x;

    const long long b_base = UP ? (long long)e * 2 * N : (long long)e * N;
    const int KT = (Kdim + BK - 1) / BK;
    const int kch = (tid % CH) * 8;
    // 32-bit element offsets from Ab (DOWN: the block's first row, a 64-bit
    // offset) and from this expert's B, as in moe_gemm.
    const unsigned short* Ab = UP ? A : A + (long long)mb * BM * Kdim;
    int ga[A_PER];
    unsigned oa[A_PER];
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
        const int c = tid + i * THREADS, r = c / CH;
        const int src = row_src[r];  // DOWN: -1 or mb*BM + r
        ga[i] = src >= 0 ? (UP ? src : src - mb * BM) * Kdim + kch : -1;
        oa[i] = (unsigned)(r * 128 + (((c % CH) ^ (r & 7)) << 4));
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
        ob[i] = A_BYTES + (unsigned)(r * 128 + (((c % CH) ^ (r & 7)) << 4));
        if (c >= NW * CH) ob[i] = ~0u;  // past the tile: this thread copies nothing
    }
    const unsigned sbase = (wg_smem(wg_dyn) + 1023u) & ~1023u;
    auto load = [&](int slot, int kt) {
        const unsigned st = sbase + (unsigned)slot * ST_BYTES;
        const int k0 = kt * BK;
        const bool kok = k0 + kch < Kdim;
#pragma unroll
        for (int i = 0; i < A_PER; ++i) {
            const bool ok = kok && ga[i] >= 0;
            wg_cp16(st + oa[i], Ab + (ok ? ga[i] + k0 : 0), ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < B_PER; ++i) {
            if ((NW * CH) % THREADS != 0 && i == B_PER - 1 && ob[i] == ~0u) break;
            const bool ok = kok && gb[i] >= 0;
            wg_cp16(st + ob[i], Be + (ok ? gb[i] + k0 : 0), ok ? 16 : 0);
        }
    };

    float d[NW / 2];
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) d[i] = 0.0f;
    const int grp = tid >> 7;
    // Every warpgroup multiplies, padding rows included: skipping the wgmma of
    // a warpgroup whose rows are all padding (under a branch) made the tiles
    // 25-30% slower on the H200 (bench/RESULTS.md, 2026-12-01).

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load(s, s);
        wg_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        wg_cpwait<STAGES - 2>();
        // cp.async wrote through the generic proxy; wgmma reads through the
        // async proxy.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        const unsigned st = sbase + (unsigned)(kt % STAGES) * ST_BYTES;
        const unsigned sa = st + (unsigned)grp * 64u * 128u, sb = st + A_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) wg_mma<NW>(d, wg_desc(sa + kk * 32), wg_desc(sb + kk * 32));
        wg_commit_mma();
        wg_wait_mma<1>();
        // Stage kt-1's wgmma is done in every warpgroup: refill its buffer
        // while stage kt's runs.
        __syncthreads();
        const int nk = kt + STAGES - 1;
        if (nk < KT) load(nk % STAGES, nk);
        wg_commit();
    }
    wg_wait_mma<0>();
    wg_cpwait<0>();
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) asm volatile("" : "+f"(d[i])::"memory");

    // Epilogue: warp w of the group holds rows 16w + lane/4 (+8); register
    // 4j + 2h + v is column 8j + 2*(lane%4) + v of row half h.
    const int lane = tid & 31, w = (tid >> 5) & 3;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int r = grp * 64 + w * 16 + (lane >> 2) + hr * 8;
        const int dst = row_dst[r];
        if (dst >= 0) wg_store_half<BN, UP>(d, hr, dst, UP && row_src[r] < 0, C, N, n0, lane);
    }
}

// ---- Persistent, warp-specialised tiles (MoEGemm.Persistent).
//
// moe_wgp: the kernel of moe_wg (same arguments, rows, padding, outputs and
// summation order: bit-identical results) as a persistent grid with PW
// producer warps and BM/64 consumer warpgroups per block. The caller's stream
// orders it like moe_wg: MOE_GRID_WAIT waits for the kernels ahead of it (the
// align, or the up kernel), and nothing else is waited for outside the block.
//
// Grid (min(SMs, tiles), 1): block b runs tiles t = b, b + gridDim.x, ... of
// the ceil(N/BN) * (npost[0]/BM) tiles (n fastest: tile t is column block
// t % ceil(N/BN) of row block t / ceil(N/BN)), skipping the blocks past npost
// and those of no expert, as moe_wg's grid does. Threads 0 .. 128*BM/64-1 are
// the consumer warpgroups, the PW warps after them the producers.
//
// Shared memory is a ring of STAGES stages (moe_wg's A and B tiles, the same
// 128B swizzle and descriptors) and two mbarriers per stage:
//   full[s]  (count 32*PW): each producer thread, after its cp.async of a
//            stage, arrives through cp.async.mbarrier.arrive.noinc, which
//            fires when the lane's copies have landed;
//   empty[s] (count 4*BM/64): lane 0 of every consumer warp arrives when its
//            wgmma of the stage has completed (wgmma.wait_group).
// Both sides keep one stage counter that runs across tiles (slot = i %
// STAGES; the parity of use i / STAGES). The producer refills a slot after
// waiting for the release of its previous use; a consumer waits for full,
// then fences the proxies (cp.async writes through the generic proxy, wgmma
// reads through the async proxy) and multiplies. The producer thus loads the
// next tile's first stages while the consumers run the epilogue of the last.
// The two roles meet at no block-wide barrier after the barriers' set-up.
//
// Every mbarrier wait gives up with __trap() (a launch error, not a hang)
// after 2^28 failed try_waits or about 5 seconds (%globaltimer).

static __device__ __forceinline__ void wgp_bar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

static __device__ __forceinline__ void wgp_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}

// wgp_cp_arrive: bar's pending count drops by one when every cp.async this
// thread has issued so far has completed (init counts these arrivals).
static __device__ __forceinline__ void wgp_cp_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

static __device__ __forceinline__ bool wgp_try(unsigned bar, unsigned parity) {
    unsigned ok;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok != 0;
}

static __device__ __forceinline__ unsigned long long wgp_clock() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}

// wgp_wait waits for the completion of the phase of bar with parity parity
// (bounded: see above).
static __device__ __forceinline__ void wgp_wait(unsigned bar, unsigned parity) {
    if (wgp_try(bar, parity)) return;
    const unsigned long long t0 = wgp_clock();
    for (unsigned n = 1;; ++n) {
        if (wgp_try(bar, parity)) return;
        if (n >= (1u << 28) || ((n & 255u) == 0 && wgp_clock() - t0 > 5000000000ull)) __trap();
    }
}

// moe_wgp: the up (UP) or down kernel of tile BM x BN, persistent, BM/64
// consumer warpgroups and PW producer warps (128*BM/64 + 32*PW threads).
// Dynamic shared memory: STAGES * (BM + NB*BN) * 128 bytes + 1024, as moe_wg;
// the 2*STAGES mbarriers are static.
template <int BM, int BN, int STAGES, int PW, bool UP>
static __device__ __forceinline__ void moe_wgp(const unsigned short* __restrict__ A,
                                               const unsigned short* __restrict__ B,
                                               const int* __restrict__ sorted,
                                               const int* __restrict__ block_expert,
                                               const int* __restrict__ npost, unsigned short* __restrict__ C,
                                               int TK, int topk, int Kdim, int N, int E0, int ns) {
    // E0 and ns (moe_shared_rows) go unused: every tile waits for the sort,
    // the fused shared expert's rows too (they sort first all the same).
    constexpr int BK = 64, CH = 8;  // 64 bf16 = 128 bytes = 8 chunks per tile row
    constexpr int GROUPS = BM / 64;
    constexpr int CONSUMERS = 128 * GROUPS;
    constexpr int PT = 32 * PW;     // producer threads
    constexpr int RSTEP = PT / CH;  // tile rows between one producer lane's rows
    constexpr int NB = UP ? 2 : 1;
    constexpr int NW = NB * BN;  // columns of one wgmma: gate and up, or down
    constexpr unsigned A_BYTES = BM * 128, ST_BYTES = (BM + NW) * 128;
    static_assert(BM % 64 == 0 && NW % 8 == 0 && NW <= 256, "tile: BM a multiple of 64, NB*BN <= 256");
    static_assert(STAGES >= 2, "at least two stages");
    static_assert(PT % 32 == 0 && RSTEP % 4 == 0 && BM % RSTEP == 0 && BN % RSTEP == 0, "producer rows");
    constexpr int A_PER = BM / RSTEP, B_PER = NW / RSTEP, B_HALF = BN / RSTEP;
    constexpr int SW = RSTEP % 8 == 0 ? 1 : 2;  // period of a lane's swizzle over its rows

    __shared__ __align__(8) unsigned long long wgp_bars[2 * STAGES];  // full[STAGES], then empty[STAGES]

    const int tid = threadIdx.x;
    const unsigned full0 = wg_smem(wgp_bars), empty0 = full0 + 8u * STAGES;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            wgp_bar_init(full0 + 8u * s, PT);
            wgp_bar_init(empty0 + 8u * s, CONSUMERS / 32);
        }
    }
    __syncthreads();
    MOE_GRID_WAIT();  // launched early: see moe_gemm
    MOE_GRID_LAUNCH();

    const int NBLK = (N + BN - 1) / BN;
    const int ntiles = NBLK * (max(npost[0], 0) / BM);
    const int KT = (Kdim + BK - 1) / BK;
    const unsigned sbase = (wg_smem(wg_dyn) + 1023u) & ~1023u;
    const int lane = tid & 31;

    if (tid >= CONSUMERS) {
        // Producer: lane l copies chunk l%8 of tile rows l/8 + RSTEP*i of
        // every stage (A rows, then B rows), 16 bytes each.
        const int pt = tid - CONSUMERS, q = pt / CH, kch = (pt % CH) * 8;
        unsigned so[SW];  // shared offset of row q + RSTEP*i's chunk: so[i % SW] + i*RSTEP*128
#pragma unroll
        for (int j = 0; j < SW; ++j) so[j] = (unsigned)(q * 128 + (((pt % CH) ^ ((q + j * RSTEP) & 7)) << 4));
        int slot = 0, fills = 0;
        unsigned ph = 0;
        for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
            const int mb = t / NBLK, n0 = (t - mb * NBLK) * BN;
            const int e = block_expert[mb];
            if (e < 0) continue;
            // Byte offset of row q + RSTEP*i's chunk from At, a multiple of
            // 16; bit 0 set: a padding row (zeros), whose offset is row 0's.
            // 32-bit: UP's rows are tokens (2*T*H bytes < 2^32); DOWN's are
            // this tile's rows of act, from At = its first row (a 64-bit
            // offset: act holds up to T*K*I elements).
            const unsigned short* At = UP ? A : A + (long long)mb * BM * Kdim;
            unsigned ga[A_PER];
#pragma unroll
            for (int i = 0; i < A_PER; ++i) {
                const int p = mb * BM + q + RSTEP * i;
                const int a = sorted[p];
                const bool real = a >= 0 && a < TK;
                ga[i] = real ? 2u * (unsigned)((UP ? a / topk : q + RSTEP * i) * Kdim + kch) : 2u * (unsigned)kch | 1u;
            }
            // B row q + RSTEP*i is row n0 + q + RSTEP*(i % B_HALF) of the gate
            // (i < B_HALF) or the up block of expert e, or of its down block.
            const long long b_base = UP ? (long long)e * 2 * N : (long long)e * N;
            const unsigned short* Bt = B + (b_base + n0 + q) * Kdim + kch;
            const long long hstride = (long long)N * Kdim;
            const int rstride = RSTEP * Kdim;
            const int nlim = N - n0 - q;  // rows RSTEP*i' < nlim exist
            for (int kt = 0; kt < KT; ++kt) {
                if (fills >= STAGES) wgp_wait(empty0 + 8u * slot, ph ^ 1u);  // the slot's previous use is released
                const unsigned st = sbase + (unsigned)slot * ST_BYTES;
                const int k0 = kt * BK;
                const bool kok = k0 + kch < Kdim;
                if (kok) {
                    const char* Ak = (const char*)(At + k0);
#pragma unroll
                    for (int i = 0; i < A_PER; ++i)
                        wg_cp16(st + so[i % SW] + i * RSTEP * 128, Ak + (ga[i] & ~1u), (ga[i] & 1u) ? 0 : 16);
                } else {  // this lane's chunk is past Kdim: zeros
#pragma unroll
                    for (int i = 0; i < A_PER; ++i) wg_cp16(st + so[i % SW] + i * RSTEP * 128, A, 0);
                }
                // Opaque to the compiler, so that it walks the rows stage by
                // stage instead of keeping every row's address in registers.
                long long hs = hstride;
                int rs = rstride;
                asm volatile("" : "+l"(hs), "+r"(rs));
                if (kok && nlim >= BN) {  // every row and chunk of the B tile exists
#pragma unroll
                    for (int h = 0; h < NB; ++h) {
                        const unsigned short* src = Bt + k0 + h * hs;
#pragma unroll
                        for (int i = h * B_HALF; i < (h + 1) * B_HALF; ++i, src += rs)
                            wg_cp16(st + A_BYTES + so[i % SW] + i * RSTEP * 128, src, 16);
                    }
                } else {
#pragma unroll
                    for (int h = 0; h < NB; ++h) {
                        const unsigned short* src = Bt + k0 + h * hs;
#pragma unroll
                        for (int i = h * B_HALF; i < (h + 1) * B_HALF; ++i, src += rs) {
                            const bool ok = kok && RSTEP * (i - h * B_HALF) < nlim;
                            wg_cp16(st + A_BYTES + so[i % SW] + i * RSTEP * 128, ok ? src : B, ok ? 16 : 0);
                        }
                    }
                }
                wgp_cp_arrive(full0 + 8u * slot);
                ++fills;
                if (++slot == STAGES) {
                    slot = 0;
                    ph ^= 1u;
                }
            }
        }
        // Every fill is consumed (the consumers run the same tiles), but
        // leave no copy in flight behind the warp.
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        return;
    }

    // Consumers: warpgroup grp multiplies tile rows 64*grp .. 64*grp+63.
    const int grp = tid >> 7, w = (tid >> 5) & 3;
    int slot = 0;
    unsigned ph = 0;
    float d[NW / 2];
    for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const int mb = t / NBLK, n0 = (t - mb * NBLK) * BN;
        const int e = block_expert[mb];
        if (e < 0) continue;
        // This thread's two epilogue rows (read now, used after the K loop).
        const int r0 = grp * 64 + w * 16 + (lane >> 2);
        const int s0 = sorted[mb * BM + r0], s1 = sorted[mb * BM + r0 + 8];
#pragma unroll
        for (int i = 0; i < NW / 2; ++i) d[i] = 0.0f;
        int prev = 0;
        for (int kt = 0; kt < KT; ++kt) {
            wgp_wait(full0 + 8u * slot, ph);
            // The stage's cp.async writes went through the generic proxy;
            // wgmma reads through the async proxy.
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            const unsigned st = sbase + (unsigned)slot * ST_BYTES;
            const unsigned sa = st + (unsigned)grp * 64u * 128u, sb = st + A_BYTES;
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) wg_mma<NW>(d, wg_desc(sa + kk * 32), wg_desc(sb + kk * 32));
            wg_commit_mma();
            wg_wait_mma<1>();
            // This warp's wgmma of the previous stage is done: release it.
            if (kt > 0 && lane == 0) wgp_arrive(empty0 + 8u * prev);
            prev = slot;
            if (++slot == STAGES) {
                slot = 0;
                ph ^= 1u;
            }
        }
        wg_wait_mma<0>();
        if (KT > 0 && lane == 0) wgp_arrive(empty0 + 8u * prev);
#pragma unroll
        for (int i = 0; i < NW / 2; ++i) asm volatile("" : "+f"(d[i])::"memory");

        // Epilogue (moe_wg's): warp w of the group holds rows 16w + lane/4
        // (+8); register 4j + 2h + v is column 8j + 2*(lane%4) + v of row half h.
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int a = hr ? s1 : s0;
            const bool real = a >= 0 && a < TK;
            const int dst = UP ? mb * BM + r0 + hr * 8 : (real ? a : -1);
            if (dst >= 0) wg_store_half<BN, UP>(d, hr, dst, UP && !real, C, N, n0, lane);
        }
    }
}
