// Row-wise work around the backward's main kernel: LSE2 and δ = rowsum(dO ∘ O) per query before it (clearing the
// rows of dQ's FP32 accumulator that the main kernel adds into, in the same pass), dQ's conversion
// to the input dtype after it, and a packed copy of a 16-bit array whose rows are not 16-byte
// aligned (the main kernel reads V and dO with cp.async).
//
// Compile-time: SB_BF16 (16-bit dtype bf16, else fp16), SB_THREADS (every kernel's CTA: specs.ROWS_THREADS),
// SB_TOKEN_PAD.
#include "common.cuh"
#include "params.cuh"
#include "seqinfo.cuh"
#include "convert.cuh"
#include "row_dot.cuh"

constexpr int THREADS = SB_THREADS;

// The main kernel's per-query row statistics, LANES = D_pad / 8 lanes per row (8 columns each, one 16-byte load of
// dO and of O, Dv columns, where rows are 16-byte aligned), THREADS / LANES rows per CTA; grid (Nq_pad·LANES / THREADS, Hq, B), packed: the longest sequence's padded rows.
// stats is FP32 [B][Hq][Nq_pad][4]: (LSE2, s_Q, δ = rowsum(dO ∘ O), s_Qᵀ) with s_Q the query's per-token
// Q̂ scale and s_Qᵀ its block's Q̂ᵀ scale, and LSE2 = +inf, δ = 0 past Lq so padded rows give P = 0 (soft-capped
// kernels: (LSE2 + r, s_Q, δ, r), r the row's share of its scores, numerics.softcap_row_bias, formed here from Q); one 16-byte row
// lets the main kernel fetch a query block's statistics with one copy, and P's (LSE2, s_Q) with one 8-byte load.
// Every row of the grid (each head's Nq_pad rows, or a packed sequence's padded rows: all the main kernel's query
// blocks add into) also gets its dq_acc row zeroed and, deterministic, its query block's turn counter: these stores
// ride along with the loads here, where a memset of its own was a pass over the accumulator.
template <int LANES>
SB_DEVICE void row_stats_rows(const RowStatsParams& p) {
    static_assert(SB_TOKEN_PAD % (THREADS / LANES) == 0, "a packed sequence's padded rows are whole CTAs");
    const int c0 = 8 * (threadIdx.x % LANES), row = blockIdx.x * (THREADS / LANES) + threadIdx.x / LANES;
    const int h = blockIdx.y;
    const SeqInfo<RowStatsParams> seq(p, blockIdx.z);
    // Packed: rows up to the sequence's padded end (whole CTAs, SB_TOKEN_PAD a multiple of their 16 or 32 rows).
    if (SB_VARLEN && row >= (seq.len_q() + SB_TOKEN_PAD - 1) / SB_TOKEN_PAD * SB_TOKEN_PAD) return;
    const int lane = threadIdx.x % LANES;
    float4* acc = reinterpret_cast<float4*>(p.dq_acc + (seq.q_row0(h) + row) * p.dq_row);
    for (int i = lane; i < p.dq_row / 4; i += LANES) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (p.dq_lock && lane == 0 && row % SB_BLOCK_Q == 0) p.dq_lock[seq.q_block0(h) + row / SB_BLOCK_Q] = 0;
    float s = 0.f;
    if (row < seq.len_q() && c0 < p.Dv) {
        const u16* dr = p.dout + seq.token(p.db, p.dh, p.dn, h, row) + c0;
        const u16* orow = p.out + seq.token(p.ob, p.oh, p.on, h, row) + c0;
        if (p.Dv % 8 == 0 && ((reinterpret_cast<size_t>(dr) | reinterpret_cast<size_t>(orow)) & 15) == 0) {
            const uint4 x = *reinterpret_cast<const uint4*>(dr), y = *reinterpret_cast<const uint4*>(orow);
            const u32 xw[4] = {x.x, x.y, x.z, x.w}, yw[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
            for (int e = 0; e < 8; ++e)
                s = fmaf(to_f32<SB_BF16>(static_cast<u16>(xw[e >> 1] >> (16 * (e & 1)))),
                         to_f32<SB_BF16>(static_cast<u16>(yw[e >> 1] >> (16 * (e & 1)))), s);
        } else {
            for (int e = 0; e < 8 && c0 + e < p.Dv; ++e) s = fmaf(to_f32<SB_BF16>(dr[e]), to_f32<SB_BF16>(orow[e]), s);
        }
    }
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    // Soft-capped with K-smoothing: r = c·log2(e)·q·μ_K, the same float as the forward's (lse.cu softcap_row_bias).
    float r = 0.f;
    if (p.softcap && p.k_mean) {
        const bool live = row < seq.len_q();
        r = p.q_prescale * row_dot_mean<LANES, SB_BF16>(p.q + seq.token(p.qb, p.qh, p.qn, h, live ? row : 0),
                                                        p.k_mean + seq.k_slice(seq.kv_head(h)) * p.D, p.D, live);
    }
    if (lane == 0) {
        const float lse2 = row < seq.len_q() ? p.lse2[seq.lse_row0(h) + row] : __int_as_float(0x7f800000);
        const float q_scale = p.q_scale[seq.q_row0(h) + row];
        if (p.softcap) {  // soft-capped kernels: the row's share of its scores r, and the capped scores' LSE2 + r
            p.stats[seq.q_row0(h) + row] = make_float4(lse2 + r, q_scale, s, r);
        } else {
            p.stats[seq.q_row0(h) + row] = make_float4(lse2, q_scale, s, p.qt_scale[seq.q_block0(h) + row / SB_BLOCK_Q]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
row_stats(SB_KERNEL_PARAMS(SB_ROW_STATS_FIELDS)) {
    const RowStatsParams p = SB_KERNEL_VIEW(RowStatsParams, SB_ROW_STATS_FIELDS);
    SB_REQUIRE_SM80();
    // D_pad / 8 lanes a row: every lane loads 16 bytes of each row.
    with_row_lanes(p.D, [&](auto lanes) { row_stats_rows<decltype(lanes)::value>(p); });
}

// dQ = scale · dq_acc, stored in the input dtype with the output's strides; one thread per 8 columns (two
// 16-byte loads, one 16-byte store where the row is 16-byte aligned: D is a multiple of 8, so dQ rows and the
// accumulator's are); grid (ceil(Lq · D/8 / THREADS), Hq, B).
extern "C" __global__ void __launch_bounds__(THREADS)
dq_convert(SB_KERNEL_PARAMS(SB_DQ_CONVERT_FIELDS)) {
    const DqConvertParams p = SB_KERNEL_VIEW(DqConvertParams, SB_DQ_CONVERT_FIELDS);
    SB_REQUIRE_SM80();
    const int h = blockIdx.y;
    const SeqInfo<DqConvertParams> seq(p, blockIdx.z);
    const int idx = blockIdx.x * THREADS + threadIdx.x, groups = p.D / 8;
    if (idx >= seq.len_q() * groups) return;
    const int row = idx / groups, col = 8 * (idx % groups);
    const float4* src = reinterpret_cast<const float4*>(p.dq_acc + (seq.q_row0(h) + row) * p.dq_row + col);
    const float4 lo = src[0], hi = src[1];
    const uint4 w = make_uint4(pack2_f32<SB_BF16>(lo.x * p.scale, lo.y * p.scale), pack2_f32<SB_BF16>(lo.z * p.scale, lo.w * p.scale),
                               pack2_f32<SB_BF16>(hi.x * p.scale, hi.y * p.scale), pack2_f32<SB_BF16>(hi.z * p.scale, hi.w * p.scale));
    u16* dst = p.dq + seq.token(p.qb, p.qh, p.qn, h, row) + col;
    if ((reinterpret_cast<size_t>(dst) & 15) == 0) {
        *reinterpret_cast<uint4*>(dst) = w;
    } else {  // 4-byte aligned: D and the strides are even
        u32* d4 = reinterpret_cast<u32*>(dst);
        d4[0] = w.x, d4[1] = w.y, d4[2] = w.z, d4[3] = w.w;
    }
}

// Packed [B][H][L][D] copy of a strided 16-bit array; grid (ceil(L · D / THREADS), H, B).
extern "C" __global__ void __launch_bounds__(THREADS)
pack_rows(SB_KERNEL_PARAMS(SB_PACK_ROWS_FIELDS)) {
    const PackRowsParams p = SB_KERNEL_VIEW(PackRowsParams, SB_PACK_ROWS_FIELDS);
    SB_REQUIRE_SM80();
    const int h = blockIdx.y, b = blockIdx.z;
    const int idx = blockIdx.x * THREADS + threadIdx.x;
    if (idx >= p.L * p.D) return;
    const int row = idx / p.D, col = idx % p.D;
    p.y[(static_cast<i64>(b) * p.H + h) * p.L * p.D + idx] = p.x[b * p.sb + h * p.sh + row * p.sn + col];
}
