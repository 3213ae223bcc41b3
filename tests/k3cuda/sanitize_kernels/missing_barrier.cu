// Planted bug for racecheck: with K3_BUG, the __syncthreads between the shared write of one warp and the read
// of it by the other warp is missing.
#ifndef K3_BUG
#define K3_BUG 0
#endif

extern "C" __global__ void __launch_bounds__(64, 1) swap_halves(const float* x, float* y) {
    __shared__ float s[64];
    const int i = threadIdx.x;
    s[i] = x[i];  // planted: write
#if !K3_BUG
    __syncthreads();
#endif
    y[i] = s[i ^ 32];  // planted: read
}
