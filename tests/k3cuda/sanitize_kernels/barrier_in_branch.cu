// Planted bug for synccheck: with K3_BUG, the __syncthreads sits in a branch only the first warp takes.
#ifndef K3_BUG
#define K3_BUG 0
#endif

extern "C" __global__ void __launch_bounds__(64, 1) branch_barrier(const float* x, float* y) {
    __shared__ float s[64];
    const int i = threadIdx.x;
    s[i] = x[i];
    if (!K3_BUG || i < 32) {
        __syncthreads();  // planted
    }
    if (!K3_BUG) y[i] = s[63 - i];
    else y[i] = x[i];
}
