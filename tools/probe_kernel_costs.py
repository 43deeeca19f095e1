"""What a kernel's time responds to: probe trees that remove one piece of work (wrong results, on purpose)
and `ab_kernels.py` timing each against the checkout, so that this / probe says what the piece costs.

Each probe is a list of (text, replacement) edits to one kernel source; `build` writes this checkout's
`kernels/` and `ptx/` with the edits applied into `tools/ab_base/<probe>` (git-ignored; carry it to the GPU
machine), `check` only verifies that every edit still finds its text (CPU, also run by the tests), and `run`
builds and times them (GPU):

    python tools/probe_kernel_costs.py check
    python tools/probe_kernel_costs.py run --probes backward_loads backward_stores -- --passes bwd \\
        --seqlens 2048 8192 --head-dims 128 --causal both --granularities fine --dtype bfloat16

A probe's kernel computes garbage, so only its time means anything; the results are in
docs/history/PERFORMANCE_LOG.md.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import ab_kernels  # noqa: E402  (its source copier)

BASE_DIR = os.path.join(ROOT, "tools", "ab_base")
BACKWARD = "kernels/backward_wgmma.cu"

# name -> (what it removes, environment for both sides of the A/B, [(file, text, replacement)]).
PROBES = {
    "backward_loads": ("the wgmma backward's key-side loads (K̂, K̂ᵀ, V)", {}, [
        (BACKWARD, "    if (!WS || tid < THREADS) {  // (WS: the producer's threads load no key-side tile)",
         "    if (a.Lq < 0 && (!WS || tid < THREADS)) {  // PROBE: no key-side loads")]),
    "backward_stores": ("the wgmma backward's dK and dV stores", {}, [
        (BACKWARD, "        if (key >= fseq.len_k()) continue;",
         "        if (key >= fseq.len_k() || a.Lq >= 0) continue;  // PROBE: no dK, dV stores")]),
    "backward_dq_reductions": ("the wgmma backward's dQ bulk reductions", {}, [
        (BACKWARD, "        bulk_reduce_add_f32(a.dq_acc + row * DQ_PITCH, tile, DQ_TILE_BYTES);",
         "        if (a.Lq < 0) bulk_reduce_add_f32(a.dq_acc + row * DQ_PITCH, tile, DQ_TILE_BYTES);  // PROBE")]),
    "backward_ws_no_cta_barriers": ("the producer backward's CTA-wide barriers in the loop",
                                    {"SAGEBWD_BACKWARD_WS": "1"}, [
        (BACKWARD, "    if constexpr (WS) named_barrier<THREADS>(BAR_COMPUTE);",
         "    if constexpr (WS) return;  // PROBE: no CTA-wide barrier")]),
    "backward_ws_offset": ("the producer backward's CTA-wide barriers, the second warpgroup started half an "
                           "iteration behind the first", {"SAGEBWD_BACKWARD_WS": "1"}, [
        (BACKWARD, "    if constexpr (WS) named_barrier<THREADS>(BAR_COMPUTE);",
         "    if constexpr (WS) return;  // PROBE: no CTA-wide barrier"),
        (BACKWARD, "    for (int it = 0; it < n_it; ++it, advance(h, i)) {\n        // Every warp is done",
         "    if (WS && n_it > 0 && loop_wg() == 1) named_barrier<THREADS>(6);  // PROBE: start half an iteration "
         "behind\n    for (int it = 0; it < n_it; ++it, advance(h, i)) {\n        // Every warp is done"),
        (BACKWARD, "        if (DP_AFTER_P) issue_dp(wgmma_desc_lo<128>(sV)",
         "        if (WS && it == 0 && loop_wg() == 0) named_barrier_arrive<THREADS>(6);  // PROBE\n"
         "        if (DP_AFTER_P) issue_dp(wgmma_desc_lo<128>(sV)")]),
}


def probe_sources(name: str, root: str = ROOT) -> dict:
    """{relative path: edited text} of probe ``name`` applied to ``root``'s sources; raises if an edit's
    text is not found exactly once (the kernel changed under the probe)."""
    edited = {}
    for path, text, replacement in PROBES[name][2]:
        source = edited.get(path)
        if source is None:
            with open(os.path.join(root, path), encoding="utf-8") as f:
                source = f.read()
        count = source.count(text)
        if count != 1:
            raise ValueError(f"probe {name}: expected its text once in {path}, found it {count} times: {text!r}")
        edited[path] = source.replace(text, replacement)
    return edited


def build(name: str) -> str:
    """tools/ab_base/<name>: this checkout's kernels/ and ptx/ with the probe's edits."""
    out = os.path.join(BASE_DIR, name)
    ab_kernels._copy_sources(ROOT, out, ab_kernels.SOURCE_DIRS)
    for rel, text in probe_sources(name).items():
        with open(os.path.join(out, rel), "w", encoding="utf-8") as f:
            f.write(text)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Arguments after -- go to ab_kernels.py.")
    parser.add_argument("action", choices=("check", "build", "run"))
    parser.add_argument("--probes", nargs="+", choices=sorted(PROBES), default=sorted(PROBES))
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    bench_args = argv[split + 1:]  # after --: ab_kernels.py's arguments
    for name in args.probes:
        if args.action == "check":
            probe_sources(name)
            print(f"{name}: applies ({PROBES[name][0]})")
            continue
        base = build(name)
        if args.action == "run":
            env = {**os.environ, **PROBES[name][1]}
            print(f"== {name}: without {PROBES[name][0]} (this / probe)", flush=True)
            subprocess.run([sys.executable, os.path.join(ROOT, "tools", "ab_kernels.py"), "--base", base, *bench_args],
                           env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
