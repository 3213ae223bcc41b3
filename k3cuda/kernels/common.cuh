// common.cuh — device helpers shared by the k3cuda kernels (included with -I k3cuda/kernels).
//
// Everything here is exact fp32 math: the build never uses --use_fast_math, so expf/tanhf/sqrtf/log1pf are
// the accurate library versions (a few ulp), which the conformance tolerances assume.
// Keep this header stable: every kernel may include it, so add helpers, do not change existing ones.
#pragma once

#define K3_WARP 32
#define K3_FULL_MASK 0xffffffffu

// sigma(x) = 1 / (1 + exp(-x)); expf(-x) overflows to +inf for x < -88, giving exactly 0 (no NaN).
__device__ __forceinline__ float k3_sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

// softcap_c(z) = c * tanh(z / c)  (docs/spec.md section 3)
__device__ __forceinline__ float k3_softcapf(float z, float c) { return c * tanhf(z / c); }

// softplus(x) = max(x, 0) + log1p(exp(-|x|)), the same stable form as k3ref.ops.softplus
__device__ __forceinline__ float k3_softplusf(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }

// Sum over the 32 lanes of a warp; every lane gets the total.
__device__ __forceinline__ float k3_warp_sum(float v) {
#pragma unroll
    for (int off = K3_WARP / 2; off > 0; off >>= 1) v += __shfl_xor_sync(K3_FULL_MASK, v, off);
    return v;
}

// Max over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float k3_warp_max(float v) {
#pragma unroll
    for (int off = K3_WARP / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(K3_FULL_MASK, v, off));
    return v;
}

// Sum over all threads of the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
// `scratch` is __shared__ float[32]. Contains two __syncthreads(): call it from every thread of the block.
__device__ __forceinline__ float k3_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % K3_WARP, warp = threadIdx.x / K3_WARP;
    const int nwarps = blockDim.x / K3_WARP;
    v = k3_warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : 0.0f;
    t = k3_warp_sum(t);
    __syncthreads();  // scratch may be reused right after
    return t;
}

// Max over all threads of the block; same contract as k3_block_sum.
__device__ __forceinline__ float k3_block_max(float v, float* scratch) {
    const int lane = threadIdx.x % K3_WARP, warp = threadIdx.x / K3_WARP;
    const int nwarps = blockDim.x / K3_WARP;
    v = k3_warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : -INFINITY;
    t = k3_warp_max(t);
    __syncthreads();
    return t;
}

// float4 helpers (16-byte accesses; callers guarantee 16-byte alignment)
__device__ __forceinline__ float4 k3_ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void k3_st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

// A 16-byte global store that stays one st.global.cg.v4.f32 (cached in L2 only). Plain float4 stores of values
// whose components were updated one by one can come out of NVVM as four scalar stores (seen in kda_decode v1).
__device__ __forceinline__ void k3_stcg4(float* p, float4 v) { __stcg(reinterpret_cast<float4*>(p), v); }
