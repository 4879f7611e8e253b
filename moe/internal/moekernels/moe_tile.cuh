// Shared by the expert GEMM tiles of moe_gemm.cu and moe_wgmma.cu (the
// moekernels package prepends it to both).

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

