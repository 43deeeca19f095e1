// Tensor-core ceilings measured in the same run as the attention kernels: back-to-back
// independent mma.sync chains with operands in registers (no memory traffic), and on sm_90a
// (SB_WGMMA) warpgroup products with both operands in shared memory and the accumulators in
// registers, the form the Hopper kernels use.
#include "common.cuh"
#include "config.cuh"
#include "mma.cuh"
#if SB_WGMMA
#include "wgmma.cuh"
#endif

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

#if SB_WGMMA
// Each warpgroup adds WG_GROUP products of 64x128 (k32 INT8, k16 16-bit) into one register accumulator,
// commits them as a group and keeps two groups in flight; A (64 rows) and B (128 rows) are 128-byte
// K-major swizzled tiles of zeros in shared memory. Two warpgroups a CTA, two CTAs an SM.
constexpr int WG_GROUP = 8;
constexpr int WG_TILE_BYTES = (64 + 128) * 128;

template <class Acc, class Issue>
SB_DEVICE void wgmma_ceiling_loop(Acc& acc, int iters, Issue issue) {
    __shared__ __align__(1024) unsigned char tiles[WG_TILE_BYTES];
    for (int i = threadIdx.x; i < WG_TILE_BYTES / 16; i += blockDim.x)
        reinterpret_cast<uint4*>(tiles)[i] = make_uint4(0, 0, 0, 0);
    fence_proxy_async();
    __syncthreads();
    const u64 a = wgmma_desc<128>(wgmma_desc_lo<128>(smem_u32(tiles)));
    const u64 b = wgmma_desc<128>(wgmma_desc_lo<128>(smem_u32(tiles) + 64 * 128));
    for (int i = 0; i < iters; ++i) {
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < WG_GROUP; ++k) issue(acc, a, b);
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    wgmma_hold_all(acc);
}

extern "C" __global__ void __launch_bounds__(256, 2) int8_wgmma_ceiling(int* out, int iters) {
    int acc[16][4] = {};
    wgmma_ceiling_loop(acc, iters, [](int (&d)[16][4], u64 a, u64 b) { wgmma_s8_ss(d, a, b, 1); });
    int s = 0;
#pragma unroll
    for (int n = 0; n < 16; ++n) s += acc[n][0] + acc[n][1] + acc[n][2] + acc[n][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(256, 2) fp16_wgmma_ceiling(float* out, int iters) {
    float acc[16][4] = {};
    wgmma_ceiling_loop(acc, iters, [](float (&d)[16][4], u64 a, u64 b) { wgmma_f16_ss<false>(d, a, b, 1); });
    float s = 0.f;
#pragma unroll
    for (int n = 0; n < 16; ++n) s += acc[n][0] + acc[n][1] + acc[n][2] + acc[n][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
#endif
