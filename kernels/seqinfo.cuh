// Where one (batch entry, head)'s tokens live. Every attention kernel takes its sequence lengths, the
// causal alignment and the first rows of a head in the padded INT8 buffers from here, so the
// padded-length arithmetic is written once. Today a batch is B sequences of equal lengths Lq, Lk in
// buffers of [B][H][N_pad] token rows; a packed (varlen) batch would be a second constructor, with
// per-sequence lengths and row offsets in place of b·H·N_pad.
// It reads the kernel's parameter struct (SB_KERNEL_VIEW) where it is: nothing is copied that the
// compiler would have to hold across a kernel's main loop.
#pragma once
#include "common.cuh"

template <class Params>
struct SeqInfo {
    const Params& p;  // Lq, Lk, Nq_pad, Nk_pad, Hq, Hkv
    int b;            // batch entry

    SB_DEVICE SeqInfo(const Params& params, int batch) : p(params), b(batch) {}

    SB_DEVICE int len_q() const { return p.Lq; }  // this batch entry's query and key tokens
    SB_DEVICE int len_k() const { return p.Lk; }
    // Token rows of a (batch, head) in the padded INT8 buffers and row statistics.
    SB_DEVICE int nq_pad() const { return p.Nq_pad; }
    SB_DEVICE int nk_pad() const { return p.Nk_pad; }
    // Causal attention is bottom-right aligned: query r sees key c iff c <= r + causal_shift().
    SB_DEVICE int causal_shift() const { return p.Lk - p.Lq; }
    // The key head that query head h reads (GQA: Hq / Hkv query heads a key head).
    SB_DEVICE int kv_head(int h) const { return h / (p.Hq / p.Hkv); }
    // (batch, head) as one index: the slice number in [B][H]... buffers.
    SB_DEVICE i64 q_slice(int h) const { return static_cast<i64>(b) * p.Hq + h; }
    SB_DEVICE i64 k_slice(int hk) const { return static_cast<i64>(b) * p.Hkv + hk; }
    // The first token row of query head h in [B][Hq][Nq_pad] buffers, and of key head hk in [B][Hkv][Nk_pad].
    SB_DEVICE i64 q_row0(int h) const { return q_slice(h) * p.Nq_pad; }
    SB_DEVICE i64 k_row0(int hk) const { return k_slice(hk) * p.Nk_pad; }
    // The first row of query head h in unpadded [B][Hq][Lq] arrays (the LSE).
    SB_DEVICE i64 lse_row0(int h) const { return q_slice(h) * p.Lq; }
    // The first 64-token block of query head h in [B][Hq][Nq_pad/64] arrays, of key head hk in [B][Hkv][Nk_pad/64].
    SB_DEVICE i64 q_block0(int h) const { return q_slice(h) * (p.Nq_pad / SB_BLOCK_Q); }
    SB_DEVICE i64 k_block0(int hk) const { return k_slice(hk) * (p.Nk_pad / SB_BLOCK_KV); }
    // Element offset of token n of head h in a 16-bit input or output with (batch, head, token) strides.
    SB_DEVICE i64 token(i64 sb, i64 sh, i64 sn, int h, i64 n) const { return b * sb + h * sh + n * sn; }
};
