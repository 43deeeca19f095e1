// The natural-log LSE returned to users: lse2·ln 2 plus c·q·μ_K, the part of every score of the
// row that K-smoothing removed (softmax ignores it, a returned LSE must not).
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
