"""Pieces of the forward and backward run now, for tests and benchmarks (no call of the library
goes through here): each records its launches into a plan of its own, runs it on a stream and
returns descriptors of views into the workspace it used.
"""
from __future__ import annotations

import dataclasses

from ..arrays import ArrayDesc, byte_view, current_stream, empty
from ..problem import AttentionProblem
from .forward import attend
from .plan import Buffer, PlanBuilder
from .quantize import Quantized, quantize_grad_output, quantize_inputs


def run_now(plan: PlanBuilder, stream: int, recorded):
    """Build ``plan`` (constants allowed), run it on ``stream``, and return ``recorded`` (a Buffer, or a
    Quantized / tuple holding Buffers) with each Buffer replaced by a descriptor viewing it."""
    built = plan.build(cacheable=False)
    _, workspace = built.run([desc.ptr for _, desc in plan.inputs], stream)
    base = built.workspace_base_offset(workspace) if workspace is not None else 0

    def view(x):
        return byte_view(workspace, base + x.offset, x.shape, x.dtype) if isinstance(x, Buffer) else x

    if isinstance(recorded, Quantized):
        return dataclasses.replace(recorded, **{f.name: view(getattr(recorded, f.name))
                                                for f in dataclasses.fields(recorded)})
    return tuple(view(x) for x in recorded)


def quantize_inputs_gpu(prob: AttentionProblem, backward: bool, stream: int, quantize_q: bool = True) -> Quantized:
    plan = PlanBuilder(prob.q.device_id, prob.q.framework, [("q", prob.q), ("k", prob.k), ("v", prob.v)])
    return run_now(plan, stream, quantize_inputs(plan, prob, backward, quantize_q=quantize_q))


def quantize_grad_output_gpu(prob: AttentionProblem, do: ArrayDesc, stream: int):
    """(dÔᵀ, scales) for ``do`` alone (the backward quantizes dO in its Q, K launch)."""
    plan = PlanBuilder(prob.q.device_id, prob.q.framework, [("do", do)])
    return run_now(plan, stream, quantize_grad_output(plan, prob, do))


def attend_launcher(prob: AttentionProblem):
    """A zero-argument callable that launches the attention kernel alone on the inputs' stream, on
    K, V (and with Q-smoothing Q) quantized now, into an output of its own (benchmarks: the plan is
    built once, so a call costs one launch; without Q-smoothing the kernel quantizes Q itself, as in
    a forward call). The launcher holds the quantized inputs and the output its plan points at."""
    stream = current_stream(prob.q)
    qz = quantize_inputs_gpu(prob, False, stream, quantize_q=prob.smooth_q)
    out = empty(prob.output_shape(), prob.dtype, prob.q)
    plan = PlanBuilder(prob.q.device_id, prob.q.framework, [])
    attend(plan, prob, qz, out, None)
    built = plan.build(cacheable=False)
    buffers = (qz, out)

    def launch():
        built.run([], stream)
        return buffers

    return launch
