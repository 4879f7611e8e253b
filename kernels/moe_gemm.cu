// Fused expert GEMMs for Mixture-of-Experts layers (bf16, tensor cores).
// Placeholder: the template body lands in the next commit.
template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, bool UP>
static __device__ void moe_gemm(const unsigned short* __restrict__ A, const unsigned short* __restrict__ B,
                                const int* __restrict__ sorted, const int* __restrict__ block_expert,
                                const int* __restrict__ npost, unsigned short* __restrict__ C, int TK, int topk,
                                int Kdim, int N) {}
