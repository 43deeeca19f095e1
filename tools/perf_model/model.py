"""Per-resource bounds of one attention kernel on one card, the warps' own latency, a list schedule of
its CTAs, and the pre-/post-pass times from their bytes.

A kernel is described per warp and per work unit (a forward key tile, a backward iteration) by
counts: instructions per pipe class, tensor multiply-adds per type, shared and global bytes
(``sass.count_function`` for ours, ``fa2_counts`` for FlashAttention-2). On a card, one unit of one
CTA costs, in SM clocks, for each throughput resource r:

    issue   warps * instructions / 4            tensor  warps * (MACs_i8 / rate_i8 + MACs_f16 / rate_f16)
    fma     warps * 32 * FP32+IMAD / 128        alu     warps * 32 * ALU / 64
    xu      warps * 32 * MUFU+conversions / 16  lsu     warps * 32 * LSU / 32
    shared  warps * shared bytes / 128

The SM's ``occupancy`` resident CTAs share these pipes, so the pipes alone make a CTA last
``occupancy * max_r(its cycles_r)``. Each warp also waits on its own dependent instructions: with W
warps a scheduler (occupancy * warps / 4), a warp gets one issue slot in W, and each of its
instructions exposes a stall the other warps do not hide, ``c_other`` clocks after a non-tensor one
and ``c_tensor`` after a tensor one (mma.sync's longer latency). One warp's chain through the CTA:

    latency = W * I + c_other * I_other + c_tensor * I_tensor      (I: the warp's instructions)

The first term is the issue bound itself (occupancy * issue cycles), so the latency term only adds to
it. A CTA lasts

    max(occupancy * max_r cycles_r, latency)

CTAs are list-scheduled on ``SMs * occupancy`` slots in launch order (heaviest first when causal),
and the kernel's time is ``max(makespan / clock, compulsory DRAM bytes / bandwidth)``.

``c_other`` and ``c_tensor`` (``Latency``) are fitted per kernel on the calibration card (fit.py);
no factor multiplies the throughput bounds, so a kernel whose latency binds on the calibration card
but whose tensor pipe binds on another card is not slowed there by what was fitted (the tensor
pipe runs at the card's rate; its instructions' latency still counts in the chain).
"""
from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np

from .cards import Card

RESOURCES = ("issue", "tensor", "fma", "alu", "xu", "lsu", "shared")


@dataclasses.dataclass(frozen=True)
class Latency:
    """Exposed stall clocks a warp instruction: after a non-tensor one and after a tensor one."""
    other: float = 0.0
    tensor: float = 0.0

    def vector(self) -> np.ndarray:
        return np.array([self.other, self.tensor], dtype=float)


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


def list_schedule(groups, slots: int) -> tuple:
    """(makespan, its gradient) of a greedy list schedule: ``groups`` of (duration, count, gradient of
    the duration) in launch order, each task to the slot free first. Many tasks a group: the k slots
    free first take one task each at once when none of them would be free again before the k-th
    starts (exactly the greedy order, in a few array steps a wave); few: a heap, task by task."""
    tasks = sum(c for _, c, _ in groups)
    if tasks <= 24 * len(groups):
        heap = [(0.0, i) for i in range(slots)]
        g0, g1 = [0.0] * slots, [0.0] * slots
        replace = heapq.heapreplace
        for d, count, g in groups:
            a, b = float(g[0]), float(g[1])
            for _ in range(count):
                t0, i = heap[0]
                replace(heap, (t0 + d, i))
                g0[i] += a
                g1[i] += b
        t_last, i_last = max(heap)
        return float(t_last), np.array([g0[i_last], g1[i_last]])
    t = np.zeros(slots)
    grad = np.zeros((slots, len(groups[0][2])))
    for d, count, g in groups:
        while count > 0:
            order = np.argsort(t, kind="stable")
            ts = t[order]
            k = min(count, slots, int(np.searchsorted(ts, ts[0] + d, side="right")))
            idx = order[:max(k, 1)]
            t[idx] += d
            grad[idx] += g
            count -= len(idx)
    last = int(np.argmax(t))
    return float(t[last]), grad[last]


@dataclasses.dataclass
class Bounds:
    """One kernel launch on one card: every CTA's throughput cycles and latency terms."""
    cycles: dict  # resource -> SM clocks summed over CTAs / SMs (perfect balance), throughput alone
    cta_cycles: np.ndarray  # one (batch, head)'s CTAs in launch order x RESOURCES: SM clocks of the CTA alone
    cta_instructions: np.ndarray  # the same CTAs x (non-tensor, tensor): a warp's instructions
    batch_heads: int
    causal: bool
    sms: int
    dram_s: float
    clock_hz: float
    occupancy: int

    def __post_init__(self):
        self._thr = self.occupancy * self.cta_cycles.max(axis=1)
        self._issue = self.occupancy * self.cta_cycles[:, RESOURCES.index("issue")]
        self._cache = {}

    def chains(self, lat: Latency) -> np.ndarray:
        """One warp's latency chain through each CTA, in SM clocks (W x I + the exposed stalls)."""
        return self._issue + self.cta_instructions @ lat.vector()

    def durations(self, lat: Latency) -> tuple:
        """(SM clocks each of the head's CTAs occupies a slot, their gradients in (c_other, c_tensor))."""
        chain = self.chains(lat)
        bound = chain > self._thr
        return np.where(bound, chain, self._thr), self.cta_instructions * bound[:, None]

    def makespan(self, lat: Latency) -> tuple:
        """(list-scheduled SM clocks, gradient in (c_other, c_tensor))."""
        key = (lat.other, lat.tensor)
        if key not in self._cache:
            durs, grads = self.durations(lat)
            slots = self.sms * self.occupancy
            if len(durs) and np.all(durs == durs[0]):  # one group: every CTA alike
                groups = [(durs[0], len(durs) * self.batch_heads, grads[0])]
            elif self.causal:  # every head's heaviest block first
                groups = [(d, self.batch_heads, g) for d, g in zip(durs, grads)]
            else:
                groups = [(d, 1, g) for d, g in zip(durs, grads)] * self.batch_heads
            self._cache = {key: list_schedule(groups, slots)}
        return self._cache[key]

    def seconds_and_gradient(self, lat: Latency = Latency()) -> tuple:
        span, grad = self.makespan(lat)
        if span / self.clock_hz >= self.dram_s:
            return span / self.clock_hz, grad / self.clock_hz
        return self.dram_s, np.zeros(2)

    def seconds(self, lat: Latency = Latency()) -> float:
        return self.seconds_and_gradient(lat)[0]

    def shares(self, lat: Latency = Latency()) -> dict:
        """Per-SM clocks of each throughput resource and of the warps' latency chains ("latency": the
        CTAs' chains over the SM's slots), summed over the launch (perfect balance)."""
        out = dict(self.cycles)
        out["latency"] = float(self.chains(lat).sum()) * self.batch_heads / (self.sms * self.occupancy)
        return out

    def binding(self, lat: Latency = Latency()) -> str:
        """What bounds the launch: "latency" (the warps' own chains), a throughput resource, or "dram"."""
        if self.dram_s * self.clock_hz > self.makespan(lat)[0]:
            return "dram"
        sh = self.shares(lat)
        return max(sh, key=sh.get)


def bounds(card: Card, k: Kernel, batch_heads: int, n: int, causal: bool, rates: dict, clock_hz: float,
           dram_bytes: float, sms: int | None = None) -> Bounds:
    sms = sms or card.sms
    occ = occupancy(card, k)
    per_unit = np.array([[unit_cycles(card, c, k.warps, rates)[r] for r in RESOURCES]
                         for c in (k.interior, k.edge, k.per_cta)])
    instr = np.array([[float(c.get("issue", 0)) - float(c.get("tensor", 0)), float(c.get("tensor", 0))]
                      for c in (k.interior, k.edge, k.per_cta)])
    units = np.array([(a, e, 1) for a, e in cta_units(k, n, causal)], dtype=float)
    cyc = units @ per_unit
    totals = cyc.sum(axis=0) * batch_heads / sms
    return Bounds(dict(zip(RESOURCES, map(float, totals))), cyc, units @ instr, batch_heads, causal, sms,
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
