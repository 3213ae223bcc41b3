// Planted bug for memcheck: with K3_BUG, the last thread reads one element past the end of x (global memory),
// and one element past the end of a __shared__ array (shared memory). Without it every access is in bounds.
#ifndef K3_BUG
#define K3_BUG 0
#endif

extern "C" __global__ void __launch_bounds__(64, 1) oob_global(const float* x, float* y, int n) {
    const int i = threadIdx.x;
    const int j = (K3_BUG && i == n - 1) ? n : i;
    y[i] = x[j] * 2.0f;  // planted: global
}

extern "C" __global__ void __launch_bounds__(64, 1) oob_shared(const float* x, float* y, int n) {
    __shared__ float s[64];
    const int i = threadIdx.x;
    s[i] = x[i];
    __syncthreads();
    const int j = (K3_BUG && i == n - 1) ? n : i;
    y[i] = s[j] + 1.0f;  // planted: shared
}
