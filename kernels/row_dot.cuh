// q·μ_K of one query row, the part of each of the row's scores that K-smoothing removes (numerics.row_dot_mean
// fixes the order): LANES = D_pad / 8 lanes a row, lane l an fmaf chain over columns 8l..8l+7 in order (one
// 16-byte load of q where the row is 16-byte aligned, μ_K as two float4 where it is), then an xor butterfly, so
// every lane of the row ends with the sum. natural_lse, softcap_row_bias and row_stats share it: the returned
// LSE, the forward's and the backward's row shares are then the same float.
// The LANES lanes of a row sit together inside one warp; every lane of the warp calls it (the butterfly's
// shuffles take the whole warp), `live` false for a row past its sequence (it contributes 0).
#pragma once
#include "common.cuh"
#include "convert.cuh"

template <int LANES, bool BF16>
SB_DEVICE float row_dot_mean(const u16* q_row, const float* mean_row, int D, bool live) {
    static_assert(32 % LANES == 0, "a row's lanes inside one warp");
    const int c0 = 8 * (threadIdx.x % LANES);
    float s = 0.f;
    if (live && c0 < D) {  // D is a multiple of 8: a lane's 8 columns are all in or all out
        const u16* qr = q_row + c0;
        const float* mk = mean_row + c0;
        float m[8];
        if ((reinterpret_cast<size_t>(mk) & 15) == 0) {
            const float4 m0 = reinterpret_cast<const float4*>(mk)[0], m1 = reinterpret_cast<const float4*>(mk)[1];
            m[0] = m0.x, m[1] = m0.y, m[2] = m0.z, m[3] = m0.w, m[4] = m1.x, m[5] = m1.y, m[6] = m1.z, m[7] = m1.w;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) m[e] = mk[e];
        }
        if ((reinterpret_cast<size_t>(qr) & 15) == 0) {
            const uint4 x = *reinterpret_cast<const uint4*>(qr);
            const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) s = fmaf(to_f32<BF16>(static_cast<u16>(w[e >> 1] >> (16 * (e & 1)))), m[e], s);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) s = fmaf(to_f32<BF16>(qr[e]), m[e], s);
        }
    }
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

// The lanes a row for head dim D: D_pad / 8, D_pad 64, 128 or 256 (specs.padded_head_dim). Calls f(Lanes<8, 16 or
// 32>{}), the count a compile-time value for the row kernels' template.
template <int N>
struct Lanes {
    static constexpr int value = N;
};
template <class F>
SB_DEVICE void with_row_lanes(int D, F f) {
    if (D > 128)
        f(Lanes<32>{});
    else if (D > 64)
        f(Lanes<16>{});
    else
        f(Lanes<8>{});
}
