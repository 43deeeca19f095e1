// Per query row, q·μ_K: the part of every score of the row that K-smoothing removed. natural_lse adds it back to
// the LSE returned to users (softmax ignores it, a returned LSE must not); softcap_row_bias gives it to the
// soft-capped kernels (tanh does not ignore it either).
#include "common.cuh"
#include "params.cuh"
#include "seqinfo.cuh"
#include "convert.cuh"

// grid (ceil(Lq / SB_THREADS), Hq, B); one thread per query row (SB_THREADS: specs.LSE_THREADS). Rows that
// saw no key get -inf.
extern "C" __global__ void __launch_bounds__(SB_THREADS)
natural_lse(SB_KERNEL_PARAMS(SB_NATURAL_LSE_FIELDS)) {
    const NaturalLseParams p = SB_KERNEL_VIEW(NaturalLseParams, SB_NATURAL_LSE_FIELDS);
    SB_REQUIRE_SM80();
    const int row = blockIdx.x * SB_THREADS + threadIdx.x, h = blockIdx.y;
    const SeqInfo<NaturalLseParams> seq(p, blockIdx.z);
    if (row >= seq.len_q()) return;
    const i64 at = seq.lse_row0(h) + row;  // lse2 and lse are [B][Hq][Lq]
    const float l2 = p.lse2[at];
    float shift = 0.f;
    if (p.k_mean) {
        const u16* qr = p.q + seq.token(p.sb, p.sh, p.sn, h, row);
        const float* mk = p.k_mean + seq.k_slice(seq.kv_head(h)) * p.D;
        for (int c = 0; c < p.D; ++c) shift = fmaf(to_f32<SB_BF16>(qr[c]), mk[c], shift);
    }
    p.lse[at] = l2 == __int_as_float(0x7f800000) ? -__int_as_float(0x7f800000)
                                                                   : l2 * 0.6931471805599453f + p.softmax_scale * shift;
}

// Soft-capped attention with K-smoothing: each query row's share r = c·log2(e)·q·μ_K of its base-2 scores, which
// K̂ = K - μ_K leaves out and tanh does not ignore (numerics.softcap_row_bias: LANES = D_pad / 8 lanes a row, each
// an fmaf chain over its 8 columns in order, added by an xor butterfly, then the prescale). [B][Hq][Nq_pad] in the
// INT8 buffers' rows, 0 on a head's (or packed sequence's) padded rows, which the kernels read too.
// grid (rows · LANES / SB_THREADS, Hq, B), rows the padded length (packed: the longest sequence's).
template <int LANES>
SB_DEVICE void row_shares(const RowBiasParams& p) {
    static_assert(SB_TOKEN_PAD % (SB_THREADS / LANES) == 0, "padded rows are whole CTAs (the butterfly's warps stay whole)");
    const int lane = threadIdx.x % LANES, c0 = 8 * lane, h = blockIdx.y;
    const int row = blockIdx.x * (SB_THREADS / LANES) + threadIdx.x / LANES;
    const SeqInfo<RowBiasParams> seq(p, blockIdx.z);
    if (row >= (SB_VARLEN ? (seq.len_q() + SB_TOKEN_PAD - 1) / SB_TOKEN_PAD * SB_TOKEN_PAD : p.Nq_pad)) return;
    float s = 0.f;
    if (row < seq.len_q() && c0 < p.D) {  // D is a multiple of 8: a lane's 8 columns are all in or all out
        const u16* qr = p.q + seq.token(p.sb, p.sh, p.sn, h, row) + c0;
        const float4* mk = reinterpret_cast<const float4*>(p.k_mean + seq.k_slice(seq.kv_head(h)) * p.D + c0);
        const float4 m0 = mk[0], m1 = mk[1];
        const float m[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
        if ((reinterpret_cast<size_t>(qr) & 15) == 0) {
            const uint4 x = *reinterpret_cast<const uint4*>(qr);
            const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) s = fmaf(to_f32<SB_BF16>(static_cast<u16>(w[e >> 1] >> (16 * (e & 1)))), m[e], s);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) s = fmaf(to_f32<SB_BF16>(qr[e]), m[e], s);
        }
    }
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) p.row_bias[seq.q_row0(h) + row] = p.q_prescale * s;
}

extern "C" __global__ void __launch_bounds__(SB_THREADS)
softcap_row_bias(SB_KERNEL_PARAMS(SB_ROW_BIAS_FIELDS)) {
    const RowBiasParams p = SB_KERNEL_VIEW(RowBiasParams, SB_ROW_BIAS_FIELDS);
    SB_REQUIRE_SM80();
    if (p.D > 128)
        row_shares<32>(p);
    else if (p.D > 64)
        row_shares<16>(p);
    else
        row_shares<8>(p);
}
