// Basic kernels: launch-overhead probe, fill, axpby, integer add.
// Every kernel is extern "C" (unmangled name), 1-D, grid-stride, and takes the
// element count as a 64-bit integer (int64 on the Go side).

extern "C" __global__ void gpuctx_empty() {}

extern "C" __global__ void gpuctx_fill_f32(float* __restrict__ y, float v, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = v;
    }
}

extern "C" __global__ void gpuctx_axpby_f32(float* __restrict__ y, const float* __restrict__ x,
                                            float a, float b, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = a * x[i] + b * y[i];
    }
}

extern "C" __global__ void gpuctx_add_i32(int* __restrict__ y, int v, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] += v;
    }
}
