// Shared by the expert GEMM tiles of moe_gemm.cu and moe_wgmma.cu (the
// moekernels package prepends it to both).

static __device__ __forceinline__ float moe_bf2f(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }

// moe_f2bf rounds to the nearest bf16, ties to even; NaNs stay quiet NaNs.
static __device__ __forceinline__ unsigned short moe_f2bf(float f) {
    unsigned int b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b >> 16) | 0x40u);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (unsigned short)(b >> 16);
}

static __device__ __forceinline__ float moe_round(float v) { return moe_bf2f(moe_f2bf(v)); }

// moe_tile_rows fills the row tables of row block mb (BM rows, THREADS
// threads, then a barrier): for UP, row_src[r] = the token of assignment
// sorted[p] (its x row) and row_dst[r] = p, the act row; for the down kernel,
// row_src[r] = p (the act row) and row_dst[r] = the assignment (the out row).
// A padding row (sorted[p] outside [0, TK)) reads zeros (row_src -1) and, for
// the down kernel, stores nothing (row_dst -1).
template <int BM, int THREADS, bool UP>
static __device__ __forceinline__ void moe_tile_rows(const int* __restrict__ sorted, int TK, int topk, int mb,
                                                     int* row_src, int* row_dst) {
    for (int r = threadIdx.x; r < BM; r += THREADS) {
        const int p = mb * BM + r;
        const int a = sorted[p];
        const bool real = a >= 0 && a < TK;
        if (UP) {
            row_src[r] = real ? a / topk : -1;
            row_dst[r] = p;
        } else {
            row_src[r] = real ? p : -1;
            row_dst[r] = real ? a : -1;
        }
    }
    __syncthreads();
}

// moe_shared_rows fills the row tables of up-kernel row block mb when it holds
// rows of the fused shared expert, and returns its expert; otherwise it
// returns -1 and touches nothing. The aligned sort puts the shared expert's ns
// chunks (experts E0 .. E0+ns-1) first (gpuctx_moe_route_align with ns > 0,
// gpuctx_moe_align with first = E0), and each chunk's segment holds every
// token once, in token order: chunk c's rows are c*RT .. c*RT+T-1 with T =
// TK/topk tokens and RT = T rounded up to BM, then padding. These rows do not
// depend on the routing, so the up kernel runs these blocks without waiting
// for the sort (MOE_GRID_WAIT): they read only x and the weights and write
// only their own act rows. That is safe because a kernel launched early
// starts only after the kernel ahead of it (the sort) passed its own wait, so
// every kernel before that one has finished: the writes to x are visible and
// no earlier reader of act is still running. Every other block waits.
template <int BM, int THREADS>
static __device__ __forceinline__ int moe_shared_rows(int TK, int topk, int E0, int ns, int mb, int* row_src,
                                                      int* row_dst) {
    if (ns <= 0 || topk <= 0) return -1;
    const int T = TK / topk;
    const int rt = (T + BM - 1) / BM;  // row blocks per chunk
    if (mb >= ns * rt) return -1;
    const int j0 = (mb % rt) * BM;
    for (int r = threadIdx.x; r < BM; r += THREADS) {
        row_src[r] = j0 + r < T ? j0 + r : -1;
        row_dst[r] = mb * BM + r;
    }
    __syncthreads();
    return E0 + mb / rt;
}

// moe_tile_expert starts row block mb of an expert GEMM kernel launched
// early without filling its row tables (moe_tile_begin's routed blocks, and
// kernels that issue their weight loads before they read the sort's rows):
// it waits for the kernels ahead (MOE_GRID_WAIT), lets the next be
// scheduled, and sets e to the block's expert, or returns false for a block
// without rows (past npost or of no expert).
template <int BM>
static __device__ __forceinline__ bool moe_tile_expert(const int* __restrict__ block_expert,
                                                       const int* __restrict__ npost, int mb, int& e) {
    MOE_GRID_WAIT();
    MOE_GRID_LAUNCH();
    // Both loads in flight at once (block_expert has cap/BM entries and mb
    // is below that): one round trip to L2 instead of two.
    const int np = npost[0];
    e = block_expert[mb];
    return mb * BM < np && e >= 0;
}

// moe_tile_begin starts row block mb of an expert GEMM kernel launched early
// (LaunchEarly): a block of the fused shared expert's rows (up kernel,
// moe_shared_rows) starts at once; every other block waits for the kernels
// ahead of it (the align, or the up kernel), reads its expert
// (moe_tile_expert) and fills its row tables (moe_tile_rows). Then it lets the
// next kernel be scheduled. It sets e to the block's expert and returns true,
// or returns false for a block without rows (past npost or of no expert),
// which the caller ends.
template <int BM, int THREADS, bool UP>
static __device__ __forceinline__ bool moe_tile_begin(const int* __restrict__ sorted,
                                                      const int* __restrict__ block_expert,
                                                      const int* __restrict__ npost, int TK, int topk, int E0,
                                                      int ns, int mb, int* row_src, int* row_dst, int& e) {
    e = UP ? moe_shared_rows<BM, THREADS>(TK, topk, E0, ns, mb, row_src, row_dst) : -1;
    if (e >= 0) {
        MOE_GRID_LAUNCH();
    } else {
        if (!moe_tile_expert<BM>(block_expert, npost, mb, e)) return false;
        moe_tile_rows<BM, THREADS, UP>(sorted, TK, topk, mb, row_src, row_dst);
    }
    return true;
}
