// Planted bug for initcheck: with K3_BUG, warp 1 reads the half of the __shared__ array that nobody wrote.
#ifndef K3_BUG
#define K3_BUG 0
#endif

extern "C" __global__ void __launch_bounds__(64, 1) half_written(const float* x, float* y) {
    __shared__ float s[64];
    const int i = threadIdx.x;
    if (i < 32) s[i] = x[i];
    __syncthreads();
    y[i] = s[K3_BUG ? i : i % 32];  // planted
}
