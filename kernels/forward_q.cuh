// The forward kernels' own Q quantization (forward.cu, forward_ws.cu): query rows of 16-bit Q coded
// into a swizzled shared tile by two threads a row, as the pre-pass's Q job codes them (quantizer.cuh,
// bit for bit). Needs SB_BF16 and SB_TINY_AMAX.
#pragma once
#include "common.cuh"
#include "convert.cuh"
#include "swizzle.cuh"
#include "quantizer.cuh"

// Q̂ of a tile's rows from 16-bit Q (head base qh_base, row stride qn elements, unit stride along d) into
// the swizzled tile at sQ (WG: the wgmma layout), as the pre-pass's Q job computes it (quantize.cu,
// per token, prescale c·log2(e)): thread tid quantizes half of row tid / 2 (DP/16
// chunks of 8 values); the two halves share the row max by a shuffle. Rows past Lq and columns past D
// are zero (codes 0, scale 0). Returns the row's scale (both threads of the row hold it).
template <int DP, bool WG>
SB_DEVICE float quantize_q_rows(u32 sQ, const u16* __restrict__ qh_base, i64 qn, int q0, int Lq, int D, float prescale,
                                int tid) {
    constexpr int CH = DP / 16;  // raw chunks a thread: half a row
    const int r = tid >> 1, c0 = (tid & 1) * CH;
    const int row = q0 + r;
    const u16* src = qh_base + static_cast<i64>(row) * qn;
    // Rows that start 16-byte aligned (D a multiple of 8) load 8 values at a time; others value by value.
    const bool aligned = rows_aligned_16(qh_base, qn, D);
    uint4 raw[CH];
#pragma unroll
    for (int c = 0; c < CH; ++c) {
        const int col = 8 * (c0 + c);
        if (aligned) {
            raw[c] = row < Lq && col < D ? *reinterpret_cast<const uint4*>(src + col) : make_uint4(0, 0, 0, 0);
        } else {
            u32 w[4] = {0, 0, 0, 0};
            for (int e = 0; e < 8; ++e)
                if (row < Lq && col + e < D) w[e >> 1] |= static_cast<u32>(src[col + e]) << (16 * (e & 1));
            raw[c] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
    // max|RN(x·p)| = RN(max|x|·p): rounding is monotonic and p > 0.
    float amax = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c) amax = max_nan(amax, chunk_abs_max(raw[c]));
    amax = mul_rn(amax, prescale);
    amax = max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    float scale;
    const float inv = psi_inverse(amax, &scale);
    // Two raw chunks (16 values) make one 16-byte chunk of the INT8 row.
#pragma unroll
    for (int c = 0; c < CH; c += 2) {
        uint2 code[2];
        constexpr float NO_SHIFT[8] = {};
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            float v[8];
            row_values<true, false>(raw[c + x], prescale, NO_SHIFT, v);
            code[x] = chunk_codes(v, inv);
        }
        const u32 dst = sQ + swizzled_offset<DP, WG>(r, (c0 + c) / 2);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(code[0].x), "r"(code[0].y), "r"(code[1].x), "r"(code[1].y) : "memory");
    }
    return scale;
}

