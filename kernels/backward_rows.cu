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

// The main kernel's per-query row statistics, LANES = D_pad / 8 lanes per row (8 columns each, one 16-byte load of
// dO and of O where rows are 16-byte aligned), 256 / LANES rows per CTA of 256 threads; grid (Nq_pad·LANES / 256, Hq, B).
// stats is FP32 [B][Hq][Nq_pad][4]: (LSE2, s_Q, δ = rowsum(dO ∘ O), s_Qᵀ) with s_Q the query's per-token
// Q̂ scale and s_Qᵀ its block's Q̂ᵀ scale, and LSE2 = +inf, δ = 0 past Lq so padded rows give P = 0; one 16-byte row
// lets the main kernel fetch a query block's statistics with one copy, and P's (LSE2, s_Q) with one 8-byte load.
template <int LANES>
SB_DEVICE void row_stats_rows(const u16* __restrict__ dout, i64 db, i64 dh, i64 dn, const u16* __restrict__ out, i64 ob,
                              i64 oh, i64 on, const float* __restrict__ lse2, const float* __restrict__ q_scale,
                              const float* __restrict__ qt_scale, int Hq, int Lq, int D, int Nq_pad, float4* __restrict__ stats) {
    const int c0 = 8 * (threadIdx.x % LANES), row = blockIdx.x * (256 / LANES) + threadIdx.x / LANES;
    const int h = blockIdx.y, b = blockIdx.z;
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
    for (int o = LANES / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x % LANES == 0)
        stats[bh * Nq_pad + row] = make_float4(row < Lq ? lse2[bh * Lq + row] : __int_as_float(0x7f800000),
                                               q_scale[bh * Nq_pad + row], s,
                                               qt_scale[bh * (Nq_pad / SB_BLOCK_Q) + row / SB_BLOCK_Q]);
}

extern "C" __global__ void __launch_bounds__(256)
row_stats(const u16* __restrict__ dout, i64 db, i64 dh, i64 dn, const u16* __restrict__ out, i64 ob, i64 oh,
          i64 on, const float* __restrict__ lse2, const float* __restrict__ q_scale, const float* __restrict__ qt_scale,
          int Hq, int Lq, int D, int Nq_pad, float4* __restrict__ stats) {
    SB_REQUIRE_SM80();
    // D_pad is 64 or 128 (specs.padded_head_dim): every lane of a row loads 16 bytes of each.
    if (D > 64)
        row_stats_rows<16>(dout, db, dh, dn, out, ob, oh, on, lse2, q_scale, qt_scale, Hq, Lq, D, Nq_pad, stats);
    else
        row_stats_rows<8>(dout, db, dh, dn, out, ob, oh, on, lse2, q_scale, qt_scale, Hq, Lq, D, Nq_pad, stats);
}

// dQ = scale · dq_acc, stored in the input dtype with the output's strides; one thread per 8 columns (two
// 16-byte loads, one 16-byte store where the row is 16-byte aligned: D is a multiple of 8, so dQ rows and the
// accumulator's are); grid (ceil(Lq · D/8 / 256), Hq, B).
extern "C" __global__ void __launch_bounds__(256)
dq_convert(const float* __restrict__ dq_acc, int Hq, int Lq, int D, int dq_row, int Nq_pad, float scale,
           u16* __restrict__ dq, i64 qb, i64 qh, i64 qn) {
    SB_REQUIRE_SM80();
    const int h = blockIdx.y, b = blockIdx.z;
    const int idx = blockIdx.x * 256 + threadIdx.x, groups = D / 8;
    if (idx >= Lq * groups) return;
    const int row = idx / groups, col = 8 * (idx % groups);
    const float4* src = reinterpret_cast<const float4*>(dq_acc + ((static_cast<i64>(b) * Hq + h) * Nq_pad + row) * dq_row + col);
    const float4 lo = src[0], hi = src[1];
    const uint4 w = make_uint4(pack2_f32<SB_BF16>(lo.x * scale, lo.y * scale), pack2_f32<SB_BF16>(lo.z * scale, lo.w * scale),
                               pack2_f32<SB_BF16>(hi.x * scale, hi.y * scale), pack2_f32<SB_BF16>(hi.z * scale, hi.w * scale));
    u16* dst = dq + b * qb + h * qh + row * qn + col;
    if ((reinterpret_cast<size_t>(dst) & 15) == 0) {
        *reinterpret_cast<uint4*>(dst) = w;
    } else {  // 4-byte aligned: D and the strides are even
        u32* d4 = reinterpret_cast<u32*>(dst);
        d4[0] = w.x, d4[1] = w.y, d4[2] = w.z, d4[3] = w.w;
    }
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
