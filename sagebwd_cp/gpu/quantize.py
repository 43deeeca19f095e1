"""Host side of ``kernels/quantize.cu``: the pre-pass that quantizes Q, K, V (forward) or Q, K, dO
(backward) into every layout the attention kernels read, with their scales and K-smoothing's μ_K
(numerics.py says what is computed).  ``quantize_inputs`` records its launches into a
``PlanBuilder`` (plan.py), with workspace sub-buffers as symbolic pointers.
"""
from __future__ import annotations

import dataclasses

from .. import numerics
from ..arrays import ArrayDesc
from ..problem import AttentionProblem
from . import params, specs
from .device import sm_count
from .plan import PlanBuilder

# QuantizeJob.flags (kernels/quantize.cu QUANT_PERMUTE_T, QUANT_PER_TOKEN, QUANT_MEAN_GIVEN, QUANT_FUSED_SUM)
PERMUTE_T, PER_TOKEN, MEAN_GIVEN, FUSED_SUM = 1, 2, 4, 8
# token_sum's grid: at most SUM_CTAS CTAs in all where the (batch, head)s allow (three 512-thread CTAs an SM,
# quantize.cu's launch bounds, on the 132 SMs of an H100/H200: one wave), each over at least SUM_MIN_SPAN
# tokens, and at most SUM_MAX_PARTS parts a (batch, head), which every K CTA adds up.
SUM_CTAS, SUM_MIN_SPAN, SUM_MAX_PARTS = 396, 256, 16


def token_sum_parts(batch: int, heads: int, n: int) -> tuple:
    """(parts, span): token_sum's CTAs per (batch, head) and the tokens each sums."""
    parts = max(1, min(SUM_MAX_PARTS, SUM_CTAS // (batch * heads), n // SUM_MIN_SPAN))
    span = -(-n // parts)
    return -(-n // span), span


# The padded head dims whose forward pre-pass forms μ_K in the K job (fused_token_sums): measured faster at 128 and
# 256 (H200: the pre-pass's kernels 15-23% shorter), slower at 64 (docs/PERFORMANCE.md).
FUSED_SUM_HEAD_DIMS = (128, 256)


def fused_token_sums(prob: AttentionProblem, other_jobs: bool, nk: int, device_id: int) -> bool:
    """Whether the forward's K job forms μ_K from its own loads (kernels/quantize.cu QUANT_FUSED_SUM, in the entry
    quantize_tensors_fused beside V's job: K read once, no token_sum launch): a launch of K and V alone (no
    ``other_jobs``: Q or dO), dense batches, FUSED_SUM_HEAD_DIMS, where a head's CTAs (one per 128 rows) can all be
    resident at once, so that those waiting for the last cannot keep it from starting: at most one for every two
    SMs (one an SM would do; the margin leaves room for kernels of other streams, NCCL's, or an MPS share that hold
    SMs meanwhile). SAGEBWD_FUSED_TOKEN_SUMS=0 turns it off, =1 on at any head dim."""
    asked = specs.env_choice("SAGEBWD_FUSED_TOKEN_SUMS", (0, 1))
    if asked == 0 or other_jobs or prob.varlen or (asked is None and prob.padded_head_dim not in FUSED_SUM_HEAD_DIMS):
        return False
    return _quantize_ctas(nk // numerics.BLOCK_KV) <= sm_count(device_id) // 2


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def row_kernel_rows(prob: AttentionProblem) -> int:
    """The query rows a head that the per-row kernels' grids cover (row_stats, softcap_row_bias): the padded length
    (Nq_pad), or a packed batch's longest sequence padded (each sequence's CTAs then stop at its own padded end)."""
    return _round_up(prob.len_q, specs.TOKEN_PAD)


def padded_rows(prob: AttentionProblem, side: str, pad: int) -> int:
    """Token rows a head takes in the INT8 buffers of ``side`` ("q" or "k"), a multiple of ``pad``:
    the padded length, or for packed batches room for every sequence from its own row
    (kernels/seqinfo.cuh varlen_row0: round_up(total, pad) + batch·pad)."""
    length, total = (prob.len_q, prob.total_q) if side == "q" else (prob.len_k, prob.total_k)
    return _round_up(total, pad) + prob.batch * pad if prob.varlen else _round_up(length, pad)


@dataclasses.dataclass
class Quantized:
    """Q̂, K̂, V̂ (and dÔ for the backward) in every layout the kernels read, with their scales (see
    numerics.py).  Buffers while a plan is recorded; ArrayDescs from ``pieces.quantize_inputs_gpu``."""

    q8: ArrayDesc | None  # [B][Hq][Nq_pad][Dp]; None where the forward kernel quantizes Q (and q_scale)
    q8t: ArrayDesc | None  # [B][Hq][Dp][Nq_pad], query order permuted for register-fed products (backward)
    qt_scale: ArrayDesc | None  # [B][Hq][Nq_pad/64]: q8t's scale per 64-query block (backward)
    q_scale: ArrayDesc | None  # [B][Hq][Nq_pad], per token
    q_mean: ArrayDesc | None  # [B][Hq][Nq_pad/64][Dp] (Q-smoothing)
    k8: ArrayDesc  # [B][Hkv][Nk_pad][Dp]
    k8t: ArrayDesc | None  # [B][Hkv][Dp][Nk_pad] (backward)
    kt_scale: ArrayDesc | None  # [B][Hkv][Nk_pad/64]: k8t's scale per 64-key block (backward)
    k_scale: ArrayDesc  # [B][Hkv][Nk_pad], per token
    k_mean: ArrayDesc | None  # [B][Hkv][D] μ_K (K-smoothing)
    vt8: ArrayDesc | None  # [B][Hkv][Dp][Nk_pad], key order permuted (numerics.KEY_PERMUTATION_16) (forward)
    v_scale: ArrayDesc | None  # [B][Hkv][Nk_pad/64]
    bias: ArrayDesc | None  # [B][Hq][Nq_pad/64][Nk_pad] (Q-smoothing add-back)
    row_bias: ArrayDesc | None  # [B][Hq][Nq_pad]: soft-capping with K-smoothing, each row's share of its scores
    # (forward; the backward's row_stats forms its own)
    nq_pad: int  # token rows a head (padded_rows)
    nk_pad: int
    dot8: ArrayDesc | None = None  # [B][Hq][Dp][Nq_pad], query order permuted (backward)
    do_scale: ArrayDesc | None = None  # [B][Hq][Nq_pad/64]


def _quantize_ctas(blocks: int) -> int:
    """CTAs of quantize_tensors for ``blocks`` 64-token blocks: two a CTA (kernels/quantize.cu quantize_blocks;
    N_pad is a multiple of 128, so a tensor has an even number)."""
    assert blocks % 2 == 0, blocks
    return blocks // 2


def _quantize_job(prob: AttentionProblem, src, side, heads, npad, prescale, flags, scale, rows=None, t=None,
                  t_scale=None, mean_sum=None, mean_out=None, block_mean=None, pad=specs.TOKEN_PAD, value=False):
    """One tensor of a quantize_tensors launch (params.cuh QuantizeJob) on the query (``side`` "q") or
    key side; with ``t_scale`` the transposed copy ``t`` is coded per 64-token block, its scales there.
    ``value``: V or dO, of V's head dim (its columns past it come out zero).
    Packed batches: each sequence's CTAs cover the longest one's rows padded to ``pad``."""
    sb, sh, sn = prob.bhnd_strides(src)
    n, cu = (prob.len_q, prob.cu_q) if side == "q" else (prob.len_k, prob.cu_k)
    seq_rows = _round_up(n, pad) if prob.varlen else 0
    return params.struct("QuantizeJob", x=src, mean_sum=mean_sum, mean_out=mean_out, block_mean_out=block_mean,
                         rows_out=rows, t_out=t, scale_out=scale, t_scale_out=t_scale, sb=sb, sh=sh, sn=sn, H=heads,
                         N=n, N_pad=npad, flags=flags, D=prob.value_dim if value else prob.head_dim, prescale=prescale,
                         ctas=_quantize_ctas((seq_rows or npad) // numerics.BLOCK_Q * heads), cu=cu,
                         seq_pad=pad if prob.varlen else 0, seq_rows=seq_rows)


def _launch_quantize(plan: PlanBuilder, prob: AttentionProblem, jobs, sum_parts: int = 0, sum_part=None,
                     arrive=None) -> None:
    """Up to three tensors in one launch (CTAs of job a, then b, then c); ``sum_parts``: token_sum's
    parts behind the job with token sums, or the CTAs of a head of the job that forms them (FUSED_SUM, with its
    sums' and arrivals' buffers ``sum_part``, ``arrive``: the entry quantize_tensors_fused)."""
    ctas = sum(params.field(job, "QuantizeJob", "ctas") for job in jobs)
    jobs = list(jobs) + [params.zeros("QuantizeJob")] * (3 - len(jobs))
    dp = prob.padded_head_dim
    assert dp in specs.PADDED_HEAD_DIMS, dp
    # D_pad threads a CTA, each with specs.QUANT_CHUNKS 16-byte chunks of dynamic shared memory.
    plan.launch(specs.quantize_spec(dp, prob.dtype, prob.varlen),
                "quantize_tensors" if arrive is None else "quantize_tensors_fused",
                (ctas, 1, prob.batch), (dp, 1, 1),
                params.args("QuantizeParams", a=jobs[0], b=jobs[1], c=jobs[2], D_pad=dp,
                               sum_parts=sum_parts, sum_part=sum_part, arrive=arrive),
                shared=dp * specs.QUANT_CHUNKS * 16)


def quantize_inputs(plan: PlanBuilder, prob: AttentionProblem, backward: bool, do=None,
                    key_pad: int = specs.TOKEN_PAD, quantize_q: bool = True, k_mean=None,
                    k_mean_given: bool = False) -> Quantized:
    """The forward reads Q̂, K̂ row-major and V̂ᵀ; the backward re-derives the same Q̂, K̂ (the
    quantization is deterministic) and also needs their transposes, but not V̂.  With ``do`` (the
    backward), dO is quantized in the same launch (see ``_grad_output_job``).  Key-side buffers
    hold a multiple of ``key_pad`` tokens (the backward's: ``BackwardTiles.key_pad``).  Without
    ``quantize_q``, Q̂ is left to the forward kernel (q8, q_scale None; no Q-smoothing).  With
    K-smoothing, ``k_mean`` ([B][Hkv][D] float32, an Output or an input) is where μ_K goes (default:
    a workspace buffer); with ``k_mean_given`` it already holds a saved forward's μ_K, so K's token
    sums are not taken again and K̂ comes out exactly as that forward's."""
    assert quantize_q or not (backward or prob.smooth_q), "the pre-pass quantizes Q for the backward and Q-smoothing"
    B, Hq, Hk, Lq, Lk, D = prob.batch, prob.heads_q, prob.heads_kv, prob.len_q, prob.len_k, prob.head_dim
    dp = prob.padded_head_dim
    nq, nk = padded_rows(prob, "q", specs.TOKEN_PAD), padded_rows(prob, "k", key_pad)
    S = 1 if prob.varlen else B  # [S][H][N_pad] INT8 buffers: a packed batch's sequences share a head's rows
    spec = specs.quantize_spec(dp, prob.dtype, prob.varlen)

    assert prob.smooth_k or k_mean is None, "μ_K is K-smoothing's"
    assert k_mean is not None or not k_mean_given
    k_sum, parts, arrive, fused = None, 0, None, False
    if prob.smooth_k and not k_mean_given:
        if k_mean is None:
            k_mean = plan.workspace("k_mean", (B, Hk, D), "float32")
        fused = fused_token_sums(prob, backward or quantize_q, nk, plan.device_id)
        # The parts: the K job's CTAs of a head (fused), or token_sum's; each stores its own sums.
        parts, span = (_quantize_ctas(nk // numerics.BLOCK_KV), 0) if fused else token_sum_parts(B, Hk, Lk)
        k_sum = plan.workspace("k_sum", (B, Hk, parts, dp), "float64")
        if fused:  # the K job sums its own loads; its arrival counts start at zero
            arrive = plan.workspace("k_arrive", (B, Hk), "int32")
            plan.launch(spec, "zero_counts", (1, 1, 1), (specs.SUM_THREADS, 1, 1),
                        params.args("ZeroCountsParams", counts=arrive, n=B * Hk))
        else:
            sb, sh, sn = prob.bhnd_strides(prob.k)
            plan.launch(spec, "token_sum", (parts, Hk, B), (specs.SUM_THREADS, 1, 1),
                        params.args("TokenSumParams", x=prob.k, sb=sb, sh=sh, sn=sn, H=Hk, N=Lk, D=D, D_pad=dp,
                                       span=span, sum_out=k_sum, cu=prob.cu_k))

    # The backward's transposed copies are coded per 64-token block (numerics.py), each with its scale.
    q8 = q8t = q_scale = qt_scale = q_mean = kt_scale = None
    jobs = []
    if quantize_q:
        q8 = plan.workspace("q8", (S, Hq, nq, dp), "int8")
        if backward:
            q8t = plan.workspace("q8t", (S, Hq, dp, nq), "int8")
            qt_scale = plan.workspace("qt_scale", (S, Hq, nq // numerics.BLOCK_Q), "float32")
        q_scale = plan.workspace("q_scale", (S, Hq, nq), "float32")
        q_mean = plan.workspace("q_mean", (B, Hq, nq // numerics.BLOCK_Q, dp), "float32") if prob.smooth_q else None
        jobs.append(_quantize_job(prob, prob.q, "q", Hq, nq, numerics.qk_prescale(prob.softmax_scale),
                                  PERMUTE_T | PER_TOKEN, q_scale, rows=q8, t=q8t, t_scale=qt_scale, block_mean=q_mean))

    k8 = plan.workspace("k8", (S, Hk, nk, dp), "int8")
    k8t = None
    if backward:
        k8t = plan.workspace("k8t", (S, Hk, dp, nk), "int8")
        kt_scale = plan.workspace("kt_scale", (S, Hk, nk // numerics.BLOCK_KV), "float32")
    k_scale = plan.workspace("k_scale", (S, Hk, nk), "float32")
    # Soft-capped with K-smoothing, dQ's K̂ᵀ is coded from K itself (numerics.py), in a launch of its own below.
    capped_smooth = bool(prob.options.softcap) and prob.smooth_k
    jobs.append(_quantize_job(prob, prob.k, "k", Hk, nk, 1.0,
                              PER_TOKEN | (MEAN_GIVEN if k_mean_given else 0) | (FUSED_SUM if fused else 0), k_scale,
                              rows=k8, t=None if capped_smooth else k8t, t_scale=None if capped_smooth else kt_scale,
                              mean_sum=None if fused else k_sum, mean_out=k_mean, pad=key_pad))

    vt8 = v_scale = None
    if not backward:
        vt8 = plan.workspace("vt8", (S, Hk, dp, nk), "int8")
        v_scale = plan.workspace("v_scale", (S, Hk, nk // numerics.BLOCK_KV), "float32")
        jobs.append(_quantize_job(prob, prob.v, "k", Hk, nk, 1.0, PERMUTE_T, v_scale, t=vt8, pad=key_pad, value=True))
    dot8 = do_scale = None
    if do is not None:
        dot8, do_scale, job = _grad_output_job(plan, prob, do)
        jobs.append(job)
    _launch_quantize(plan, prob, jobs, parts, k_sum if fused else None, arrive)
    row_bias = None
    if capped_smooth:
        if backward:  # ψ per 64-key block, the block's scale in kt_scale; the backward's r comes from row_stats
            _launch_quantize(plan, prob, [_quantize_job(prob, prob.k, "k", Hk, nk, 1.0, 0, kt_scale, t=k8t, pad=key_pad)])
        else:
            row_bias = softcap_row_bias(plan, prob, nq, k_mean)

    bias = None
    if prob.smooth_q:
        bias = plan.workspace("bias", (B, Hq, nq // numerics.BLOCK_Q, nk), "float32")
        sb, sh, sn = prob.bhnd_strides(prob.k)
        plan.launch(specs.bias_spec(prob.dtype), "smooth_q_bias",
                    (-(-nk // specs.BIAS_THREADS), -(-(nq // numerics.BLOCK_Q) // specs.BIAS_QBLOCKS), B * Hq),
                    (specs.BIAS_THREADS, 1, 1),
                    params.args("SmoothQBiasParams", k=prob.k, sb=sb, sh=sh, sn=sn, Hq=Hq, Hkv=Hk, Lk=Lk, D=D,
                                   D_pad=dp, Nq_pad=nq, Nk_pad=nk, q_mean=q_mean, k_mean=k_mean, bias=bias))
    return Quantized(q8, q8t, qt_scale, q_scale, q_mean, k8, k8t, kt_scale, k_scale, k_mean, vt8, v_scale, bias,
                     row_bias, nq, nk, dot8, do_scale)


def softcap_row_bias(plan: PlanBuilder, prob: AttentionProblem, nq: int, k_mean):
    """[B][Hq][nq] float32: each query row's share c·log2(e)·q·μ_K of its scores (kernels/lse.cu, numerics.py), which
    the soft-capped kernels add back before tanh."""
    S, Hq = 1 if prob.varlen else prob.batch, prob.heads_q
    row_bias = plan.workspace("row_bias", (S, Hq, nq), "float32")
    rows = row_kernel_rows(prob)
    sb, sh, sn = prob.bhnd_strides(prob.q)
    lengths = prob.kernel_lengths()
    del lengths["Lk"]
    # D_pad / 8 lanes a row (kernels/lse.cu row_shares)
    plan.launch(specs.lse_spec(prob.dtype, prob.varlen), "softcap_row_bias",
                (rows * (prob.padded_head_dim // 8) // specs.LSE_THREADS, Hq, prob.batch), (specs.LSE_THREADS, 1, 1),
                params.args("RowBiasParams", q=prob.q, sb=sb, sh=sh, sn=sn, Hq=Hq, Hkv=prob.heads_kv, D=prob.head_dim,
                               Nq_pad=nq, q_prescale=numerics.qk_prescale(prob.softmax_scale), k_mean=k_mean,
                               row_bias=row_bias, **lengths))
    return row_bias


def _grad_output_job(plan: PlanBuilder, prob: AttentionProblem, do):
    """dÔ for dV = P̂ᵀdÔ: ψ per 64 rows of dO, stored transposed ([B][Hq][Dp][Nq_pad]) in the
    fragment token order of register-fed products, with scales [B][Hq][Nq_pad/64]."""
    S, Hq, dp = 1 if prob.varlen else prob.batch, prob.heads_q, prob.padded_head_dim
    nq = padded_rows(prob, "q", specs.TOKEN_PAD)
    dot8 = plan.workspace("dot8", (S, Hq, dp, nq), "int8")
    scale = plan.workspace("do_scale", (S, Hq, nq // numerics.BLOCK_Q), "float32")
    return dot8, scale, _quantize_job(prob, do, "q", Hq, nq, 1.0, PERMUTE_T, scale, t=dot8, value=True)


def quantize_grad_output(plan: PlanBuilder, prob: AttentionProblem, do):
    """(dÔᵀ, scales) for ``do`` alone, in a launch of its own (the backward quantizes dO in its Q, K launch)."""
    dot8, scale, job = _grad_output_job(plan, prob, do)
    _launch_quantize(plan, prob, [job])
    return dot8, scale
