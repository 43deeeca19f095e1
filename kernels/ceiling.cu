// Tensor-core ceilings measured in the same run as the attention kernels: back-to-back
// independent mma.sync chains with operands in registers (no memory traffic).
#include "common.cuh"
#include "mma.cuh"

#define CHAINS 8

extern "C" __global__ void __launch_bounds__(256) int8_mma_ceiling(int* out, int iters) {
    SB_REQUIRE_SM80();
    const u32 a[4] = {threadIdx.x, threadIdx.x * 3u, threadIdx.x ^ 5u, 7u};
    const u32 b[2] = {threadIdx.x * 11u, 13u};
    int acc[CHAINS][4] = {};
    for (int i = 0; i < iters; ++i)
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) mma_s8_16832(acc[c], a, b);
    int s = 0;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(256) fp16_mma_ceiling(float* out, int iters) {
    SB_REQUIRE_SM80();
    const u32 a[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u};
    const u32 b[2] = {0x3c003c00u, 0x3c003c00u};
    float acc[CHAINS][4] = {};
    for (int i = 0; i < iters; ++i)
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) mma_16816<false>(acc[c], a, b);
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
