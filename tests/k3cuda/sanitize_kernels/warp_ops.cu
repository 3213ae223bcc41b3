// The warp intrinsics and dynamic shared memory of the checked emulation, against NumPy: integer shuffles,
// __shfl_down_sync / __shfl_up_sync / __shfl_sync, __ballot_sync, atomicAdd, extern __shared__. With K3_BUG the
// dynamic shared array is read one element past the launch's `shared` bytes (memcheck).
#ifndef K3_BUG
#define K3_BUG 0
#endif

extern "C" __global__ void __launch_bounds__(64, 1) warp_ops(const int* x, int* out, float* total) {
    extern __shared__ __align__(16) int dyn[];
    const int i = threadIdx.x, lane = i % 32;
    int v = x[i];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);  // lane 0: warp sum
    const int first = __shfl_sync(0xffffffffu, x[i], 0);                                // lane 0's x
    const int prev = __shfl_up_sync(0xffffffffu, x[i], 1);                              // lane - 1's x (own at 0)
    const unsigned odd = __ballot_sync(0xffffffffu, x[i] & 1);
    dyn[i] = x[i];
    __syncthreads();
    const int mirrored = dyn[K3_BUG && i == 63 ? 64 : 63 - i];  // planted
    atomicAdd(total, float(x[i]));
    out[4 * i + 0] = lane == 0 ? v : 0;
    out[4 * i + 1] = first + prev;
    out[4 * i + 2] = int(odd);
    out[4 * i + 3] = mirrored;
}
