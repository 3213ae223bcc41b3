// attnres_mix.cu — Block AttnRes softmax mix over depth sources, blended with the plain residual sum.
//
// What it computes (docs/spec.md section 3.6 "Block AttnRes"; docs/interfaces.md core `attnres_mix`):
//   sources V [S, T, D] fp32 (S <= 9 depth sources, T tokens), proj_w [D], norm_w [D], mix, eps (1e-5):
//   rms_i = sqrt(mean_d V_id^2 + eps);  logit_i = sum_d V_id / rms_i * norm_w_d * proj_w_d;
//   alpha = softmax_i(logit);  out[t] = (1 - mix) sum_i V_i + mix sum_i alpha_i V_i
//                                     = sum_i ((1 - mix) + mix alpha_i) V_i          -> out [T, D] fp32
//   (mix = 1 is production; the blend coefficients (1-mix) + mix*alpha_i are formed once per token.)
//
// Algorithm: one block of 256 threads per token. Pass 1: each thread walks d in float4 steps (scalar when
// D % 4 != 0) and accumulates, per source, sum V^2 and sum V * (norm_w * proj_w) in fp32; warp shuffles and a
// shared-memory step reduce the 2S sums; warp 0 forms the S logits, the softmax (exact expf) and the blend
// coefficients. Pass 2: out = sum_i coef_i V_i, reading the sources again (the block read them microseconds
// earlier: 9 * 7168 * 4 = 258 KB per token, expected to hit L2).
//
// Versions:
//   v1: block per token, two passes over the sources (not yet measured on a GPU).
//       For T = 1 one SM does all the work (latency-bound: ~260 KB through one SM); a split-D variant with a
//       second tiny kernel is the next step if T = 1 matters.
//
// Bytes it must move: sources S*T*D*4 (once) + out T*D*4 + proj_w, norm_w 2*D*4
//   (the second pass over the sources is extra traffic, from L2 when it hits).
#include <math.h>
#include <stdint.h>

#include "common.cuh"

#define AR_THREADS 256
#define AR_MIN_BLOCKS 2                      // 65536 / (256 * 2) -> <= 128 registers
#define AR_WARPS (AR_THREADS / 32)
#define AR_MAX_S 9

extern "C" __global__ void __launch_bounds__(AR_THREADS, AR_MIN_BLOCKS)
attnres_mix_f32(const float* __restrict__ sources, const float* __restrict__ proj_w, const float* __restrict__ norm_w,
                float* __restrict__ out, int S, int T, int D, float mix, float eps) {
    __shared__ float red[2 * AR_MAX_S][AR_WARPS];
    __shared__ float coef_s[AR_MAX_S];
    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool vec = (D & 3) == 0;   // rows start 16-byte aligned only when D % 4 == 0
    const int64_t stride = (int64_t)T * D;                   // from source i to source i+1
    const float* v0 = sources + (int64_t)t * D;                 // source 0, token t

    float ss[AR_MAX_S], dot[AR_MAX_S];
#pragma unroll
    for (int i = 0; i < AR_MAX_S; ++i) { ss[i] = 0.f; dot[i] = 0.f; }

    if (vec) {
        for (int d = 4 * threadIdx.x; d < D; d += 4 * AR_THREADS) {
            const float4 a = k3_ld4(norm_w + d), b = k3_ld4(proj_w + d);
            const float4 pw = make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
#pragma unroll
            for (int i = 0; i < AR_MAX_S; ++i) {
                if (i < S) {
                    const float4 v = k3_ld4(v0 + i * stride + d);
                    ss[i] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                    dot[i] += v.x * pw.x + v.y * pw.y + v.z * pw.z + v.w * pw.w;
                }
            }
        }
    } else {
        for (int d = threadIdx.x; d < D; d += AR_THREADS) {
            const float pw = norm_w[d] * proj_w[d];
#pragma unroll
            for (int i = 0; i < AR_MAX_S; ++i) {
                if (i < S) {
                    const float v = v0[i * stride + d];
                    ss[i] += v * v;
                    dot[i] += v * pw;
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < AR_MAX_S; ++i) {
        if (i < S) {
            const float a = k3_warp_sum(ss[i]), b = k3_warp_sum(dot[i]);
            if (lane == 0) { red[i][warp] = a; red[AR_MAX_S + i][warp] = b; }
        }
    }
    __syncthreads();
    if (warp == 0) {
        float logit[AR_MAX_S];
        float m = -INFINITY;
#pragma unroll
        for (int i = 0; i < AR_MAX_S; ++i) {
            logit[i] = -INFINITY;
            if (i < S) {
                const float a = k3_warp_sum(lane < AR_WARPS ? red[i][lane] : 0.f);
                const float b = k3_warp_sum(lane < AR_WARPS ? red[AR_MAX_S + i][lane] : 0.f);
                logit[i] = b / sqrtf(a / (float)D + eps);
                m = fmaxf(m, logit[i]);
            }
        }
        float e[AR_MAX_S], sum = 0.f;
#pragma unroll
        for (int i = 0; i < AR_MAX_S; ++i) {
            e[i] = i < S ? expf(logit[i] - m) : 0.f;
            sum += e[i];
        }
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < AR_MAX_S; ++i)
                if (i < S) coef_s[i] = (1.0f - mix) + mix * (e[i] / sum);
        }
    }
    __syncthreads();

    float coef[AR_MAX_S];
#pragma unroll
    for (int i = 0; i < AR_MAX_S; ++i) coef[i] = i < S ? coef_s[i] : 0.f;
    float* o = out + (int64_t)t * D;
    if (vec) {
        for (int d = 4 * threadIdx.x; d < D; d += 4 * AR_THREADS) {
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int i = 0; i < AR_MAX_S; ++i) {
                if (i < S) {
                    const float4 v = k3_ld4(v0 + i * stride + d);
                    acc.x += coef[i] * v.x; acc.y += coef[i] * v.y; acc.z += coef[i] * v.z; acc.w += coef[i] * v.w;
                }
            }
            k3_st4(o + d, acc);
        }
    } else {
        for (int d = threadIdx.x; d < D; d += AR_THREADS) {
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < AR_MAX_S; ++i)
                if (i < S) acc += coef[i] * v0[i * stride + d];
            o[d] = acc;
        }
    }
}
