// rmsnorm.cu — RMSNorm over the last axis, one block per row (docs/spec.md section 3).
//
//   y[r, d] = w[d] * x[r, d] / sqrt(mean_d(x[r, :]^2) + eps)        x, y: [rows, D] fp32;  w: [D] fp32
//
// Sum of squares accumulated in fp32 per thread, then a warp-shuffle + shared-memory block reduction; exact
// sqrtf (no fast math). 16-byte accesses when D % 4 == 0 (rows then stay 16-byte aligned), scalar otherwise.
//
// Versions:
//   v1: one block of 256 threads per row, two passes over the row (the second pass re-reads x, from L1/L2
//       for rows up to 7168 floats = 28 KB). Matches the float64 reference in the CPU emulation
//       (k3cuda.testing); not yet measured on a GPU.
//
// Bytes it must move: read x (rows*D*4) + read w (D*4) + write y (rows*D*4); FLOPs ~ 4*rows*D.
// The re-read of the row in pass 2 should hit L1; if it does not, traffic is 1.5x the minimum.
#include "common.cuh"

#define RMSNORM_THREADS 256
#define RMSNORM_MIN_BLOCKS 4

extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS, RMSNORM_MIN_BLOCKS)
rmsnorm_f32(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int D, float eps) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const float* xr = x + row * D;
    float* yr = y + row * D;
    float ss = 0.0f;
    if ((D & 3) == 0) {
        for (int i = threadIdx.x * 4; i < D; i += RMSNORM_THREADS * 4) {
            const float4 v = k3_ld4(xr + i);
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < D; i += RMSNORM_THREADS) ss += xr[i] * xr[i];
    }
    ss = k3_block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)D + eps);
    if ((D & 3) == 0) {
        for (int i = threadIdx.x * 4; i < D; i += RMSNORM_THREADS * 4) {
            const float4 v = k3_ld4(xr + i), g = k3_ld4(w + i);
            k3_st4(yr + i, make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w));
        }
    } else {
        for (int i = threadIdx.x; i < D; i += RMSNORM_THREADS) yr[i] = xr[i] * inv * w[i];
    }
}
