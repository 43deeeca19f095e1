// The steps the forward kernels (forward.cu, forward_ws.cu) share, written once: their own Q
// quantization, P̂'s coefficients per V block, a tile's row maximum against the lazily moved reference,
// P̂'s codes, and the output rows. Q quantization: query rows of 16-bit Q coded into a swizzled shared
// tile by two threads a row, as the pre-pass's Q job codes them (quantizer.cuh,
// bit for bit). Needs SB_BF16 and SB_TINY_AMAX.
#pragma once
#include "common.cuh"
#include "convert.cuh"
#include "swizzle.cuh"
#include "quantizer.cuh"
#include "exp2.cuh"

// Q̂ of a tile's rows from 16-bit Q (head base qh_base, row stride qn elements, unit stride along d) into
// the swizzled tile at sQ (WG: the wgmma layout of a ROWS-row tile), as the pre-pass's Q job computes it (quantize.cu,
// per token, prescale c·log2(e)): thread tid quantizes half of row tid / 2 (DP/16
// chunks of 8 values); the two halves share the row max by a shuffle. Rows past Lq and columns past D
// are zero (codes 0, scale 0). Returns the row's scale (both threads of the row hold it).
template <int DP, bool WG, int ROWS>
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
        int at;
        if constexpr (WG) at = wgmma_tile_offset<DP, ROWS>(r, (c0 + c) / 2);
        else at = swizzled_offset<DP>(r, (c0 + c) / 2);
        const u32 dst = sQ + at;
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(code[0].x), "r"(code[0].y), "r"(code[1].x), "r"(code[1].y) : "memory");
    }
    return scale;
}


// P̂'s coefficient per V block of a key tile (numerics: forward P quantization): 255 (levels) for the
// block with the largest V scale s_max among those holding a key < Lk, levels·s_V·(1/s_max) for the
// others; O then adds (P̂V̂)·β·pv_scale, pv_scale = s_max/levels. A non-finite block's scale wins.
// sv: the tile's V block scales, first_block its first block's index among the head's.
template <int VBLOCKS, int BKV>
SB_DEVICE void p_coefficients(const float (&sv)[VBLOCKS], int first_block, int len_k, float levels,
                              float (&pcoef)[VBLOCKS], float& pv_scale) {
    float smax = sv[0];
#pragma unroll
    for (int vb = 1; vb < VBLOCKS; ++vb)
        if ((first_block + vb) * BKV < len_k) smax = max_nan(smax, sv[vb]);
    const float inv = rcp_approx(smax);  // the SFU's 1/s_max (numerics: within one ulp of IEEE)
#pragma unroll
    for (int vb = 0; vb < VBLOCKS; ++vb)
        pcoef[vb] = VBLOCKS == 1 || sv[vb] == smax ? levels : __fmul_rn(__fmul_rn(levels, sv[vb]), inv);
    pv_scale = smax * (1.f / levels);
}

// A tile's maximum of one row (this thread's part rm, then its quad's; times the row's Q scale where
// the max was taken before it) against the row's reference max m_ref, which moves to it only when it
// passes m_ref + lazy (log2 units; -inf, every key masked, never does): returns whether it moved,
// with alpha = exp2(m_old - m_ref) for O and l, beta = exp2(rm - m_ref) for the tile's P, and the
// exponents' offset r_use (0 for a fully masked row: exp2(-inf) = 0, not exp2(-inf + inf) = NaN).
SB_DEVICE bool tile_row_max(float rm, float q_scale, bool scaled, float lazy, float& m_ref, float& alpha, float& beta,
                            float& r_use) {
    rm = fmaxf(rm, __shfl_xor_sync(0xffffffffu, rm, 1));
    rm = fmaxf(rm, __shfl_xor_sync(0xffffffffu, rm, 2));
    if (scaled) rm *= q_scale;
    const float m_old = m_ref;
    const float m_use = rm > m_old + lazy ? rm : m_old;
    alpha = exp2_approx(m_old - m_use);  // 1 unless m_ref moved; 0 from the first reference
    m_ref = m_use;
    beta = exp2_approx(rm - m_use);  // 0 for a fully masked row
    r_use = rm == -__int_as_float(0x7f800000) ? 0.f : rm;
    return m_use != m_old;
}

// P̂ = rint(fp16(e)·fp16(coef)) as u8, packed in the A-fragment order that V̂ᵀ's key permutation
// matches: exponents u of a 16-row m-tile's NT_KV n-tiles into KSTEPS_P k-steps of 32 keys.
template <int NT_KV, int BKV>
SB_DEVICE void code_p(const float (&u)[NT_KV][4], const float* pcoef, u32 (&pf)[NT_KV / 4][4]) {
#pragma unroll
    for (int kk = 0; kk < NT_KV / 4; ++kk) {
        const int n = 4 * kk;
        const u32 pc = pack2_f32<false>(pcoef[kk * 32 / BKV], pcoef[kk * 32 / BKV]);  // fp16(coef) twice
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            pf[kk][half] = pack4_p_codes(u[n][2 * half], u[n][2 * half + 1], u[n + 1][2 * half], u[n + 1][2 * half + 1], pc);
            pf[kk][2 + half] = pack4_p_codes(u[n + 2][2 * half], u[n + 2][2 * half + 1], u[n + 3][2 * half],
                                             u[n + 3][2 * half + 1], pc);
        }
    }
}

// One output row of this thread (rows g and g + 8 of its m-tile are half 0 and 1): O = acc / l in the
// output dtype (its NT_D column pairs 2t, 2t + 1 of each n-tile, columns below D: O's, V's head dim) and the
// base-2 LSE m_ref + log2(l), +inf for a row that saw no key. A non-finite l (a NaN or inf input reached the
// row) gives NaN for both, so that the backward's P of the row is NaN. l_part: the thread's part of
// l (its quad adds theirs). orow(): the row's output, called for a valid row only; lse: the LSE (null:
// none wanted), its element lse_index() written by the quad's first thread.
template <bool BF16, int NT_D, class Row, class LseIndex>
SB_DEVICE void store_row(const float (&o)[NT_D][4], int half, float l_part, float m_ref, bool valid, int D, int t,
                         Row orow, float* lse, LseIndex lse_index) {
    float l = l_part;
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const bool finite = l < __int_as_float(0x7f800000);  // false for inf and NaN
    const float nan = __int_as_float(0x7fffffff);
    const float inv = l == 0.f ? 0.f : (finite ? 1.f / l : nan);
    if (valid) {
        u16* out = orow();
#pragma unroll
        for (int n = 0; n < NT_D; ++n) {
            const int col = n * 8 + 2 * t;
            if (col < D) *reinterpret_cast<u32*>(out + col) = pack2_f32<BF16>(o[n][2 * half] * inv, o[n][2 * half + 1] * inv);
        }
        if (lse && t == 0) lse[lse_index()] = l == 0.f ? __int_as_float(0x7f800000) : (finite ? m_ref + log2_approx(l) : nan);
    }
}
