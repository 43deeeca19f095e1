"""One call on a GPU machine (no network needed): install from the checkout, run the GPU tests,
run a short benchmark, print a compact summary last.

    python benchmarks/gpu_check.py [--quick] [--bench-args ...]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, **kw):
    print("$", " ".join(cmd), flush=True)
    t = time.time()
    rc = subprocess.call(cmd, cwd=ROOT, **kw)
    return rc, time.time() - t


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-install", action="store_true")
    ap.add_argument("--tests", default="tests", help="pytest target(s), space separated")
    ap.add_argument("--pytest-args", default="")
    ap.add_argument("--bench-args", default="--seqlens 4096 16384")
    args = ap.parse_args(argv)
    out = os.environ.get("OUT", ROOT)
    summary = []
    if not args.skip_install:
        rc, dt = run([sys.executable, "-m", "pip", "install", "-q", "-e", ".", "--no-deps", "--no-build-isolation"])
        summary.append(f"install: rc={rc} ({dt:.0f}s)")
    rc, dt = run([sys.executable, "-m", "sagebwd_cp", "info"])
    summary.append(f"info/compile: rc={rc} ({dt:.0f}s)")
    junit = os.path.join(out, "gpu-tests.xml")
    rc_t, dt = run([sys.executable, "-m", "pytest", "-q", "-rs", f"--junitxml={junit}", *args.tests.split(),
                    *args.pytest_args.split()])
    summary.append(f"tests: rc={rc_t} ({dt:.0f}s)")
    rc_b, dt = run([sys.executable, "benchmarks/bench_attention.py", "--json", os.path.join(out, "bench.json"),
                    *args.bench_args.split()])
    summary.append(f"bench: rc={rc_b} ({dt:.0f}s)")
    print("\n== gpu_check summary ==\n" + "\n".join(summary))
    return rc_t or rc_b


if __name__ == "__main__":
    sys.exit(main())
