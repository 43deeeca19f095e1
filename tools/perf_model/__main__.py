"""python -m tools.perf_model {sass,count,fit} (from the repository root).

    sass   count the SASS of every mma.sync kernel the model uses (nvdisasm needed) into a JSON file
    count  any specs' SASS (mma.sync or wgmma) by key pattern: instructions a warp per main-loop iteration,
           by pipe and by opcode (nvdisasm needed), e.g. --arch sm_90 'backward.hd128.bfloat16.causal.fine.s2.wgmma'
    fit    read a calibration run's JSON (tools/perf_model/calibrate.py), fit, write the tables
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import fit as fit_mod

RESULTS = os.path.join("benchmarks", "results", "perf_model")
COUNTS = os.path.join(RESULTS, "sass_counts.json")
ARCHS = ("sm_90", "sm_89", "sm_120")


def cmd_sass(args) -> int:
    from . import library, sass

    tool = sass.nvdisasm_path()
    if tool is None:
        print("nvdisasm not found: pip install nvidia-cuda-nvdisasm (or set SAGEBWD_NVDISASM)", file=sys.stderr)
        return 2
    kernels = fit_mod.count_all(args.archs, fit_mod.shared_limits())
    out = {"tool": "python -m tools.perf_model sass", "nvrtc": list(library.compiler().nvrtc_version()),
           "nvdisasm": os.path.basename(os.path.dirname(os.path.dirname(tool))), "kernels": kernels}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    library.write_json(args.out, dict(sorted(out.items())))
    for key, c in sorted(kernels.items()):
        i = c["interior"]
        print(f"{key:28s} {c['spec']:44s} regs {c['registers']:3d} issue {i.get('issue', 0):5d} "
              f"tensor {i.get('tensor', 0):3d} fma {i.get('fma', 0):4d} alu {i.get('alu', 0):4d} xu {i.get('xu', 0):3d} "
              f"lsu {i.get('lsu', 0):4d} shared {i.get('shared_bytes', 0):6d} B")
    print(f"wrote {args.out}")
    return 0


def cmd_count(args) -> int:
    import fnmatch

    from . import library, sass

    if sass.nvdisasm_path() is None:
        print("nvdisasm not found: pip install nvidia-cuda-nvdisasm (or set SAGEBWD_NVDISASM)", file=sys.stderr)
        return 2
    specs = [s for s in library.specs().all_specs(args.arch) if any(fnmatch.fnmatch(s.key, p) for p in args.patterns)]
    if not specs:
        print(f"no spec of {args.arch} matches {args.patterns}", file=sys.stderr)
        return 2
    for spec in specs:
        cubin, log = sass.compile_cubin(spec, args.arch)
        reports = library.compiler().parse_ptxas_report(log)
        for name, text in sass.functions(sass.disassemble(cubin)).items():
            c = sass.count_function(text)
            i, e = c["interior"], c["edge"]
            regs = reports[name].registers if name in reports else "?"
            print(f"{spec.key} {name}: registers {regs}, loop instructions {c['loop']}; a warp "
                  f"an iteration: interior {i.get('issue', 0)} (edge {e.get('issue', 0)}): " +
                  ", ".join(f"{k} {i.get(k, 0)}" for k in sass.CLASSES))
            top = list(c["interior_opcodes"].items())[:args.top]
            print("  " + ", ".join(f"{op} {n}" for op, n in top))
    return 0


def cmd_fit(args) -> int:
    from . import library

    with open(args.calibration) as f:
        cal = json.load(f)
    if not cal.get("records"):
        print(f"{args.calibration}: no measured shapes", file=sys.stderr)
        return 2
    counts = fit_mod.load_counts(args.counts, ARCHS)
    text, summary = fit_mod.report(cal, counts, args.calibration)
    out_dir = os.path.join(args.out, cal["device"]["name"].replace(" ", "_"))
    os.makedirs(out_dir, exist_ok=True)
    if os.path.abspath(args.calibration) != os.path.abspath(os.path.join(out_dir, "calibration.json")):
        library.write_json(os.path.join(out_dir, "calibration.json"), cal)
    with open(os.path.join(out_dir, "model.md"), "w") as f:
        f.write(text)
    library.write_json(os.path.join(out_dir, "model.json"), summary)
    print(text)
    print(f"\nwrote {out_dir}/model.md, model.json, calibration.json")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.perf_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sass", help="count the mma.sync kernels' SASS")
    s.add_argument("--archs", nargs="+", default=list(ARCHS))
    s.add_argument("--out", default=COUNTS)
    c = sub.add_parser("count", help="any specs' SASS per main-loop iteration (mma.sync or wgmma)")
    c.add_argument("patterns", nargs="+", help="spec key globs (specs.all_specs)")
    c.add_argument("--arch", default="sm_90")
    c.add_argument("--top", type=int, default=25, help="opcodes listed (default 25)")
    f = sub.add_parser("fit", help="fit on a calibration run, predict the RTX 4090 and 5090")
    f.add_argument("--calibration", required=True, help="calibration.json written by tools/perf_model/calibrate.py")
    f.add_argument("--counts", default=COUNTS, help="SASS counts (missing archs are counted now)")
    f.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    return {"sass": cmd_sass, "count": cmd_count, "fit": cmd_fit}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
