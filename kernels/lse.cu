// The natural-log LSE returned to users: lse2·ln 2 plus c·q·μ_K, the part of every score of the
// row that K-smoothing removed (softmax ignores it, a returned LSE must not).
#include "common.cuh"
#include "convert.cuh"

#ifndef SB_BF16
#define SB_BF16 0
#endif

// grid (ceil(Lq / 128), Hq, B); one thread per query row. Rows that saw no key get -inf.
extern "C" __global__ void __launch_bounds__(128)
natural_lse(const u16* __restrict__ q, i64 sb, i64 sh, i64 sn, int Hq, int Hkv, int Lq, int D,
            float softmax_scale, const float* __restrict__ k_mean, const float* __restrict__ lse2,
            float* __restrict__ lse) {
    SB_REQUIRE_SM80();
    const int row = blockIdx.x * 128 + threadIdx.x, h = blockIdx.y, b = blockIdx.z;
    if (row >= Lq) return;
    const i64 at = (static_cast<i64>(b) * Hq + h) * Lq + row;  // lse2 and lse are [B][Hq][Lq]
    const float l2 = lse2[at];
    float shift = 0.f;
    if (k_mean) {
        const u16* qr = q + b * sb + h * sh + row * sn;
        const float* mk = k_mean + (static_cast<i64>(b) * Hkv + h / (Hq / Hkv)) * D;
        for (int c = 0; c < D; ++c) shift = fmaf(to_f32<SB_BF16>(qr[c]), mk[c], shift);
    }
    lse[at] = l2 == __int_as_float(0x7f800000) ? -__int_as_float(0x7f800000)
                                                                   : l2 * 0.6931471805599453f + softmax_scale * shift;
}
