"""One call on a GPU machine (no network needed): install from the checkout, run the GPU tests,
run a short benchmark, print a compact summary last. ``--sanitize`` also runs compute-sanitizer's
memcheck, racecheck, synccheck and initcheck, in parallel processes, over the small case set of
``benchmarks/sanitize_cases.py`` (every kernel family and variant on tiny shapes) and puts their error
counts in the summary; 0 errors are required.  The test report (gpu-tests.xml), the benchmark's
bench.json and the sanitizer logs go to ``--out`` (default: ``$OUT`` if set, else
``benchmarks/out/gpu_check``, which the repository ignores).

    python benchmarks/gpu_check.py [--sanitize] [--skip-tests] [--skip-bench] [--bench-args ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")


def run(cmd, **kw):
    print("$", " ".join(cmd), flush=True)
    t = time.time()
    rc = subprocess.call(cmd, cwd=ROOT, **kw)
    return rc, time.time() - t


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        path = os.path.join(root, "bin", "compute-sanitizer")
        if root and os.path.isfile(path):
            return path
    return None


def sanitizer_errors(log: str):
    """The error count a compute-sanitizer log reports (racecheck: errors and warnings), or None."""
    m = re.search(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)", log)
    if m:
        return int(m.group(1)) + int(m.group(2))
    m = re.search(r"ERROR SUMMARY: (\d+) errors?", log)
    return int(m.group(1)) if m else None


def sanitize(out: str, timeout: float, quick: bool) -> tuple[int, list]:
    """Runs the case set once plainly (compiling its kernels, so that the sanitized runs only load them),
    then under each sanitizer tool at once; returns (status, summary lines)."""
    tool_path = _sanitizer()
    if tool_path is None:
        return 1, ["sanitize: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)"]
    cases = [sys.executable, os.path.join(ROOT, "benchmarks", "sanitize_cases.py")] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the kernel cache as configured: the plain pass fills it
    rc, dt = run(cases, env=env)
    lines = [f"sanitize: case set rc={rc} ({dt:.0f}s)"]
    if rc != 0:
        return rc, lines
    procs, t0 = {}, time.time()
    for tool in SANITIZER_TOOLS:
        log = open(os.path.join(out, f"sanitize-{tool}.log"), "w")
        cmd = [tool_path, "--tool", tool, "--error-exitcode", "1", "--print-limit", "20", *cases]
        print("$", " ".join(cmd), flush=True)
        procs[tool] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    status = 0
    for tool, (proc, log) in procs.items():
        try:
            proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        text = open(log.name, errors="replace").read()
        errors = sanitizer_errors(text)
        ok = proc.returncode == 0 and errors == 0
        status |= 0 if ok else 1
        what = "timed out" if proc.returncode in (-9, 137) else f"rc={proc.returncode}"
        lines.append(f"sanitize {tool}: {errors if errors is not None else '?'} errors, {what} "
                     f"({time.time() - t0:.0f}s; {os.path.basename(log.name)})")
    return status, lines


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-install", action="store_true")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--tests", default="tests", help="pytest target(s), space separated")
    ap.add_argument("--pytest-args", default="")
    ap.add_argument("--bench-args", default="--seqlens 4096 16384")
    ap.add_argument("--sanitize", action="store_true", help="also run compute-sanitizer over sanitize_cases.py")
    ap.add_argument("--sanitize-quick", action="store_true", help="the sanitizer over three cases only")
    ap.add_argument("--sanitize-timeout", type=float, default=900.0, help="seconds for the four sanitizer runs")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "out", "gpu_check"),
                    help="folder for gpu-tests.xml, bench.json and the sanitizer logs (default: %(default)s)")
    args = ap.parse_args(argv)
    out = args.out
    os.makedirs(out, exist_ok=True)
    summary = []
    status = 0
    if not args.skip_install:
        rc, dt = run([sys.executable, "-m", "pip", "install", "-q", "-e", ".", "--no-deps", "--no-build-isolation"])
        summary.append(f"install: rc={rc} ({dt:.0f}s)")
    rc, dt = run([sys.executable, "-m", "sagebwd_cp", "info"])
    summary.append(f"info/compile: rc={rc} ({dt:.0f}s)")
    if not args.skip_tests:
        junit = os.path.join(out, "gpu-tests.xml")
        rc, dt = run([sys.executable, "-m", "pytest", "-q", "-rs", f"--junitxml={junit}", *args.tests.split(),
                      *args.pytest_args.split()])
        summary.append(f"tests: rc={rc} ({dt:.0f}s)")
        status |= rc
    if args.sanitize or args.sanitize_quick:
        rc, lines = sanitize(out, args.sanitize_timeout, args.sanitize_quick)
        summary.extend(lines)
        status |= rc
    if not args.skip_bench:
        rc, dt = run([sys.executable, "benchmarks/bench_attention.py", "--json", os.path.join(out, "bench.json"),
                      *args.bench_args.split()])
        summary.append(f"bench: rc={rc} ({dt:.0f}s)")
        status |= rc
    print("\n== gpu_check summary ==\n" + "\n".join(summary))
    return status


if __name__ == "__main__":
    sys.exit(main())
