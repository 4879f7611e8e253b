// The per-token-group activation quantizer's arithmetic (vLLM's
// per_token_group_quant_fp8 rule: moe_w8a8.cu's QUANT), shared by the two
// units that quantize: moe_w8a8.cu (gpuctx_moe_fp8_quant) and moe.cu
// (gpuctx_moe_route_align, which quantizes x for the w8a8 tiles while it
// routes a small batch). One text, so both give the same bits. The E4M3
// conversion needs sm_89 or later: elsewhere nothing here is compiled.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
#define MOE_HAS_E4M3_CVT 1

// w8_e4m3x2 returns the E4M3 codes of lo (bits 0-7) and hi (bits 8-15).
static __device__ __forceinline__ unsigned w8_e4m3x2(float lo, float hi) {
    unsigned short c;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(c) : "f"(hi), "f"(lo));
    return c;
}

// w8_codes2 returns the E4M3 codes of v0 / s and v1 / s as __fdiv_rn and
// cvt.rn.satfinite.e4m3x2 give them (w8_e4m3x2 of the exactly rounded
// quotients), from q = v * r with r = __frcp_rn(s): q is within 3 ulp of the
// exactly rounded quotient (relative 2^-22.4), so when q * (1 - 2^-20) and q
// * (1 + 2^-20) get the same codes (E4M3 rounding is monotonic), so does
// the quotient; otherwise (q near an E4M3 rounding midpoint, about one value
// in 10^5) w8_codes2 divides. About a fifth of the instructions of two
// divisions: the quantizer is bound by its instructions (ncu, H200: 71%
// issue slots, 67% of them ALU, 23% DRAM, with a division per value). A NaN,
// an infinity and 0 come out as the quotient's (r is 0 only for an infinite
// s, where v / s is 0 or NaN as q is).
static __device__ __forceinline__ unsigned w8_codes2(float v0, float v1, float s, float r) {
    const float q0 = __fmul_rn(v0, r), q1 = __fmul_rn(v1, r);
    const float lo = 1.0f - 0x1p-20f, hi = 1.0f + 0x1p-20f;
    const unsigned a = w8_e4m3x2(__fmul_rn(q0, lo), __fmul_rn(q1, lo));
    const unsigned b = w8_e4m3x2(__fmul_rn(q0, hi), __fmul_rn(q1, hi));
    return a == b ? a : w8_e4m3x2(__fdiv_rn(v0, s), __fdiv_rn(v1, s));
}

// w8_quant8 quantizes the 8 bf16 values h (lane's 8 columns, zeros past K)
// of one (row, group) held by a half-warp: the group's amax over the 16
// lanes of mask, the scale s, and the 8 codes (byte i is column i).
static __device__ __forceinline__ uint2 w8_quant8(uint4 h, unsigned mask, float& s) {
    const unsigned w[4] = {h.x, h.y, h.z, h.w};
    float v[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o));
    s = __fdiv_rn(fmaxf(amax, 1e-10f), 448.0f);
    const float r = __frcp_rn(s);
    unsigned c[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = w8_codes2(v[2 * i], v[2 * i + 1], s, r);
    return make_uint2(c[0] | (c[1] << 16), c[2] | (c[3] << 16));
}
#endif
