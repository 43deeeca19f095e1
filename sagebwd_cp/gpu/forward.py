"""The forward on the GPU: quantize K, V (and Q for Q-smoothing; otherwise the attention kernel
quantizes its own Q rows) into the layouts the products read (quantize.py), then attend.

The functions record launches into a ``PlanBuilder`` (``plan.py``), with workspace sub-buffers and
outputs as symbolic pointers; ``forward_plan`` assembles them into the plan a call replays.
"""
from __future__ import annotations

from .. import numerics
from ..arrays import ArrayDesc
from ..problem import AttentionProblem
from . import params, specs
from .device import device_arch, sm_count
from .launch import attention_grid, tensor_map
from .plan import KERNEL_LAYOUT, LaunchPlan, PlanBuilder
from .quantize import Quantized, quantize_inputs
from .tensor_map import DTYPE_UINT8, TensorMapLayout


def varlen_inputs(prob: AttentionProblem) -> list:
    """A packed batch's offsets, per-call inputs of its plans after the arrays."""
    return [("cu_seqlens_q", prob.cu_q), ("cu_seqlens_k", prob.cu_k)] if prob.varlen else []


def _key_tile_maps(prob: AttentionProblem, qz: Quantized, ws: specs.WsForwardTiles) -> list:
    """The tensor maps forward_ws.cu loads its key tiles with (ForwardMaps): K̂ (key_tile rows of Dp
    bytes) and V̂ᵀ (Dp rows of key_tile bytes), in the boxes and swizzles of ``ws.key_maps``."""
    dp, nk = prob.padded_head_dim, qz.nk_pad
    slices = (1 if prob.varlen else prob.batch) * prob.heads_kv
    k_box, vt_box = ws.key_maps(dp)
    rows = TensorMapLayout(DTYPE_UINT8, (dp, slices * nk), (dp,), k_box.box, k_box.swizzle)
    cols = TensorMapLayout(DTYPE_UINT8, (nk, slices * dp), (nk,), vt_box.box, vt_box.swizzle)
    return params.args("ForwardMaps", tm_k=tensor_map(rows, qz.k8), tm_vt=tensor_map(cols, qz.vt8))


def attend(plan: PlanBuilder, prob: AttentionProblem, qz: Quantized, out, lse2) -> None:
    dp, dev = prob.padded_head_dim, prob.q.device_id
    arch = device_arch(dev)
    ws = specs.forward_ws_tiles(dp, arch, prob.options, prob.varlen, prob.len_k, prob.value_dim)
    ob, oh, on = prob.bhnd_strides(out)
    qb, qh, qn = prob.bhnd_strides(prob.q)
    args = params.args("ForwardParams", q8=qz.q8, q_scale=qz.q_scale, k8=qz.k8, k_scale=qz.k_scale,
                       vt8=qz.vt8, v_scale=qz.v_scale, bias=qz.bias, row_bias=qz.row_bias, out=out, lse2=lse2, q=prob.q,
                       ob=ob, oh=oh, on=on, q_sb=qb, q_sh=qh, q_sn=qn, Hq=prob.heads_q, Hkv=prob.heads_kv,
                       D=prob.head_dim, Dv=prob.value_dim, Nq_pad=qz.nq_pad, Nk_pad=qz.nk_pad,
                       q_prescale=numerics.qk_prescale(prob.softmax_scale), **prob.kernel_band(), **prob.kernel_softcap(),
                       **prob.kernel_lengths())
    if ws is not None:
        # A 1-D grid over the work tiles (kernels/forward_ws.cu's schedule), or a CTA per SM for each.
        q_blocks = -(-prob.len_q // ws.cta_q)
        work = q_blocks * prob.heads_q * prob.batch
        grid = (min(work, ws.ctas_per_sm * sm_count(dev)) if ws.persistent else work, 1, 1)
        spec = specs.forward_ws_spec(dp, prob.dtype, prob.options, ws, prob.varlen)
        args += _key_tile_maps(prob, qz, ws)
        args += params.args("ForwardSchedule", batch=prob.batch, q_blocks=q_blocks)
    else:
        tiles = specs.forward_tiles(dp, arch, specs.narrow_value_dim(prob.options, prob.value_dim), prob.options)
        spec = specs.forward_spec(dp, prob.dtype, prob.options, tiles, prob.varlen)
        grid = attention_grid(prob.len_q, tiles.cta_q, prob.heads_q, prob.batch,
                              specs.forward_grid_order(prob.options.banded), "q")  # kernels/forward.cu SB_GRID_ORDER
    # Without Q-smoothing the kernel quantizes Q itself (kernels/forward_parts.cuh).
    threads = ws.threads if ws is not None else tiles.threads
    plan.launch(spec, "attention_forward", grid, (threads, 1, 1), args, shared=KERNEL_LAYOUT)


def natural_lse(plan: PlanBuilder, prob: AttentionProblem, qz: Quantized, lse2, lse, out=None, sinks=None) -> None:
    """lse: float32 natural-log LSE (prob.lse_shape()), K-smoothing's shift added back; with ``sinks`` (float32
    (Hq,)) their join too: ``out`` and ``lse2`` rewritten in place, lse the joined LSE (kernels/lse.cu)."""
    sb, sh, sn = prob.bhnd_strides(prob.q)
    ob, oh, on = prob.bhnd_strides(out) if sinks is not None else (0, 0, 0)
    lengths = prob.kernel_lengths()
    del lengths["Lk"]
    plan.launch(specs.lse_spec(prob.dtype, prob.varlen), "natural_lse",
                (-(-prob.len_q * (prob.padded_head_dim // 8) // specs.LSE_THREADS), prob.heads_q, prob.batch),
                (specs.LSE_THREADS, 1, 1),  # D_pad / 8 lanes a row (kernels/row_dot.cuh)
                params.args("NaturalLseParams", q=prob.q, sb=sb, sh=sh, sn=sn, Hq=prob.heads_q, Hkv=prob.heads_kv,
                               D=prob.head_dim, softmax_scale=prob.softmax_scale, k_mean=qz.k_mean,
                               lse2=lse2, lse=lse, sinks=sinks, out=out if sinks is not None else None, ob=ob, oh=oh,
                               on=on, Dv=prob.value_dim, **lengths))


FORWARD_INPUTS = ("q", "k", "v", "out")  # then cu_seqlens_q, cu_seqlens_k for packed batches


def forward_plan(prob: AttentionProblem, out: ArrayDesc | None, training: bool, return_lse: bool,
                 given_mean: ArrayDesc | None = None, sinks: ArrayDesc | None = None) -> LaunchPlan:
    """The plan of one forward.  Inputs: q, k, v (and out when the caller passes it, then μ_K when
    given: K is quantized with it, its token sums not taken, then the sinks' float32 logits when given: joined
    where the LSE is formed, return_lse); outputs, in this order, those of
    "out", "lse2" (training), "k_mean" (training with K-smoothing and no μ_K given: μ_K, which the
    backward reuses) and "lse" (return_lse) that are allocated."""
    assert sinks is None or return_lse, "the sinks join where the returned LSE is formed"
    inputs = [("q", prob.q), ("k", prob.k), ("v", prob.v)] + ([("out", out)] if out is not None else [])
    inputs += [("k_mean", given_mean)] if given_mean is not None else []
    inputs += [("sinks", sinks)] if sinks is not None else []
    plan = PlanBuilder(prob.q.device_id, prob.q.framework, inputs + varlen_inputs(prob))
    if out is None:
        out = plan.output("out", prob.output_shape(), prob.dtype)
    lse_shape = prob.lse_shape()
    lse2 = k_mean = None
    if training:
        lse2 = plan.output("lse2", lse_shape, "float32")
        if prob.smooth_k and given_mean is None:
            k_mean = plan.output("k_mean", numerics.k_mean_shape(prob.batch, prob.heads_kv, prob.head_dim),
                                 "float32")
    elif return_lse:
        lse2 = plan.workspace("lse2", lse_shape, "float32")
    if given_mean is not None:
        k_mean = given_mean
    qz = quantize_inputs(plan, prob, False, quantize_q=prob.smooth_q, k_mean=k_mean, k_mean_given=given_mean is not None)
    attend(plan, prob, qz, out, lse2)
    if return_lse:
        natural_lse(plan, prob, qz, lse2, plan.output("lse", lse_shape, "float32"), out, sinks)
    return plan.build(problem=prob)
