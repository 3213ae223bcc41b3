// Planted bug for synccheck (warp fidelity): the upper half-warp exits early; with K3_BUG the remaining lanes
// shuffle with the full mask, naming lanes that have exited (undefined on a GPU). The fix names only the lanes
// that are left.
#ifndef K3_BUG
#define K3_BUG 0
#endif

extern "C" __global__ void __launch_bounds__(32, 1) half_warp_sum(const float* x, float* y) {
    const int lane = threadIdx.x;
    float v = x[lane];
    if (lane >= 16) return;
    const unsigned mask = K3_BUG ? 0xffffffffu : 0x0000ffffu;
    for (int off = 8; off > 0; off >>= 1) v += __shfl_xor_sync(mask, v, off);  // planted
    if (lane == 0) y[0] = v;
}
