// FP8 block-scaled expert GEMM, weight-only (w8a16): a DRAFT that has not yet
// been compiled by NVRTC nor run on a GPU, and is not wired into the layer.
//
// gpuctx_moe_fp8_w8a16 (x, w, ws, counts, offsets, y, E, N, K, bf16)
//   For each expert e and each of its plan rows r (offsets[e] <= r <
//   offsets[e] + counts[e], the layout of gpuctx_moe_plan):
//     y[r, n] = sum_k x[r, k] * w[e, n, k] * ws[e, n / 128, k / 128]
//   x [rows, K] and y [rows, N] are f32, or bf16 bits when bf16 = 1; w
//   [E, N, K] holds OCP FP8 E4M3 codes (the checkpoint's F8_E4M3 weights,
//   nn.Linear layout), ws [E, ceil(N/128), ceil(K/128)] f32 their scale_inv.
//   Any N and K (partial blocks work). Grid (ceil(N / blockDim.x), E), any
//   block width; one thread per output column n of one expert.
//
// Every y[r, n] is computed in the order of moe/fp8.GemmW8A16, each operation
// rounded to f32 with no contraction into FMA (__fmul_rn, __fadd_rn), so the
// Go twin matches it bit for bit:
//   acc = 0
//   for each K block b (128 columns, the last partial):
//     p = 0; for k in the block, ascending: p = p + x[r, k] * fp8(w[e, n, k])
//     acc = acc + p * ws[e, n / 128, b]
//   y[r, n] = acc (rounded to bf16, ties to even, when bf16 = 1)
//
// It is the correctness reference of the device path, not its fast path:
// each thread streams one weight row byte by byte (uncoalesced), for up to
// FP8_ROWS rows at a time. The bytes-bound batches want warp-cooperative
// 16-byte loads, and the compute-bound ones the tensor cores (mma.sync e4m3
// on sm_89, wgmma on sm_90): not done.

#define FP8_BLOCK 128
#define FP8_ROWS 8

// The value of E4M3 code c (exact): sign, 4 exponent bits of bias 7, 3
// mantissa bits; exponent 0 holds the subnormals m * 2^-9; 0x7f and 0xff are
// NaN. As moe/fp8.FromE4M3.
static __device__ __forceinline__ float fp8_e4m3_value(unsigned int c) {
    const unsigned int e = (c >> 3) & 15u, m = c & 7u;
    unsigned int bits;
    if (e == 15u && m == 7u) {
        bits = 0x7fc00000u;
    } else if (e == 0u) {
        bits = __float_as_uint((float)m * 0.001953125f);  // m * 2^-9, exact
    } else {
        bits = ((e + 120u) << 23) | (m << 20);  // rebias 7 -> 127
    }
    return __uint_as_float(bits | ((c & 0x80u) << 24));
}

static __device__ __forceinline__ float fp8_load_act(const void* x, long long i, int bf16) {
    if (bf16) return __uint_as_float((unsigned int)((const unsigned short*)x)[i] << 16);
    return ((const float*)x)[i];
}

// Round to the nearest bf16, ties to even; NaN stays a quiet NaN (as
// half.BF16).
static __device__ __forceinline__ unsigned short fp8_to_bf16(float v) {
    const unsigned int b = __float_as_uint(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b >> 16) | 0x40u);
    return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

static __device__ __forceinline__ void fp8_store_act(void* y, long long i, float v, int bf16) {
    if (bf16) {
        ((unsigned short*)y)[i] = fp8_to_bf16(v);
    } else {
        ((float*)y)[i] = v;
    }
}

extern "C" __global__ void gpuctx_moe_fp8_w8a16(const void* __restrict__ x, const unsigned char* __restrict__ w,
                                                const float* __restrict__ ws, const int* __restrict__ counts,
                                                const int* __restrict__ offsets, void* __restrict__ y, int E, int N,
                                                int K, int bf16) {
    const int e = blockIdx.y;
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= E || n >= N) return;
    const int r0 = offsets[e], cnt = counts[e];
    const int KB = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    const unsigned char* wr = w + ((long long)e * N + n) * K;
    const float* sr = ws + ((long long)e * ((N + FP8_BLOCK - 1) / FP8_BLOCK) + n / FP8_BLOCK) * KB;
    for (int rb = 0; rb < cnt; rb += FP8_ROWS) {
        const int nr = min(FP8_ROWS, cnt - rb);
        const long long xrow = (long long)(r0 + rb) * K;
        float acc[FP8_ROWS];
#pragma unroll
        for (int i = 0; i < FP8_ROWS; ++i) acc[i] = 0.0f;
        for (int b = 0; b < KB; ++b) {
            float p[FP8_ROWS];
#pragma unroll
            for (int i = 0; i < FP8_ROWS; ++i) p[i] = 0.0f;
            const int k1 = min((b + 1) * FP8_BLOCK, K);
            for (int k = b * FP8_BLOCK; k < k1; ++k) {
                const float wv = fp8_e4m3_value(wr[k]);
#pragma unroll
                for (int i = 0; i < FP8_ROWS; ++i) {
                    if (i < nr) p[i] = __fadd_rn(p[i], __fmul_rn(fp8_load_act(x, xrow + (long long)i * K + k, bf16), wv));
                }
            }
            const float s = sr[b];
#pragma unroll
            for (int i = 0; i < FP8_ROWS; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(p[i], s));
        }
        for (int i = 0; i < nr; ++i) fp8_store_act(y, (long long)(r0 + rb + i) * N + n, acc[i], bf16);
    }
}
