"""SASS of the mma.sync kernels, counted: NVRTC's cubin disassembled by ``nvdisasm`` on the CPU.

For one kernel specialization and arch this finds the main loop (the backward branch whose body
holds the most tensor instructions), takes the path through one iteration that an interior tile
runs (every product, the stage prefetch, the fewest other instructions: no mask, no rescale), and
counts per warp, per pipe class, the instructions of that path: tensor (MACs per type), FMA, ALU,
XU (MUFU and the legacy conversions), LSU, uniform and control; with the shared-memory and global
bytes its loads and stores move. The edge path (the most instructions: masks, rescales) is counted
too, and the straight-line code before and after the loop (per CTA).

The pipe of each opcode is our reading of NVIDIA's throughput tables (CUDA C Programming Guide,
"Arithmetic Instructions") and of Nsight Compute's pipe names; where it is uncertain (``I2FP``,
``F2FP``) the choice is named in ``PIPE_OF``. A wrong pipe moves a throughput bound; the
latency chain counts every instruction alike (tensor apart), so the fitted stalls do not absorb it.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

from . import library

# Opcode (the part before the first dot) -> pipe class.
PIPE_OF = {}
for _op in ("FFMA", "FMUL", "FADD", "FFMA32I", "FMUL32I", "FADD32I", "HFMA2", "HMUL2", "HADD2", "FSWZADD",
            "IMAD", "IMUL", "IDP", "IMADSP", "IMUL32I", "IMAD32I"):
    PIPE_OF[_op] = "fma"  # FP32 arithmetic and IMAD (IMAD on the FMA-heavy half)
for _op in ("IADD3", "IADD", "IADD32I", "LOP3", "LOP", "LOP32I", "SHF", "SHL", "SHR", "ISETP", "FSETP", "HSETP2",
            "PSETP", "SEL", "FSEL", "IMNMX", "HMNMX2", "MOV", "MOV32I", "PRMT", "LEA", "IABS", "PLOP3", "P2R", "R2P",
            "VOTE", "BMSK", "SGXT", "I2FP", "F2FP", "VIADD", "VIMNMX", "VIADDMNMX", "CSET", "CSETP", "ISCADD",
            "FMNMX", "FLO", "BREV", "POPC"):
    # integer, logic, compare/select and FP32 min/max (Nsight Compute's "alu" pipe), and our reading for
    # I2FP/F2FP (int->float and float-pair packing): 16 lanes a scheduler, half the issue rate
    PIPE_OF[_op] = "alu"
for _op in ("MUFU", "I2F", "F2I", "F2F", "FRND", "I2I", "F2IP"):
    PIPE_OF[_op] = "xu"  # special functions and the legacy (non-FP-pipe) conversions: 4 lanes a scheduler
for _op in ("LDS", "STS", "LDSM", "STSM", "LDG", "STG", "LDGSTS", "RED", "REDG", "ATOM", "ATOMG", "ATOMS", "LD",
            "ST", "LDL", "STL", "SHFL", "MATCH", "LDGMC", "REDUX", "LDC"):
    PIPE_OF[_op] = "lsu"  # memory input/output (MIO): loads, stores, shuffles
for _op in ("IMMA", "HMMA", "DMMA", "BMMA", "QMMA", "OMMA", "HGMMA", "IGMMA", "QGMMA"):
    PIPE_OF[_op] = "tensor"
CLASSES = ("tensor", "fma", "alu", "xu", "lsu", "uniform", "other")

_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_\w+):")
_TARGET = re.compile(r"`\((\.L_\w+)\)")
_MMA_SHAPE = re.compile(r"^(IMMA|HMMA)\.(\d+)")


@dataclasses.dataclass
class Instr:
    index: int
    addr: int
    pred: str | None
    opcode: str  # full, with modifiers: "IMMA.16832.S8.S8"
    operands: str
    target: str | None  # branch target label

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


def parse(text: str) -> tuple:
    """(instructions, {label: index of the instruction after it}) of one function's disassembly."""
    instrs, labels = [], {}
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        body = m.group(2).strip()
        pred = None
        if body.startswith("@"):
            pred, body = body.split(None, 1)
        parts = body.split(None, 1)
        op, rest = parts[0], parts[1] if len(parts) > 1 else ""
        t = _TARGET.search(rest)
        instrs.append(Instr(len(instrs), int(m.group(1), 16), pred, op, rest, t.group(1) if t else None))
    return instrs, labels


def _width(opcode: str) -> int:
    """Bytes a lane moves for a load/store opcode's width modifier."""
    mods = opcode.split(".")[1:]
    for m in mods:
        if m in ("U8", "S8"):
            return 1
        if m in ("U16", "S16"):
            return 2
        if m == "64" or m.endswith("x2"):
            return 8
        if m == "128" or m.endswith("x4"):
            return 16
    return 4


def features(ins: Instr) -> dict:
    """What one warp-level instruction costs: its class, tensor MACs by type, bytes moved."""
    op, base = ins.opcode, ins.base
    if (base.startswith("U") and base not in PIPE_OF) or base in ("R2UR", "S2UR"):
        cls = "uniform"
    else:
        cls = PIPE_OF.get(base, "other")
    f = collections.Counter({cls: 1, "issue": 1})
    m = _MMA_SHAPE.match(op)
    if m:
        digits = m.group(2)  # "16832" = m16 n8 k32, "16816", "1688", "884"
        mm, nn, kk = int(digits[:2]), int(digits[2]), int(digits[3:])
        if m.group(1) == "IMMA":
            f["macs_i8"] += mm * nn * kk
        else:
            f["macs_f16_f32acc" if ".F32" in op else "macs_f16_f16acc"] += mm * nn * kk
        f["mma_" + m.group(1).lower()] += 1
    if base == "LDSM":
        n = int(op.split(".")[-1]) if op.split(".")[-1].isdigit() else 1
        f["shared_bytes"] += 128 * n
    elif base in ("LDS", "STS", "ATOMS"):
        f["shared_bytes"] += 32 * _width(op)
    elif base == "LDGSTS":
        w = _width(op)
        f["global_bytes"] += 32 * w
        f["shared_bytes"] += 32 * w
        f["ldgsts"] += 1
    elif base in ("LDG", "STG", "RED", "REDG", "ATOM", "ATOMG"):
        f["global_bytes"] += 32 * _width(op)
        if base in ("RED", "REDG", "ATOM", "ATOMG"):
            f["atomics"] += 1
    elif base in ("LDL", "STL"):
        f["local_bytes"] += 32 * _width(op)
    return f


def _is_branch(ins: Instr) -> bool:
    return ins.base in ("BRA", "CALL", "JMP", "BRX") and ins.target is not None


TENSOR_OPS = ("IMMA", "HMMA", "IGMMA", "HGMMA", "QGMMA")  # mma.sync and wgmma


def find_main_loop(instrs, labels) -> tuple:
    """(first, last) instruction index of the loop whose body holds the most tensor instructions
    (``last`` is its backward branch). Branches after the function's last unconditional EXIT are out-of-line
    stubs (the wgmma kernels' mbarrier retries jump back into the loop from there), not loops."""
    exits = [x.index for x in instrs if x.base == "EXIT" and x.pred is None]
    end = exits[-1] if exits else len(instrs)
    best = None
    for ins in instrs[:end]:
        if ins.base == "BRA" and ins.target in labels and labels[ins.target] <= ins.index:
            lo, hi = labels[ins.target], ins.index
            mma = sum(1 for x in instrs[lo:hi + 1] if x.base in TENSOR_OPS)
            if best is None or mma > best[0] or (mma == best[0] and hi - lo > best[2] - best[1]):
                best = (mma, lo, hi)
    if best is None or best[0] == 0:
        raise ValueError("no loop with tensor instructions found")
    return best[1], best[2]


def _sum(features_list) -> collections.Counter:
    total = collections.Counter()
    for f in features_list:
        total.update(f)
    return total


def loop_paths(instrs, labels, lo, hi) -> dict:
    """{"interior": Counter, "edge": Counter} of one iteration of the loop [lo, hi].

    The body's branches form a DAG (forward branches; the branch back to ``lo`` ends an iteration;
    branches that leave the body go to cold code, e.g. shuffles' out-of-line retries, and count as not
    taken). The interior path maximizes (tensor instructions, prefetch copies) and then minimizes the
    other instructions; the edge path maximizes all three."""
    leaders = {lo}
    for k in range(lo, hi + 1):
        x = instrs[k]
        if _is_branch(x) or x.base == "EXIT":
            if k + 1 <= hi:
                leaders.add(k + 1)
            t = labels.get(x.target) if x.target else None
            if t is not None and lo < t <= hi:
                leaders.add(t)
    starts = sorted(leaders)
    block_of = {s: i for i, s in enumerate(starts)}
    ends = starts[1:] + [hi + 1]
    feats = [_sum(features(instrs[k]) for k in range(s, e)) for s, e in zip(starts, ends)]
    END = -1

    def successors(b):
        last = instrs[ends[b] - 1]
        nxt = [b + 1] if ends[b] <= hi else []
        if ends[b] - 1 == hi:
            return [END]
        if last.base == "EXIT":
            return nxt if last.pred else []
        if _is_branch(last):
            t = labels.get(last.target)
            taken = []
            if t == lo:
                taken = [END]
            elif t is not None and lo < t <= hi and t > last.index:
                taken = [block_of[t]]
            if last.pred is None and last.base == "BRA":
                return taken
            return nxt + taken
        return nxt

    def solve(key):
        best = {END: (collections.Counter(), [])}
        for b in range(len(starts) - 1, -1, -1):
            options = []
            for s in successors(b):
                if s in best:
                    c, path = best[s]
                    options.append((feats[b] + c, [b] + path))
            if options:
                best[b] = max(options, key=lambda o: key(o[0]))
        if 0 not in best:
            raise ValueError("no path through the loop body")
        return best[0]

    def tensor(c):
        return c["tensor"]

    interior, ipath = solve(lambda c: (tensor(c), c["ldgsts"], -c["issue"]))
    edge, epath = solve(lambda c: (tensor(c), c["ldgsts"], c["issue"]))
    opcodes = collections.Counter()
    for b in ipath:
        for k in range(starts[b], ends[b]):
            opcodes[instrs[k].opcode] += 1
    return {"interior": interior, "edge": edge, "interior_opcodes": opcodes,
            "blocks": len(starts), "interior_blocks": len(ipath), "edge_blocks": len(epath)}


_FUNCTION = re.compile(r"^\.text\.(\w+):\s*$", re.MULTILINE)


def functions(text: str) -> dict:
    """{kernel name: its disassembly} of a cubin's nvdisasm text (one ``.text.<name>:`` section a kernel)."""
    heads = list(_FUNCTION.finditer(text))
    return {m.group(1): text[m.end():heads[k + 1].start() if k + 1 < len(heads) else len(text)]
            for k, m in enumerate(heads)}


def count_function(text: str) -> dict:
    instrs, labels = parse(text)
    lo, hi = find_main_loop(instrs, labels)
    paths = loop_paths(instrs, labels, lo, hi)
    first_exit = next((x.index for x in instrs[hi + 1:] if x.base == "EXIT" and x.pred is None), len(instrs))
    outside = _sum(features(x) for x in instrs[:lo]) + _sum(features(x) for x in instrs[hi + 1:first_exit + 1])
    return {"loop": [lo, hi], "instructions": len(instrs), "interior": dict(paths["interior"]),
            "edge": dict(paths["edge"]), "per_cta": dict(outside),
            "interior_opcodes": dict(paths["interior_opcodes"].most_common()),
            "blocks": paths["blocks"]}


# ---------------------------------------------------------------------------------------------
# Tools and compilation

def nvdisasm_path() -> str | None:
    """``nvdisasm``: $SAGEBWD_NVDISASM, PATH, or the nvidia-cuda-nvdisasm wheel's copy."""
    env = os.environ.get("SAGEBWD_NVDISASM")
    if env and os.path.exists(env):
        return env
    found = shutil.which("nvdisasm")
    if found:
        return found
    for entry in sys.path:
        for pattern in ("nvidia/cu*/bin/nvdisasm", "nvidia/cuda_nvdisasm/bin/nvdisasm"):
            hits = sorted(glob.glob(os.path.join(entry, pattern)))
            if hits:
                return hits[-1]
    return None


def pad_cubin(cubin: bytes) -> bytes:
    """Zero bytes up to the end of the ELF's program and section header tables: NVRTC's cubin as
    CuPy returns it can stop a few bytes short of them, which nvdisasm refuses."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("expected a 64-bit ELF cubin")
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    need = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return cubin + b"\0" * max(0, need - len(cubin))


def disassemble(cubin: bytes, tool: str | None = None) -> str:
    tool = tool or nvdisasm_path()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found (pip install nvidia-cuda-nvdisasm, or set SAGEBWD_NVDISASM)")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(pad_cubin(cubin))
        out = subprocess.run([tool, "-c", path], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {out.stderr[-1000:]}")
    return out.stdout


def compile_cubin(spec, arch: str) -> tuple:
    """(cubin bytes, NVRTC log) of ``spec`` for ``arch``, compiled now (no cache, no GPU)."""
    compiler = library.compiler()
    return compiler._nvrtc_compile(compiler.flatten_source(spec.filename), spec, arch)


def kernel_spec(kind: str, head_dim: int, causal: bool, arch: str, shared_limit: int, dtype: str = "float16"):
    """The mma.sync specialization the library launches for ``kind`` ("fwd" or "bwd": fine,
    non-deterministic, no Q-smoothing) on ``arch`` with ``shared_limit`` bytes of shared memory a block."""
    specs = library.specs()
    options = library.options()(causal=causal)  # fine, non-deterministic, no Q-smoothing: the defaults
    if kind == "fwd":
        return specs.forward_spec(head_dim, dtype, options, specs.FORWARD_TILES[head_dim])
    tiles, spec = specs.backward_kernel(head_dim, dtype, options, specs.BackwardTiles(2), arch, shared_limit)
    return spec


def profile_kernel(kind: str, head_dim: int, causal: bool, arch: str, shared_limit: int) -> dict:
    """Counts of one kernel: ``count_function``'s, with its registers, shared layout and spec key."""
    spec = kernel_spec(kind, head_dim, causal, arch, shared_limit)
    cubin, log = compile_cubin(spec, arch)
    counts = count_function(disassemble(cubin))
    reg = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    shared = re.search(r"sagebwd_cp dynamic shared bytes: (\d+)", log)
    defines = dict(spec.defines)
    threads = 32 * defines["SB_WARPS"] if kind == "fwd" else 256
    counts.update(kind=kind, head_dim=head_dim, causal=causal, arch=arch, spec=spec.key,
                  registers=int(reg.group(1)) if reg else None, shared_bytes=int(shared.group(1)) if shared else None,
                  threads=threads, stages=defines.get("SB_STAGES"),
                  spill_bytes=sum(map(int, spill.groups())) if spill else None,
                  cta_queries=(16 * defines["SB_WARPS"] * defines["SB_MT"]) if kind == "fwd" else None)
    return counts
