// The host-kernel contract. Each kernel's parameters are listed once, here, as F(type, name) entries
// (F0 for the first): the kernel takes them as its parameters in list order (SB_KERNEL_PARAMS) and reads
// them through the struct of the same list (SB_KERNEL_VIEW); the host (sagebwd_cp/params.py) reads the
// lists from this file and passes the fields by name. A new field is one line here, then the kernel
// that reads it and the host call that names it. Types the host knows: pointers, i64, int, float,
// TensorMap and the structs below.
// Separate parameters rather than one struct parameter: NVVM merges loads from one struct parameter
// into vector loads, and the register-capped backward variants then spilled (docs/ARCHITECTURE.md).
// Shapes: B batch, Hq / Hkv query / key heads, Lq / Lk tokens, D head dim, DP its padded size
// (SB_DP), Nq_pad / Nk_pad the padded token counts of the INT8 buffers (SeqInfo, seqinfo.cuh).
#pragma once
#include "common.cuh"
#include "config.cuh"
#include "tma.cuh"

#define SB_FIELD(type, name) type name;
#define SB_STRUCT(name, fields)       \
    struct name {                     \
        fields(SB_FIELD, SB_FIELD)    \
    };
#define SB_PARAM0(type, name) type name##_
#define SB_PARAM(type, name) , type name##_
#define SB_INIT(type, name) name##_,
// The kernel's parameter declarations, and the struct they fill (first thing in the kernel's body).
#define SB_KERNEL_PARAMS(fields) fields(SB_PARAM0, SB_PARAM)
#define SB_KERNEL_VIEW(name, fields) name{fields(SB_INIT, SB_INIT)}
// Tensor maps are read where they are (TMA takes their address): __grid_constant__, no struct.
#define SB_MAP_PARAM0(type, name) const __grid_constant__ type name
#define SB_MAP_PARAM(type, name) , const __grid_constant__ type name
#define SB_KERNEL_MAPS(fields) fields(SB_MAP_PARAM0, SB_MAP_PARAM)
// A further list of plain parameters after a first one (written with no comma before it).
#define SB_KERNEL_PARAMS_MORE(fields) fields(SB_PARAM, SB_PARAM)
// Names a parameter list that has no struct view, for the host.
#define SB_PARAM_LIST(name, fields)

// cu_q, cu_k: packed batches (SB_VARLEN, seqinfo.cuh): [B+1] int32 first tokens of each sequence
// (cu_seqlens), the last the total; null for dense batches. Lq, Lk are then the totals.

// forward.cu attention_forward
#define SB_FORWARD_FIELDS(F0, F) \
    F0(const i8* __restrict__, q8)            /* [B][Hq][Nq_pad][DP], Q-smoothing only (else the kernel codes Q) */ \
    F(const float* __restrict__, q_scale)     /* [B][Hq][Nq_pad], Q-smoothing only */ \
    F(const i8* __restrict__, k8)             /* [B][Hkv][Nk_pad][DP] */ \
    F(const float* __restrict__, k_scale)     /* [B][Hkv][Nk_pad] */ \
    F(const i8* __restrict__, vt8)            /* [B][Hkv][DP][Nk_pad], key order permuted */ \
    F(const float* __restrict__, v_scale)     /* [B][Hkv][Nk_pad/64] */ \
    F(const float* __restrict__, bias)        /* [B][Hq][Nq_pad/64][Nk_pad], Q-smoothing's add-back */ \
    F(const float* __restrict__, row_bias)    /* [B][Hq][Nq_pad]: SB_SOFTCAP with K-smoothing, each row's share of its */ \
                                              /* scores (lse.cu softcap_row_bias), else null */ \
    F(u16* __restrict__, out)                 /* 16-bit output, strides ob, oh, on */ \
    F(float* __restrict__, lse2)              /* [B][Hq][Lq] base-2 LSE, or null */ \
    F(const u16* __restrict__, q)             /* 16-bit Q, strides q_sb, q_sh, q_sn, unit stride along d */ \
    F(i64, ob) F(i64, oh) F(i64, on) F(i64, q_sb) F(i64, q_sh) F(i64, q_sn) \
    F(int, Hq) F(int, Hkv) F(int, Lq) F(int, Lk) F(int, D) F(int, Nq_pad) F(int, Nk_pad) \
    F(int, Dv)                                /* V's and O's head dim (<= D; value_head_dim.py) */ \
    F(float, q_prescale)                      /* c·log2(e): Q's factor before its quantization */ \
    F(const int*, cu_q) F(const int*, cu_k)   /* packed batches (above), else null */ \
    F(int, win_hi) F(int, win_width)          /* SB_WINDOW: the band's right edge (dense: Lk - Lq + right; packed: right) */ \
                                              /* and width (seqinfo.cuh band_hi) */ \
    F(float, softcap2) F(float, inv_softcap2) /* SB_SOFTCAP: C = softcap·log2(e) and 1/C (softcap.cuh) */
SB_STRUCT(ForwardParams, SB_FORWARD_FIELDS)

// forward_ws.cu attention_forward, after ForwardParams: the TMA maps of the key-side tiles
#define SB_FORWARD_MAPS(F0, F) \
    F0(TensorMap, tm_k)                       /* K̂ bytes [B·Hkv·Nk_pad][DP], box DP x 128 rows */ \
    F(TensorMap, tm_vt)                       /* V̂ᵀ bytes [B·Hkv·DP][Nk_pad], box 128 x DP */
SB_PARAM_LIST(ForwardMaps, SB_FORWARD_MAPS)

// forward_ws.cu attention_forward, last: its static schedule's work tiles (query block, head, batch entry)
#define SB_FORWARD_SCHEDULE(F0, F) \
    F0(int, batch)                            /* batch entries (packed: sequences) */ \
    F(int, q_blocks)                          /* query blocks of CTA_Q rows (packed: of the longest sequence) */
SB_PARAM_LIST(ForwardSchedule, SB_FORWARD_SCHEDULE)

// backward.cu and backward_wgmma.cu attention_backward
#define SB_BACKWARD_FIELDS(F0, F) \
    F0(const i8*, q8)                         /* [B][Hq][Nq_pad][DP] */ \
    F(const i8*, q8t)                         /* [B][Hq][DP][Nq_pad], fragment token order, coded per 64-query block */ \
    F(const float*, q_mean)                   /* [B][Hq][Nq_pad/64][DP] (SB_BIAS) */ \
    F(const i8*, k8)                          /* [B][Hkv][Nk_pad][DP] */ \
    F(const i8*, k8t)                         /* [B][Hkv][DP][Nk_pad], coded per 64-key block */ \
    F(const float*, k_scale)                  /* [B][Hkv][Nk_pad], per token */ \
    F(const float*, kt_scale)                 /* [B][Hkv][Nk_pad/64]: k8t's scales */ \
    F(const float*, bias)                     /* [B][Hq][Nq_pad/64][Nk_pad] (SB_BIAS) */ \
    F(const u16*, v)                          /* 16-bit V, strides vb, vh, vn; 16-byte aligned rows */ \
    F(const u16*, dout)                       /* 16-bit dO, strides db, dh, dn; 16-byte aligned rows */ \
    F(const i8*, dot8)                        /* [B][Hq][DP][Nq_pad], fragment token order */ \
    F(const float*, do_scale)                 /* [B][Hq][Nq_pad/64] */ \
    F(const float4*, stats)                   /* [B][Hq][Nq_pad] (LSE2, s_Q, δ, s_Qᵀ): s_Q the per-token Q̂ scale, s_Qᵀ q8t's */ \
                               /* of the row's block; LSE2 = +inf, δ = 0 on padded rows; SB_SOFTCAP: (LSE2 + r, s_Q, δ, r), */ \
                               /* r the row's share of its scores (0 without K-smoothing; backward_rows.cu) */ \
    F(const float*, qt_scale)                 /* [B][Hq][Nq_pad/64]: q8t's scales (SB_SOFTCAP reads s_Qᵀ here) */ \
    F(float*, dq_acc)                         /* [B][Hq][Nq_pad][dq_row], zeroed by row_stats (specs.BackwardTiles.dq_row) */ \
    F(int*, dq_lock)                          /* [B][Hq][Nq_pad/64], zeroed by row_stats (SB_DETERMINISTIC) */ \
    F(u16*, dk)                               /* 16-bit outputs, strides kb, kh, kn and wb, wh, wn */ \
    F(u16*, dv) \
    F(i64, vb) F(i64, vh) F(i64, vn) F(i64, db) F(i64, dh) F(i64, dn) \
    F(i64, kb) F(i64, kh) F(i64, kn) F(i64, wb) F(i64, wh) F(i64, wn) \
    F(int, Hq) F(int, Hkv) F(int, Lq) F(int, Lk) F(int, D) F(int, Nq_pad) F(int, Nk_pad) \
    F(int, Dv)                                /* V's, dO's and dV's head dim (<= D; value_head_dim.py): loads zero-fill past it */ \
    F(int, grid_order)                        /* launch.py BLOCKS_FIRST, HEADS_FIRST, HEADS_BATCH_FIRST (backward_common.cuh) */ \
    F(const int*, cu_q) F(const int*, cu_k)   /* packed batches (above), else null */ \
    F(int, win_hi) F(int, win_width)          /* SB_WINDOW: the band's right edge (dense: Lk - Lq + right; packed: right) */ \
                                              /* and width (seqinfo.cuh band_hi) */ \
    F(float, softcap2) F(float, inv_softcap2) /* SB_SOFTCAP: C = softcap·log2(e) and 1/C (softcap.cuh) */
SB_STRUCT(BackwardParams, SB_BACKWARD_FIELDS)

// backward_wgmma.cu attention_backward, after BackwardParams: the TMA maps of the query-side tiles
#define SB_BACKWARD_MAPS(F0, F) \
    F0(TensorMap, tm_q)                       /* Q̂ bytes [B·Hq·Nq_pad][DP] as (column, row, column block), box DP or 128 x 64 x blocks */ \
    F(TensorMap, tm_qt)                       /* Q̂ᵀ bytes [B·Hq·DP][Nq_pad], box 64 x DP (or a pass's rows) */ \
    F(TensorMap, tm_dot)                      /* dÔᵀ, as tm_qt */ \
    F(TensorMap, tm_do)                       /* dO 16-bit [B][Hq][Lq][Dv] (its strides), box 64 x 64 x 1 x 1, zero past Lq, Dv */ \
    F(TensorMap, tm_dq)                       /* dq_acc f32 [rows][SB_DQ_PITCH], box SB_TMA_DQ_COLS x 64, for reductions */
SB_PARAM_LIST(BackwardMaps, SB_BACKWARD_MAPS)

// One tensor of quantize.cu quantize_tensors (its comment says what each field does).
#define SB_QUANTIZE_JOB_FIELDS(F0, F) \
    F0(const u16*, x)                         /* 16-bit input, strides sb, sh, sn (elements), unit stride along d */ \
    F(const double*, mean_sum) F(float*, mean_out) F(float*, block_mean_out) \
    F(i8*, rows_out) F(i8*, t_out) F(float*, scale_out) F(float*, t_scale_out) \
    F(i64, sb) F(i64, sh) F(i64, sn) \
    F(int, H) F(int, N) F(int, N_pad) F(int, flags) \
    F(int, D)                                 /* x's columns: Q·K's head dim, or V's and dO's (value_head_dim.py) */ \
    F(float, prescale) \
    F(int, ctas)                              /* CTAs of this job: two 64-token blocks each; 0 for an absent tensor */ \
    F(const int*, cu)                         /* packed batches (SB_VARLEN): [B+1] first tokens, else null */ \
    F(int, seq_pad)                           /* packed: a sequence's rows are a multiple of this (seqinfo.cuh varlen_row0) */ \
    F(int, seq_rows)                          /* packed: rows a sequence's CTAs cover (the longest's, padded) */
SB_STRUCT(QuantizeJob, SB_QUANTIZE_JOB_FIELDS)

// quantize.cu quantize_tensors: jobs a, b, c run on consecutive CTAs.
#define SB_QUANTIZE_FIELDS(F0, F) \
    F0(QuantizeJob, a) F(QuantizeJob, b) F(QuantizeJob, c) \
    F(int, D_pad) \
    F(int, sum_parts)                         /* token_sum's parts behind the job with mean_sum, or a head's CTAs (FUSED_SUM) */ \
    F(double*, sum_part) F(int*, arrive)      /* quantize_tensors_fused: its K job's token sums and arrivals */
SB_STRUCT(QuantizeParams, SB_QUANTIZE_FIELDS)

// quantize.cu zero_counts
#define SB_ZERO_COUNTS_FIELDS(F0, F) \
    F0(int*, counts) F(int, n)
SB_STRUCT(ZeroCountsParams, SB_ZERO_COUNTS_FIELDS)

// quantize.cu token_sum
#define SB_TOKEN_SUM_FIELDS(F0, F) \
    F0(const u16*, x) F(i64, sb) F(i64, sh) F(i64, sn) \
    F(int, H) F(int, N) F(int, D) F(int, D_pad) \
    F(int, span)                              /* tokens per part */ \
    F(double*, sum_out)                       /* [B][H][parts][D_pad] */ \
    F(const int*, cu)                         /* packed batches: [B+1] first tokens (N the longest), else null */
SB_STRUCT(TokenSumParams, SB_TOKEN_SUM_FIELDS)

// backward_rows.cu row_stats
#define SB_ROW_STATS_FIELDS(F0, F) \
    F0(const u16*, dout) F(i64, db) F(i64, dh) F(i64, dn) \
    F(const u16*, out) F(i64, ob) F(i64, oh) F(i64, on) \
    F(const float*, lse2) F(const float*, q_scale) F(const float*, qt_scale) \
    F(int, Hq) F(int, Lq) F(int, D) F(int, Nq_pad) \
    F(int, Dv)                                /* dO's and O's columns (V's head dim, <= D) */ \
    F(float4*, stats)                         /* [B][Hq][Nq_pad] (LSE2, s_Q, δ, s_Qᵀ), or for soft-capped kernels */ \
                                              /* (LSE2 + r, s_Q, δ, r) (params.cuh BackwardParams) */ \
    F(int, softcap)                           /* 1: the soft-capped kernels' stats */ \
    F(const u16*, q) F(i64, qb) F(i64, qh) F(i64, qn) F(int, Hkv) F(float, q_prescale) \
    F(const float*, k_mean)                   /* soft-capped: [B][Hkv][D] μ_K for r (row_dot.cuh), or null: r = 0 */ \
    F(float*, dq_acc) F(int, dq_row)          /* zeroed here for the main kernel's dQ: [B][Hq][Nq_pad][dq_row] */ \
    F(int*, dq_lock)                          /* [B][Hq][Nq_pad / 64], zeroed here; null unless deterministic */ \
    F(const int*, cu_q) F(const int*, cu_k)   /* packed batches (above), else null */
SB_STRUCT(RowStatsParams, SB_ROW_STATS_FIELDS)

// backward_rows.cu dq_convert
#define SB_DQ_CONVERT_FIELDS(F0, F) \
    F0(const float*, dq_acc) F(int, Hq) F(int, Lq) F(int, D) F(int, dq_row) F(int, Nq_pad) \
    F(float, scale)                           /* the softmax scale c */ \
    F(u16*, dq) F(i64, qb) F(i64, qh) F(i64, qn) \
    F(const int*, cu_q) F(const int*, cu_k)   /* packed batches (above), else null */
SB_STRUCT(DqConvertParams, SB_DQ_CONVERT_FIELDS)

// backward_rows.cu pack_rows
#define SB_PACK_ROWS_FIELDS(F0, F) \
    F0(const u16*, x) F(i64, sb) F(i64, sh) F(i64, sn) F(int, H) F(int, L) F(int, D) \
    F(u16*, y)                                /* [B][H][L][D] */
SB_STRUCT(PackRowsParams, SB_PACK_ROWS_FIELDS)

// lse.cu natural_lse
#define SB_NATURAL_LSE_FIELDS(F0, F) \
    F0(const u16*, q) F(i64, sb) F(i64, sh) F(i64, sn) \
    F(int, Hq) F(int, Hkv) F(int, Lq) F(int, D) \
    F(float, softmax_scale) \
    F(const float*, k_mean)                   /* [B][Hkv][D] μ_K, or null */ \
    F(float*, lse2) F(float*, lse)            /* [B][Hq][Lq]: lse2 read (and with sinks rewritten), lse written */ \
    F(const float*, sinks)                    /* [Hq] float32 sink logits joined here (sinks.py), or null */ \
    F(u16*, out) F(i64, ob) F(i64, oh) F(i64, on) F(int, Dv)  /* with sinks: O, rescaled in place */ \
    F(const int*, cu_q) F(const int*, cu_k)   /* packed batches (above), else null */
SB_STRUCT(NaturalLseParams, SB_NATURAL_LSE_FIELDS)

// lse.cu softcap_row_bias
#define SB_ROW_BIAS_FIELDS(F0, F) \
    F0(const u16*, q) F(i64, sb) F(i64, sh) F(i64, sn) \
    F(int, Hq) F(int, Hkv) F(int, Lq) F(int, D) F(int, Nq_pad) \
    F(float, q_prescale) \
    F(const float*, k_mean)                   /* [B][Hkv][D] μ_K */ \
    F(float*, row_bias)                       /* [B][Hq][Nq_pad]: each row's share, 0 on padded rows */ \
    F(const int*, cu_q) F(const int*, cu_k)   /* packed batches (above), else null */
SB_STRUCT(RowBiasParams, SB_ROW_BIAS_FIELDS)

// smooth_q_bias.cu smooth_q_bias
#define SB_SMOOTH_Q_BIAS_FIELDS(F0, F) \
    F0(const u16*, k) F(i64, sb) F(i64, sh) F(i64, sn) \
    F(int, Hq) F(int, Hkv) F(int, Lk) F(int, D) F(int, D_pad) F(int, Nq_pad) F(int, Nk_pad) \
    F(const float*, q_mean) F(const float*, k_mean) F(float*, bias)
SB_STRUCT(SmoothQBiasParams, SB_SMOOTH_Q_BIAS_FIELDS)
