// kda_decode.cu — one decode token of Kimi Delta Attention, per (sequence b, head h) (docs/spec.md section 3.1).
//
// Inputs (fp32, contiguous): q, k, g_raw: [B, H, K]; v: [B, H, V]; beta_raw: [B, H]; A_log: [H];
// dt_bias: [H*K]; state S: [B, H, K, V] (updated in place); output o: [B, H, V].  K = V = 128.
//   g[k]   = lb * sigma(exp(A_log[h]) * (g_raw[k] + dt_bias[h*K + k]))      (lb = gate_lower_bound, e.g. -5)
//          = -exp(A_log[h]) * softplus(g_raw[k] + dt_bias[h*K + k])         (lb = NaN: Kimi Linear form)
//   q^ = q / sqrt(sum q^2 + 1e-6) * scale,  k^ = k / sqrt(sum k^2 + 1e-6),  beta = sigma(beta_raw)
//   S <- Diag(exp g) S;   S <- S + beta k^ (v - S^T k^)^T;   o = S^T q^
// The short causal conv + SiLU that produce q, k, v stay in the host graph (k3ref.kda): this kernel starts
// after them, at the L2 norms, exactly where the `kda_decode` core starts.
//
// Each column v of S evolves independently (u[v] = sum_k S[k,v] k^[k], then column v is updated and read
// out), so a block owns COLS columns of one (b, h): thread (tk, tv) keeps rows tk, tk+TK, ... of four
// adjacent columns in registers (float4, one 16-byte load and store per row: a warp reads whole 128..512-byte
// row segments). The two column sums over k (S^T k^ and S^T q^) are reduced across the TK row groups in
// shared memory. S is read once and written once; q, k, g_raw are re-read by each of the V/COLS blocks of a
// head (1.5 KB against 16..64 KB of state).
//
// Versions:
//   v1: kda_decode_f32: COLS = 128 (one block per (b, h), 16 rows x float4 per thread);
//       kda_decode_f32_split4: COLS = 32 (4 blocks per (b, h), for B*H too small to fill the GPU);
//       the raw state loads are issued before the gate/norm preamble to overlap its latency; state stores go
//       through __stcg because NVVM split the plain float4 stores into 4 scalar st.global.f32 each (seen in
//       the PTX: 80 scalar state stores -> 20 st.global.cg.v4.f32). Matches the float64 reference in the CPU
//       emulation (k3cuda.testing); not yet measured on a GPU.
//
// Bytes it must move: state read + write 2*B*H*K*V*4 (the dominant term: 128 KB per head)
//   + q, k, g_raw 3*B*H*K*4 + v B*H*V*4 + o B*H*V*4 + beta_raw B*H*4 + A_log H*4 + dt_bias H*K*4.
// FLOPs ~ 7*B*H*K*V (decay 1, S^T k 2, update 2, S^T q 2).
#include "common.cuh"

#define KDA_K 128
#define KDA_V 128
#define KDA_THREADS 256            // == 2*K: the preamble uses one thread per element of q and of k
#define KDA_MIN_BLOCKS_128 2       // 64 state registers per thread
#define KDA_MIN_BLOCKS_32 4        // 16 state registers per thread
#define KDA_L2_EPS 1e-6f

template <int COLS>
__device__ __forceinline__ void kda_decode_body(const float* __restrict__ q, const float* __restrict__ k,
                                                const float* __restrict__ v, const float* __restrict__ g_raw,
                                                const float* __restrict__ beta_raw, const float* __restrict__ A_log,
                                                const float* __restrict__ dt_bias, float* state,
                                                float* __restrict__ o, int H, float lower_bound, float scale) {
    constexpr int TV = COLS / 4;             // threads across the block's columns (4 columns each)
    constexpr int TK = KDA_THREADS / TV;     // row groups
    constexpr int RK = KDA_K / TK;           // rows per thread
    static_assert(KDA_THREADS == 2 * KDA_K && KDA_V % COLS == 0 && KDA_K % TK == 0, "geometry");

    __shared__ float qh[KDA_K], kh[KDA_K], decay[KDA_K], part[KDA_THREADS / K3_WARP];
    __shared__ __align__(16) float red[TK][COLS];

    const int tid = threadIdx.x, lane = tid % K3_WARP, warp = tid / K3_WARP;
    const int h = blockIdx.y, b = blockIdx.z;
    const long long bh = (long long)b * H + h;
    const int tv = tid % TV, tk = tid / TV;
    const int col = blockIdx.x * COLS + tv * 4;
    float* S = state + bh * (KDA_K * KDA_V);

    // Issue the state loads first; they are scaled by the decay once the preamble has computed it.
    float4 s[RK];
#pragma unroll
    for (int i = 0; i < RK; ++i) s[i] = k3_ld4(S + (tk + i * TK) * KDA_V + col);

    // Preamble: threads 0..K-1 hold q[k] and the gate of row k; threads K..2K-1 hold k[k].
    const float x = tid < KDA_K ? q[bh * KDA_K + tid] : k[bh * KDA_K + tid - KDA_K];
    const float ss = k3_warp_sum(x * x);
    if (lane == 0) part[warp] = ss;
    if (tid < KDA_K) {
        const float a = g_raw[bh * KDA_K + tid] + dt_bias[(long long)h * KDA_K + tid];
        const float A = expf(A_log[h]);
        const float g = isnan(lower_bound) ? -A * k3_softplusf(a) : lower_bound * k3_sigmoidf(A * a);
        decay[tid] = expf(g);
    }
    __syncthreads();
    constexpr int HALF = KDA_THREADS / K3_WARP / 2;  // warps holding q, then warps holding k
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < HALF; ++w) sum += part[tid < KDA_K ? w : HALF + w];
    if (tid < KDA_K) qh[tid] = x / sqrtf(sum + KDA_L2_EPS) * scale;
    else kh[tid - KDA_K] = x / sqrtf(sum + KDA_L2_EPS);
    const float beta = k3_sigmoidf(beta_raw[bh]);
    __syncthreads();

    // S <- Diag(exp g) S, and this thread's share of u = S^T k^ for its 4 columns.
    float4 u = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < RK; ++i) {
        const int r = tk + i * TK;
        const float d = decay[r], kr = kh[r];
        s[i].x *= d; s[i].y *= d; s[i].z *= d; s[i].w *= d;
        u.x += s[i].x * kr; u.y += s[i].y * kr; u.z += s[i].z * kr; u.w += s[i].w * kr;
    }
    k3_st4(&red[tk][tv * 4], u);
    __syncthreads();
    u = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int j = 0; j < TK; ++j) {
        const float4 t = k3_ld4(&red[j][tv * 4]);
        u.x += t.x; u.y += t.y; u.z += t.z; u.w += t.w;
    }
    const float4 vv = k3_ld4(v + bh * KDA_V + col);
    const float4 delta = make_float4(beta * (vv.x - u.x), beta * (vv.y - u.y), beta * (vv.z - u.z), beta * (vv.w - u.w));
    __syncthreads();  // everyone has read red before it is reused for o

    // S <- S + k^ delta^T (written back in place), and this thread's share of o = S^T q^.
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < RK; ++i) {
        const int r = tk + i * TK;
        const float kr = kh[r], qr = qh[r];
        s[i].x += kr * delta.x; s[i].y += kr * delta.y; s[i].z += kr * delta.z; s[i].w += kr * delta.w;
        k3_stcg4(S + r * KDA_V + col, s[i]);   // one 16-byte store (a plain float4 store was split in four)
        acc.x += s[i].x * qr; acc.y += s[i].y * qr; acc.z += s[i].z * qr; acc.w += s[i].w * qr;
    }
    k3_st4(&red[tk][tv * 4], acc);
    __syncthreads();
    if (tk == 0) {
        acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int j = 0; j < TK; ++j) {
            const float4 t = k3_ld4(&red[j][tv * 4]);
            acc.x += t.x; acc.y += t.y; acc.z += t.z; acc.w += t.w;
        }
        k3_st4(o + bh * KDA_V + col, acc);
    }
}

// grid (1, H, B), block KDA_THREADS
extern "C" __global__ void __launch_bounds__(KDA_THREADS, KDA_MIN_BLOCKS_128)
kda_decode_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
               const float* __restrict__ g_raw, const float* __restrict__ beta_raw, const float* __restrict__ A_log,
               const float* __restrict__ dt_bias, float* state, float* __restrict__ o, int H, float lower_bound,
               float scale) {
    kda_decode_body<128>(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, o, H, lower_bound, scale);
}

// grid (4, H, B), block KDA_THREADS
extern "C" __global__ void __launch_bounds__(KDA_THREADS, KDA_MIN_BLOCKS_32)
kda_decode_f32_split4(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                      const float* __restrict__ g_raw, const float* __restrict__ beta_raw,
                      const float* __restrict__ A_log, const float* __restrict__ dt_bias, float* state,
                      float* __restrict__ o, int H, float lower_bound, float scale) {
    kda_decode_body<32>(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, o, H, lower_bound, scale);
}
