// mxfp4_gemv.cu — y = W x with W in the K3 MXFP4 layout, dequantised on the fly.
//
// What it computes (docs/spec.md section 3.5 "MXFP4"; docs/interfaces.md core `mxfp4_gemv`):
//   packed u8 [N, K/2]: element 2i in the low nibble of byte i, 2i+1 in the high nibble (E2M1 codes);
//   scale u8 [N, K/32]: one E8M0 byte per 32 elements, 2^(e - 127), e = 255 is NaN;
//   E2M1 = [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6];
//   x fp32 [T, K] -> y fp32 [T, N],  y[t, n] = sum_g 2^(e[n,g]-127) * sum_{k in group g} E2M1[code[n,k]] x[t,k].
//
// Algorithm: 256 threads = 8 warps, 2 rows per warp (16 rows per block), grid (ceil(N/16), ceil(T/4)); a block
// handles up to 4 vectors (blockIdx.y picks which). One 16-byte load of a row's packed bytes is exactly one
// 32-element scale group; lane l takes groups l, l+32, ... of its warp's two rows. Codes are decoded through a
// 16-entry table in shared memory (16 distinct banks: a warp's lookups never conflict). Each group's dot product
// is accumulated in fp32 and multiplied by the group's scale (ldexpf: exact, subnormal 2^-127 included) once;
// the 32 lanes are summed with shuffles.
// x is read through L1 (it is shared by every row); each x load serves the warp's two rows.
//
// Versions:
//   v1: warp per 2 rows, smem E2M1 table, fp32 x and accumulation (not yet measured on a GPU).
//       Expected bound: the table lookups and x loads (one shared-memory wavefront per element per row plus
//       x through L1), near DRAM speed but probably under it. Next: decode a byte pair with PRMT/bit tricks.
//
// Bytes it must move: packed N*K/2 + scale N*K/32 + x T*K*4 + y T*N*4
//   (one K3 expert w1: N=3072, K=3584: 5.5 MB packed + 0.34 MB scales; it fits in the H200's 50 MB L2).
#include <math.h>
#include <stdint.h>

#include "common.cuh"

#define MX_THREADS 256
#define MX_MIN_BLOCKS 3                     // 65536 / (256 * 3) -> <= 80 registers
#define MX_WARPS (MX_THREADS / 32)
#define MX_ROWS_PER_WARP 2
#define MX_ROWS_PER_BLOCK (MX_WARPS * MX_ROWS_PER_WARP)
#define MX_VECTORS_PER_BLOCK 4              // blockIdx.y walks T in steps of 4
#define MX_GROUP 32

// E8M0 byte -> 2^(e - 127), exact (e = 0 gives the fp32 subnormal 2^-127); e = 255 -> NaN.
__device__ __forceinline__ float mx_e8m0(uint32_t e) {
    return e == 255u ? NAN : ldexpf(1.0f, (int)e - 127);
}

extern "C" __global__ void __launch_bounds__(MX_THREADS, MX_MIN_BLOCKS)
mxfp4_gemv_f32(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scale, const float* __restrict__ x,
               float* __restrict__ y, int N, int K, int T) {
    __shared__ float lut[16];
    if (threadIdx.x < 16) {
        const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
        lut[threadIdx.x] = (threadIdx.x & 8) ? -mag[threadIdx.x & 7] : mag[threadIdx.x & 7];
    }
    __syncthreads();

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * MX_WARPS + warp) * MX_ROWS_PER_WARP;
    const int t0 = blockIdx.y * MX_VECTORS_PER_BLOCK;
    if (row0 >= N) return;
    const int G = K / MX_GROUP;
    const int nt = min(MX_VECTORS_PER_BLOCK, T - t0);

    float acc[MX_ROWS_PER_WARP][MX_VECTORS_PER_BLOCK];
#pragma unroll
    for (int r = 0; r < MX_ROWS_PER_WARP; ++r)
#pragma unroll
        for (int t = 0; t < MX_VECTORS_PER_BLOCK; ++t) acc[r][t] = 0.f;

    for (int g = lane; g < G; g += 32) {
        uint4 wq[MX_ROWS_PER_WARP];
        float sc[MX_ROWS_PER_WARP];
#pragma unroll
        for (int r = 0; r < MX_ROWS_PER_WARP; ++r) {
            const int n = row0 + r;
            if (n < N) {
                wq[r] = __ldg(reinterpret_cast<const uint4*>(packed + (int64_t)n * (K / 2)) + g);
                sc[r] = mx_e8m0(__ldg(scale + (int64_t)n * G + g));
            } else {
                wq[r] = uint4{0u, 0u, 0u, 0u};
                sc[r] = 0.f;
            }
        }
        float part[MX_ROWS_PER_WARP][MX_VECTORS_PER_BLOCK];
#pragma unroll
        for (int r = 0; r < MX_ROWS_PER_WARP; ++r)
#pragma unroll
            for (int t = 0; t < MX_VECTORS_PER_BLOCK; ++t) part[r][t] = 0.f;

#pragma unroll
        for (int q = 0; q < 4; ++q) {       // 4 bytes = 8 elements at a time: k = 32 g + 8 q + e
            float w[MX_ROWS_PER_WARP][8];
#pragma unroll
            for (int r = 0; r < MX_ROWS_PER_WARP; ++r) {
                const uint32_t word = q == 0 ? wq[r].x : q == 1 ? wq[r].y : q == 2 ? wq[r].z : wq[r].w;
#pragma unroll
                for (int e = 0; e < 8; ++e) w[r][e] = lut[(word >> (4 * e)) & 15u];  // byte e/2: low nibble first
            }
#pragma unroll
            for (int t = 0; t < MX_VECTORS_PER_BLOCK; ++t) {
                if (t < nt) {
                    const float* xp = x + (int64_t)(t0 + t) * K + MX_GROUP * g + 8 * q;
                    const float4 xa = __ldg(reinterpret_cast<const float4*>(xp));
                    const float4 xb = __ldg(reinterpret_cast<const float4*>(xp + 4));
#pragma unroll
                    for (int r = 0; r < MX_ROWS_PER_WARP; ++r)
                        part[r][t] += w[r][0] * xa.x + w[r][1] * xa.y + w[r][2] * xa.z + w[r][3] * xa.w
                                    + w[r][4] * xb.x + w[r][5] * xb.y + w[r][6] * xb.z + w[r][7] * xb.w;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < MX_ROWS_PER_WARP; ++r)
#pragma unroll
            for (int t = 0; t < MX_VECTORS_PER_BLOCK; ++t) acc[r][t] += sc[r] * part[r][t];
    }

#pragma unroll
    for (int r = 0; r < MX_ROWS_PER_WARP; ++r) {
#pragma unroll
        for (int t = 0; t < MX_VECTORS_PER_BLOCK; ++t) {
            const float v = k3_warp_sum(acc[r][t]);
            if (lane == 0 && row0 + r < N && t < nt) y[(int64_t)(t0 + t) * N + row0 + r] = v;
        }
    }
}
