"""Ring (context-parallel) attention on ``torch.distributed``: every rank holds a shard of the
sequence (its queries, keys and values); K/V shards travel around the ring with point-to-point ops
(``batch_isend_irecv``) while each rank attends its queries to the shard it holds, and the partial
outputs are merged by LSE (``chunked.forward_chunks``).  The backward passes K/V around again with
float32 dK/dV accumulators travelling beside them, each rank adding its share, until they are
home.  All shards are quantized with one μ_K, the token mean of the whole K (an all-reduce of the
shards' float64 token sums), so the result is exact up to float32 merging, as in
``chunked_attention`` (docs/ALGORITHM.md, chunked attention).

Causal attention needs the zig-zag layout (``zigzag_shard``): the sequence cut into 2·W chunks,
rank r holding chunks r and 2W−1−r, so every rank does the same work.  Against the shard of rank
s, rank r computes: its own shard causally (s = r); its queries against the first half of the
shard, not causal (s < r); the second half of its queries against the whole shard, not causal
(s > r).  Works with gloo (CPU tensors: the emulator) and NCCL (CUDA tensors).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from sagebwd_cp import chunked as _neutral
from sagebwd_cp.options import AttentionOptions, check_flag, check_layout, window_options

from . import _ops
from ._checks import check_tensors, tensor_list
from .chunked import backward_chunks, band_pieces, forward_chunks

__all__ = ["ring_attention", "zigzag_shard", "zigzag_unshard"]


def _seq_dim(layout: str) -> int:
    return 2 if layout == "HND" else 1


def zigzag_shard(x: Tensor, rank: int, world_size: int, dim: int) -> Tensor:
    """Rank ``rank``'s shard of ``x`` in the zig-zag layout: ``x`` cut into 2·world_size equal
    chunks along ``dim``, chunks rank and 2·world_size−1−rank concatenated."""
    check_tensors("x", x)
    n = x.shape[dim]
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank, world_size: expected 0 <= rank < world_size, got {rank}, {world_size}")
    if n % (2 * world_size):
        raise ValueError(f"x: expected a length along dim {dim} divisible by 2·world_size = {2 * world_size}, got {n}")
    chunks = x.chunk(2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim)


def zigzag_unshard(shards, dim: int) -> Tensor:
    """The sequence from every rank's zig-zag shard (``shards[r]``, rank order): the inverse of
    ``zigzag_shard``."""
    halves = [s.chunk(2, dim) for s in tensor_list(shards, "shards")]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


class _Ring:
    """The ring of a process group: this rank, the world size, the global ranks of the neighbours."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        glob = (lambda i: dist.get_global_rank(group, i)) if group is not None else (lambda i: i)
        self.next, self.prev = glob((self.rank + 1) % self.size), glob((self.rank - 1) % self.size)

    def exchange(self, tensors, tag: int):
        """Send ``tensors`` to the next rank and receive same-shaped ones from the previous, started
        now: (requests, received).  Tags keep concurrent exchanges apart (gloo matches by tag)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag + i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag + i) for i, t in enumerate(received)]
        return dist.batch_isend_irecv(ops), received


def _wait(requests) -> None:
    for r in requests:
        r.wait()


def _step(ring: _Ring, step: int, options: AttentionOptions, len_q: int, len_k: int) -> list:
    """The calls of one ring step against the shard of rank (rank − step), as ``forward_chunks`` takes
    them: (0, q row0, q row1, key0, key1, options) against the shard held."""
    src = (ring.rank - step) % ring.size
    if options.windowed or options.softcap:
        return _band_step(ring.rank, src, ring.size, len_q, options)
    if not options.causal or src == ring.rank:
        return [(0, 0, len_q, 0, len_k, options)]
    plain = options._replace(causal=False)
    if src < ring.rank:  # the shard's first chunk (src) precedes both of ours; its second (2W-1-src) follows both
        return [(0, 0, len_q, 0, len_k // 2, plain)]
    return [(0, len_q // 2, len_q, 0, len_k, plain)]  # only our second chunk sees any of it, all of it


def _band_step(rank: int, src: int, size: int, length: int, options: AttentionOptions) -> list:
    """A window's calls (or a soft cap's, whose kernels take a band) against the shard of rank ``src``:
    each of our two zig-zag chunks against each of its two, ``band_pieces``' call where a row sees a key."""
    chunk = length // 2
    halves = lambda r: ((r * chunk, 0), ((2 * size - 1 - r) * chunk, chunk))  # noqa: E731 (position, local row)
    pieces = []
    for q_pos, q_row in halves(rank):
        for k_pos, k_row in halves(src):
            for _, r0, r1, k0, k1, call in band_pieces(0, q_pos, q_pos + chunk, k_pos, k_pos + chunk, 0, options):
                pieces.append((0, q_row + r0, q_row + r1, k_row + k0, k_row + k1, call))
    return pieces


def _shared_key_mean(ring: _Ring, k: Tensor, layout: str) -> Tensor:
    """μ_K of the whole sequence: the shards' float64 token sums added over the group."""
    total = _neutral.key_sum(k, layout, xp=torch)
    if ring.size > 1:
        dist.all_reduce(total, group=ring.group)
    return (total / float(k.shape[_seq_dim(layout)] * ring.size)).to(torch.float32)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, options):
        layout = options.layout
        ring, seq = _Ring(group), _seq_dim(layout)
        k, v = k.contiguous(), v.contiguous()
        k_mean = _shared_key_mean(ring, k, layout) if options.smooth_k else _ops._no_k_mean(q)
        len_q, len_k = q.shape[seq], k.shape[seq]
        out = lse = None
        cur = (k, v)
        for step in range(ring.size):
            pending = ring.exchange(cur, 0) if step < ring.size - 1 else None
            pieces = _step(ring, step, options, len_q, len_k)
            out, lse = forward_chunks(q, [cur], pieces, k_mean, layout, out, lse)
            if pending:
                _wait(pending[0])
                cur = tuple(pending[1])
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, k_mean)
        ctx.group, ctx.options = group, options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, k_mean = ctx.saved_tensors
        options = ctx.options
        ring, seq = _Ring(ctx.group), _seq_dim(options.layout)
        len_q, len_k = q.shape[seq], k.shape[seq]
        dout = dout.contiguous()
        lse2 = _neutral.lse_to_lse2(lse, q, k_mean if options.smooth_k else None, options.softmax_scale,
                                    options.layout, xp=torch)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur, arriving = (k, v), None  # arriving: the dK/dV accumulators of the shard held, on their way here
        for step in range(ring.size):
            pending = ring.exchange(cur, 0) if step < ring.size - 1 else None
            dkv = tuple(torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in cur)
            pieces = _step(ring, step, options, len_q, len_k)
            backward_chunks(q, [cur], pieces, out, lse2, dout, k_mean, dq, [dkv])
            if arriving:
                _wait(arriving[0])
                dkv = tuple(a + b for a, b in zip(dkv, arriving[1]))
            # The accumulators go on to the next holder of this shard; after the last step, home.
            arriving = ring.exchange(dkv, 2) if ring.size > 1 else None
            if pending:
                _wait(pending[0])
                cur = tuple(pending[1])
        if arriving:
            _wait(arriving[0])
            dkv = arriving[1]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
                   layout: str = "HND", group=None, smooth_k: bool = True, smooth_q: bool = False,
                   granularity: str = "fine", deterministic: bool = False, return_lse: bool = False,
                   window_size=(-1, -1), softcap: float = 0.0):
    """Attention over a sequence sharded across the ranks of ``group`` (default: the world), with
    autograd.  Each rank passes its own shard: q, k, v with the local tokens, all ranks the same
    number (the ring receives into buffers of the local shape).  Not causal: any split of the
    sequence (shard r the r-th piece, or any order: the result per query does not depend on where
    the keys are).  Causal: the zig-zag layout (``zigzag_shard``), queries and keys alike, with an
    even local length; masking is over the whole sequence.  A sliding window (``window_size``, over
    the whole sequence) and soft-capping take the zig-zag layout too.  Returns this rank's output rows (and,
    with ``return_lse``, their natural-log LSE, float32, not differentiable).  CUDA tensors need the
    NCCL backend, CPU tensors gloo.  Options as in ``attention``."""
    check_tensors("q, k, v", q, k, v)
    options = AttentionOptions(causal=causal, softmax_scale=softmax_scale, smooth_k=smooth_k, smooth_q=smooth_q,
                               layout=check_layout(layout), granularity=granularity, deterministic=deterministic,
                               **window_options(window_size), softcap=softcap)
    return_lse = check_flag(return_lse, "return_lse")
    _ops.check_ranks(options.layout, q=q, k=k, v=v)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first (torchrun sets up the environment)")
    seq = _seq_dim(options.layout)
    if options.banded and (q.shape[seq] != k.shape[seq] or q.shape[seq] % 2):
        kind = "causal" if options.causal else "windowed"
        raise ValueError(f"q, k: {kind} ring attention takes zig-zag shards (zigzag_shard) of equal, even length; got "
                         f"{q.shape[seq]} query and {k.shape[seq]} key tokens")
    out, lse = _RingAttention.apply(q, k, v, group, options)
    return (out, lse) if return_lse else out
