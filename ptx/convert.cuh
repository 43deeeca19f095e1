// Conversions: 16-bit floats as raw bits <-> f32, correctly rounded f32 arithmetic that the
// compiler may not contract, INT8 rounding on the FMA pipe and byte packing.
#pragma once
#include "common.cuh"

// cvt.f32.f16 / bf16 -> f32 (a shift: bf16 is the top half of an f32).
template <bool BF16>
SB_DEVICE float to_f32(u16 x) {
    if (BF16) return __uint_as_float(static_cast<u32>(x) << 16);
    float f;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(x));
    return f;
}

// cvt.rn.f16.f32 / cvt.rn.bf16.f32: f32 -> 16 bits, round to nearest even.
template <bool BF16>
SB_DEVICE u16 from_f32(float f) {
    u16 x;
    if (BF16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(x) : "f"(f));
    else asm("{ .reg .f16 h; cvt.rn.f16.f32 h, %1; mov.b16 %0, h; }" : "=h"(x) : "f"(f));
    return x;
}

// Half by half max of two packed 16-bit pairs that are not negative; a NaN half wins (max.NaN.f16x2 /
// max.NaN.bf16x2, as max_nan below).
template <bool BF16>
SB_DEVICE u32 max2(u32 a, u32 b) {
    u32 r;
    if (BF16) asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    else asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// max.NaN.f32: the larger of a and b, NaN if either is NaN, where fmaxf returns the other operand. Every
// maximum that becomes a quantization scale uses it, so that a NaN or inf input makes its block's scale
// non-finite and reaches every result computed from that block, instead of vanishing (docs/ALGORITHM.md,
// non-finite inputs). The same instruction as fmaxf (FMNMX), with the NaN flag.
SB_DEVICE float max_nan(float a, float b) { float r; asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }

// cvt.rn.{f16x2,bf16x2}.f32: two f32 -> packed pair, `lo` in the low half.
template <bool BF16>
SB_DEVICE u32 pack2_f32(float lo, float hi) {
    u32 r;
    if (BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// mul.rn.f32 / sub.rn.f32 / div.rn.f32: IEEE results, never fused into an FMA, so the
// quantizer matches the NumPy emulator bit for bit.
SB_DEVICE float mul_rn(float a, float b) { float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
SB_DEVICE float sub_rn(float a, float b) { float r; asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
SB_DEVICE float add_rn(float a, float b) { float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
SB_DEVICE float div_rn(float a, float b) { float r; asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }

// 1.5*2^23: added to |y| < 2^22, it leaves round-to-nearest-even of y in the low mantissa bits, so
// rounding runs on the FMA pipe (the SFU's cvt is a scarcer unit); the low byte of the sum's bits
// is the two's-complement INT8 value.
constexpr float ROUND_MAGIC = 12582912.0f;

// x * inv rounded to an integer (one FMA). Returns the float whose low byte is the INT8 value.
SB_DEVICE float round_magic(float x, float inv) { return fmaf(x, inv, ROUND_MAGIC); }

// prmt.b32: bytes 0 of four words -> one word (a in byte 0 ... d in byte 3).
SB_DEVICE u32 pack4_low_bytes(u32 a, u32 b, u32 c, u32 d) {
    u32 lo, hi, r;
    asm("prmt.b32 %0, %1, %2, 0x0040;" : "=r"(lo) : "r"(a), "r"(b));
    asm("prmt.b32 %0, %1, %2, 0x0040;" : "=r"(hi) : "r"(c), "r"(d));
    asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(r) : "r"(lo), "r"(hi));
    return r;
}

// The forward's P̂ (numerics.forward_p_codes): four e in [0, 1] to u8 codes rint(fp16(e)·fp16(coef)),
// packed a in byte 0 ... d in byte 3. coef2 holds fp16(coef) in both halves. Per pair one cvt.rn.f16x2
// and one fma.rn.f16x2 with 1024, which rounds the exact product once to an integer (float16 spacing
// is 1 in [1024, 2048)) and leaves it in the low byte of each half; one prmt gathers the four bytes.
SB_DEVICE u32 pack4_p_codes(float a, float b, float c, float d, u32 coef2) {
    constexpr u32 BIAS2 = 0x64006400u;  // 1024.0 in both float16 halves
    u32 ab = pack2_f32<false>(a, b), cd = pack2_f32<false>(c, d), r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(ab) : "r"(ab), "r"(coef2), "r"(BIAS2));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(cd) : "r"(cd), "r"(coef2), "r"(BIAS2));
    asm("prmt.b32 %0, %1, %2, 0x6420;" : "=r"(r) : "r"(ab), "r"(cd));
    return r;
}
