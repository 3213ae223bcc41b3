// Planted bug for memcheck (alignment): with K3_BUG, each thread loads a float4 one float past a 16-byte
// boundary (x86 allows it; a GPU faults with a misaligned address).
#ifndef K3_BUG
#define K3_BUG 0
#endif

extern "C" __global__ void __launch_bounds__(64, 1) load4(const float* x, float* y) {
    const int i = threadIdx.x;
    const float4 v = *reinterpret_cast<const float4*>(x + 4 * i + K3_BUG);  // planted
    y[i] = v.x + v.y + v.z + v.w;
}
