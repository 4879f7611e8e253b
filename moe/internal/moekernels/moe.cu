// Mixture-of-Experts kernels: routing (scores, grouped top-k, renormalisation),
// token permutation (per-expert counts, offsets, positions, gather), SwiGLU and
// the weighted combine. Package moe drives them; their Go twins
// (moe/internal/moekernels/route.go) have the same names and arithmetic.
//
// Conventions (see the table in moekernels.go):
//   - dims are 32-bit ints; element offsets are computed in 64 bits;
//   - activations are f32 or bf16 (flag bf16 = 1), bf16 held as unsigned short
//     bits (no cuda_bf16.h: NVRTC compiles this file with no include path);
//     every computation is in f32 and bf16 stores round to nearest even;
//   - row kernels (gather, swiglu, combine) take any grid and block: blocks
//     stride over rows, threads over columns;
//   - gpuctx_moe_route needs blocks of exactly 32 threads (one warp per token,
//     any grid); gpuctx_moe_plan needs exactly one block of 256 threads.
//   - every reduction has a fixed order, so results are bitwise reproducible.

// MOE_MAX_E and MOE_MAX_K come from the prelude that moekernels.go prepends
// (moekernels.MaxExperts, moekernels.MaxTopK).
#define MOE_PLAN_WARPS 8
#define MOE_FULL 0xffffffffu

static __device__ __forceinline__ float moe_bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

static __device__ __forceinline__ unsigned short moe_f32_to_bf16(float f) {
    unsigned int b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
        return (unsigned short)((b >> 16) | 0x40u);
    }
    b += 0x7fffu + ((b >> 16) & 1u);
    return (unsigned short)(b >> 16);
}

static __device__ __forceinline__ float moe_ld(const void* p, long long i, int bf16) {
    if (bf16) {
        return moe_bf16_to_f32(((const unsigned short*)p)[i]);
    }
    return ((const float*)p)[i];
}

static __device__ __forceinline__ void moe_st(void* p, long long i, float v, int bf16) {
    if (bf16) {
        ((unsigned short*)p)[i] = moe_f32_to_bf16(v);
    } else {
        ((float*)p)[i] = v;
    }
}

static __device__ __forceinline__ int moe_imin(int a, int b) { return a < b ? a : b; }

// moe_better reports whether candidate (v, i) beats the current best (bv, bi):
// a larger value, or an equal value with a lower index. Index -1 means "none":
// it never beats anything and anything beats it.
static __device__ __forceinline__ bool moe_better(float v, int i, float bv, int bi) {
    if (i < 0) return false;
    if (bi < 0) return true;
    return v > bv || (v == bv && i < bi);
}

// Butterfly reductions: every lane ends with the same bits (the operations are
// commutative, so lane i and lane i^off combine the same two operands).
static __device__ __forceinline__ float moe_warp_max(float v) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(MOE_FULL, v, off));
    return v;
}

static __device__ __forceinline__ float moe_warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(MOE_FULL, v, off);
    return v;
}

static __device__ __forceinline__ void moe_warp_argmax(float& bv, int& bi) {
    for (int off = 16; off > 0; off >>= 1) {
        float ov = __shfl_xor_sync(MOE_FULL, bv, off);
        int oi = __shfl_xor_sync(MOE_FULL, bi, off);
        if (moe_better(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
    // Lane 0's answer is the answer (identical anyway unless NaNs broke the order).
    bv = __shfl_sync(MOE_FULL, bv, 0);
    bi = __shfl_sync(MOE_FULL, bi, 0);
}

// gpuctx_moe_route: per token t, from logits [T,E] (f32):
//   scores = softmax(logits) (scoring 0) or sigmoid(logits) (scoring 1);
//   choice = scores (+ bias[e] when has_bias) -- used for selection only;
//   method 1 (group_limited_greedy): group score = max of choice in the group;
//   method 2 (noaux_tc): group score = sum of the two largest choices in the group;
//   for methods 1 and 2 keep the topk_groups best groups (ties: lower group) and
//   set the choice of every expert of the other groups to 0.0;
//   top-K of choice, largest first, ties to the lower expert index;
//   weight = scores[e] for method 2, else choice[e]; if norm, divide by
//   (sum of the K weights + norm_eps); multiply by scale.
// Outputs topk_idx [T,ks] (int32) and topk_w [T,ks] (f32): slots 0..K-1 of each
// row hold the routed experts; slots K..K+ns-1 hold the shared experts E..E+ns-1
// with weight 1 (ns = 0 without a fused shared expert; ks >= K + ns).
// Launch: block (32,1,1), any grid (blocks stride over tokens). E <= 512, K <= 16,
// ns <= 16.
// moe_route_args_ok reports whether gpuctx_moe_route's sizes are in range.
static __device__ __forceinline__ bool moe_route_args_ok(int E, int K, int method, int groups, int topk_groups,
                                                         int ks, int ns) {
    if (E <= 0 || E > MOE_MAX_E || K <= 0 || K > MOE_MAX_K || K > E) return false;
    if (ns < 0 || ns > MOE_MAX_K || ks < K + ns) return false;
    if (method != 0 && (groups <= 0 || groups > E || E % groups != 0 || topk_groups > groups)) return false;
    return true;
}

// moe_route_token routes token t (one warp, lane = its lane) from lg = its E
// logits (read with __ldcg: another block may have written them). Lane l holds
// the scores of experts l, l+32, ... in registers; the shared arrays of one
// warp (ch [E], gs [max(E, groups)] and keep [groups]) hold the group limit's
// scores (methods 1 and 2) and then, in gs, each expert's weight for the
// top-K to read back. Expert k's index and weight end in lane k.
#define MOE_RT_PER (MOE_MAX_E / 32)
static __device__ __forceinline__ void moe_route_token(const float* __restrict__ lg, const float* __restrict__ bias,
                                       int* __restrict__ topk_idx, float* __restrict__ topk_w, int t, int E, int K,
                                       int scoring, int method, int groups, int topk_groups, int has_bias, int norm,
                                       float norm_eps, float scale, int ks, int ns, float* ch, float* gs,
                                       unsigned char* keep, int* sidx, int lane) {
    const float neg_inf = __uint_as_float(0xff800000u);
    float sc[MOE_RT_PER], cv[MOE_RT_PER];
    if (scoring == 1) {
#pragma unroll
        for (int j = 0; j < MOE_RT_PER; ++j) {
            if (32 * j >= E) break;
            const int e = lane + 32 * j;
            sc[j] = e < E ? 1.0f / (1.0f + expf(-__ldcg(lg + e))) : 0.0f;
        }
    } else {
        float m = neg_inf;
#pragma unroll
        for (int j = 0; j < MOE_RT_PER; ++j) {
            if (32 * j >= E) break;
            const int e = lane + 32 * j;
            sc[j] = e < E ? __ldcg(lg + e) : neg_inf;
            m = fmaxf(m, sc[j]);
        }
        m = moe_warp_max(m);
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < MOE_RT_PER; ++j) {
            if (32 * j >= E) break;
            if (lane + 32 * j < E) {
                sc[j] = expf(sc[j] - m);
                s += sc[j];
            }
        }
        s = moe_warp_sum(s);
#pragma unroll
        for (int j = 0; j < MOE_RT_PER; ++j) {
            if (32 * j >= E) break;
            sc[j] = sc[j] / s;
        }
    }
#pragma unroll
    for (int j = 0; j < MOE_RT_PER; ++j) {
        if (32 * j >= E) break;
        const int e = lane + 32 * j;
        cv[j] = (has_bias && e < E) ? sc[j] + bias[e] : sc[j];
    }
    if (method != 0) {
        const int per = E / groups;
#pragma unroll
        for (int j = 0; j < MOE_RT_PER; ++j) {
            if (32 * j >= E) break;
            if (lane + 32 * j < E) ch[lane + 32 * j] = cv[j];
        }
        __syncwarp();
        for (int g = lane; g < groups; g += 32) {
            float a = neg_inf, b = neg_inf;
            for (int j = 0; j < per; ++j) {
                float v = ch[g * per + j];
                if (v > a) {
                    b = a;
                    a = v;
                } else if (v > b) {
                    b = v;
                }
            }
            gs[g] = (method == 1) ? a : a + b;
            keep[g] = 0;
        }
        __syncwarp();
        for (int r = 0; r < topk_groups; ++r) {
            float bv = neg_inf;
            int bi = -1;
            for (int g = lane; g < groups; g += 32) {
                if (!keep[g] && moe_better(gs[g], g, bv, bi)) {
                    bv = gs[g];
                    bi = g;
                }
            }
            moe_warp_argmax(bv, bi);
            __syncwarp();
            if (lane == 0 && bi >= 0) keep[bi] = 1;
            __syncwarp();
        }
#pragma unroll
        for (int j = 0; j < MOE_RT_PER; ++j) {
            if (32 * j >= E) break;
            const int e = lane + 32 * j;
            if (e < E && !keep[e / per]) cv[j] = 0.0f;
        }
        __syncwarp();  // the next token reuses ch, gs and keep
    }
    int my_idx = 0;  // lane k < K: the k-th choice and its weight
    float my_w = 0.0f;
#if __CUDA_ARCH__ >= 800
    // Without NaNs the order (larger value, then lower index) is total, and
    // an orderable unsigned key of each choice (-0 as +0) carries it. Round k
    // takes the best choice after round k-1's (key pk, expert pi) in that
    // order: each lane's best key among its slots after it (its lowest slot
    // among equals: the lowest expert), then the warp's largest key and the
    // lowest expert holding it from two warp reductions (redux.sync). Key 0
    // is "none" (a slot past E): without NaNs every real key is at least 1.
    // Nothing is written to the lanes' arrays and no array is indexed by a
    // choice: the keys stay in registers (session 22's ncu found the earlier
    // form, which cleared the chosen key, with its arrays in local memory),
    // and lane k reads its choice's weight from gs. The same choices, in the
    // same order, as the general loop below.
    bool nan = false;
#pragma unroll
    for (int j = 0; j < MOE_RT_PER; ++j) {
        if (32 * j >= E) break;
        nan |= lane + 32 * j < E && isnan(cv[j]);
    }
    if (!__any_sync(MOE_FULL, nan)) {
        unsigned key[MOE_RT_PER];
#pragma unroll
        for (int j = 0; j < MOE_RT_PER; ++j) {
            if (32 * j >= E) break;
            const int e = lane + 32 * j;
            const unsigned u = __float_as_uint(cv[j] + 0.0f);
            key[j] = e < E ? ((u & 0x80000000u) ? ~u : (u | 0x80000000u)) : 0u;
            if (e < E) gs[e] = (method == 2) ? sc[j] : cv[j];
        }
        __syncwarp();  // gs: the weights, read below by other lanes
        unsigned pk = 0xffffffffu;  // round k-1's key and expert (none before round 0)
        int pi = -1;
        for (int k = 0; k < K; ++k) {
            unsigned bk = 0u;
            int bj = 0;
#pragma unroll
            for (int j = 0; j < MOE_RT_PER; ++j) {
                if (32 * j >= E) break;
                const unsigned kj = key[j];
                const bool after = kj < pk || (kj == pk && lane + 32 * j > pi);
                if (after && kj > bk) {
                    bk = kj;
                    bj = j;
                }
            }
            pk = __reduce_max_sync(MOE_FULL, bk);
            pi = (int)__reduce_min_sync(MOE_FULL, bk == pk ? (unsigned)(lane + 32 * bj) : 0xffffffffu);
            if (lane == k) my_idx = pi;
        }
        if (lane < K) my_w = gs[my_idx];
        __syncwarp();  // the next token rewrites gs
    } else
#endif
    {
        unsigned taken = 0;  // bit j: expert lane + 32j is chosen
        for (int k = 0; k < K; ++k) {
            float bv = neg_inf;
            int bi = -1;
#pragma unroll
            for (int j = 0; j < MOE_RT_PER; ++j) {
                if (32 * j >= E) break;
                const int e = lane + 32 * j;
                if (e < E && !((taken >> j) & 1u) && moe_better(cv[j], e, bv, bi)) {
                    bv = cv[j];
                    bi = e;
                }
            }
            moe_warp_argmax(bv, bi);
            if (bi < 0) bi = 0;  // unreachable: K <= E leaves an untaken expert
            // The owner lane of bi marks it and hands its weight to lane k.
            float w = 0.0f;
#pragma unroll
            for (int j = 0; j < MOE_RT_PER; ++j) {
                if (32 * j >= E) break;
                if (lane + 32 * j == bi) {
                    taken |= 1u << j;
                    w = (method == 2) ? sc[j] : cv[j];
                }
            }
            w = __shfl_sync(MOE_FULL, w, bi & 31);
            if (lane == k) {
                my_idx = bi;
                my_w = w;
            }
        }
    }
    // Every lane sums the K weights in slot order (lane 0's sum before): the
    // shuffles unrolled to MOE_MAX_K, so that they issue back to back and only
    // the additions wait on one another.
    float s = 0.0f;
    if (norm) {
#pragma unroll
        for (int k = 0; k < MOE_MAX_K; ++k) {
            const float v = __shfl_sync(MOE_FULL, my_w, k);
            if (k < K) s += v;
        }
        s += norm_eps;
    }
    if (lane < K) {
        float v = my_w;
        if (norm) v = v / s;
        topk_idx[(long long)t * ks + lane] = my_idx;
        topk_w[(long long)t * ks + lane] = v * scale;
        if (sidx) sidx[t * ks + lane] = my_idx;
    } else if (lane < K + ns) {
        topk_idx[(long long)t * ks + lane] = E + (lane - K);
        topk_w[(long long)t * ks + lane] = 1.0f;
        if (sidx) sidx[t * ks + lane] = E + (lane - K);
    } else if (sidx && lane < ks) {
        sidx[t * ks + lane] = -1;  // a slot no expert fills: not sorted
    }
}

extern "C" __global__ void gpuctx_moe_route(const float* __restrict__ logits, const float* __restrict__ bias,
                                            int* __restrict__ topk_idx, float* __restrict__ topk_w,
                                            int T, int E, int K, int scoring, int method, int groups,
                                            int topk_groups, int has_bias, int norm, float norm_eps, float scale,
                                            int ks, int ns) {
    __shared__ float ch[MOE_MAX_E];
    __shared__ float gs[MOE_MAX_E];
    __shared__ unsigned char keep[MOE_MAX_E];
    MOE_GRID_WAIT();
    MOE_GRID_LAUNCH();
    if (threadIdx.x >= 32) return;  // one warp per block; extra threads idle
    if (!moe_route_args_ok(E, K, method, groups, topk_groups, ks, ns)) return;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        moe_route_token(logits + (long long)t * E, bias, topk_idx, topk_w, t, E, K, scoring, method, groups,
                        topk_groups, has_bias, norm, norm_eps, scale, ks, ns, ch, gs, keep, nullptr, threadIdx.x);
    }
}

// moe_warp_exscan, run by one whole warp (lane = its lane), turns seg[0..E)
// into its exclusive prefix sums and stores the total in seg[E]: each lane
// sums a run of ceil(E/32) entries, a shuffle scan adds the runs.
static __device__ __forceinline__ void moe_warp_exscan(int* seg, int E, int lane) {
    const int chunk = (E + 31) / 32;
    const int lo = lane * chunk;
    const int hi = moe_imin(E, lo + chunk);
    int s = 0;
    for (int e = lo; e < hi; ++e) s += seg[e];
    int incl = s;
    for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(MOE_FULL, incl, d);
        if (lane >= d) incl += v;
    }
    int acc = incl - s;
    for (int e = lo; e < hi; ++e) {
        const int c = seg[e];
        seg[e] = acc;
        acc += c;
    }
    if (lane == 31) seg[E] = incl;
}

// moe_seg_pos is the place of expert e's segment among the E segments of the
// aligned sort, which start at expert first (0 <= first < E) and wrap round:
// first, first+1, ..., E-1, 0, ..., first-1.
static __device__ __forceinline__ int moe_seg_pos(int e, int first, int E) {
    const int o = e - first;
    return o < 0 ? o + E : o;
}

// gpuctx_moe_plan: a stable counting sort of the TK = T*K assignments
// topk_idx[a] (a = t*K + k) by expert: counts[e] = assignments of expert e;
// offsets[e] = sum of counts[0..e-1] (offsets has E+1 entries, offsets[E] = TK);
// pos[a] = offsets[e] + (number of assignments a' < a with expert e), i.e. rows
// of each expert are in (token, k) order. An expert index outside [0,E) gets
// pos -1 and is not counted.
// Launch: grid (1,1,1), block (256,1,1). E <= 512.
extern "C" __global__ void gpuctx_moe_plan(const int* __restrict__ topk_idx, int* __restrict__ counts,
                                           int* __restrict__ offsets, int* __restrict__ pos, int TK, int E) {
    __shared__ int cnt[MOE_PLAN_WARPS][MOE_MAX_E];
    __shared__ int off[MOE_MAX_E + 1];
    if (blockIdx.x != 0 || blockDim.x != 32 * MOE_PLAN_WARPS || E <= 0 || E > MOE_MAX_E) return;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    for (int i = tid; i < MOE_PLAN_WARPS * MOE_MAX_E; i += blockDim.x) cnt[i / MOE_MAX_E][i % MOE_MAX_E] = 0;
    __syncthreads();
    // Each warp owns one contiguous segment of the assignments.
    const int seg = (TK + MOE_PLAN_WARPS - 1) / MOE_PLAN_WARPS;
    const int s0 = warp * seg;
    const int s1 = moe_imin(TK, s0 + seg);
    // Pass 1: per-warp, per-expert counts.
    for (int base = s0; base < s1; base += 32) {
        const int a = base + lane;
        int e = -1;
        if (a < s1) {
            e = topk_idx[a];
            if (e < 0 || e >= E) e = -1;
        }
        const unsigned m = __match_any_sync(MOE_FULL, e);
        if (e >= 0 && lane == __ffs(m) - 1) cnt[warp][e] += __popc(m);
        __syncwarp();
    }
    __syncthreads();
    // Per expert: totals, and each warp's start within the expert's rows.
    for (int e = tid; e < E; e += blockDim.x) {
        int run = 0;
        for (int w = 0; w < MOE_PLAN_WARPS; ++w) {
            const int c = cnt[w][e];
            cnt[w][e] = run;
            run += c;
        }
        off[e] = run;
        counts[e] = run;
    }
    __syncthreads();
    if (warp == 0) moe_warp_exscan(off, E, lane);  // exclusive scan of the totals
    __syncthreads();
    for (int e = tid; e <= E; e += blockDim.x) offsets[e] = off[e];
    for (int e = tid; e < E; e += blockDim.x) {
        for (int w = 0; w < MOE_PLAN_WARPS; ++w) cnt[w][e] += off[e];
    }
    __syncthreads();
    // Pass 2: positions, in assignment order within each expert.
    const unsigned lower = (1u << lane) - 1u;
    for (int base = s0; base < s1; base += 32) {
        const int a = base + lane;
        int e = -1;
        if (a < s1) {
            e = topk_idx[a];
            if (e < 0 || e >= E) e = -1;
        }
        const unsigned m = __match_any_sync(MOE_FULL, e);
        if (a < s1) pos[a] = (e >= 0) ? cnt[warp][e] + __popc(m & lower) : -1;
        __syncwarp();
        if (e >= 0 && lane == __ffs(m) - 1) cnt[warp][e] += __popc(m);
        __syncwarp();
    }
}

// gpuctx_moe_gather: xp[pos[a], :] = x[a / K, :] for a in [0, TK) with
// pos[a] >= 0; rows of H elements of elem_bytes (4: f32, 2: bf16) each.
// Launch: any grid and block.
extern "C" __global__ void gpuctx_moe_gather(const void* __restrict__ x, const int* __restrict__ pos,
                                             void* __restrict__ xp, int TK, int K, int H, int elem_bytes) {
    for (int a = blockIdx.x; a < TK; a += gridDim.x) {
        const int r = pos[a];
        if (r < 0) continue;
        const long long src = (long long)(a / K) * H;
        const long long dst = (long long)r * H;
        if (elem_bytes == 2) {
            const unsigned short* s = (const unsigned short*)x + src;
            unsigned short* d = (unsigned short*)xp + dst;
            for (int h = threadIdx.x; h < H; h += blockDim.x) d[h] = s[h];
        } else {
            const float* s = (const float*)x + src;
            float* d = (float*)xp + dst;
            for (int h = threadIdx.x; h < H; h += blockDim.x) d[h] = s[h];
        }
    }
}

// gpuctx_moe_swiglu: act[r, i] = silu(h[r, i]) * h[r, I + i] for r < rows,
// i < I, where h is [rows, 2I] (gate columns then up columns) and act is
// [rows, I]; silu(g) = g / (1 + exp(-g)); f32 math, stored f32 or bf16.
// Threads stride over the rows*I outputs, one each per grid pass (size the
// grid to ceil(rows*I / block) so that every load is in flight at once).
// Launch: any grid and block.
extern "C" __global__ void gpuctx_moe_swiglu(const void* __restrict__ h, void* __restrict__ act, int rows, int I,
                                             int bf16) {
    const long long n = (long long)rows * I;
    for (long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x; v < n; v += (long long)gridDim.x * blockDim.x) {
        const long long r = v / I, i = v - r * I;
        const float g = moe_ld(h, r * 2 * I + i, bf16);
        const float u = moe_ld(h, r * 2 * I + I + i, bf16);
        moe_st(act, v, (g / (1.0f + expf(-g))) * u, bf16);
    }
}

// gpuctx_moe_combine: y[t, :] = sum_{k=0..K-1} w[t*K+k] * out[pos[t*K+k], :]
// (when has_routed; k in increasing order, skipping pos < 0)
// + s * shared[t, :] (when has_shared; s = sigmoid(gate[t]) when has_gate, else 1),
// accumulated in f32 in that order and stored f32 or bf16. out is [TK, H],
// shared [T, H], gate [T] (f32), y [T, H]. Pointers of absent parts are not read.
// Launch: any grid and block.
extern "C" __global__ void gpuctx_moe_combine(const void* __restrict__ out, const int* __restrict__ pos,
                                              const float* __restrict__ w, const void* __restrict__ shared,
                                              const float* __restrict__ gate, void* __restrict__ y, int T, int K,
                                              int H, int has_routed, int has_shared, int has_gate, int bf16) {
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        float sg = 1.0f;
        if (has_shared && has_gate) sg = 1.0f / (1.0f + expf(-gate[t]));
        const long long row = (long long)t * H;
        for (int h = threadIdx.x; h < H; h += blockDim.x) {
            float acc = 0.0f;
            if (has_routed) {
                for (int k = 0; k < K; ++k) {
                    const int p = pos[(long long)t * K + k];
                    if (p >= 0) acc += w[(long long)t * K + k] * moe_ld(out, (long long)p * H + h, bf16);
                }
            }
            if (has_shared) acc += sg * moe_ld(shared, row + h, bf16);
            moe_st(y, row + h, acc, bf16);
        }
    }
}

// ---- Small-batch routed experts: device-side group sizes, no host round trip.
//
// gpuctx_moe_expert_up and gpuctx_moe_expert_down compute the routed experts
// straight from the plan (counts, offsets) on the device, one warp per output
// row of one expert, reading that row of the expert's weights once for up to
// MOE_XT of the expert's tokens at a time. Each touched expert's weights are read
// once (from DRAM; later token tiles hit the cache), so for small batches the
// cost is the weight bytes, with no grouped-GEMM setup and no host wait for the
// counts. Rounding matches the GEMM path: the gate and up dot products are
// rounded to the activation dtype before SwiGLU, as a GEMM that stores h is.
// H and I must be multiples of 8 and every matrix 16-byte aligned (the layer
// checks); loads are 16 bytes wide.
#define MOE_XW 8  // warps (output rows) per block
#define MOE_XT 4  // tokens of one expert per pass over a weight row

// moe_ld8 loads elements [i, i+8) of p (i a multiple of 8) as f32.
template <int BF>
static __device__ __forceinline__ void moe_ld8(const void* __restrict__ p, long long i, float* v) {
    if (BF) {
        const uint4 q = *(const uint4*)((const unsigned short*)p + i);
        const unsigned int w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v[2 * j] = __uint_as_float(w[j] << 16);
            v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
        }
    } else {
        const float4 a = *(const float4*)((const float*)p + i);
        const float4 b = *(const float4*)((const float*)p + i + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
}

// moe_round rounds v to the activation dtype (identity for f32).
template <int BF>
static __device__ __forceinline__ float moe_round(float v) {
    return BF ? moe_bf16_to_f32(moe_f32_to_bf16(v)) : v;
}

template <int BF>
static __device__ void moe_expert_up(const void* __restrict__ xp, const void* __restrict__ gu,
                                     const int* __restrict__ counts, const int* __restrict__ offsets,
                                     void* __restrict__ act, int E, int H, int I) {
    const int e = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const int i = blockIdx.x * MOE_XW + (threadIdx.x >> 5);
    if (e >= E || i >= I) return;  // whole warps leave together: no block barrier below
    const int n = counts[e];
    const int off = offsets[e];
    const long long g_row = ((long long)e * 2 * I + i) * H;
    const long long u_row = ((long long)e * 2 * I + I + i) * H;
    for (int t0 = 0; t0 < n; t0 += MOE_XT) {
        const int nt = moe_imin(MOE_XT, n - t0);
        float ag[MOE_XT], au[MOE_XT];
#pragma unroll
        for (int j = 0; j < MOE_XT; ++j) {
            ag[j] = 0.0f;
            au[j] = 0.0f;
        }
        for (int h = lane * 8; h < H; h += 32 * 8) {
            float gw[8], uw[8];
            moe_ld8<BF>(gu, g_row + h, gw);
            moe_ld8<BF>(gu, u_row + h, uw);
#pragma unroll
            for (int j = 0; j < MOE_XT; ++j) {
                if (j < nt) {
                    float xv[8];
                    moe_ld8<BF>(xp, (long long)(off + t0 + j) * H + h, xv);
#pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        ag[j] += gw[q] * xv[q];
                        au[j] += uw[q] * xv[q];
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < MOE_XT; ++j) {
            if (j < nt) {  // nt is the same on every lane: the shuffles stay converged
                const float g = moe_round<BF>(moe_warp_sum(ag[j]));
                const float u = moe_round<BF>(moe_warp_sum(au[j]));
                if (lane == 0) moe_st(act, (long long)(off + t0 + j) * I + i, (g / (1.0f + expf(-g))) * u, BF);
            }
        }
    }
}

template <int BF>
static __device__ void moe_expert_down(const void* __restrict__ act, const void* __restrict__ down,
                                       const int* __restrict__ counts, const int* __restrict__ offsets,
                                       void* __restrict__ out, int E, int H, int I) {
    const int e = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const int h = blockIdx.x * MOE_XW + (threadIdx.x >> 5);
    if (e >= E || h >= H) return;
    const int n = counts[e];
    const int off = offsets[e];
    const long long d_row = ((long long)e * H + h) * I;
    for (int t0 = 0; t0 < n; t0 += MOE_XT) {
        const int nt = moe_imin(MOE_XT, n - t0);
        float acc[MOE_XT];
#pragma unroll
        for (int j = 0; j < MOE_XT; ++j) acc[j] = 0.0f;
        for (int k = lane * 8; k < I; k += 32 * 8) {
            float dw[8];
            moe_ld8<BF>(down, d_row + k, dw);
#pragma unroll
            for (int j = 0; j < MOE_XT; ++j) {
                if (j < nt) {
                    float av[8];
                    moe_ld8<BF>(act, (long long)(off + t0 + j) * I + k, av);
#pragma unroll
                    for (int q = 0; q < 8; ++q) acc[j] += dw[q] * av[q];
                }
            }
        }
#pragma unroll
        for (int j = 0; j < MOE_XT; ++j) {
            if (j < nt) {
                const float v = moe_warp_sum(acc[j]);
                if (lane == 0) moe_st(out, (long long)(off + t0 + j) * H + h, v, BF);
            }
        }
    }
}

// gpuctx_moe_expert_up: for every expert e and every row r in [offsets[e],
// offsets[e] + counts[e]) of xp [TK, H]: act[r, i] = silu(g) * u for i < I, with
// g = xp[r, :] . gu[e, i, :] and u = xp[r, :] . gu[e, I + i, :] (gu is [E, 2I, H],
// gate rows then up rows), each rounded to the activation dtype first.
// Launch: grid (ceil(I / 8), E, 1), block (256, 1, 1).
extern "C" __global__ void gpuctx_moe_expert_up(const void* __restrict__ xp, const void* __restrict__ gu,
                                                const int* __restrict__ counts, const int* __restrict__ offsets,
                                                void* __restrict__ act, int E, int H, int I, int bf16) {
    if (bf16) {
        moe_expert_up<1>(xp, gu, counts, offsets, act, E, H, I);
    } else {
        moe_expert_up<0>(xp, gu, counts, offsets, act, E, H, I);
    }
}

// gpuctx_moe_expert_down: for every expert e and every row r in [offsets[e],
// offsets[e] + counts[e]): out[r, h] = act[r, :] . down[e, h, :] for h < H
// (down is [E, H, I], act [TK, I], out [TK, H]).
// Launch: grid (ceil(H / 8), E, 1), block (256, 1, 1).
extern "C" __global__ void gpuctx_moe_expert_down(const void* __restrict__ act, const void* __restrict__ down,
                                                  const int* __restrict__ counts, const int* __restrict__ offsets,
                                                  void* __restrict__ out, int E, int H, int I, int bf16) {
    if (bf16) {
        moe_expert_down<1>(act, down, counts, offsets, out, E, H, I);
    } else {
        moe_expert_down<0>(act, down, counts, offsets, out, E, H, I);
    }
}

// ---- Fused routed path (with moe_gemm.cu): block-aligned sort and row combine.
//
// gpuctx_moe_align: vLLM's moe_align_block_size, stable. For experts e in
// segment order (first, first+1, ..., E-1, 0, ..., first-1; moe_seg_pos),
// c_e = assignments a in [0, TK) with topk_idx[a] == e (others ignored);
// expert e's segment holds roundup(c_e, BM) rows starting at S_e = sum of the
// earlier segments. FusedShared puts the shared expert's chunks first
// (first = the routed expert count): their rows then do not depend on the
// routing, and the up kernel computes them before the routing is done
// (moe_shared_rows, moe_tile.cuh). sorted [cap]: sorted[S_e + j] = the j-th
// assignment of e in increasing a; every other entry (padding, and everything from npost on) is
// TK. block_expert [cap/BM]: e for the blocks of e's segment, -1 past npost.
// npost [1]: the padded total. The caller sizes cap = roundup(TK + min(E, TK)
// * (BM - 1), BM); a cap too small leaves npost = -1 and writes nothing else.
// Launch: grid (1,1,1), block (512,1,1). E <= 512.
#define MOE_ALIGN_WARPS 16
#define MOE_ALIGN_UNROLL 8  // assignments per lane loaded before they are counted

// moe_align_block is gpuctx_moe_align's body for one block of
// 32 * MOE_ALIGN_WARPS threads, with its shared arrays passed in.
static __device__ void moe_align_block(const int* __restrict__ topk_idx, int* __restrict__ sorted,
                                       int* __restrict__ block_expert, int* __restrict__ npost, int TK, int E,
                                       int BM, int cap, int first, int (*cnt)[MOE_MAX_E], int* seg) {
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    // Each of the first nw warps owns one contiguous segment of at least 32
    // assignments (few warps for a small batch: fewer counters to scan) and
    // walks it in chunks of 32 * MOE_ALIGN_UNROLL: all loads of a chunk are
    // in flight at once, then each group of 32 is counted with
    // __match_any_sync. The rows do not depend on nw.
    const int nw = TK <= 0 ? 1 : moe_imin(MOE_ALIGN_WARPS, (TK + 31) / 32);
    for (int i = tid; i < nw * MOE_MAX_E; i += blockDim.x) cnt[i / MOE_MAX_E][i % MOE_MAX_E] = 0;
    __syncthreads();
    const int per = (TK + nw - 1) / nw;
    const int s0 = warp * per;
    const int s1 = moe_imin(TK, s0 + per);
    for (int base = s0; base < s1; base += 32 * MOE_ALIGN_UNROLL) {
        int ev[MOE_ALIGN_UNROLL];
#pragma unroll
        for (int u = 0; u < MOE_ALIGN_UNROLL; ++u) {
            const int a = base + u * 32 + lane;
            ev[u] = a < s1 ? topk_idx[a] : -1;
        }
#pragma unroll
        for (int u = 0; u < MOE_ALIGN_UNROLL; ++u) {
            const int e = (ev[u] >= 0 && ev[u] < E) ? ev[u] : -1;
            const unsigned m = __match_any_sync(MOE_FULL, e);
            if (e >= 0 && lane == __ffs(m) - 1) cnt[warp][e] += __popc(m);
            __syncwarp();
        }
    }
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x) {
        int run = 0;
        for (int w = 0; w < nw; ++w) {
            const int c = cnt[w][e];
            cnt[w][e] = run;
            run += c;
        }
        seg[moe_seg_pos(e, first, E)] = (run + BM - 1) / BM * BM;
    }
    __syncthreads();
    if (warp == 0) moe_warp_exscan(seg, E, lane);  // the padded sizes' offsets, in segment order
    __syncthreads();
    const int total = seg[E];
    if (total > cap) {
        if (tid == 0) npost[0] = -1;
        return;
    }
    for (int p = tid; p < cap; p += blockDim.x) sorted[p] = TK;
    for (int b = tid; b < cap / BM; b += blockDim.x) block_expert[b] = -1;
    for (int e = tid; e < E; e += blockDim.x) {
        const int s = seg[moe_seg_pos(e, first, E)];
        for (int w = 0; w < nw; ++w) cnt[w][e] += s;
    }
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x) {
        const int o = moe_seg_pos(e, first, E);
        for (int b = seg[o] / BM; b < seg[o + 1] / BM; ++b) block_expert[b] = e;
    }
    if (tid == 0) npost[0] = total;
    const unsigned lower = (1u << lane) - 1u;
    for (int base = s0; base < s1; base += 32 * MOE_ALIGN_UNROLL) {
        int ev[MOE_ALIGN_UNROLL];
#pragma unroll
        for (int u = 0; u < MOE_ALIGN_UNROLL; ++u) {
            const int a = base + u * 32 + lane;
            ev[u] = a < s1 ? topk_idx[a] : -1;
        }
#pragma unroll
        for (int u = 0; u < MOE_ALIGN_UNROLL; ++u) {
            const int a = base + u * 32 + lane;
            const int e = (ev[u] >= 0 && ev[u] < E) ? ev[u] : -1;
            const unsigned m = __match_any_sync(MOE_FULL, e);
            if (e >= 0) sorted[cnt[warp][e] + __popc(m & lower)] = a;
            __syncwarp();
            if (e >= 0 && lane == __ffs(m) - 1) cnt[warp][e] += __popc(m);
            __syncwarp();
        }
    }
}

extern "C" __global__ __launch_bounds__(32 * MOE_ALIGN_WARPS) void gpuctx_moe_align(
    const int* __restrict__ topk_idx, int* __restrict__ sorted, int* __restrict__ block_expert, int* __restrict__ npost,
    int TK, int E, int BM, int cap, int first) {
    __shared__ int cnt[MOE_ALIGN_WARPS][MOE_MAX_E];
    __shared__ int seg[MOE_MAX_E + 1];
    MOE_GRID_WAIT();
    MOE_GRID_LAUNCH();
    if (blockIdx.x != 0 || blockDim.x != 32 * MOE_ALIGN_WARPS || E <= 0 || E > MOE_MAX_E || BM <= 0 ||
        cap % BM != 0 || first < 0 || first >= E) {
        return;
    }
    moe_align_block(topk_idx, sorted, block_expert, npost, TK, E, BM, cap, first, cnt, seg);
}

// ---- The same sort in three launches, for large TK (one block of
// gpuctx_moe_align walks every assignment twice on one SM): blocks of
// MOE_ALIGN_CHUNK assignments count in parallel, one block scans, and the
// blocks scatter in parallel. Same outputs as gpuctx_moe_align.
//
// gpuctx_moe_align_count (topk_idx, bcnt, TK, E): bcnt [nb, E] = the
//     assignments of expert e in chunk b (nb = ceil(TK / MOE_ALIGN_CHUNK)).
//     Grid (nb,1,1), block (512,1,1).
// gpuctx_moe_align_scan (bcnt, boff, sorted, block_expert, npost, TK, E, BM,
//     cap, nb, first): boff [nb, E] = the first row of chunk b's assignments of e;
//     sorted [cap] = TK, block_expert and npost as gpuctx_moe_align (npost -1
//     and nothing else written when cap is too small). Grid (1,1,1), block (512,1,1).
// gpuctx_moe_align_scatter (topk_idx, boff, npost, sorted, TK, E): sorted at
//     the rows of every routed assignment of the chunk, in increasing order.
//     Grid (nb,1,1), block (512,1,1); nothing when npost[0] < 0.
#define MOE_ALIGN_CHUNK 2048

extern "C" __global__ __launch_bounds__(32 * MOE_ALIGN_WARPS) void gpuctx_moe_align_count(
    const int* __restrict__ topk_idx, int* __restrict__ bcnt, int TK, int E) {
    __shared__ int cnt[MOE_MAX_E];
    MOE_GRID_WAIT();
    MOE_GRID_LAUNCH();
    if (E <= 0 || E > MOE_MAX_E) return;
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    const int a0 = blockIdx.x * MOE_ALIGN_CHUNK, a1 = moe_imin(TK, a0 + MOE_ALIGN_CHUNK);
    for (int a = a0 + threadIdx.x; a < a1; a += blockDim.x) {
        const int e = topk_idx[a];
        if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) bcnt[blockIdx.x * E + e] = cnt[e];
}

extern "C" __global__ __launch_bounds__(32 * MOE_ALIGN_WARPS) void gpuctx_moe_align_scan(
    const int* __restrict__ bcnt, int* __restrict__ boff, int* __restrict__ sorted, int* __restrict__ block_expert,
    int* __restrict__ npost, int TK, int E, int BM, int cap, int nb, int first) {
    __shared__ int seg[MOE_MAX_E + 1];
    MOE_GRID_WAIT();
    MOE_GRID_LAUNCH();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (blockIdx.x != 0 || blockDim.x != 32 * MOE_ALIGN_WARPS || E <= 0 || E > MOE_MAX_E || BM <= 0 ||
        cap % BM != 0 || first < 0 || first >= E) {
        return;
    }
    for (int e = tid; e < E; e += blockDim.x) {
        int run = 0;
        for (int b = 0; b < nb; ++b) {
            const int c = bcnt[b * E + e];
            boff[b * E + e] = run;
            run += c;
        }
        seg[moe_seg_pos(e, first, E)] = (run + BM - 1) / BM * BM;
    }
    __syncthreads();
    if (warp == 0) moe_warp_exscan(seg, E, lane);  // the padded sizes' offsets, in segment order
    __syncthreads();
    const int total = seg[E];
    if (total > cap) {
        if (tid == 0) npost[0] = -1;
        return;
    }
    for (int p = tid; p < cap; p += blockDim.x) sorted[p] = TK;
    for (int b = tid; b < cap / BM; b += blockDim.x) block_expert[b] = -1;
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x) {
        const int o = moe_seg_pos(e, first, E);
        for (int b = 0; b < nb; ++b) boff[b * E + e] += seg[o];
        for (int b = seg[o] / BM; b < seg[o + 1] / BM; ++b) block_expert[b] = e;
    }
    if (tid == 0) npost[0] = total;
}

extern "C" __global__ __launch_bounds__(32 * MOE_ALIGN_WARPS) void gpuctx_moe_align_scatter(
    const int* __restrict__ topk_idx, const int* __restrict__ boff, const int* __restrict__ npost,
    int* __restrict__ sorted, int TK, int E) {
    __shared__ int cnt[MOE_ALIGN_WARPS][MOE_MAX_E];
    MOE_GRID_WAIT();
    MOE_GRID_LAUNCH();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (npost[0] < 0 || blockDim.x != 32 * MOE_ALIGN_WARPS || E <= 0 || E > MOE_MAX_E) return;
    for (int i = tid; i < MOE_ALIGN_WARPS * E; i += blockDim.x) cnt[i / E][i % E] = 0;
    __syncthreads();
    // Warp w owns 128 consecutive assignments of the chunk: four rounds of 32.
    constexpr int PER = MOE_ALIGN_CHUNK / MOE_ALIGN_WARPS;
    const int s0 = blockIdx.x * MOE_ALIGN_CHUNK + warp * PER;
    const int s1 = moe_imin(TK, s0 + PER);
    int ev[PER / 32];
#pragma unroll
    for (int u = 0; u < PER / 32; ++u) {
        const int a = s0 + u * 32 + lane;
        const int e = a < s1 ? topk_idx[a] : -1;
        ev[u] = (e >= 0 && e < E) ? e : -1;
    }
#pragma unroll
    for (int u = 0; u < PER / 32; ++u) {
        const unsigned m = __match_any_sync(MOE_FULL, ev[u]);
        if (ev[u] >= 0 && lane == __ffs(m) - 1) cnt[warp][ev[u]] += __popc(m);
        __syncwarp();
    }
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x) {
        int run = boff[blockIdx.x * E + e];
        for (int w = 0; w < MOE_ALIGN_WARPS; ++w) {
            const int c = cnt[w][e];
            cnt[w][e] = run;
            run += c;
        }
    }
    __syncthreads();
    const unsigned lower = (1u << lane) - 1u;
#pragma unroll
    for (int u = 0; u < PER / 32; ++u) {
        const int a = s0 + u * 32 + lane;
        const int e = ev[u];
        const unsigned m = __match_any_sync(MOE_FULL, e);
        if (e >= 0) sorted[cnt[warp][e] + __popc(m & lower)] = a;
        __syncwarp();
        if (e >= 0 && lane == __ffs(m) - 1) cnt[warp][e] += __popc(m);
        __syncwarp();
    }
}

// gpuctx_moe_route_align: the router GEMM, gpuctx_moe_route and
// gpuctx_moe_align in one launch, for small batches (one launch instead of
// three): logits[t, e] = x[t, :] . router[e, :] (bf16 operands, f32 sums,
// stored to logits [T, E]), then the routing of every token (topk_idx, topk_w
// [T, ks]; the route's arguments) and the aligned sort of its TK = T * ks
// assignments over E + ns experts (the align's arguments, first = E when ns > 0:
// the shared expert's chunks sort first).
// Every block computes logits, one warp per (token, expert) in the same order
// whatever the grid (lanes stride over h, 16-byte loads, butterfly sum), so
// the router is read by as many SMs as there are blocks; the last block to
// finish (a ticket taken with atomicInc on ticket[0], which it leaves at 0
// for the next launch) routes the tokens, one warp per token, and sorts.
// ticket must be 0 before the first launch. Launch: grid (ceil(T*E/16),1,1)
// (any grid works), block (512,1,1), dynamic shared memory
// moe_ra_smem(T, E) bytes (RouteAlignSmem in Go). H a multiple of 8,
// E + ns <= 512, T*E <= MOE_RA_MAX_DOTS. With quant_x != 0 (sm_89 and later;
// elsewhere the kernel writes nothing) every block also takes a share of x's
// quantization for the w8a8 tiles: xq [T, H] E4M3 codes and xs [T,
// ceil(H/128)] scales, as gpuctx_moe_fp8_quant (x, xq, xs, -, T, H, 0)
// writes them; xq and xs are not read otherwise.
#define MOE_RA_ALIGN_BYTES (MOE_ALIGN_WARPS * MOE_MAX_E * 4 + (MOE_MAX_E + 1) * 4)

// Bytes of one routing warp's arrays (ch and gs, then keep) and of the whole
// dynamic shared memory: min(T, 16) warps' arrays and the small sort's
// arrays (MOE_RA_SMALL_BYTES) while routing, or the align's counters (always
// the larger: T*E <= MOE_RA_MAX_DOTS).
#define MOE_RA_SMALL_TK 128  // assignments up to which the small sort runs
#define MOE_RA_SMALL_BYTES (4 * (MOE_RA_SMALL_TK + MOE_MAX_E + MOE_MAX_E + 1))
static __host__ __device__ __forceinline__ int moe_ra_warp_bytes(int E) { return (9 * E + 15) / 16 * 16; }
static __host__ __device__ __forceinline__ int moe_ra_smem(int T, int E) {
    const int rw = T < MOE_ALIGN_WARPS ? (T > 0 ? T : 1) : MOE_ALIGN_WARPS;
    const int route = rw * moe_ra_warp_bytes(E) + MOE_RA_SMALL_BYTES;
    return route > MOE_RA_ALIGN_BYTES ? route : MOE_RA_ALIGN_BYTES;
}

// moe_ra_small_sort is gpuctx_moe_align's result for TK <= MOE_RA_SMALL_TK
// assignments whose experts are in shared memory (sidx, written by the
// routing warps): a thread per assignment finds its rank among the earlier
// assignments of its expert, cnt (zeroed before the routing) counts them,
// one warp scans the padded sizes into seg, and every row of sorted and
// block_expert is written once. Same outputs as moe_align_block.
static __device__ void moe_ra_small_sort(const int* sidx, int* cnt, int* seg, int* __restrict__ sorted,
                                         int* __restrict__ block_expert, int* __restrict__ npost, int TK, int E,
                                         int BM, int cap, int first) {
    const int tid = threadIdx.x, lane = tid & 31;
    int e = -1, rank = 0;
    if (tid < TK) {
        e = sidx[tid];
        if (e < 0 || e >= E) e = -1;
        if (e >= 0) {
            for (int a = 0; a < tid; ++a) rank += sidx[a] == e;
            atomicAdd(&cnt[e], 1);
        }
    }
    __syncthreads();
    // The padded sizes in segment order and their offsets: thread o takes
    // segment o (expert first + o, wrapping), a warp scan, then one over the
    // warps' totals (a thread per segment: E <= MOE_MAX_E <= the block).
    {
        static_assert(MOE_MAX_E <= 32 * MOE_ALIGN_WARPS, "the small sort takes a thread per expert");
        __shared__ int wtot[MOE_ALIGN_WARPS];
        const int o = tid, warp = tid >> 5;
        int i = o + first;
        if (i >= E) i -= E;
        const int v = o < E ? (cnt[i] + BM - 1) / BM * BM : 0;
        int incl = v;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int u = __shfl_up_sync(MOE_FULL, incl, d);
            if (lane >= d) incl += u;
        }
        if (lane == 31) wtot[warp] = incl;
        __syncthreads();
        if (warp == 0) {
            int t = lane < MOE_ALIGN_WARPS ? wtot[lane] : 0;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int u = __shfl_up_sync(MOE_FULL, t, d);
                if (lane >= d) t += u;
            }
            if (lane < MOE_ALIGN_WARPS) wtot[lane] = t;  // inclusive over the warps
        }
        __syncthreads();
        const int before = warp > 0 ? wtot[warp - 1] : 0;
        if (o < E) seg[o] = before + incl - v;
        if (o == E - 1) seg[E] = before + incl;
    }
    __syncthreads();
    const int total = seg[E];
    if (total > cap) {
        if (tid == 0) npost[0] = -1;
        return;
    }
    if (e >= 0) sorted[seg[moe_seg_pos(e, first, E)] + rank] = tid;
    for (int i = tid; i < E; i += blockDim.x) {  // expert i's padding rows and blocks
        const int o = moe_seg_pos(i, first, E);
        for (int p = seg[o] + cnt[i]; p < seg[o + 1]; ++p) sorted[p] = TK;
        for (int b = seg[o] / BM; b < seg[o + 1] / BM; ++b) block_expert[b] = i;
    }
    for (int p = total + tid; p < cap; p += blockDim.x) sorted[p] = TK;
    for (int b = total / BM + tid; b < cap / BM; b += blockDim.x) block_expert[b] = -1;
    if (tid == 0) npost[0] = total;
}

extern "C" __global__ __launch_bounds__(32 * MOE_ALIGN_WARPS, 1) void gpuctx_moe_route_align(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ router, const float* __restrict__ bias,
    float* __restrict__ logits, int* __restrict__ topk_idx, float* __restrict__ topk_w, int* __restrict__ sorted,
    int* __restrict__ block_expert, int* __restrict__ npost, unsigned int* __restrict__ ticket, int T, int H, int E,
    int K, int scoring, int method, int groups, int topk_groups, int has_bias, int norm, float norm_eps,
    float scale, int ks, int ns, int BM, int cap, unsigned char* __restrict__ xq, float* __restrict__ xs,
    int quant_x) {
    extern __shared__ __align__(16) unsigned char ra_dyn[];
    __shared__ bool last;
    MOE_GRID_WAIT();  // x and the ticket come from earlier work
    // The kernel behind (the up tile) may be scheduled from here only when
    // the fused shared expert's chunks are sorted (ns > 0): its blocks of
    // their rows start before the sort ends (moe_shared_rows). Otherwise
    // from the last block's routing on, below: an up tile's blocks launched
    // early wait on their SMs, holding shared memory and registers, for as
    // long as this kernel runs, and the shared expert's GEMMs on the side
    // stream (Dual) then found no room (DeepSeek-V2-Lite FP8 Dual, 1 token,
    // about 50 -> 60 us once the w8a8 up tile came straight behind this
    // kernel with no quantizer launch between them: bench/RESULTS.md,
    // session 23).
    if (ns > 0) MOE_GRID_LAUNCH();
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    const int Ex = E + ns;
    const int first = ns > 0 ? E : 0;  // the shared expert's chunks E..Ex-1 sort first
    if (blockDim.x != 32 * MOE_ALIGN_WARPS || T < 0 || H % 8 != 0 || Ex > MOE_MAX_E || T * E > MOE_RA_MAX_DOTS ||
        BM <= 0 || cap % BM != 0 || !moe_route_args_ok(E, K, method, groups, topk_groups, ks, ns) ||
        dyn < (unsigned)moe_ra_smem(T, E)) {
        return;
    }
#ifndef MOE_HAS_E4M3_CVT
    if (quant_x) return;
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Logits: one warp per (token, expert), 16-byte loads, butterfly sum.
    for (int d = blockIdx.x * MOE_ALIGN_WARPS + warp; d < T * E; d += gridDim.x * MOE_ALIGN_WARPS) {
        const int t = d / E, e = d - t * E;
        const unsigned short* xr = x + (long long)t * H;
        const unsigned short* wr = router + (long long)e * H;
        float acc = 0.0f;
#pragma unroll 8
        for (int h = lane * 8; h < H; h += 32 * 8) {  // eight 16-byte loads of each operand in flight per lane
            const uint4 a = *(const uint4*)(xr + h);
            const uint4 b = *(const uint4*)(wr + h);
            const unsigned int av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                acc += __uint_as_float(av[j] << 16) * __uint_as_float(bv[j] << 16);
                acc += __uint_as_float(av[j] & 0xffff0000u) * __uint_as_float(bv[j] & 0xffff0000u);
            }
        }
        acc = moe_warp_sum(acc);
        if (lane == 0) logits[(long long)t * E + e] = acc;
    }
#ifdef MOE_HAS_E4M3_CVT
    // With quant_x, x's E4M3 codes and scales for the w8a8 tiles, as
    // gpuctx_moe_fp8_quant (x, xq, xs, -, T, H, 0) gives them (the same
    // w8_quant8): a half-warp per (token, 128-column group) over every
    // block, so that the chain needs no quantizer launch of its own.
    if (quant_x) {
        const int G = (H + 127) / 128, hl = threadIdx.x & 15;
        const unsigned mask = 0xffffu << (threadIdx.x & 16);
        for (int w = blockIdx.x * (32 * MOE_ALIGN_WARPS / 16) + (threadIdx.x >> 4); w < T * G;
             w += gridDim.x * (32 * MOE_ALIGN_WARPS / 16)) {
            const int t = w / G, k = (w - t * G) * 128 + 8 * hl;
            const bool ok = k < H;
            const long long off = (long long)t * H + k;
            const uint4 h = ok ? *(const uint4*)(x + off) : make_uint4(0u, 0u, 0u, 0u);
            float sc;
            const uint2 c = w8_quant8(h, mask, sc);
            if (ok) *(uint2*)(xq + off) = c;
            if (hl == 0) xs[w] = sc;
        }
    }
#endif
    // The last block to get here routes and sorts: every block's logits are
    // in global memory before its ticket, and the last block reads them from
    // L2 after its own. The ticket is one acquire-release atomic of thread 0
    // between two barriers (CUTLASS's barrier arrives the same way): the
    // barrier orders the block's logits stores before its release, and the
    // last block's acquire before its reads. It replaced a sequentially
    // consistent fence (__threadfence) on each side: by ncu's stall samples
    // (H200, Qwen3-30B-A3B, one token) the ticket and the fence after it were
    // roughly 2k of the launch's 28.6k cycles; this change was measured only
    // together with the routing's and the sort's (bench/RESULTS.md).
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned old;
        asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;\n"
                     : "=r"(old)
                     : "l"(ticket), "r"(gridDim.x - 1)
                     : "memory");
        last = old == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    if (ns == 0) MOE_GRID_LAUNCH();  // the other blocks have exited (see above)
    // A warp per token reads its logits from L2 (__ldcg in moe_route_token);
    // for a small batch the experts also go to shared memory for the small
    // sort, whose counters are zeroed meanwhile.
    const int rw = T < MOE_ALIGN_WARPS ? T : MOE_ALIGN_WARPS;
    const bool small = T * ks <= MOE_RA_SMALL_TK;
    int* sidx = (int*)(ra_dyn + (rw > 0 ? rw : 1) * moe_ra_warp_bytes(E));
    int* scnt = sidx + MOE_RA_SMALL_TK;
    int* sseg = scnt + MOE_MAX_E;
    if (small) {
        for (int i = threadIdx.x; i < Ex; i += blockDim.x) scnt[i] = 0;
    }
    if (warp < rw) {
        float* ch = (float*)(ra_dyn + warp * moe_ra_warp_bytes(E));
        float* gs = ch + E;
        unsigned char* keep = (unsigned char*)(gs + E);
        for (int t = warp; t < T; t += rw) {
            moe_route_token(logits + (long long)t * E, bias, topk_idx, topk_w, t, E, K, scoring, method, groups,
                            topk_groups, has_bias, norm, norm_eps, scale, ks, ns, ch, gs, keep, small ? sidx : nullptr,
                            lane);
        }
    }
    __syncthreads();
    if (small) {
        moe_ra_small_sort(sidx, scnt, sseg, sorted, block_expert, npost, T * ks, Ex, BM, cap, first);
        return;
    }
    moe_align_block(topk_idx, sorted, block_expert, npost, T * ks, Ex, BM, cap, first, (int(*)[MOE_MAX_E])ra_dyn,
                    (int*)(ra_dyn + MOE_ALIGN_WARPS * MOE_MAX_E * 4));
}

// gpuctx_moe_combine_rows: gpuctx_moe_combine with the routed rows in
// assignment order: y[t, :] = sum_{k ascending} w[t*K+k] * out[t*K+k, :] (when
// has_routed) + s * shared[t, :] (when has_shared; s = sigmoid(gate[t]) when
// has_gate, else 1), f32 in that order, stored f32 or bf16. One thread per
// element, or per eight (16-byte accesses) for bf16 with H a multiple of 8
// (pointers 16-byte aligned). Launch: any grid and block.
extern "C" __global__ void gpuctx_moe_combine_rows(const void* __restrict__ out, const float* __restrict__ w,
                                                   const void* __restrict__ shared, const float* __restrict__ gate,
                                                   void* __restrict__ y, int T, int K, int H, int has_routed,
                                                   int has_shared, int has_gate, int bf16) {
    MOE_GRID_WAIT();
    MOE_GRID_LAUNCH();
    const long long n = (long long)T * H;
    const long long tid0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long step = (long long)gridDim.x * blockDim.x;
    if (bf16 && H % 8 == 0) {  // eight elements per thread, 16-byte loads and stores
        for (long long v = tid0; v < n / 8; v += step) {
            const long long i = v * 8;
            const int t = (int)(i / H);
            const int h = (int)(i - (long long)t * H);
            float acc[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
            if (has_routed) {
                // Eight rows' loads in flight, then their sums in k order.
                for (int k0 = 0; k0 < K; k0 += 8) {
                    uint4 q[8];
                    float wk[8];
#pragma unroll
                    for (int u = 0; u < 8; ++u) {
                        const long long a = (long long)t * K + moe_imin(k0 + u, K - 1);
                        wk[u] = w[a];
                        q[u] = *(const uint4*)((const unsigned short*)out + a * H + h);
                    }
#pragma unroll
                    for (int u = 0; u < 8; ++u) {
                        if (k0 + u >= K) break;
                        const unsigned int v[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            acc[2 * j] += wk[u] * __uint_as_float(v[j] << 16);
                            acc[2 * j + 1] += wk[u] * __uint_as_float(v[j] & 0xffff0000u);
                        }
                    }
                }
            }
            if (has_shared) {
                const float sg = has_gate ? 1.0f / (1.0f + expf(-gate[t])) : 1.0f;
                const uint4 q = *(const uint4*)((const unsigned short*)shared + i);
                const unsigned int u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    acc[2 * j] += sg * __uint_as_float(u[j] << 16);
                    acc[2 * j + 1] += sg * __uint_as_float(u[j] & 0xffff0000u);
                }
            }
            uint4 r;
            r.x = (unsigned)moe_f32_to_bf16(acc[0]) | ((unsigned)moe_f32_to_bf16(acc[1]) << 16);
            r.y = (unsigned)moe_f32_to_bf16(acc[2]) | ((unsigned)moe_f32_to_bf16(acc[3]) << 16);
            r.z = (unsigned)moe_f32_to_bf16(acc[4]) | ((unsigned)moe_f32_to_bf16(acc[5]) << 16);
            r.w = (unsigned)moe_f32_to_bf16(acc[6]) | ((unsigned)moe_f32_to_bf16(acc[7]) << 16);
            *(uint4*)((unsigned short*)y + i) = r;
        }
        return;
    }
    for (long long i = tid0; i < n; i += step) {
        const int t = (int)(i / H);
        const int h = (int)(i - (long long)t * H);
        float acc = 0.0f;
        if (has_routed) {
            for (int k = 0; k < K; ++k) {
                const long long a = (long long)t * K + k;
                acc += w[a] * moe_ld(out, a * H + h, bf16);
            }
        }
        if (has_shared) {
            const float sg = has_gate ? 1.0f / (1.0f + expf(-gate[t])) : 1.0f;
            acc += sg * moe_ld(shared, i, bf16);
        }
        moe_st(y, i, acc, bf16);
    }
}
