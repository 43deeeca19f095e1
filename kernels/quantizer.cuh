// The pre-pass quantizer ψ (numerics.py quantize_block) on 16-bit inputs: row values, maxima, scales
// and codes, shared by quantize.cu and the forward kernel's own Q quantization (forward.cu), so both
// give the same codes and scales bit for bit. Needs SB_BF16 (the input dtype) and SB_TINY_AMAX.
#pragma once
#include "common.cuh"
#include "convert.cuh"

// ψ of a block with max|x| = amax (numerics.quantize_block): stores the scale amax/127 at `scale`
// (when given) and returns the inverse 127/amax; a block under TINY_AMAX counts as zero (scale 0, inverse 0).
// A block holding NaN or inf has amax NaN or inf (max_nan), so its scale is NaN or inf and its codes 0.
SB_DEVICE float psi_inverse(float amax, float* scale) {
    const bool zero = amax < SB_TINY_AMAX;
    if (scale) *scale = zero ? 0.f : div_rn(amax, 127.f);
    return zero ? 0.f : div_rn(127.f, amax);
}

// The INT8 code of x with inverse scale inv (numerics.quantize_block: rint(x·inv), clamped) in the low
// byte. |x| <= amax and inv = RN(127/amax) give |x·inv| < 127.5, so the clamp never binds; one FMA with
// ROUND_MAGIC rounds the exact product once (the emulator rounds the float64 product, also exact). A NaN
// product (an inf or NaN input) codes 0, as cvt.rni gives: fmaxf drops the NaN for CODE_ZERO, the float
// below the valid sums whose low byte is 0.
constexpr float CODE_ZERO = ROUND_MAGIC - 256.f;
SB_DEVICE u32 int8_code(float x, float inv) { return __float_as_uint(fmaxf(round_magic(x, inv), CODE_ZERO)); }

// max|x| over a chunk's 8 raw 16-bit values, as f32 (exact: max and |.| commute with the widening); NaN if
// one is NaN.
SB_DEVICE float chunk_abs_max(uint4 r) {
    constexpr u32 ABS = 0x7fff7fffu;
    const u32 m = max2<SB_BF16>(max2<SB_BF16>(r.x & ABS, r.y & ABS), max2<SB_BF16>(r.z & ABS, r.w & ABS));
    return max_nan(to_f32<SB_BF16>(static_cast<u16>(m)), to_f32<SB_BF16>(static_cast<u16>(m >> 16)));
}

// A row's 8 entries from its raw chunk r: x·prescale - shift, each step only where the job has it
// (x·1 and x - 0 are x, so skipping them changes no bit). Raw chunks outside the tensor are zero and
// the shift is zero past D, so columns need no mask; rows past N do where there is a shift.
template <bool PRESCALE, bool SHIFT>
SB_DEVICE void row_values(uint4 r, float prescale, const float (&shift)[8], float (&v)[8]) {
    const u32 words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        float y = to_f32<SB_BF16>(static_cast<u16>(words[e >> 1] >> (16 * (e & 1))));
        if (PRESCALE) y = mul_rn(y, prescale);
        if (SHIFT) y = sub_rn(y, shift[e]);
        v[e] = y;
    }
}

// The INT8 codes of a row's 8 values with inverse scale inv, packed: columns 0-3 in x, 4-7 in y.
SB_DEVICE uint2 chunk_codes(const float (&v)[8], float inv) {
    return make_uint2(pack4_low_bytes(int8_code(v[0], inv), int8_code(v[1], inv), int8_code(v[2], inv), int8_code(v[3], inv)),
                      pack4_low_bytes(int8_code(v[4], inv), int8_code(v[5], inv), int8_code(v[6], inv), int8_code(v[7], inv)));
}

// Rows of 16-bit values starting at base with row stride sn (elements) and D values a row can be read
// 16 bytes (8 values) at a time, a chunk all inside the row or all past D.
SB_DEVICE bool rows_aligned_16(const u16* base, i64 sn, int D) {
    return D % 8 == 0 && sn % 8 == 0 && (reinterpret_cast<size_t>(base) & 15) == 0;
}
