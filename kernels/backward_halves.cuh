// What the sm_90 backward kernels whose warpgroups split a 64-query block into halves share (backward_quad.cu at
// head dim 128, backward_pair.cu at MLA's 192/128): a warpgroup holds Sᵀ, dPᵀ and dSᵀ of its warps' 16 keys x the
// half's 32 queries (HALF_NT n-tiles in the accumulator layout: key rows krow, krow + 8, query columns 8n + 2t, +1),
// so a key's maxima over the block's queries take both halves (exchanged through shared memory), and the codes go to
// shared memory, where the gradient products read both halves.
#pragma once
#include "backward_common.cuh"
#include "swizzle.cuh"
#include "cp_async.cuh"

constexpr int HALF_Q = SB_BLOCK_Q / 2;  // queries of a half
constexpr int HALF_NT = HALF_Q / 8;     // its n-tiles

// This half's per-key maxima m (P's for krow, krow + 8, then |dS|'s) into red[P or Z][warpgroup][key] (lanes t = 0),
// for the partner warpgroup to read once a barrier has passed.
template <int W>
SB_DEVICE void publish_key_maxima(float (&red)[2][W][SB_BLOCK_KV], const float (&m)[4], int wg, int krow, int t) {
    if (t != 0) return;
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        red[x][wg][krow] = m[2 * x];
        red[x][wg][krow + 8] = m[2 * x + 1];
    }
}

// The maxima over the whole block: this half's m joined with the partner's published ones.
template <int W>
SB_DEVICE void join_key_maxima(float (&m)[4], const float (&red)[2][W][SB_BLOCK_KV], int partner, int krow) {
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        m[2 * x] = max_nan(m[2 * x], red[x][partner][krow]);
        m[2 * x + 1] = max_nan(m[2 * x + 1], red[x][partner][krow + 8]);
    }
}

// Codes of x (the warp's 16 keys x half qh's 32 queries, inverse scales inv per key row) into a [64 keys][64 q] A tile
// of 64-byte rows: pack_a's words at their fragment token order's bytes (16-byte chunk 2·qh + r of the row, bytes
// 4t..4t+3).
SB_DEVICE void store_half_codes(i8* tile, const float (&x)[HALF_NT][4], const float (&inv)[2], int krow, int qh, int t) {
    u32 w4[4];
    pack_a(w4, x, inv, 0);
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            *reinterpret_cast<u32*>(tile + swizzled_offset<64, true>(krow + 8 * half, 2 * qh + r) + 4 * t) = w4[2 * r + half];
}

// Ŷ's ψ of query column yc of the half (lane (g, t) takes yc = (g / 2)·8 + 2t + g % 2, spread_max8's order): the
// max of |dS| over the warp's 16 keys, then over the warpgroup's four warps through red_y[warpgroup][warp][query]
// (named barrier bar_id, the warpgroup's 128 threads).
template <int W>
SB_DEVICE Psi half_query_psi(const float (&ds)[HALF_NT][4], float (&red_y)[W][4][HALF_Q], int wg, int wv, int g, int t,
                             int bar_id, int& yc) {
    float colmax[8];
#pragma unroll
    for (int y = 0; y < 8; ++y) colmax[y] = max_nan(fabsf(ds[y / 2][y % 2]), fabsf(ds[y / 2][2 + y % 2]));
    yc = (g >> 1) * 8 + 2 * t + (g & 1);
    red_y[wg][wv][yc] = spread_max8(colmax, g);
    named_barrier<128>(bar_id);
    float my = red_y[wg][0][yc];
#pragma unroll
    for (int x = 1; x < 4; ++x) my = max_nan(my, red_y[wg][x][yc]);
    return psi(my);
}

// Ŷ's codes of dS (inverse scale inv of lane (g, t)'s column, gathered by shuffles) into a [64 q][keys] tile of
// ROW-byte rows: query row HALF_Q·qh + 8n + 2t + c, the warp's keys at 16-byte chunk `chunk`, bytes g and g + 8. The
// row's swizzle key is the same for every n, so two offsets address all 32 bytes.
template <int ROW>
SB_DEVICE void store_half_y(i8* tile, const float (&ds)[HALF_NT][4], float inv, int chunk, int qh, int g, int t) {
    const int y_off[2] = {swizzled_offset<ROW, true>(HALF_Q * qh + 2 * t, chunk) + g,
                          swizzled_offset<ROW, true>(HALF_Q * qh + 2 * t + 1, chunk) + g};
#pragma unroll
    for (int n = 0; n < HALF_NT; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float inv_c = __shfl_sync(0xffffffffu, inv, (2 * n + c) * 4 + t);
#pragma unroll
            for (int half = 0; half < 2; ++half)
                tile[y_off[c] + n * 8 * ROW + 8 * half] = static_cast<i8>(quant_byte(ds[n][2 * half + c], inv_c) & 0xffu);
        }
}

// The 64-key CTAs (backward_pair.cu, backward_phases.cu) of key block j: K̂ [64][DP] and V [64][DPV] (zero past the
// keys and V's head dim) in one cp.async group, then K̂ᵀ [DQK][64] in a second, for the caller to commit and wait.
template <int DP, int DQK, int DPV, int THREADS>
SB_DEVICE void load_key_block(u32 k_dst, u32 v_dst, u32 kt_dst, const BackwardParams& a, const BackwardSeq& seq,
                              int hk, int j, int tid) {
    constexpr int KEYS = SB_BLOCK_KV;
    const int kvalid = min(KEYS, seq.len_k() - j * KEYS);
    load_tile<DP, KEYS, THREADS, true>(k_dst, a.k8 + (seq.k_row0(hk) + j * KEYS) * DP, DP);
    const u16* vsrc = a.v + seq.key_token(a.vb, a.vh, a.vn, hk, static_cast<i64>(j) * KEYS);
    constexpr int VCH = 2 * DPV / 16;  // 16-byte chunks of a row
    static_assert(KEYS * VCH % THREADS == 0, "whole passes of the threads");
#pragma unroll
    for (int k = 0; k < KEYS * VCH / THREADS; ++k) {
        const int r = (tid + k * THREADS) / VCH, c = (tid + k * THREADS) % VCH;
        const bool ok = c * 8 < a.Dv && r < kvalid;  // zero past the keys and V's head dim
        cp_async_16(v_dst + wgmma_tile_offset<2 * DPV, KEYS>(r, c), ok ? vsrc + r * a.vn + 8 * c : vsrc, ok ? 16 : 0);
    }
    cp_async_commit();
    load_tile<64, DQK, THREADS, true>(kt_dst, a.k8t + seq.kt_base(hk, DP) + j * KEYS, seq.nk_pad());
}

// The first query block of key block j's sweep (sweep_advance's order over i0..i_last). Causal: the sweep of
// backward_wgmma.cu's 128-key CTA j / 2 (its rotation; block i0 - 1, which that CTA walks and this one does not, holds
// no key of this CTA: P = 0 there), so that dK and dV take their terms in that kernel's order, bit for bit its results.
SB_DEVICE int pair_sweep_start(int j, int i0, int i_last, const BackwardSeq& seq) {
    if (!SB_CAUSAL) return i0;
    const int n_wide = query_blocks((j >> 1) * 2 * SB_BLOCK_KV, 2 * SB_BLOCK_KV, seq).n_i;
    const int i_start = i_last - (j >> 1) % SWEEP_ROTATE % max(n_wide, 1);
    return i_start < i0 ? i_last : i_start;
}
