"""The benchmark and accuracy report: speed, accuracy, memory, sliding windows and soft-capping, and head
dims above 128, in one call (what the measuring scripts share is in report_common.py).

    python benchmarks/report.py --all [--install] [--results-dir DIR] [--quick]

``--all`` runs report_speed.py, report_accuracy.py, report_memory.py, bench_windows.py and, for head dims
above 128, bench_wide_head_dims.py and report_accuracy.py at d=192 and 256 (each writes one JSON file into
DIR/<device>/, DIR defaulting to benchmarks/results; the windows' and the wide head dims' with their Markdown
tables beside them, windows.md: windows and a soft cap of 30 against FlexAttention and cuDNN; wide_head_dims.md:
d=256, 192 and 192/128 against cuDNN, FlashAttention-2 and FlexAttention; accuracy_wide_head_dims.json and its
table), then renders the Markdown tables and
charts next to them (README.md is left alone here: run render_report.py for that).  ``--install``
first installs the checkout (editable, no dependencies) and any wheel in benchmarks/wheels/.
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import render_report  # noqa: E402
from report_common import DEFAULT_RESULTS, HERE, ROOT, cuda_device_name, device_dir, log  # noqa: E402

# ---------------------------------------------------------------------------------------------
# One call for everything.

def _install() -> int:
    cmds = [[sys.executable, "-m", "pip", "install", "-q", "-e", ".", "--no-deps", "--no-build-isolation"]]
    wheels = sorted(glob.glob(os.path.join(HERE, "wheels", "*.whl")))
    if wheels:
        cmds.append([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *wheels])
    rc = 0
    for cmd in cmds:
        log("$ " + " ".join(cmd))
        rc = rc or subprocess.call(cmd, cwd=ROOT)
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="every part below")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--windows", action="store_true", help="sliding windows and soft-capping (bench_windows.py)")
    ap.add_argument("--wide-head-dims", action="store_true",
                    help="head dims 192 and 256, and 192/128 (bench_wide_head_dims.py, report_accuracy.py)")
    ap.add_argument("--install", action="store_true", help="pip install -e . and benchmarks/wheels/*.whl first")
    ap.add_argument("--results-dir", default=DEFAULT_RESULTS, help="parent of the <device>/ folder")
    ap.add_argument("--quick", action="store_true", help="a short smoke run of each")
    ap.add_argument("--no-render", action="store_true", help="write the JSON files only")
    args = ap.parse_args(argv)
    parts = [p for p in ("speed", "accuracy", "memory", "windows", "wide_head_dims") if args.all or getattr(args, p)]
    if not parts:
        ap.error("name what to measure: --all, or any of --speed --accuracy --memory --windows --wide-head-dims")

    if args.install and _install():
        log("install failed")
        return 1
    target = device_dir(args.results_dir, cuda_device_name())  # exits here without a GPU
    os.makedirs(target, exist_ok=True)
    common = ["--results-dir", args.results_dir] + (["--quick"] if args.quick else [])
    failed, times = [], {}
    for part in parts:
        # A process each: a fresh install is only importable in a new interpreter, and a failure (or a
        # sticky CUDA error) in one measurement cannot take the others down.
        start = time.time()
        cmd = [sys.executable, os.path.join(HERE, f"report_{part}.py"), *common]
        if part == "windows":
            quick = ["--shapes", "1x16x4x4096x1024", "--reps", "3"] if args.quick else []
            cmd = [sys.executable, os.path.join(HERE, "bench_windows.py"), "--softcap", "30", *quick,
                   "--json", os.path.join(target, "windows.json")]
        cmds = [cmd]
        if part == "wide_head_dims":
            quick = ["--shapes", "1x16x4x2048x256", "2x16x4x2048x192x128", "--reps", "3"] if args.quick else []
            cmds = [[sys.executable, os.path.join(HERE, "bench_wide_head_dims.py"), *quick,
                     "--json", os.path.join(target, "wide_head_dims.json")],
                    # granularity "fine" alone: the wide kernels take no "paper"
                    [sys.executable, os.path.join(HERE, "report_accuracy.py"), "--configs", "192:1024", "256:1024",
                     "--sigmas", *(["1", "5"] if args.quick else ["1", "3", "5"]), "--granularities", "fine",
                     "--out", os.path.join(target, "accuracy_wide_head_dims.json")]]
        rc = 0
        for c in cmds:
            log("$ " + " ".join(c))
            rc = subprocess.call(c, cwd=ROOT) or rc
        if part == "wide_head_dims" and not rc and not args.no_render:  # the d=192 and 256 accuracy's table
            render_report.render_wide_accuracy(target)
        times[part] = time.time() - start
        if rc:
            failed.append(part)
    if not args.no_render and set(parts) & {"speed", "accuracy", "memory"}:  # (the bench_ scripts render their own)
        try:
            render_report.render(target, readme=None)
            loaded = [render_report.load(os.path.join(target, f"{n}.json")) for n in ("speed", "accuracy", "memory")]
            print("\n" + render_report.headline(*loaded, target))
        except Exception:  # noqa: BLE001 - the JSON files are what matter; rendering can run later anywhere
            traceback.print_exc()
            failed.append("render")
    log("\n== report ==\n" + "\n".join(f"{p}: {'FAILED' if p in failed else 'ok'} ({times[p]:.0f} s)" for p in parts)
        + ("\nrender: FAILED" if "render" in failed else "") + f"\nresults in {target}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
