// mla_decode.cu — absorbed MLA decode over a paged latent cache (FlashMLA's decode interface), split-KV.
//
// What it computes (docs/spec.md section 3.2 "Gated NoPE MLA"; docs/interfaces.md core `mla_decode`):
//   q_abs [B, H, W] fp32 with W = R + P (K3: R = kv_rank = 512, P = 64), rows [W_UK,h^T q_nope_h | q_pe_h];
//   kv_cache [N_pages, page, W] (fp32 for conformance, bf16 for production), rows [c_j | k_pe_j];
//   block_table [B, max_pages] int32 (page of tokens page*i .. page*i+page-1), seq_lens [B] int32 (>= 1).
//   s_hj = scale * q_abs_h . row_j  for j < seq_lens[b];  p_h = softmax_j(s_h)  (fp32);
//   o_lat[b, h, :] = sum_j p_hj c_j                                        -> o_lat [B, H, R] fp32
//
// Algorithm: split-KV with online softmax, then a combine kernel.
//   mla_decode_split_{f32,bf16}: grid (ceil(H/16), num_splits, B), 128 threads = 4 warps x 4 heads. The block
//     for (b, split) handles tokens [split*chunk, min((split+1)*chunk, L)) for its 16 heads, 16 tokens per
//     shared-memory tile (converted to fp32 once per tile; each tile row is read from DRAM once per head group
//     and the head groups of one (b, split) are neighbours in blockIdx.x, so the repeats hit L2).
//     Each warp keeps its 4 heads' q (18 floats/head/lane) and accumulators (16 floats/head/lane) in registers.
//     Scores: per token a lane does 4 partial dot products, then a 4-way reduce-scatter over the warp (6
//     shuffles instead of 20) leaves head hh's score in lanes 8hh..8hh+7, which run that head's online softmax
//     (running max m and sum l). Writes the un-normalised partial o [B, S, H, R], m and l [B, S, H]; an empty
//     split writes o = 0, m = -inf, l = 0.
//   mla_decode_combine: grid (H, B), 128 threads; M = max_s m_s, o = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
// Limits (checked by the wrapper): R % 4 == 0, R <= 512; P % 2 == 0, P <= 64 (rows of other widths than K3's
// 576 load element by element when W * sizeof(cache) is not a multiple of 16 bytes);
// B and num_splits <= 65535 (grid z / y).
//
// Versions:
//   v1: CUDA-core fp32 FMA, split-KV + combine as above (not yet measured on a GPU).
//       Expected bound: fp32 FMA, not DRAM. Per token and head ~2*(W + R) = 2176 FLOP against W*2 = 1152 bytes
//       of bf16 cache shared by the H heads: ~1.9*H FLOP/byte, above the H200's fp32 ridge (~67 TFLOP/s over
//       4.8 TB/s = 14 FLOP/byte) already at H = 12. Upper bounds at 100% FMA issue for the bench cases (B=64,
//       L=8192, bf16): H=96 109.5 GFLOP = 1.6 ms vs 0.63 GB ~ 0.15 ms of copy -> <= ~0.1 of copy bandwidth;
//       H=12 (12 of 16 heads per block busy) -> <= ~0.55. The 0.6 gate is expected to FAIL with v1.
//       Next: v2 bf16 mma.sync (m16n8k16) for q.K^T and P.V (q and p split into bf16 hi + lo terms where fp32
//       accuracy is needed), cp.async double-buffered tiles.
//
// Bytes it must move (FlashMLA's accounting): the cache rows once per sequence
//   sum_b seq_lens[b] * W * sizeof(cache)  +  q: B*H*W*4  +  o_lat: B*H*R*4
//   (+ block table and seq_lens; the partial o/m/l round trip of the split scheme is extra traffic, not counted).
#include <math.h>
#include <stdint.h>

#include <cuda_bf16.h>   // the CPU emulation (k3cuda/testing.py) supplies a stand-in with the names used here

#include "common.cuh"

#define MLA_WARPS 4
#define MLA_THREADS (MLA_WARPS * 32)              // 128 threads per split block
#define MLA_MIN_BLOCKS 2                          // blocks per SM: 65536 / (128 * 2) -> <= 255 registers
#define MLA_HPW 4                                 // heads per warp
#define MLA_HEADS_PER_BLOCK (MLA_WARPS * MLA_HPW) // 16
#define MLA_TILE 16                               // cache rows per shared-memory tile
#define MLA_MAX_R 512
#define MLA_MAX_P 64
#define MLA_ROW (MLA_MAX_R + MLA_MAX_P)           // 576: shared-memory row stride in floats
#define MLA_LATENT_CHUNKS (MLA_MAX_R / 128)       // float4 chunks of the latent per lane
#define COMBINE_THREADS 128
#define COMBINE_MIN_BLOCKS 4

// 16 bytes of the cache -> fp32 in shared memory (4 floats or 8 bf16).
__device__ __forceinline__ void mla_copy16(float* dst, const float* src) {
    k3_st4(dst, *reinterpret_cast<const float4*>(src));
}
__device__ __forceinline__ void mla_copy16(float* dst, const __nv_bfloat16* src) {
    const uint4 u = *reinterpret_cast<const uint4*>(src);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
    const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    const float2 c = __bfloat1622float2(h[2]), d = __bfloat1622float2(h[3]);
    k3_st4(dst, make_float4(a.x, a.y, b.x, b.y));
    k3_st4(dst + 4, make_float4(c.x, c.y, d.x, d.y));
}

__device__ __forceinline__ float mla_to_float(float x) { return x; }
__device__ __forceinline__ float mla_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Rows t_base .. t_base+n-1 of sequence b (through its block-table row) -> tile[j * MLA_ROW + col], fp32.
// 16-byte copies when a row is a whole number of them (K3: 576 * 2 bytes), else one element at a time.
template <typename T>
__device__ __forceinline__ void mla_load_tile(float* tile, const T* __restrict__ kv, const int* __restrict__ bt_row,
                                              int page_size, int W, int t_base, int n) {
    constexpr int VEC = 16 / (int)sizeof(T);
    if (W % VEC == 0) {
        const int vecs = W / VEC;
        const int total = n * vecs;
#pragma unroll 4
        for (int idx = threadIdx.x; idx < total; idx += MLA_THREADS) {
            const int j = idx / vecs;
            const int v = idx - j * vecs;
            const int t = t_base + j;
            const int64_t row = (int64_t)bt_row[t / page_size] * page_size + t % page_size;
            mla_copy16(tile + j * MLA_ROW + v * VEC, kv + row * W + v * VEC);
        }
    } else {
        for (int idx = threadIdx.x; idx < n * W; idx += MLA_THREADS) {
            const int j = idx / W;
            const int col = idx - j * W;
            const int t = t_base + j;
            const int64_t row = (int64_t)bt_row[t / page_size] * page_size + t % page_size;
            tile[j * MLA_ROW + col] = mla_to_float(kv[row * W + col]);
        }
    }
}

// a[0..3]: this lane's partial sums for the warp's 4 heads. Returns the warp-wide sum of a[lane >> 3]:
// after the exchange at distance 16 each half keeps two heads, at distance 8 each quarter keeps one,
// then the 8 lanes of a quarter finish their head's sum.
__device__ __forceinline__ float mla_reduce_scatter4(const float a[4], int lane) {
    const bool upper = (lane & 16) != 0;
    const float b0 = (upper ? a[2] : a[0]) + __shfl_xor_sync(K3_FULL_MASK, upper ? a[0] : a[2], 16);
    const float b1 = (upper ? a[3] : a[1]) + __shfl_xor_sync(K3_FULL_MASK, upper ? a[1] : a[3], 16);
    const bool mid = (lane & 8) != 0;
    float c = (mid ? b1 : b0) + __shfl_xor_sync(K3_FULL_MASK, mid ? b0 : b1, 8);
    c += __shfl_xor_sync(K3_FULL_MASK, c, 4);
    c += __shfl_xor_sync(K3_FULL_MASK, c, 2);
    c += __shfl_xor_sync(K3_FULL_MASK, c, 1);
    return c;
}

// The q slices this lane holds for the warp's heads: latent columns 4*lane + 128*i, rope columns R + 2*lane,
// R + 2*lane + 1; zero when out of range. (Scalar loads: a q row starts 16-byte aligned only when W % 4 == 0,
// and this runs once per block.)
__device__ __forceinline__ void mla_load_q(const float* __restrict__ q, int b, int h0, int lane, int H, int R, int P,
                                           float4 (&qc)[MLA_HPW][MLA_LATENT_CHUNKS], float2 (&qp)[MLA_HPW]) {
    const int W = R + P;
#pragma unroll
    for (int hh = 0; hh < MLA_HPW; ++hh) {
        const int h = h0 + hh;
        const float* qrow = q + ((int64_t)b * H + h) * W;
#pragma unroll
        for (int i = 0; i < MLA_LATENT_CHUNKS; ++i) {
            const int col = 4 * lane + 128 * i;
            qc[hh][i] = (h < H && col < R) ? make_float4(qrow[col], qrow[col + 1], qrow[col + 2], qrow[col + 3])
                                           : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        qp[hh] = (h < H && 2 * lane < P) ? make_float2(qrow[R + 2 * lane], qrow[R + 2 * lane + 1])
                                         : make_float2(0.f, 0.f);
    }
}

// s[j] = (q_h . [c_j | k_pe_j]) * scale for the head of this lane's quarter (lane >> 3), rows j < n of the
// tile; -inf for the stale rows j >= n, which the softmax then ignores.
__device__ __forceinline__ void mla_tile_scores(const float* tile, int n, int lane, int R, int P, float scale,
                                                const float4 (&qc)[MLA_HPW][MLA_LATENT_CHUNKS],
                                                const float2 (&qp)[MLA_HPW], float (&s)[MLA_TILE]) {
#pragma unroll
    for (int j = 0; j < MLA_TILE; ++j) {
        s[j] = -INFINITY;
        if (j < n) {
            const float* row = tile + j * MLA_ROW;
            float a[MLA_HPW] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int i = 0; i < MLA_LATENT_CHUNKS; ++i) {
                const int col = 4 * lane + 128 * i;
                if (col < R) {
                    const float4 c = k3_ld4(row + col);
#pragma unroll
                    for (int hh = 0; hh < MLA_HPW; ++hh)
                        a[hh] += qc[hh][i].x * c.x + qc[hh][i].y * c.y + qc[hh][i].z * c.z + qc[hh][i].w * c.w;
                }
            }
            if (2 * lane < P) {
                const float2 c = *reinterpret_cast<const float2*>(row + R + 2 * lane);
#pragma unroll
                for (int hh = 0; hh < MLA_HPW; ++hh) a[hh] += qp[hh].x * c.x + qp[hh].y * c.y;
            }
            s[j] = mla_reduce_scatter4(a, lane) * scale;
        }
    }
}

// Online softmax over one tile for this lane's head: s becomes p = exp(s - m_new) (0 for stale rows), m_run and
// l_run are updated; returns alpha = exp(m_old - m_new), the factor that rescales the running accumulator
// (0 on the first tile, where m_run = -inf). The 8 lanes of a quarter hold identical values.
__device__ __forceinline__ float mla_online_softmax(float (&s)[MLA_TILE], int n, float& m_run, float& l_run) {
    float m_tile = -INFINITY;
#pragma unroll
    for (int j = 0; j < MLA_TILE; ++j) m_tile = fmaxf(m_tile, s[j]);
    const float m_new = fmaxf(m_run, m_tile);      // finite: the tile has >= 1 row
    const float alpha = expf(m_run - m_new);
    float psum = 0.f;
#pragma unroll
    for (int j = 0; j < MLA_TILE; ++j) {
        s[j] = (j < n) ? expf(s[j] - m_new) : 0.f;
        psum += s[j];
    }
    l_run = l_run * alpha + psum;
    m_run = m_new;
    return alpha;
}

// acc_h = alpha_h * acc_h + sum_j p_hj c_j for the warp's heads, over the latent columns this lane holds.
__device__ __forceinline__ void mla_accumulate(const float* tile, int n, int lane, int R,
                                               const float (&alpha)[MLA_HPW], const float (&p_tile)[MLA_HPW][MLA_TILE],
                                               float4 (&acc)[MLA_HPW][MLA_LATENT_CHUNKS]) {
#pragma unroll
    for (int hh = 0; hh < MLA_HPW; ++hh) {
        const float al = alpha[hh];
#pragma unroll
        for (int i = 0; i < MLA_LATENT_CHUNKS; ++i) {
            acc[hh][i].x *= al; acc[hh][i].y *= al; acc[hh][i].z *= al; acc[hh][i].w *= al;
        }
    }
    for (int j = 0; j < n; ++j) {
        const float* row = tile + j * MLA_ROW;
        float p[MLA_HPW];
#pragma unroll
        for (int hh = 0; hh < MLA_HPW; ++hh) p[hh] = p_tile[hh][j];
#pragma unroll
        for (int i = 0; i < MLA_LATENT_CHUNKS; ++i) {
            const int col = 4 * lane + 128 * i;
            if (col < R) {
                const float4 c = k3_ld4(row + col);
#pragma unroll
                for (int hh = 0; hh < MLA_HPW; ++hh) {
                    acc[hh][i].x += p[hh] * c.x; acc[hh][i].y += p[hh] * c.y;
                    acc[hh][i].z += p[hh] * c.z; acc[hh][i].w += p[hh] * c.w;
                }
            }
        }
    }
}

// One (head group, split, sequence) block: the unnormalised partial output and its softmax statistics
// (m, l) over the split's tokens, for mla_combine. Per tile: load it to shared memory, score it, run the
// online softmax, accumulate.
template <typename T>
__device__ __forceinline__ void mla_split_body(const float* __restrict__ q, const T* __restrict__ kv,
                                               const int* __restrict__ block_table, const int* __restrict__ seq_lens,
                                               float* __restrict__ o_part, float* __restrict__ m_part,
                                               float* __restrict__ l_part, float scale, int H, int R, int P,
                                               int max_pages, int page_size, int chunk, int num_splits) {
    __shared__ __align__(16) float tile[MLA_TILE * MLA_ROW];
    __shared__ float p_s[MLA_WARPS][MLA_HPW][MLA_TILE];
    __shared__ float alpha_s[MLA_WARPS][MLA_HPW];

    const int group = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int W = R + P;
    const int L = seq_lens[b];
    const int t0 = split * chunk;
    const int t1 = min(t0 + chunk, L);
    const int h0 = group * MLA_HEADS_PER_BLOCK + warp * MLA_HPW;  // the warp's first head
    const bool warp_active = h0 < H;
    const int my_hh = lane >> 3;                                   // the head whose softmax this lane runs
    const int* bt_row = block_table + (int64_t)b * max_pages;

    float4 qc[MLA_HPW][MLA_LATENT_CHUNKS];
    float2 qp[MLA_HPW];
    float4 acc[MLA_HPW][MLA_LATENT_CHUNKS];
    mla_load_q(q, b, h0, lane, H, R, P, qc, qp);
#pragma unroll
    for (int hh = 0; hh < MLA_HPW; ++hh)
#pragma unroll
        for (int i = 0; i < MLA_LATENT_CHUNKS; ++i) acc[hh][i] = make_float4(0.f, 0.f, 0.f, 0.f);
    float m_run = -INFINITY, l_run = 0.f;

    for (int tb = t0; tb < t1; tb += MLA_TILE) {
        const int n = min(MLA_TILE, t1 - tb);
        __syncthreads();  // every warp is done with the previous tile
        mla_load_tile(tile, kv, bt_row, page_size, W, tb, n);
        __syncthreads();
        if (!warp_active) continue;

        float s[MLA_TILE];
        mla_tile_scores(tile, n, lane, R, P, scale, qc, qp, s);
        const float alpha = mla_online_softmax(s, n, m_run, l_run);
        if ((lane & 7) == 0) {
            alpha_s[warp][my_hh] = alpha;
#pragma unroll
            for (int j = 0; j < MLA_TILE; ++j) p_s[warp][my_hh][j] = s[j];
        }
        __syncwarp();
        mla_accumulate(tile, n, lane, R, alpha_s[warp], p_s[warp], acc);
        __syncwarp();  // p_s / alpha_s are rewritten by the next tile
    }

    if (!warp_active) return;
    const int64_t part = (int64_t)b * num_splits + split;   // index of (b, split)
#pragma unroll
    for (int hh = 0; hh < MLA_HPW; ++hh) {
        const int h = h0 + hh;
        if (h >= H) continue;
        float* orow = o_part + (part * H + h) * R;
#pragma unroll
        for (int i = 0; i < MLA_LATENT_CHUNKS; ++i) {
            const int col = 4 * lane + 128 * i;
            if (col < R) k3_st4(orow + col, acc[hh][i]);
        }
    }
    if ((lane & 7) == 0 && h0 + my_hh < H) {
        m_part[part * H + h0 + my_hh] = m_run;
        l_part[part * H + h0 + my_hh] = l_run;
    }
}

extern "C" __global__ void __launch_bounds__(MLA_THREADS, MLA_MIN_BLOCKS)
mla_decode_split_f32(const float* __restrict__ q, const float* __restrict__ kv, const int* __restrict__ block_table,
                     const int* __restrict__ seq_lens, float* __restrict__ o_part, float* __restrict__ m_part,
                     float* __restrict__ l_part, float scale, int H, int R, int P, int max_pages, int page_size,
                     int chunk, int num_splits) {
    mla_split_body<float>(q, kv, block_table, seq_lens, o_part, m_part, l_part, scale, H, R, P, max_pages,
                          page_size, chunk, num_splits);
}

extern "C" __global__ void __launch_bounds__(MLA_THREADS, MLA_MIN_BLOCKS)
mla_decode_split_bf16(const float* __restrict__ q, const __nv_bfloat16* __restrict__ kv,
                      const int* __restrict__ block_table, const int* __restrict__ seq_lens,
                      float* __restrict__ o_part, float* __restrict__ m_part, float* __restrict__ l_part, float scale,
                      int H, int R, int P, int max_pages, int page_size, int chunk, int num_splits) {
    mla_split_body<__nv_bfloat16>(q, kv, block_table, seq_lens, o_part, m_part, l_part, scale, H, R, P, max_pages,
                                  page_size, chunk, num_splits);
}

// o_lat[b, h, :] = sum_s e^(m_s - M) o_part[b, s, h, :] / sum_s e^(m_s - M) l_s,  M = max_s m_s.
// Empty splits carry m = -inf, l = 0, o = 0 and weigh 0; split 0 is never empty (seq_len >= 1), so M is finite.
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS, COMBINE_MIN_BLOCKS)
mla_decode_combine(const float* __restrict__ o_part, const float* __restrict__ m_part,
                   const float* __restrict__ l_part, float* __restrict__ o_lat, int H, int R, int num_splits) {
    const int h = blockIdx.x, b = blockIdx.y;
    float M = -INFINITY;
    for (int s = 0; s < num_splits; ++s) M = fmaxf(M, m_part[((int64_t)b * num_splits + s) * H + h]);
    float denom = 0.f;
    for (int s = 0; s < num_splits; ++s) {
        const int64_t i = ((int64_t)b * num_splits + s) * H + h;
        denom += l_part[i] * expf(m_part[i] - M);
    }
    const float inv = 1.0f / denom;
    for (int col = 4 * threadIdx.x; col < R; col += 4 * COMBINE_THREADS) {
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < num_splits; ++s) {
            const int64_t i = ((int64_t)b * num_splits + s) * H + h;
            const float w = expf(m_part[i] - M);
            const float4 v = k3_ld4(o_part + i * R + col);
            o.x += w * v.x; o.y += w * v.y; o.z += w * v.z; o.w += w * v.w;
        }
        k3_st4(o_lat + ((int64_t)b * H + h) * R + col, make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv));
    }
}
