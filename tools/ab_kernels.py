"""A/B of kernel sources in one run: times our kernels as they are, then with another version's
``kernels/`` and ``ptx/`` swapped in, then as they are again (the repeat shows the run's noise),
and prints the three side by side. Compiled kernels are cached by source, so both versions build.

Prepare the other version where the checkout is (the folder is git-ignored; carry it to the GPU
machine with the run):

    git archive <commit> kernels ptx | tar -x -C tools/ab_base
    python tools/ab_kernels.py --passes fwd --seqlens 4096 16384 --head-dims 64 --causal both

With ``--base-env NAME=VALUE`` (repeatable) the base is instead these same sources run with those
environment settings, e.g. ``--base-env SAGEBWD_BACKWARD_WS=1`` against the default choice.

Every argument but ``--base``, ``--base-env`` and ``--bench`` goes to ``bench_attention.py``, or with
``--bench wide_head_dims`` to ``bench_wide_head_dims.py`` (our kernels only, in calls a second, 1000 / ms,
so that this / base stays above 1 where this is faster). The Python side of the checkout is
shared, so the two versions must take the same kernel arguments, unless the base folder also holds
the other version's ``sagebwd_cp/`` (``git archive <commit> kernels ptx sagebwd_cp``): then its
Python modules are swapped in too.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_DIRS = {"kernels": (".cu", ".cuh"), "ptx": (".cu", ".cuh")}
PYTHON_DIR = {"sagebwd_cp": (".py",)}  # swapped when the base holds it


def _copy_sources(src_root: str, dst_root: str, dirs: dict) -> None:
    """The files of ``dirs`` with their suffixes, subfolders included (sagebwd_cp/gpu/...)."""
    for d, suffixes in dirs.items():
        for folder, subdirs, names in os.walk(os.path.join(src_root, d)):
            subdirs[:] = [s for s in subdirs if s != "__pycache__"]
            rel = os.path.relpath(folder, src_root)
            os.makedirs(os.path.join(dst_root, rel), exist_ok=True)
            for name in names:
                if name.endswith(suffixes):
                    shutil.copy2(os.path.join(folder, name), os.path.join(dst_root, rel, name))


@contextlib.contextmanager
def swapped_sources(base: str, root: str | None = None):
    """``root``'s (default: this checkout's) kernel sources (and Python modules, where ``base`` holds them) replaced
    by ``base``'s inside the block, and its own put back after, whatever happened."""
    root = root or ROOT
    for d in SOURCE_DIRS:
        if not os.path.isdir(os.path.join(base, d)):
            raise SystemExit(f"--base: expected {os.path.join(base, d)} (git archive <commit> kernels ptx)")
    dirs = {**SOURCE_DIRS, **(PYTHON_DIR if all(os.path.isdir(os.path.join(base, d)) for d in PYTHON_DIR) else {})}
    saved = tempfile.mkdtemp()
    _copy_sources(root, saved, dirs)
    try:
        _copy_sources(base, root, dirs)
        yield
    finally:
        _copy_sources(saved, root, dirs)
        shutil.rmtree(saved, ignore_errors=True)


def _bench(bench_args, env=None, script="attention") -> dict:
    """{(d, causal, N, pass, impl): TOPS} of our rows, from bench_attention.py's table; or, script
    "wide_head_dims", {(shape, pass): calls a second} from bench_wide_head_dims.py's lines; or, script "kernels",
    {(shape, kernel): 1000 / µs} from tools/experiments/kernel_times.py (each kernel of one fwd+bwd)."""
    extra = ["--peers", "ours"] if script == "wide_head_dims" else []
    path = (os.path.join(ROOT, "tools", "experiments", "kernel_times.py") if script == "kernels" else
            os.path.join(ROOT, "benchmarks", f"bench_{script}.py"))
    out = subprocess.run([sys.executable, path, *bench_args, *extra],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise SystemExit(f"{os.path.basename(path)} failed:\n{out.stdout}\n{out.stderr}")
    rows = {}
    if script == "kernels":  # "<shape> <kernel> <µs>"
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) == 3:
                rows[(parts[0], "-", "-", parts[1], "ours")] = 1000.0 / float(parts[2])
        return rows
    if script == "wide_head_dims":  # "<shape>: ours <fwd ms>/<fwd+bwd ms>"
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] == "ours":
                fwd, fwdbwd = map(float, parts[2].split("/"))
                rows[(parts[0].rstrip(":"), "-", "-", "fwd", "ours")] = 1000.0 / fwd
                rows[(parts[0].rstrip(":"), "-", "-", "fwdbwd", "ours")] = 1000.0 / fwdbwd
        return rows
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 7 and parts[0].isdigit() and "sagebwd" in line:
            d, c, n, pas = parts[:4]
            tail = 6 if parts[-1].endswith("MiB") else 5  # ms, TOPS, xFA2, xcuDNN, %int8 (, peak)
            impl = " ".join(parts[4:-tail])
            tops = float(parts[-tail + 1])
            rows[(d, c, n, pas, impl)] = tops
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=os.path.join(ROOT, "tools", "ab_base"),
                    help="a folder holding the other version's kernels/ and ptx/")
    ap.add_argument("--base-env", action="append", default=[], metavar="NAME=VALUE",
                    help="compare with these sources under this environment setting instead of --base")
    ap.add_argument("--bench", choices=("attention", "wide_head_dims", "kernels"), default="attention",
                    help="the benchmark to time with (its arguments follow; kernels: the shapes of "
                         "tools/experiments/kernel_times.py, each kernel's 1000 / µs)")
    args, bench_args = ap.parse_known_args(argv)
    run = lambda env=None: _bench(bench_args, env, args.bench)  # noqa: E731
    if args.base_env:
        if any("=" not in item for item in args.base_env):
            raise SystemExit(f"--base-env: expected NAME=VALUE, got {args.base_env}")
        env = dict(item.split("=", 1) for item in args.base_env)
        first, base, again = run(), run(env), run()
        _print(first, base, again)
        return 0
    first = run()
    with swapped_sources(args.base):
        base = run()
    again = run()
    _print(first, base, again)
    return 0


def _print(first: dict, base: dict, again: dict) -> None:
    print(f"{'d':>3} c {'N':>6} {'pass':<6} {'impl':<26} {'this':>7} {'base':>7} {'again':>7} {'this/base':>9}")
    for key in first:
        t1, tb, t2 = first[key], base.get(key), again.get(key)
        ratio = f"{(t1 + t2) / 2 / tb:9.3f}" if tb and t2 else "        -"
        print(f"{key[0]:>3} {key[1]} {key[2]:>6} {key[3]:<6} {key[4]:<26} {t1:7.1f} "
              f"{tb if tb is not None else float('nan'):7.1f} {t2 if t2 is not None else float('nan'):7.1f} {ratio}")


if __name__ == "__main__":
    sys.exit(main())
