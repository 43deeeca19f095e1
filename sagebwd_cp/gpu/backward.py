"""The backward on the GPU: re-derive Q̂, K̂ (deterministic, so identical to the forward's) and
quantize dO in one launch, gather (LSE2, δ) per query row, run the key-block-owned kernel, convert dQ.  ``backward_plan``
records these launches into the plan a call replays (plan.py)."""
from __future__ import annotations

from .. import numerics
from ..arrays import ArrayDesc
from ..options import AttentionOptions
from ..problem import AttentionProblem
from . import params, specs
from .device import device_arch, shared_memory_limit, sm_count
from .forward import varlen_inputs
from .launch import BLOCKS_FIRST, HEADS_BATCH_FIRST, HEADS_FIRST, attention_grid, tensor_map
from .plan import KERNEL_LAYOUT, LaunchPlan, PlanBuilder
from .quantize import quantize_inputs, row_kernel_rows
from .tensor_map import DTYPE_FLOAT32, DTYPE_UINT8, DTYPE_UINT16, TensorMapLayout


def _cp_async_ready(desc: ArrayDesc, prob: AttentionProblem) -> bool:
    """cp.async reads 16-byte chunks: the base and every (batch, head, token) stride must keep
    rows 16-byte aligned (the plan key holds each pointer's alignment, so a plan's choice holds)."""
    return desc.ptr % 16 == 0 and all(s % 8 == 0 for s in prob.bhnd_strides(desc))


def _tma_ready(desc: ArrayDesc, prob: AttentionProblem, heads: int, length: int) -> bool:
    """A TMA tensor map also needs positive strides (where the extent is above 1)."""
    extents = (1, heads, prob.total_q) if prob.varlen else (prob.batch, heads, length)
    return _cp_async_ready(desc, prob) and all(s > 0 for s, n in zip(prob.bhnd_strides(desc), extents) if n > 1)


def _aligned_rows(plan: PlanBuilder, name: str, desc: ArrayDesc, prob: AttentionProblem, heads: int, length: int,
                  tma: bool = False):
    """(array, (batch, head, token) strides): the array itself, or a packed [B][H][L][D] copy (a
    packed batch's [total][H][D] as one [1][H][total][D] sequence: its token stride stays the row's), D its columns."""
    if _tma_ready(desc, prob, heads, length) if tma else _cp_async_ready(desc, prob):
        return desc, prob.bhnd_strides(desc)
    d = desc.shape[-1]
    batch = prob.batch
    if prob.varlen:
        batch, length = 1, desc.shape[0]
    packed = plan.workspace(name, (batch, heads, length, d), prob.dtype)
    sb, sh, sn = prob.bhnd_strides(desc)
    threads = specs.ROWS_THREADS
    plan.launch(specs.backward_rows_spec(prob.dtype), "pack_rows", (-(-length * d // threads), heads, batch),
                (threads, 1, 1), params.args("PackRowsParams", x=desc, sb=sb, sh=sh, sn=sn, H=heads, L=length, D=d,
                                            y=packed))
    return packed, (0 if prob.varlen else heads * length * d, length * d, d)


def _column_blocks(dtype: int, item: int, row: int, rows: int, box: specs.TmaBox) -> TensorMapLayout:
    """A map of ``rows`` rows of ``row`` elements (``item`` bytes each) seen as their column blocks of box[0]
    elements: (columns, rows, blocks), so that one box takes a block's rows for box[2] blocks side by side."""
    return TensorMapLayout(dtype, (box.box[0], rows, row // box.box[0]), (item * row, item * box.box[0]), box.box,
                           box.swizzle)


def _query_tile_maps(qz, do_rows, do_strides, dq_acc, prob: AttentionProblem, tiles: specs.BackwardTiles) -> dict:
    """The tensor maps backward_wgmma.cu loads its query-side tiles with (BackwardParams tm_*), in the
    boxes and swizzles of ``tiles.query_maps``: Q̂ (64 rows of Dp bytes, or of its 128-byte column blocks),
    Q̂ᵀ and dÔᵀ (a pass's rows of 64 bytes: of Q·K's and of V's head dim), dO (64 rows x 64 columns of 16 bits, zero past Lq
    and V's head dim); and
    dq_acc's ([rows][dq_row] f32) that dQ's partial tiles add into."""
    B, Hq, Lq, Dv, dp, nq = prob.batch, prob.heads_q, prob.len_q, prob.value_dim, prob.padded_head_dim, qz.nq_pad
    if prob.varlen:  # one [1][Hq][total][D] dO and [1][Hq][...] INT8 buffers (kernels/seqinfo.cuh)
        B, Lq = 1, prob.total_q
    boxes = tiles.query_maps(dp)
    rows = _column_blocks(DTYPE_UINT8, 1, dp, B * Hq * nq, boxes["rows"])
    cols = TensorMapLayout(DTYPE_UINT8, (nq, B * Hq * dp), (nq,), boxes["cols"].box, boxes["cols"].swizzle)
    value_cols = TensorMapLayout(DTYPE_UINT8, (nq, B * Hq * dp), (nq,), boxes["value_cols"].box,
                                 boxes["value_cols"].swizzle)
    # A stride of an extent-1 dimension is never stepped: any legal value stands in for it.
    db, dh, dn = do_strides
    strides, inner = [], Dv * 2
    for n, s in zip((Lq, Hq, B), (dn, dh, db)):
        strides.append(2 * s if n > 1 else -(-inner // 16) * 16)
        inner = strides[-1] * n
    grad = TensorMapLayout(DTYPE_UINT16, (Dv, Lq, Hq, B), tuple(strides), boxes["grad"].box, boxes["grad"].swizzle)
    dq_row = tiles.dq_row(dp)
    if len(boxes["dq"].box) == 3:  # the pair kernels' swizzled column blocks
        acc = _column_blocks(DTYPE_FLOAT32, 4, dq_row, B * Hq * nq, boxes["dq"])
    else:
        acc = TensorMapLayout(DTYPE_FLOAT32, (dq_row, B * Hq * nq), (4 * dq_row,), boxes["dq"].box, boxes["dq"].swizzle)
    return dict(tm_q=tensor_map(rows, qz.q8), tm_qt=tensor_map(cols, qz.q8t), tm_dot=tensor_map(value_cols, qz.dot8),
                tm_do=tensor_map(grad, do_rows), tm_dq=tensor_map(acc, dq_acc))


# A causal backward grid of at most this many CTAs an SM may start heads and batch first (backward_grid).
FEW_WAVES = 4


def backward_grid(prob: AttentionProblem, block_keys: int, deterministic: bool, wgmma: bool, sms: int,
                  passes: int = 1, batch_beside_heads: bool = True) -> tuple[tuple, int]:
    """The backward kernel's grid and its order (launch.attention_grid; BackwardParams.grid_order).
    Causal key blocks differ in work (the first sees every query), and the kernels start each (head,
    batch entry)'s blocks heaviest first. Where such a chain is shorter than a wave and the grid is a
    few waves, the natural order starts the last chains' heaviest blocks last and they run on alone, so
    the wgmma kernel goes heads first: every head's heaviest block before any head's next one. The batch
    goes beside the heads, HEADS_BATCH_FIRST, where one batch entry's CTAs fill at most half the SMs (a
    GQA 4:1 model's 2K backward, 256 CTAs on 132 SMs, list schedule: 61% busy blocks first, 63% heads
    first, 97% heads and batch first); else in z, HEADS_FIRST, so that the CTAs running together share
    one batch entry's query-side tiles in L2 (at 8K two entries' tiles overflow it: -8%). Grids of many
    waves whose chains are shorter than a wave go heads first too, HEADS_FIRST, deterministic or not (H200,
    causal, against blocks first: MHA d=128 2K-8K and GQA 4:1 8K 1.03-1.12x, d=256 4K 1.07x; deterministic,
    against heads and batch first, MHA 2K 1.22x at d=128 and 1.13x at d=64, 8K even; 16K even). Chains of a
    wave or more (32K) keep a head's CTAs together, BLOCKS_FIRST, for L2 (heads first cost the d=128 32K model
    shape 9%), or when deterministic go heads and batch first (their turns pass along CTAs that started
    together). The mma.sync kernel (64-key CTAs, several an SM) does
    so only when deterministic, fixed at compile time (kernels/backward.cu): a grid-order argument
    costs it a register it does not have at d=64 (specs.backward_fixed_grid_order). ``passes`` CTAs a key
    block (specs.BackwardTiles.passes) lie next to one another on the blocks' axis, so that they read the
    same tiles at about the same time (L2). ``batch_beside_heads`` False keeps HEADS_FIRST where HEADS_BATCH_FIRST
    would be taken: the pair kernel (specs.BackwardTiles.pair) measured 0.81-0.86x under it at 8x16x4x1024, 192/128
    (H200), where the two-pass kernel measured 1.03-1.07x (tools/experiments/grid_orders.py)."""
    blocks = -(-prob.len_k // block_keys)
    short = blocks * passes < sms  # a (head, batch entry)'s chain of key blocks is shorter than a wave
    few = blocks * passes * prob.heads_kv * prob.batch <= FEW_WAVES * sms and short
    banded = prob.options.banded
    fixed = specs.backward_fixed_grid_order(wgmma, banded, deterministic)
    if fixed is not None:
        order = fixed
    elif not banded:
        order = BLOCKS_FIRST
    elif few:
        batch = deterministic or (batch_beside_heads and 2 * blocks * prob.heads_kv <= sms)
        order = HEADS_BATCH_FIRST if batch else HEADS_FIRST
    elif short:
        order = HEADS_FIRST
    else:
        order = HEADS_BATCH_FIRST if deterministic else BLOCKS_FIRST
    return attention_grid(prob.len_k, block_keys, prob.heads_kv, prob.batch, order, "k", passes), order


BACKWARD_INPUTS = ("q", "k", "v", "out", "lse2", "do")  # then k_mean if given, then a packed batch's offsets


def backward_plan(prob: AttentionProblem, out: ArrayDesc, lse2: ArrayDesc, do: ArrayDesc, options: AttentionOptions,
                  k_mean: ArrayDesc | None = None, keep_stats: bool = False) -> LaunchPlan:
    """The plan of one backward with ``options`` (its granularity and order; the rest are ``prob``'s):
    inputs BACKWARD_INPUTS (then "k_mean", the forward's μ_K, when
    given: K's token sums are then not taken again), outputs dq, dk, dv (new arrays in q's layout
    and dtype); with ``keep_stats`` (dense batches) first "stats", the row statistics [B][Hq][Nq_pad][4] whose third
    column is δ = rowsum(dO ∘ O) (attention sinks' gradient reads it: sinks.py)."""
    assert not (keep_stats and prob.varlen), "a packed batch's statistics rows are its sequences' padded rows"
    inputs = list(zip(BACKWARD_INPUTS, (prob.q, prob.k, prob.v, out, lse2, do)))
    plan = PlanBuilder(prob.q.device_id, prob.q.framework,
                       inputs + ([("k_mean", k_mean)] if k_mean else []) + varlen_inputs(prob))
    B, Hq, Hk, Lq, Lk, D = prob.batch, prob.heads_q, prob.heads_kv, prob.len_q, prob.len_k, prob.head_dim
    dp = prob.padded_head_dim
    deterministic = options.deterministic
    rows = specs.backward_rows_spec(prob.dtype, prob.varlen)
    S = 1 if prob.varlen else B  # [S][Hq][Nq_pad] rows (quantize.py)
    lengths = prob.kernel_lengths()
    q_lengths = {n: v for n, v in lengths.items() if n != "Lk"}

    dev = prob.q.device_id
    arch = device_arch(dev)
    wanted = specs.narrow_backward_tiles(specs.backward_tiles(dp, arch, deterministic), dp, D, prob.value_dim, options)
    tiles, spec = specs.backward_kernel(dp, prob.dtype, options, wanted, arch, shared_memory_limit(dev), prob.varlen)
    qz = quantize_inputs(plan, prob, True, do, key_pad=tiles.key_pad, k_mean=k_mean, k_mean_given=k_mean is not None)
    nq, nk = qz.nq_pad, qz.nk_pad

    stats = (plan.output if keep_stats else plan.workspace)("stats", (S, Hq, nq, 4), "float32")  # (LSE2, s_Q, δ, s_Qᵀ)
    # dQ's accumulator and the deterministic turn counters start at zero: row_stats clears them (no memset).
    dq_row = tiles.dq_row(dp)
    dq_acc = plan.workspace("dq_acc", (S, Hq, nq, dq_row), "float32")
    lock = plan.workspace("lock", (S, Hq, nq // numerics.BLOCK_Q), "int32") if deterministic else None
    db, dh, dn = prob.bhnd_strides(do)
    ob, oh, on = prob.bhnd_strides(out)
    sb, sh, sn = prob.bhnd_strides(prob.q)
    # D_pad / 8 lanes a row, specs.ROWS_THREADS threads a CTA (backward_rows.cu row_stats)
    threads = specs.ROWS_THREADS
    plan.launch(rows, "row_stats", (row_kernel_rows(prob) * (dp // 8) // threads, Hq, B), (threads, 1, 1),
                params.args("RowStatsParams", dout=do, db=db, dh=dh, dn=dn, out=out, ob=ob, oh=oh, on=on, lse2=lse2,
                               q_scale=qz.q_scale, qt_scale=qz.qt_scale, Hq=Hq, D=D, Nq_pad=nq, Dv=prob.value_dim,
                               stats=stats,
                               softcap=int(bool(prob.options.softcap)), q=prob.q, qb=sb, qh=sh, qn=sn, Hkv=Hk,
                               q_prescale=numerics.qk_prescale(prob.softmax_scale),
                               k_mean=qz.k_mean if prob.options.softcap else None,
                               dq_acc=dq_acc, dq_row=dq_row, dq_lock=lock, **q_lengths))

    v_rows, (vb, vh, vn) = _aligned_rows(plan, "v_rows", prob.v, prob, Hk, Lk)
    do_rows, (db, dh, dn) = _aligned_rows(plan, "do_rows", do, prob, Hq, Lq, tma=tiles.wgmma)

    dq = plan.output("dq", prob.query_shape(), prob.dtype)
    dk = plan.output("dk", prob.key_shape(), prob.dtype)
    dv = plan.output("dv", prob.key_shape(prob.value_dim), prob.dtype)
    kb, kh, kn = prob.bhnd_strides(dk)
    wb, wh, wn = prob.bhnd_strides(dv)

    maps = params.args("BackwardMaps", **_query_tile_maps(qz, do_rows, (db, dh, dn), dq_acc, prob, tiles)) if tiles.wgmma else []
    grid, grid_order = backward_grid(prob, tiles.block_keys, deterministic, tiles.wgmma, sm_count(dev),
                                     tiles.passes(dp), batch_beside_heads=not tiles.pair)
    plan.launch(spec, "attention_backward", grid, (tiles.threads, 1, 1),
                params.args("BackwardParams", q8=qz.q8, q8t=qz.q8t, q_mean=qz.q_mean, k8=qz.k8, k8t=qz.k8t,
                               k_scale=qz.k_scale, kt_scale=qz.kt_scale, bias=qz.bias, v=v_rows, dout=do_rows,
                               dot8=qz.dot8, do_scale=qz.do_scale, stats=stats, qt_scale=qz.qt_scale, dq_acc=dq_acc,
                               dq_lock=lock, dk=dk,
                               dv=dv, vb=vb, vh=vh, vn=vn, db=db, dh=dh, dn=dn, kb=kb, kh=kh, kn=kn, wb=wb, wh=wh,
                               wn=wn, Hq=Hq, Hkv=Hk, D=D, Dv=prob.value_dim, Nq_pad=nq, Nk_pad=nk,
                               grid_order=grid_order,
                               **prob.kernel_band(), **prob.kernel_softcap(), **lengths) + maps,
                shared=KERNEL_LAYOUT)
    # Only dQ's conversion is left: the quantized tensors, row statistics and packed rows go back to
    # the allocator before dq is allocated (a lower peak than holding them with every output).
    plan.release_workspace(keep=(dq_acc, lock))

    qb, qh, qn = prob.bhnd_strides(dq)
    plan.launch(rows, "dq_convert", (-(-Lq * (D // 8) // threads), Hq, B), (threads, 1, 1),
                params.args("DqConvertParams", dq_acc=dq_acc, Hq=Hq, D=D, dq_row=dq_row, Nq_pad=nq,
                               scale=prob.softmax_scale, dq=dq, qb=qb, qh=qh, qn=qn, **q_lengths))
    return plan.build(problem=prob)
