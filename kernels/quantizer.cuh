// The pre-pass quantizer ψ (numerics.py quantize_block) on 16-bit inputs, shared by quantize.cu and
// the forward kernel's own Q quantization (forward.cu), so both give the same codes and scales bit
// for bit. Needs SB_BF16 (the input dtype) and SB_TINY_AMAX.
#pragma once
#include "common.cuh"
#include "convert.cuh"

// ψ of a block with max|x| = amax (numerics.quantize_block): stores the scale amax/127 at `scale`
// (when given) and returns the inverse 127/amax; a block under TINY_AMAX counts as zero (scale 0, inverse 0).
SB_DEVICE float psi_inverse(float amax, float* scale) {
    const bool zero = amax < SB_TINY_AMAX;
    if (scale) *scale = zero ? 0.f : div_rn(amax, 127.f);
    return zero ? 0.f : div_rn(127.f, amax);
}

// The INT8 code of x with inverse scale inv (numerics.quantize_block: rint(x·inv), clamped) in the low
// byte. |x| <= amax and inv = RN(127/amax) give |x·inv| < 127.5, so the clamp never binds; the product
// is rounded before ROUND_MAGIC is added (not fused: the emulator rounds it too). A NaN product (an
// inf or NaN input) codes 0, as cvt.rni gives: fmaxf drops the NaN for CODE_ZERO, the float below the
// valid sums whose low byte is 0.
constexpr float CODE_ZERO = ROUND_MAGIC - 256.f;
SB_DEVICE u32 int8_code(float x, float inv) { return __float_as_uint(fmaxf(add_rn(mul_rn(x, inv), ROUND_MAGIC), CODE_ZERO)); }

// Half by half max of two packed 16-bit pairs that are not negative; a NaN half loses to the other
// (max.f16x2 / max.bf16x2, as fmaxf).
template <bool BF16>
SB_DEVICE u32 max2(u32 a, u32 b) {
    u32 r;
    if (BF16) asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    else asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// max|x| over a chunk's 8 raw 16-bit values, as f32 (exact: max and |.| commute with the widening).
SB_DEVICE float chunk_abs_max(uint4 r) {
    constexpr u32 ABS = 0x7fff7fffu;
    const u32 m = max2<SB_BF16>(max2<SB_BF16>(r.x & ABS, r.y & ABS), max2<SB_BF16>(r.z & ABS, r.w & ABS));
    return fmaxf(to_f32<SB_BF16>(static_cast<u16>(m)), to_f32<SB_BF16>(static_cast<u16>(m >> 16)));
}
