// Two half-warps each reduce within themselves at the same time, with disjoint masks (legal). With K3_BUG the
// upper half names the whole warp while the lower half names itself: overlapping, different masks (synccheck).
#ifndef K3_BUG
#define K3_BUG 0
#endif

extern "C" __global__ void __launch_bounds__(32, 1) half_warps(const float* x, float* y) {
    const int lane = threadIdx.x;
    const unsigned mask = lane < 16 ? 0x0000ffffu : (K3_BUG ? 0xffffffffu : 0xffff0000u);
    float v = x[lane];
    for (int off = 8; off > 0; off >>= 1) v += __shfl_xor_sync(mask, v, off);  // planted
    y[lane] = v;
}
