"""Compile an experiment kernel of this folder with a library spec's defines (NVRTC, no GPU) and print ptxas's
registers and spills: `python tools/experiments/registers.py backward_4wg.cu backward.hd128.bfloat16.causal.fine.s2.wgmma`."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from sagebwd_cp.gpu import compiler, specs  # noqa: E402
from tools.perf_model import sass  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("source", help="a .cu file of tools/experiments")
    ap.add_argument("spec", help="the library spec whose defines it takes")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("-D", action="append", default=[], help="NAME=VALUE: a define added or replaced")
    args = ap.parse_args(argv)
    spec = next(s for s in specs.all_specs(args.arch) if s.key == args.spec)
    defines = dict(spec.defines)
    defines.update(dict(d.split("=", 1) for d in args.D))
    spec = dataclasses.replace(spec, filename=args.source, defines=tuple(sorted(defines.items())), layout=False)
    _, log = sass.compile_cubin(spec, args.arch, (HERE, *compiler.source_dirs()))
    for entry, report in compiler.parse_ptxas_report(log).items():
        print(f"{args.source} ({args.spec} defines, {args.arch}): {entry} {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
