// Where one (batch entry, head)'s tokens live. Every attention kernel takes its sequence lengths, the
// causal alignment and the first rows of a head in the padded INT8 buffers from here, so the
// padded-length arithmetic is written once.
//   Dense batches: B sequences of equal lengths Lq, Lk; 16-bit arrays with (batch, head, token)
//   strides; INT8 buffers [B][H][N_pad] token rows (N_pad a multiple of the kernel's padding).
//   Packed batches (SB_VARLEN): sequence b is tokens cu_q[b]..cu_q[b+1] of 16-bit [total][H][D]
//   arrays (the batch stride unused), Lq and Lk are the token totals, and the INT8 buffers are
//   [1][H][N_pad] with sequence b from row varlen_row0(cu, b, pad): its own rows, a multiple of pad
//   of them, so quantization blocks and key tiles never straddle two sequences.
// pad is SB_TOKEN_PAD (specs.TOKEN_PAD) on the query side, the kernel's KEY_PAD on the key side.
// It reads the kernel's parameter struct (SB_KERNEL_VIEW) where it is: nothing is copied that the
// compiler would have to hold across a kernel's main loop.
#pragma once
#include "common.cuh"
#include "config.cuh"

static_assert(!SB_WINDOW || SB_CAUSAL, "a sliding window is a banded mask");
static_assert(SB_TOKEN_PAD % SB_BLOCK_Q == 0 && SB_TOKEN_PAD % SB_BLOCK_KV == 0, "padded rows are whole 64-token blocks");

// First row of packed sequence b in an INT8 buffer whose sequences are padded to multiples of pad:
// round_up(cu[b], pad) + b·pad. Sequence b then has room for round_up(len_b, pad) rows before b + 1's
// first (the rounding loses less than pad, the b·pad term adds pad a sequence), with no prefix sum
// over the batch; a buffer holds round_up(total, pad) + B·pad rows (quantize.py varlen_rows).
SB_DEVICE i64 varlen_row0(int start, int b, int pad) {
    return static_cast<i64>((start + pad - 1) / pad) * pad + static_cast<i64>(b) * pad;
}

// A packed batch's sequence bound cu[i], loaded afresh at each use: the kernels' main loops run at their
// register cap, and values held across them spilled there (a load that L1 serves costs less).
SB_DEVICE int fresh_bound(const int* cu, int i) {
    int v;
    asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(cu + i));
    return v;
}

// KEY_PAD: the key-side padding of a packed batch's INT8 buffers (the backward's whole key tiles).
// FRESH_KEYS: a packed batch's key bounds are loaded where they are used instead of held in registers
// (which of the two spills depends on the kernel: the wgmma backward at its 255 registers loads them).
template <class Params, int KEY_PAD = SB_TOKEN_PAD, bool FRESH_KEYS = false>
struct SeqInfo {
    const Params& p;  // Lq, Lk, Nq_pad, Nk_pad, Hq, Hkv (and cu_q, cu_k packed)
    int b;            // batch entry
    int q_first = 0, q_count = 0, k_first = 0, k_count = 0;  // packed batches: first token and count

    SB_DEVICE SeqInfo(const Params& params, int batch) : p(params), b(batch) {
        if constexpr (SB_VARLEN) {
            q_first = p.cu_q[b];
            q_count = p.cu_q[b + 1] - q_first;
            if constexpr (!FRESH_KEYS) {
                k_first = p.cu_k[b];
                k_count = p.cu_k[b + 1] - k_first;
            }
        }
    }

    // Packed batches: this sequence's first query and key token (cu_seqlens).
    SB_DEVICE int q_start() const { return q_first; }
    SB_DEVICE int k_start() const {
        if constexpr (SB_VARLEN && FRESH_KEYS) return fresh_bound(p.cu_k, b);
        return k_first;
    }
    // This batch entry's query and key tokens.
    SB_DEVICE int len_q() const {
        if constexpr (SB_VARLEN) return q_count;
        return p.Lq;
    }
    SB_DEVICE int len_k() const {
        if constexpr (SB_VARLEN) return FRESH_KEYS ? fresh_bound(p.cu_k, b + 1) - k_start() : k_count;
        return p.Lk;
    }
    // Token rows of a head in the padded INT8 buffers and row statistics (all sequences' when packed).
    SB_DEVICE int nq_pad() const { return p.Nq_pad; }
    SB_DEVICE int nk_pad() const { return p.Nk_pad; }
    // Causal attention is bottom-right aligned: query r sees key c iff c <= r + causal_shift().
    SB_DEVICE int causal_shift() const { return len_k() - len_q(); }
    // The banded mask of SB_CAUSAL kernels: query r sees key c iff band_lo() <= c - r <= band_hi(). Causal
    // alone is band_hi() = causal_shift() with no left edge; SB_WINDOW kernels read the edges of a sliding
    // window (params.cuh win_hi, win_width; options.UNBOUNDED, 2^29, for an open side: sums of token
    // indices and two of it stay in int32): a dense batch's band_hi() is the parameter itself, which the
    // compiler reads where used. The kernels test the left edge as key + win_width < row + band_hi(), which
    // holds no second bound across their loops (both spilled the d=128 wgmma backward).
    SB_DEVICE int band_hi() const { return SB_WINDOW ? (SB_VARLEN ? causal_shift() : 0) + p.win_hi : causal_shift(); }
    SB_DEVICE int band_lo() const { return SB_WINDOW ? band_hi() - p.win_width : -(1 << 30); }
    // The key head that query head h reads (GQA: Hq / Hkv query heads a key head).
    SB_DEVICE int kv_head(int h) const { return h / (p.Hq / p.Hkv); }
    // (batch, head) as one index: the slice number in [B][H]... arrays (k_mean; dense INT8 buffers).
    SB_DEVICE i64 q_slice(int h) const { return static_cast<i64>(b) * p.Hq + h; }
    SB_DEVICE i64 k_slice(int hk) const { return static_cast<i64>(b) * p.Hkv + hk; }
    // The first token row of query head h in [B][Hq][Nq_pad] buffers, and of key head hk in [B][Hkv][Nk_pad].
    SB_DEVICE i64 q_row0(int h) const {
        return SB_VARLEN ? h * static_cast<i64>(p.Nq_pad) + varlen_row0(q_start(), b, SB_TOKEN_PAD) : q_slice(h) * p.Nq_pad;
    }
    SB_DEVICE i64 k_row0(int hk) const {
        return SB_VARLEN ? hk * static_cast<i64>(p.Nk_pad) + varlen_row0(k_start(), b, KEY_PAD) : k_slice(hk) * p.Nk_pad;
    }
    // Transposed INT8 buffers ([B][H][DP][N_pad], token columns): the head's first row (of DP) and the
    // sequence's first column; the element of (d, token n) is at (qt_row0(h) + d)·N_pad + qt_col0() + n.
    SB_DEVICE i64 qt_row0(int h, int dp) const { return (SB_VARLEN ? h : q_slice(h)) * dp; }
    SB_DEVICE i64 kt_row0(int hk, int dp) const { return (SB_VARLEN ? hk : k_slice(hk)) * dp; }
    SB_DEVICE int qt_col0() const { return SB_VARLEN ? static_cast<int>(varlen_row0(q_start(), b, SB_TOKEN_PAD)) : 0; }
    SB_DEVICE int kt_col0() const { return SB_VARLEN ? static_cast<int>(varlen_row0(k_start(), b, KEY_PAD)) : 0; }
    SB_DEVICE i64 qt_base(int h, int dp) const {
        return SB_VARLEN ? qt_row0(h, dp) * p.Nq_pad + qt_col0() : q_row0(h) * dp;
    }
    SB_DEVICE i64 kt_base(int hk, int dp) const {
        return SB_VARLEN ? kt_row0(hk, dp) * p.Nk_pad + kt_col0() : k_row0(hk) * dp;
    }
    // The first row of query head h in the LSE: [B][Hq][Lq], or [Hq][total] packed.
    SB_DEVICE i64 lse_row0(int h) const { return SB_VARLEN ? h * static_cast<i64>(p.Lq) + q_start() : q_slice(h) * p.Lq; }
    // The first 64-token block of query head h in [B][Hq][Nq_pad/64] arrays, of key head hk in [B][Hkv][Nk_pad/64].
    SB_DEVICE i64 q_block0(int h) const { return SB_VARLEN ? q_row0(h) / SB_BLOCK_Q : q_slice(h) * (p.Nq_pad / SB_BLOCK_Q); }
    SB_DEVICE i64 k_block0(int hk) const { return SB_VARLEN ? k_row0(hk) / SB_BLOCK_KV : k_slice(hk) * (p.Nk_pad / SB_BLOCK_KV); }
    // Element offset of query token n of head h in a 16-bit input or output with (batch, head, token)
    // strides, and of key token n (packed: the sequence's first token in place of the batch stride).
    SB_DEVICE i64 token(i64 sb, i64 sh, i64 sn, int h, i64 n) const {
        return SB_VARLEN ? (q_start() + n) * sn + h * sh : b * sb + h * sh + n * sn;
    }
    SB_DEVICE i64 key_token(i64 sb, i64 sh, i64 sn, int h, i64 n) const {
        return SB_VARLEN ? (k_start() + n) * sn + h * sh : b * sb + h * sh + n * sn;
    }
};
