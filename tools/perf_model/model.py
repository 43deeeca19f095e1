"""Per-resource bounds of one attention kernel on one card, a list schedule of its CTAs, and the
pre-/post-pass times from their bytes.

A kernel is described per warp and per work unit (a forward key tile, a backward iteration) by
counts: instructions per pipe class, tensor multiply-adds per type, shared and global bytes
(``sass.count_function`` for ours, ``fa2_counts`` for FlashAttention-2). On a card, one unit of one
CTA costs, in SM clocks, for each resource r:

    issue   warps * instructions / 4            tensor  warps * (MACs_i8 / rate_i8 + MACs_f16 / rate_f16)
    fma     warps * 32 * FP32+IMAD / 128        alu     warps * 32 * ALU / 64
    xu      warps * 32 * MUFU+conversions / 16  lsu     warps * 32 * LSU / 32
    shared  warps * shared bytes / 128

A CTA's duration is ``occupancy * max_r(sum of its units' cycles)`` (the SM's ``occupancy`` resident
CTAs share it), CTAs are list-scheduled on ``SMs * occupancy`` slots in launch order (heaviest first
when causal), and the kernel's time is

    T = latency_factor * max(makespan / clock, compulsory DRAM bytes / bandwidth)

with the latency factor fitted per kernel on the calibration card (fit.py). The "serial" variant
replaces max_r by tensor + max(the others), a bound on no overlap of products and the rest.
"""
from __future__ import annotations

import dataclasses
import heapq
import math

from .cards import Card

RESOURCES = ("issue", "tensor", "fma", "alu", "xu", "lsu", "shared")


@dataclasses.dataclass
class Kernel:
    """A kernel's counts per warp and unit, and its launch shape."""
    name: str
    warps: int
    registers: int
    shared_bytes: int  # dynamic shared memory a CTA
    interior: dict
    edge: dict
    per_cta: dict
    block_q: int  # queries a CTA (forward) or a unit (backward)
    block_k: int  # keys a unit (forward) or a CTA (backward)
    backward: bool


def occupancy(card: Card, k: Kernel) -> int:
    """Resident CTAs an SM: registers (256-register warp granules, 8 a thread), shared memory (+1 KB
    a CTA reserved), threads and the CTA limit."""
    regs_warp = math.ceil(max(k.registers, 1) / 8) * 8 * 32
    by_regs = card.regs_per_sm // (regs_warp * k.warps)
    by_smem = card.shared_per_sm // (k.shared_bytes + 1024) if k.shared_bytes else card.max_ctas_per_sm
    by_threads = card.max_threads_per_sm // (32 * k.warps)
    return max(1, min(by_regs, by_smem, by_threads, card.max_ctas_per_sm))


def unit_cycles(card: Card, counts: dict, warps: int, rates: dict) -> dict:
    """SM clocks of one unit of one CTA per resource (the SM to itself)."""
    g = lambda key: float(counts.get(key, 0))  # noqa: E731
    return {"issue": warps * g("issue") / card.issue_per_sm,
            "tensor": warps * (g("macs_i8") / rates["i8"] + (g("macs_f16_f32acc") + g("macs_f16_f16acc")) / rates["f16"]),
            "fma": warps * 32 * g("fma") / card.fma_lanes,
            "alu": warps * 32 * g("alu") / card.alu_lanes,
            "xu": warps * 32 * g("xu") / card.xu_lanes,
            "lsu": warps * 32 * g("lsu") / card.lsu_lanes,
            "shared": warps * g("shared_bytes") / card.shared_bytes_per_clk}


def cta_units(k: Kernel, n: int, causal: bool) -> list:
    """(interior units, edge units) of every CTA of one (batch, head), in launch order, for a square
    problem of ``n`` tokens. Forward: CTAs of ``block_q`` queries over ``block_k``-key units; backward:
    CTAs of ``block_k`` keys over ``block_q``-query units."""
    out = []
    if not k.backward:
        n_cta, n_unit = math.ceil(n / k.block_q), math.ceil(n / k.block_k)
        for qb in range(n_cta):
            if causal:
                units = min(n_unit, math.ceil((qb + 1) * k.block_q / k.block_k))
                edge = min(units, math.ceil(k.block_q / k.block_k))
            else:
                units, edge = n_unit, 0
            out.append((units - edge, edge))
    else:
        n_cta, n_unit = math.ceil(n / k.block_k), math.ceil(n / k.block_q)
        for j in range(n_cta):
            if causal:
                units = n_unit - (j * k.block_k) // k.block_q
                edge = min(units, math.ceil(k.block_k / k.block_q))
            else:
                units, edge = n_unit, 0
            out.append((units - edge, edge))
    if causal:
        out.sort(key=lambda u: -(u[0] + u[1]))  # heaviest first, as the grids launch them
    return out


@dataclasses.dataclass
class Bounds:
    cycles: dict  # resource -> SM clocks summed over CTAs / SMs (perfect balance)
    makespan: float  # list-scheduled SM clocks (max resource per CTA)
    makespan_serial: float  # same, tensor + max(others) per CTA
    dram_s: float
    clock_hz: float
    occupancy: int

    @property
    def binding(self) -> str:
        return max(self.cycles, key=self.cycles.get)

    def seconds(self, serial: bool = False) -> float:
        return max((self.makespan_serial if serial else self.makespan) / self.clock_hz, self.dram_s)


def bounds(card: Card, k: Kernel, batch_heads: int, n: int, causal: bool, rates: dict, clock_hz: float,
           dram_bytes: float, sms: int | None = None) -> Bounds:
    sms = sms or card.sms
    occ = occupancy(card, k)
    u_int, u_edge, u_cta = (unit_cycles(card, c, k.warps, rates) for c in (k.interior, k.edge, k.per_cta))
    per_head = cta_units(k, n, causal)
    totals = dict.fromkeys(RESOURCES, 0.0)
    durations, serial = [], []
    for a, e in per_head:
        cyc = {r: a * u_int[r] + e * u_edge[r] + u_cta[r] for r in RESOURCES}
        for r in RESOURCES:
            totals[r] += cyc[r] * batch_heads
        durations.append(occ * max(cyc.values()))
        serial.append(occ * (cyc["tensor"] + max(v for r, v in cyc.items() if r != "tensor")))
    slots = sms * occ

    def makespan(durs):
        # batch_heads copies of the head's CTAs; causal grids start every head's heaviest block first
        order = [d for d in durs for _ in range(batch_heads)] if causal else durs * batch_heads
        if len(order) <= slots:
            return max(order, default=0.0)
        heap = [0.0] * slots
        for d in order:
            heapq.heapreplace(heap, heap[0] + d)
        return max(heap)

    return Bounds({r: v / sms for r, v in totals.items()}, makespan(durations), makespan(serial),
                  dram_bytes / (card.dram_gbps * 1e9), clock_hz, occ)


# ---------------------------------------------------------------------------------------------
# Bytes moved (per element of B*H*N*d; GQA 1, 16-bit inputs)

def kernel_dram_bytes(impl: str, backward: bool, elems: float) -> float:
    """Compulsory DRAM bytes of the attention kernel: each operand read once, each result written once."""
    if impl == "ours":
        # fwd: q (16-bit, quantized in the kernel), k8, vt8, o; bwd: q8, q8t, dot8, dO, k8, k8t, v, dk, dv, dq_acc
        return elems * (17 if backward else 6)
    return elems * (16 if backward else 8)  # FA2 fwd: q, k, v, o; bwd: q, k, v, dO, dk, dv, dq_accum (fp32)


def prepost(impl: str, backward: bool, elems: float) -> tuple:
    """(launches, DRAM bytes) of the pre- and post-passes around the attention kernel."""
    if impl == "ours":
        if backward:  # quantize Q, K, dO (read 6, write q8, q8t, k8, k8t, dot8), row_stats (O, dO),
            return 4, elems * 25  # dq_acc cleared (4), dq_convert (read 4, write 2)
        return 2, elems * 8  # token_sum (K), quantize K, V (read 4, write k8 and vt8)
    if backward:
        return 2, elems * 14  # dot_do_o (O, dO; clears dQaccum 4), convert_dq (read 4, write 2)
    return 0, 0.0


# ---------------------------------------------------------------------------------------------
# FlashAttention-2, from its algorithm (no SASS of it here)

# Tiles torch's vendored FlashAttention-2 picks (aten/src/ATen/native/transformers/cuda/flash_attn,
# flash_fwd_launch_template.h and flash_bwd_launch_template.h, no dropout): (block_q, block_k, warps).
def fa2_tiles(backward: bool, d: int, arch: str, causal: bool, shared_per_block: int) -> tuple:
    sm8x = arch in ("sm_86", "sm_89")
    if not backward:
        if d <= 64:
            return 128, 128, 4
        if sm8x:
            return (64, 64, 4) if causal else (128, 32, 4)
        return 128, 64, 4
    big = shared_per_block >= 144 * 1024
    if d <= 64:
        return (128, 128, 8) if big else (64, 128, 8)
    return (64, 128, 8) if big else (64, 64, 8)


def fa2_counts(backward: bool, d: int, bq: int, bk: int, warps: int) -> dict:
    """Our estimate of FlashAttention-2's instructions per warp and unit (forward: a bq x bk tile of
    a CTA; backward: one bk-key CTA's bq-query iteration), fp16 mma.sync m16n8k16 with FP32
    accumulation. Per score: forward FFMA (scale, max), FMNMX, MUFU.EX2, FADD (row sum), half an F2FP
    (P to fp16 pairs); backward FFMA + MUFU.EX2 (P), FADD + FMUL (dS), F2FP (P, dS), their stores to
    shared memory for the transposed products. ldmatrix of every operand fragment a warp needs, the
    cp.async copies of each tile, FP32 atomics for dQ; a fixed allowance for addresses and the loop."""
    c = {}
    if not backward:
        wm = bq // warps  # query rows a warp
        s = wm * bk / 32  # scores a thread
        macs = 2 * wm * bk * d
        ldsm = (2 * bk * d * 2 + wm * d * 2) / 512  # K and V fragments (all of them), Q reloaded
        copies = 2 * bk * d * 2 / warps  # K and V tile bytes a warp copies
        c.update(macs_f16_f32acc=macs, tensor=macs / 2048, fma=2 * s + wm * d / 32 + 2 * wm / 16,
                 alu=1.5 * s + 40, xu=s + 2 * wm / 16, lsu=ldsm + copies / 512 + 4 * wm / 16,
                 shared_bytes=512 * ldsm + copies, global_bytes=copies, other=6)
    else:
        s = bq * bk / (32 * warps)
        macs = 5 * bq * bk * d / warps
        # operand bytes a warp loads for an M x N x K product with the warps split 2 x 4 over M x N
        prod = lambda m, n, k: 2 * k * (m / 2 + n / 4)  # noqa: E731
        ldsm = (prod(bq, bk, d) * 2 + prod(bk, d, bq) * 2 + prod(bq, d, bk)) / 512
        copies = (2 * bq * d * 2 + 8 * bq) / warps  # Q and dO tiles, LSE and D
        atomics = bq * d / (32 * warps)  # dQ accumulation, one FP32 atomic an element
        sts = 2 * s * 2  # P and dS as fp16 into shared memory (bytes a thread)
        c.update(macs_f16_f32acc=macs, tensor=macs / 2048, fma=3 * s, alu=s + 60, xu=s,
                 lsu=ldsm + copies / 512 + atomics + sts / 4,
                 shared_bytes=512 * ldsm + copies + 32 * sts, global_bytes=copies + 128 * atomics, other=8)
    c["issue"] = sum(c[k] for k in ("tensor", "fma", "alu", "xu", "lsu", "other"))
    return c


def fa2_kernel(backward: bool, d: int, arch: str, causal: bool, shared_per_block: int) -> Kernel:
    bq, bk, warps = fa2_tiles(backward, d, arch, causal, shared_per_block)
    c = fa2_counts(backward, d, bq, bk, warps)
    edge = dict(c)
    edge["alu"] = c["alu"] + (bq * bk / (32 * warps))  # the mask's compare a score
    edge["issue"] = c["issue"] + (bq * bk / (32 * warps))
    if backward:
        smem = (3 * bq * d + 2 * bk * d + 2 * bq * bk) * 2
    else:
        smem = (bq + 2 * bk) * d * 2
    # Registers: FlashAttention-2's kernels are built at 255 a thread or near it (assumed, not read).
    return Kernel(f"fa2.{'bwd' if backward else 'fwd'}.hd{d}", warps, 255 if backward or d > 64 else 192, smem, c,
                  edge, {"issue": 200, "alu": 120, "fma": 40, "lsu": 20}, bq, bk, backward)


def ours_kernel(counts: dict) -> Kernel:
    """Kernel from ``sass.profile_kernel``'s counts (forward: 16 x warps queries over 64-key tiles;
    backward: 64-key CTAs of 8 warps over 64-query iterations)."""
    backward = counts["kind"] == "bwd"
    warps = counts["threads"] // 32
    return Kernel(counts["spec"], warps, counts["registers"] or 255, counts["shared_bytes"] or 0, counts["interior"],
                  counts["edge"], counts["per_cta"], 64 if backward else counts["cta_queries"], 64, backward)
