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

