// Per query row, q·μ_K: the part of every score of the row that K-smoothing removed. natural_lse adds it back to
// the LSE returned to users (softmax ignores it, a returned LSE must not); softcap_row_bias gives it to the
// soft-capped kernels (tanh does not ignore it either).
#include "common.cuh"
#include "params.cuh"
#include "seqinfo.cuh"
#include "convert.cuh"
#include "row_dot.cuh"

// log(e^a + e^b) as sinks.py's logaddexp forms it: max + log1p(exp(-|a - b|)), a or b where both are the same
// infinity.
SB_DEVICE float log_add_exp(float a, float b) {
    if (a == b && isinf(a)) return a;
    const float m = fmaxf(a, b);
    return m + log1pf(expf(-fabsf(a - b)));
}

// The natural-log LSE of each query row, LSE2·ln 2 + c·q·μ_K (numerics.natural_lse), with D_pad / 8 lanes a row
// (row_dot.cuh), SB_THREADS / LANES rows a CTA: grid (ceil(Lq · LANES / SB_THREADS), Hq, B). Rows that saw no key
// get -inf. With sinks the row's sink logit σ joins its normalizer here (sinks.py join_sinks, in one pass over O):
// λ' = logaddexp(λ, σ), O·exp(λ - λ') rounded once to 16 bits in place (each lane its 8 columns), LSE2 moved by
// (λ' - λ)·log2 e, and λ' returned.
template <int LANES>
SB_DEVICE void natural_lse_rows(const NaturalLseParams& p) {
    const int row = blockIdx.x * (SB_THREADS / LANES) + threadIdx.x / LANES, h = blockIdx.y;
    const SeqInfo<NaturalLseParams> seq(p, blockIdx.z);
    const bool live = row < seq.len_q();
    float shift = 0.f;
    if (p.k_mean)  // every lane of the warp, live or not: the butterfly's shuffles
        shift = row_dot_mean<LANES, SB_BF16>(p.q + seq.token(p.sb, p.sh, p.sn, h, live ? row : 0),
                                             p.k_mean + seq.k_slice(seq.kv_head(h)) * p.D, p.D, live);
    if (!live) return;
    const i64 at = seq.lse_row0(h) + row;  // lse2 and lse are [B][Hq][Lq]
    const float l2 = p.lse2[at];
    float lse = l2 == __int_as_float(0x7f800000) ? -__int_as_float(0x7f800000)
                                                 : fmaf(l2, 0.6931471805599453f, p.softmax_scale * shift);
    const bool first = threadIdx.x % LANES == 0;
    if (p.sinks) {
        const float joined = log_add_exp(lse, p.sinks[h]);
        const float w = expf(lse - joined);  // 0 where the row saw no key
        const int c0 = 8 * (threadIdx.x % LANES);
        if (c0 < p.Dv) {  // Dv is a multiple of 8: a lane's 8 columns are all in or all out
            u16* orow = p.out + seq.token(p.ob, p.oh, p.on, h, row) + c0;
            if ((reinterpret_cast<size_t>(orow) & 15) == 0) {
                auto scaled = [w](u32 pair) {  // two 16-bit values times w, each rounded once
                    return pack2_f32<SB_BF16>(to_f32<SB_BF16>(static_cast<u16>(pair)) * w,
                                              to_f32<SB_BF16>(static_cast<u16>(pair >> 16)) * w);
                };
                const uint4 x = *reinterpret_cast<const uint4*>(orow);
                *reinterpret_cast<uint4*>(orow) = make_uint4(scaled(x.x), scaled(x.y), scaled(x.z), scaled(x.w));
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) orow[e] = from_f32<SB_BF16>(to_f32<SB_BF16>(orow[e]) * w);
            }
        }
        if (first) p.lse2[at] = add_rn(l2, mul_rn(joined - lse, 1.4426950408889634f));  // (sinks.py's two roundings)
        lse = joined;
    }
    if (first) p.lse[at] = lse;
}

extern "C" __global__ void __launch_bounds__(SB_THREADS)
natural_lse(SB_KERNEL_PARAMS(SB_NATURAL_LSE_FIELDS)) {
    const NaturalLseParams p = SB_KERNEL_VIEW(NaturalLseParams, SB_NATURAL_LSE_FIELDS);
    SB_REQUIRE_SM80();
    with_row_lanes(p.D, [&](auto lanes) { natural_lse_rows<decltype(lanes)::value>(p); });
}

// Soft-capped attention with K-smoothing: each query row's share r = c·log2(e)·q·μ_K of its base-2 scores, which
// K̂ = K - μ_K leaves out and tanh does not ignore (numerics.softcap_row_bias: the prescale times row_dot_mean).
// [B][Hq][Nq_pad] in the INT8 buffers' rows, 0 on a head's (or packed sequence's) padded rows, which the kernels
// read too. grid (rows · LANES / SB_THREADS, Hq, B), rows the padded length (packed: the longest sequence's).
template <int LANES>
SB_DEVICE void row_shares(const RowBiasParams& p) {
    static_assert(SB_TOKEN_PAD % (SB_THREADS / LANES) == 0, "padded rows are whole CTAs (the butterfly's warps stay whole)");
    const int h = blockIdx.y, row = blockIdx.x * (SB_THREADS / LANES) + threadIdx.x / LANES;
    const SeqInfo<RowBiasParams> seq(p, blockIdx.z);
    if (row >= (SB_VARLEN ? (seq.len_q() + SB_TOKEN_PAD - 1) / SB_TOKEN_PAD * SB_TOKEN_PAD : p.Nq_pad)) return;
    const bool live = row < seq.len_q();
    const float s = row_dot_mean<LANES, SB_BF16>(p.q + seq.token(p.sb, p.sh, p.sn, h, live ? row : 0),
                                                 p.k_mean + seq.k_slice(seq.kv_head(h)) * p.D, p.D, live);
    if (threadIdx.x % LANES == 0) p.row_bias[seq.q_row0(h) + row] = p.q_prescale * s;
}

extern "C" __global__ void __launch_bounds__(SB_THREADS)
softcap_row_bias(SB_KERNEL_PARAMS(SB_ROW_BIAS_FIELDS)) {
    const RowBiasParams p = SB_KERNEL_VIEW(RowBiasParams, SB_ROW_BIAS_FIELDS);
    SB_REQUIRE_SM80();
    with_row_lanes(p.D, [&](auto lanes) { row_shares<decltype(lanes)::value>(p); });
}
