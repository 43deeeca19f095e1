// What the two backward kernels share (backward.cu: mma.sync, 64-key CTAs; backward_wgmma.cu:
// sm_90a warpgroups, 128-key CTAs): the quantizer of dS and P inside the
// kernel (numerics.quantize_tile), register-A fragment packing, the warp reductions, the per-score
// steps of the softmax and dS, the deterministic turn and the causal query-block range.
#pragma once
#include "common.cuh"
#include "params.cuh"
#include "seqinfo.cuh"
#include "convert.cuh"
#include "exp2.cuh"
#include "softcap.cuh"

// Compile-time parameters (specs.backward_spec sets them; the defaults let a file compile alone).
// The grid's axes (config.cuh GridOrder over key blocks, Hkv, B; backward.backward_grid says which grid
// takes which): SB_GRID_ORDER, fixed at compile time for the mma.sync kernel (one register fewer at
// d=64: specs.backward_fixed_grid_order), or -1 for the launch's grid_order.
struct GridCell { int j, hk, b; };  // key block, key head, batch entry
static_assert(SB_GRID_ORDER >= -1 && SB_GRID_ORDER <= HEADS_BATCH_FIRST, "a GridOrder, or -1");
SB_DEVICE GridCell backward_cell(int grid_order) {
    if (SB_GRID_ORDER >= 0) grid_order = SB_GRID_ORDER;
    const int x = blockIdx.x, y = blockIdx.y, z = blockIdx.z;
    if (SB_CAUSAL && grid_order == HEADS_BATCH_FIRST) return {z, x, y};
    if (SB_CAUSAL && grid_order == HEADS_FIRST) return {y, x, z};
    return {x, y, z};
}

// The keys of a CTA (specs.BackwardTiles.block_keys: 64 for backward.cu, 128 for
// backward_wgmma.cu); a packed batch's key-side INT8 rows per sequence are a multiple of SB_KEY_PAD:
// whole CTAs of keys and of SB_TOKEN_PAD (specs.BackwardTiles.key_pad).
constexpr int BACKWARD_CTA_KEYS = SB_CTA_KEYS;
constexpr int BACKWARD_KEY_PAD = SB_KEY_PAD;
static_assert(BACKWARD_KEY_PAD % BACKWARD_CTA_KEYS == 0 && BACKWARD_KEY_PAD % SB_TOKEN_PAD == 0,
              "key-side rows are whole CTAs of keys and whole padded blocks");
using BackwardSeq = SeqInfo<BackwardParams, BACKWARD_KEY_PAD, SB_WGMMA>;

SB_DEVICE float quad_max(float v) {
    v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return max_nan(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

SB_DEVICE float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Max over the 8 lanes of equal t (lanes t, t+4, ..., t+28) of eight values v[0..7], scattered:
// lane g (= lane / 4) returns the max of v[g]. Three butterfly steps halve the values each time
// (7 shuffles instead of 24): at step `bit`, a lane keeps the half of its values whose index has
// that bit equal to its own and sends the other half to its partner.
SB_DEVICE float spread_max8(const float (&v)[8], int g) {
    float w4[4], w2[2];
    const bool b2 = g & 4, b1 = g & 2, b0 = g & 1;
#pragma unroll
    for (int x = 0; x < 4; ++x) {
        const float keep = b2 ? v[4 + x] : v[x], send = b2 ? v[x] : v[4 + x];
        w4[x] = max_nan(keep, __shfl_xor_sync(0xffffffffu, send, 16));
    }
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        const float keep = b1 ? w4[2 + x] : w4[x], send = b1 ? w4[x] : w4[2 + x];
        w2[x] = max_nan(keep, __shfl_xor_sync(0xffffffffu, send, 8));
    }
    const float keep = b0 ? w2[1] : w2[0], send = b0 ? w2[0] : w2[1];
    return max_nan(keep, __shfl_xor_sync(0xffffffffu, send, 4));
}

SB_DEVICE float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ψ of a tile inside the backward for a block with max|x| = amax and L levels (numerics.quantize_tile):
// scale = amax·(1/L), inv = L·rcp(amax) with the SFU's reciprocal.
struct Psi {
    float scale, inv;
};
template <int L>
SB_DEVICE Psi tile_psi(float amax) {
    if (amax < static_cast<float>(SB_TINY_AMAX)) return {1.f, 0.f};
    return {mul_rn(amax, 1.f / L), mul_rn(static_cast<float>(L), rcp_approx(amax))};
}
SB_DEVICE Psi psi(float amax) { return tile_psi<SB_INT8_MAX>(amax); }
// Unsigned ψ of non-negative P (fine mode): codes 0..255.
SB_DEVICE Psi psi_unsigned(float amax) { return tile_psi<SB_P_LEVELS>(amax); }

// x̂ = rint(x·inv) as a byte (|x·inv| <= 127, or 0 <= x·inv <= 255 unsigned, by construction: no clamp).
SB_DEVICE u32 quant_byte(float x, float inv) { return __float_as_uint(round_magic(x, inv)); }

// Pack the [16 rows][32 cols] of a warp's accumulator-layout tile held in n-tiles n0..n0+3 (rows
// g / g+8 per half) into the A fragment of one 32-column k-step; the column order inside each 16
// is numerics.KEY_PERMUTATION_16, which the B operands (Q̂ᵀ, dÔᵀ) are stored in. inv[half] is the
// row's inverse scale.
template <int N>
SB_DEVICE void pack_a(u32 (&a)[4], const float (&x)[N][4], const float (&inv)[2], int n0 = 0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float v = inv[half];
        a[half] = pack4_low_bytes(quant_byte(x[n0][2 * half], v), quant_byte(x[n0][2 * half + 1], v),
                                  quant_byte(x[n0 + 1][2 * half], v), quant_byte(x[n0 + 1][2 * half + 1], v));
        a[2 + half] = pack4_low_bytes(quant_byte(x[n0 + 2][2 * half], v), quant_byte(x[n0 + 2][2 * half + 1], v),
                                      quant_byte(x[n0 + 3][2 * half], v), quant_byte(x[n0 + 3][2 * half + 1], v));
    }
}

// A warp's tiles in the accumulator layout: n-tile n, register 2·half + c is key row g + 8·half and
// query column qcol0 + 8n + 2t + c; stats_s holds (LSE2, s_Q, δ, s_Qᵀ) per query column of the stage
// (soft-capped kernels: (LSE2 + r, s_Q, δ, r), r the row's share of its scores): P's (LSE2, s_Q) is one 8-byte load.
SB_DEVICE float2 lse_and_sq(const float4* stats_s, int col) { return reinterpret_cast<const float2*>(stats_s)[2 * col]; }

// Pᵀ = exp2((Sᵀ·s_K)·s_Q (+ bias) - LSE2), zero past the ends and right of the band (MASK >= 1) and left
// of it (MASK == 2: a sliding window's edge), hi the band's right edge (SeqInfo::band_hi).
template <int MASK, int N>
SB_DEVICE void probabilities_of(float (&p)[N][4], const int (&s)[N][4], const float (&s_k)[2], const float (&bias_row)[2],
                                const float4* stats_s, int qcol0, int t, int key_lo, int q0, const BackwardSeq& seq, int hi) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int col = qcol0 + n * 8 + 2 * t + c;
            const float2 ls = lse_and_sq(stats_s, col);
            const float lse = ls.x, sq = ls.y;
            const float r = SB_SOFTCAP ? stats_s[col].w : 0.f;  // the row's share of its scores (K-smoothing)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int key = key_lo + 8 * half, q = q0 + col;
                const float u = static_cast<float>(s[n][2 * half + c]) * s_k[half];
                float e = exp2_approx(SB_BIAS      ? fmaf(u, sq, bias_row[half]) - lse
                                      : SB_SOFTCAP ? soft_cap(fmaf(u, sq, r), seq.p.softcap2, seq.p.inv_softcap2) - lse
                                                   : fmaf(u, sq, -lse));
                if (MASK && !(key < seq.len_k() && q < seq.len_q() && (!SB_CAUSAL || key <= q + hi))) e = 0.f;
                if (MASK == 2 && key + seq.p.win_width < q + hi) e = 0.f;
                p[n][2 * half + c] = e;
            }
        }
}
// need_mask is uniform over the warp: tiles inside the sequences and the band (most of them) branch
// around the per-score compares and selects. In SB_WINDOW kernels the masked tiles compare with the
// window's left edge too (a third path, for the tiles that only the right edge or the ends cut, spilled
// the d=128 wgmma kernels).
template <int N>
SB_DEVICE void probabilities(float (&p)[N][4], const int (&s)[N][4], const float (&s_k)[2], const float (&bias_row)[2],
                             const float4* stats_s, int qcol0, int t, int key_lo, int q0, bool need_mask, const BackwardSeq& seq,
                             int hi) {
    if (need_mask)
        probabilities_of<SB_WINDOW ? 2 : 1>(p, s, s_k, bias_row, stats_s, qcol0, t, key_lo, q0, seq, hi);
    else
        probabilities_of<0>(p, s, s_k, bias_row, stats_s, qcol0, t, key_lo, q0, seq, hi);
}

// dSᵀ = Pᵀ ∘ (dPᵀ - δ), in dPᵀ's registers; soft-capped, times the cap's slope (softcap.cuh).
template <int N, class Params>
SB_DEVICE void ds_from_dp(float (&ds)[N][4], const float (&p)[N][4], const float4* stats_s, int qcol0, int t,
                          const Params& params) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const float4* st = stats_s + qcol0 + n * 8 + 2 * t + c;
            const float dl = st->z;
            ds[n][c] = p[n][c] * (ds[n][c] - dl);
            ds[n][2 + c] = p[n][2 + c] * (ds[n][2 + c] - dl);
            if (SB_SOFTCAP) {
                const float lse2 = st->x;
                ds[n][c] *= soft_cap_slope(p[n][c], lse2, params.inv_softcap2);
                ds[n][2 + c] *= soft_cap_slope(p[n][2 + c], lse2, params.inv_softcap2);
            }
        }
}

// Per key row (half): the max of x (of |x| if ABS) over the warp's columns (its quad).
template <bool ABS, int N>
SB_DEVICE void row_max(float (&m)[2], const float (&x)[N][4]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float v = 0.f;
#pragma unroll
        for (int n = 0; n < N; ++n)
            v = ABS ? max_nan(v, max_nan(fabsf(x[n][2 * half]), fabsf(x[n][2 * half + 1])))
                    : max_nan(v, max_nan(x[n][2 * half], x[n][2 * half + 1]));
        m[half] = quad_max(v);
    }
}

// Per key row (half): the sum of x over the warp's columns.
template <int N>
SB_DEVICE void row_sum(float (&r)[2], const float (&x)[N][4]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float v = 0.f;
#pragma unroll
        for (int n = 0; n < N; ++n) v += x[n][2 * half] + x[n][2 * half + 1];
        r[half] = quad_sum(v);
    }
}

// Deterministic dQ: key blocks add into a query block's dQ in order. One thread waits for the
// blocks before this one, and after the block's adds (and a fence and barrier) passes the turn on.
SB_DEVICE void wait_turn(const int* lock, int j) {
    while (ld_acquire_gpu(lock) != j) {
    }
}
SB_DEVICE void pass_turn(int* lock, int j) { st_release_gpu(lock, j + 1); }

// The query blocks (of SB_BLOCK_Q rows) that a CTA of keys first_key .. first_key + keys - 1 walks: i0 ..
// i0 + n_i - 1. Under the band (SB_CAUSAL; seqinfo.cuh band_lo, band_hi), i0 is the first block with a row
// that sees a key of the CTA (causal: every later block does too) and the last is the last such block (a
// sliding window). Blocks past Lq hold no valid row.
struct QueryBlocks {
    int i0, n_i;
};
SB_DEVICE QueryBlocks query_blocks(int first_key, int keys, const BackwardSeq& seq) {
    constexpr int BQ = SB_BLOCK_Q;
    int i0 = 0, i_end = (seq.len_q() + BQ - 1) / BQ;
    if (SB_CAUSAL) {
        const int x = first_key - seq.band_hi() - (BQ - 1);  // a block that ends before the first row seeing first_key
        i0 = x <= 0 ? 0 : (x + BQ - 1) / BQ;
        const int y = first_key + keys - 1 - seq.band_lo();  // the last row that sees the CTA's last key
        if (SB_WINDOW) i_end = y < 0 ? 0 : min(i_end, y / BQ + 1);
    }
    return {i0, max(0, i_end - i0)};
}

// The deterministic turn of key CTA j (of cta_keys keys) at the query block whose first row is q0: the
// CTAs that add into a query block's dQ are those from the first whose keys its rows see, in order.
SB_DEVICE int dq_turn(int j, int q0, int cta_keys, const BackwardSeq& seq) {
    if (!SB_WINDOW) return j;
    const int first = q0 + seq.band_lo();  // the block's first row's first key
    return first > 0 ? j - first / cta_keys : j;
}

// The order in which a CTA walks its (query head of the group, query block) pairs, the blocks i0..i_last of
// query_blocks above. Without the mask, heads outer and query blocks first to last. Causal, heads inner and
// query blocks last to first, so that the CTAs of a (batch, key head) that start together read the same few
// query blocks' tiles at about the same time, while those are in L2 (first to last, CTA j would start on
// block ~2j, each CTA on blocks of its own, and the query side of every (batch, head) in flight would
// compete for L2). Deterministic, a CTA so waits about one iteration for the turn of the CTA before it
// (first to last, those waits add up along the CTAs). Otherwise CTA j starts j % SWEEP_ROTATE blocks into
// its list and wraps around at its end, so that the dQ reductions in flight at one time spread over
// SWEEP_ROTATE query blocks instead of all adding into one.
constexpr int SWEEP_ROTATE = SB_CAUSAL && !SB_DETERMINISTIC ? 4 : 1;
// (hh, ii) -> the next pair. CTA j's first is (h_first, i_last - j % SWEEP_ROTATE % max(n_i, 1)) causal, else
// (h_first, i0); the kernels form it in place (through a function here ptxas schedules the deterministic
// kernels differently).
SB_DEVICE void sweep_advance(int& hh, int& ii, int h_first, int group, int i0, int i_last) {
    if (!SB_CAUSAL) {
        if (++ii > i_last) {
            ii = i0;
            ++hh;
        }
    } else if (++hh == h_first + group) {
        hh = h_first;
        ii = SWEEP_ROTATE > 1 && ii == i0 ? i_last : ii - 1;  // (no wrap without a rotation)
    }
}
// Step it of the sweep that starts at (h_first, i_start), in closed form: sweep_advance applied it times (for a thread
// that needs one step's pair without carrying the sweep through a loop).
SB_DEVICE void sweep_at(int it, int& hh, int& ii, int h_first, int group, int i0, int n_i, int i_start) {
    if (SB_CAUSAL) {
        hh = h_first + it % group;
        ii = i_start - it / group;
        if (ii < i0) ii += n_i;  // (the rotation's wrap; with none, i_start is the last block and this never runs)
    } else {
        hh = h_first + it / n_i;
        ii = i0 + it % n_i;
    }
}
