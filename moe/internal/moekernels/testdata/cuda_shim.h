// Syntax-check shim for TestCUDASourcesParse: the CUDA keywords and intrinsics that
// the registered sources use, as host C++ declarations (g++ -fsyntax-only).
#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __CUDA_ARCH__ 900
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
struct dim3v { unsigned x, y, z; };
extern dim3v threadIdx, blockIdx, blockDim, gridDim;
float __uint_as_float(unsigned); unsigned __float_as_uint(float);
float __fmul_rn(float, float); float __fadd_rn(float, float); float __fdiv_rn(float, float); float __fsub_rn(float, float);
float __fmaf_rn(float, float, float); float __frcp_rn(float);
float fmaxf(float, float); float fminf(float, float); float fabsf(float); float expf(float); float rintf(float); float sqrtf(float);
bool isnan(float);
unsigned __byte_perm(unsigned, unsigned, unsigned);
template <class T> T __shfl_xor_sync(unsigned, T, int, int = 32);
template <class T> T __shfl_sync(unsigned, T, int, int = 32);
template <class T> T __shfl_up_sync(unsigned, T, int, int = 32);
template <class T> T __shfl_down_sync(unsigned, T, int, int = 32);
unsigned __reduce_max_sync(unsigned, unsigned); unsigned __reduce_min_sync(unsigned, unsigned); unsigned __reduce_add_sync(unsigned, unsigned);
int __any_sync(unsigned, int); int __all_sync(unsigned, int); unsigned __ballot_sync(unsigned, int); unsigned __match_any_sync(unsigned, int);
void __syncwarp(unsigned = 0xffffffffu);
unsigned long long __cvta_generic_to_shared(const void*);
void __syncthreads(); void __threadfence(); int __popc(unsigned); int __ffs(int); int __clz(int);
template <class T> T atomicAdd(T*, T); unsigned atomicInc(unsigned*, unsigned); template <class T> T atomicMax(T*, T); template <class T> T atomicCAS(T*, T, T);
template <class T> T __ldcg(const T*); template <class T> T __ldg(const T*);
float __int_as_float(int); int __float_as_int(float); int __float2int_rn(float); long long clock64(); 
int min(int, int); int max(int, int); unsigned min(unsigned, unsigned); unsigned max(unsigned, unsigned);
long long min(long long, long long); long long max(long long, long long);
float min(float, float); float max(float, float);
uint2 make_uint2(unsigned, unsigned); uint4 make_uint4(unsigned, unsigned, unsigned, unsigned);
void __trap();
