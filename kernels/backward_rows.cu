// Row-wise work around the backward's main kernel: LSE2 and δ = rowsum(dO ∘ O) per query before it, dQ's conversion
// to the input dtype after it, and a packed copy of a 16-bit array whose rows are not 16-byte
// aligned (the main kernel reads V and dO with cp.async).
//
// Compile-time: SB_BF16 (16-bit dtype bf16, else fp16).
#include "common.cuh"
#include "convert.cuh"

#ifndef SB_BF16
#define SB_BF16 0
#endif

// The main kernel's per-query row statistics, 16 lanes per row (8 columns each, one 16-byte load of
// dO and of O where rows are 16-byte aligned), 16 rows per CTA of 256 threads; grid (Nq_pad / 16, Hq, B).
// stats is FP32 [B][Hq][Nq_pad][4]: (LSE2, s_Q, δ = rowsum(dO ∘ O), 0) with s_Q the query's per-token
// Q̂ scale, and LSE2 = +inf, δ = 0 past Lq so padded rows give P = 0; one 16-byte row lets the main
// kernel fetch a query block's statistics with one copy, and P's (LSE2, s_Q) with one 8-byte load.
extern "C" __global__ void __launch_bounds__(256)
row_stats(const u16* __restrict__ dout, i64 db, i64 dh, i64 dn, const u16* __restrict__ out, i64 ob, i64 oh,
          i64 on, const float* __restrict__ lse2, const float* __restrict__ q_scale, const float* __restrict__ qt_scale,
          int Hq, int Lq, int D, int Nq_pad, float4* __restrict__ stats) {
    SB_REQUIRE_SM80();
    const int c0 = 8 * (threadIdx.x & 15), row = blockIdx.x * 16 + (threadIdx.x >> 4), h = blockIdx.y, b = blockIdx.z;
    const i64 bh = static_cast<i64>(b) * Hq + h;
    float s = 0.f;
    if (row < Lq && c0 < D) {
        const u16* dr = dout + b * db + h * dh + row * dn + c0;
        const u16* orow = out + b * ob + h * oh + row * on + c0;
        if (D % 8 == 0 && ((reinterpret_cast<size_t>(dr) | reinterpret_cast<size_t>(orow)) & 15) == 0) {
            const uint4 x = *reinterpret_cast<const uint4*>(dr), y = *reinterpret_cast<const uint4*>(orow);
            const u32 xw[4] = {x.x, x.y, x.z, x.w}, yw[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
            for (int e = 0; e < 8; ++e)
                s = fmaf(to_f32<SB_BF16>(static_cast<u16>(xw[e >> 1] >> (16 * (e & 1)))),
                         to_f32<SB_BF16>(static_cast<u16>(yw[e >> 1] >> (16 * (e & 1)))), s);
        } else {
            for (int e = 0; e < 8 && c0 + e < D; ++e) s = fmaf(to_f32<SB_BF16>(dr[e]), to_f32<SB_BF16>(orow[e]), s);
        }
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 15) == 0)
        stats[bh * Nq_pad + row] = make_float4(row < Lq ? lse2[bh * Lq + row] : __int_as_float(0x7f800000),
                                               q_scale[bh * Nq_pad + row], s,
                                               qt_scale[bh * (Nq_pad / SB_BLOCK_Q) + row / SB_BLOCK_Q]);
}

// dQ = scale · dq_acc, stored in the input dtype with the output's strides; one thread per pair
// of columns; grid (ceil(Lq · D/2 / 256), Hq, B).
extern "C" __global__ void __launch_bounds__(256)
dq_convert(const float* __restrict__ dq_acc, int Hq, int Lq, int D, int D_pad, int Nq_pad, float scale,
           u16* __restrict__ dq, i64 qb, i64 qh, i64 qn) {
    SB_REQUIRE_SM80();
    const int h = blockIdx.y, b = blockIdx.z;
    const int idx = blockIdx.x * 256 + threadIdx.x, pairs = D / 2;
    if (idx >= Lq * pairs) return;
    const int row = idx / pairs, col = 2 * (idx % pairs);
    const float* src = dq_acc + ((static_cast<i64>(b) * Hq + h) * Nq_pad + row) * D_pad + col;
    *reinterpret_cast<u32*>(dq + b * qb + h * qh + row * qn + col) = pack2_f32<SB_BF16>(src[0] * scale, src[1] * scale);
}

// Packed [B][H][L][D] copy of a strided 16-bit array; grid (ceil(L · D / 256), H, B).
extern "C" __global__ void __launch_bounds__(256)
pack_rows(const u16* __restrict__ x, i64 sb, i64 sh, i64 sn, int H, int L, int D, u16* __restrict__ y) {
    SB_REQUIRE_SM80();
    const int h = blockIdx.y, b = blockIdx.z;
    const int idx = blockIdx.x * 256 + threadIdx.x;
    if (idx >= L * D) return;
    const int row = idx / D, col = idx % D;
    y[(static_cast<i64>(b) * H + h) * L * D + idx] = x[b * sb + h * sh + row * sn + col];
}
