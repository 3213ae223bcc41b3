// situ_glu.cu — the SiTU-GLU nonlinearity, fused over a [gate | up] buffer (docs/spec.md section 3.3).
//
//   h[r, i] = softcap_beta(g) * sigma(g) * softcap_lbeta(u),   g = gate[r, i], u = up[r, i],
//   softcap_c(z) = c * tanh(z / c);  beta = 4 (SiTU), lbeta = 25 (linear branch)
//
// gate and up are read through one row stride `ld` (elements): a fused checkpoint buffer [rows, 2I] is
// gate = buf, up = buf + I, ld = 2I; two separate [rows, I] arrays are ld = I. h: [rows, I], row stride I.
// Exact expf/tanhf (no fast math). 16-byte accesses when I % 4 == 0 and ld % 4 == 0, scalar otherwise.
// Grid: x = rows, y = ceil(I / (THREADS * 4)); each thread does 4 consecutive elements.
//
// Versions:
//   v1: elementwise, 4 elements per thread, float4 loads/stores. Matches the float64 reference in the CPU
//       emulation (k3cuda.testing); not yet measured on a GPU.
//
// Bytes it must move: read gate and up (2*rows*I*4) + write h (rows*I*4) = 12*rows*I; FLOPs ~ 10*rows*I
// (plus 3 transcendentals per element: tanh, exp, tanh).
#include "common.cuh"

#define SITU_THREADS 256
#define SITU_MIN_BLOCKS 4

__device__ __forceinline__ float situ_one(float g, float u, float beta, float lbeta) {
    return k3_softcapf(g, beta) * k3_sigmoidf(g) * k3_softcapf(u, lbeta);
}

extern "C" __global__ void __launch_bounds__(SITU_THREADS, SITU_MIN_BLOCKS)
situ_glu_f32(const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ h,
             int I, int ld, float beta, float linear_beta) {
    const long long row = blockIdx.x;
    const int i0 = (blockIdx.y * SITU_THREADS + threadIdx.x) * 4;
    if (i0 >= I) return;
    const float* g = gate + row * ld;
    const float* u = up + row * ld;
    float* out = h + row * I;
    if ((I & 3) == 0 && (ld & 3) == 0) {
        const float4 gv = k3_ld4(g + i0), uv = k3_ld4(u + i0);
        k3_st4(out + i0, make_float4(situ_one(gv.x, uv.x, beta, linear_beta), situ_one(gv.y, uv.y, beta, linear_beta),
                                     situ_one(gv.z, uv.z, beta, linear_beta), situ_one(gv.w, uv.w, beta, linear_beta)));
    } else {
        for (int i = i0; i < min(i0 + 4, I); ++i) out[i] = situ_one(g[i], u[i], beta, linear_beta);
    }
}
