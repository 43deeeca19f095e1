"""Command line: ``python -m sagebwd_cp info`` and ``python -m sagebwd_cp compile --arch sm_89``
(with no command, the help).

``info`` is quick: versions (the library, Python, NumPy, torch, CuPy, JAX, NVRTC, each "not installed"
where absent), the kernel cache, the kernels each arch takes, every visible GPU or their absence,
and one kernel compiled.
``compile`` builds every specialization, one process per core, and needs no GPU (NVRTC compiles
for any ``sm_XX``), so it doubles as a pre-compile step that fills the disk cache and as the check
that no kernel spills registers (exit 1 if one does or fails to compile).
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import importlib.metadata
import importlib.util
import platform
import sys
import time

from . import __version__
from .options import AttentionOptions
from .gpu import compiler, coverage, specs as kernel_specs
from .gpu.device import cuda_device, cuda_devices

CHECK_ARCH_WITHOUT_GPU = "sm_90"


@dataclasses.dataclass
class KernelRow:
    """One kernel entry of one specialization, compiled for one arch."""

    key: str
    entry: str
    arch: str
    registers: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    seconds: float = 0.0
    error: str = ""
    ptxas_level: int = 3  # compiler.SPILL_FALLBACK_LEVEL where -O3 spilled (compiler.SPILL_FALLBACK_ARCHS)

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def ok(self) -> bool:
        return not self.error and self.spill_bytes == 0


def _rows(spec, arch: str, result, seconds: float) -> list:
    """The rows of one specialization's compile: ``result`` is its CompiledKernel or the exception."""
    if isinstance(result, BaseException):
        return [KernelRow(spec.key, ",".join(spec.entries), arch, error=str(result))]
    if not result.reports:
        # Some NVRTC builds ignore -Xptxas=-v: no report to check, which is not a failure.
        return [KernelRow(spec.key, entry, arch, -1, 0, 0, 0, seconds) for entry in spec.entries]
    rows = []
    for entry in spec.entries:
        report = result.reports.get(entry)
        if report is None:
            # ptxas reports every entry it compiled: a missing one is a misnamed kernel.
            rows.append(KernelRow(spec.key, entry, arch, seconds=seconds,
                                  error=f"ptxas reported no kernel named {entry!r}"))
            continue
        rows.append(KernelRow(spec.key, entry, arch, report.registers, report.stack_bytes,
                              report.spill_stores, report.spill_loads, seconds, ptxas_level=result.ptxas_level))
    return rows


def compile_pairs(pairs, *, use_disk_cache: bool = True, jobs: int = 1, progress=None) -> list:
    """Compile ``(spec, arch)`` pairs, ``jobs`` processes at a time; rows in the pairs' order,
    failures included.  ``progress``, if given, is called once per finished specialization."""
    pairs = list(pairs)
    done = [None] * len(pairs)
    for i, result, seconds in compiler.compile_many(pairs, jobs=jobs, use_disk_cache=use_disk_cache):
        done[i] = _rows(*pairs[i], result, seconds)
        if progress is not None:
            progress()
    return [row for rows in done for row in rows]


def compile_all(arch: str, specs=None, *, use_disk_cache: bool = True, jobs: int = 1) -> list:
    """Compile every specialization for ``arch``; one row per kernel entry, failures included."""
    if specs is None:
        specs = kernel_specs.all_specs(arch)
    return compile_pairs([(spec, arch) for spec in specs], use_disk_cache=use_disk_cache, jobs=jobs)


def representative_spec(arch: str):
    """The kernel ``info`` compiles: the forward a float16 call at head dim 128 launches on ``arch``."""
    return kernel_specs.forward_spec(128, "float16", AttentionOptions(), kernel_specs.forward_tiles(128, arch=arch))


def _table(header, rows) -> str:
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    return "\n".join(lines)


def _kernel_name(row: KernelRow) -> str:
    return f"{row.key}:{row.entry}"


def _report_failures(rows) -> int:
    """Print what went wrong to stderr; the exit code (0 or 1)."""
    bad = [r for r in rows if not r.ok]
    for r in bad:
        if r.error:
            print(f"FAILED {_kernel_name(r)} [{r.arch}]: {r.error}", file=sys.stderr)
        else:
            print(f"SPILLS {_kernel_name(r)} [{r.arch}]: {r.spill_stores} bytes stored, "
                  f"{r.spill_loads} bytes loaded", file=sys.stderr)
    if bad:
        print(f"{len(bad)} of {len(rows)} kernels failed to compile or spill registers", file=sys.stderr)
    return 1 if bad else 0


NOT_INSTALLED = "not installed"


def _installed_version(module: str, distribution: str) -> str:
    """The installed version of an optional framework, read from its metadata without importing it
    (importing torch or JAX takes seconds), or NOT_INSTALLED."""
    if importlib.util.find_spec(module) is None:
        return NOT_INSTALLED
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "installed, version unknown"


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 100 else text[:97] + "..."


def _versions() -> list:
    """(component, version) of the library, Python, NumPy, the frameworks (torch, CuPy, JAX) and NVRTC,
    "not installed" for those absent."""
    import numpy

    out = [("sagebwd_cp", __version__), ("python", platform.python_version()), ("numpy", numpy.__version__),
           ("torch", _installed_version("torch", "torch"))]
    cupy = None
    if importlib.util.find_spec("cupy") is None:
        out.append(("cupy", NOT_INSTALLED))
    else:
        try:
            import cupy
        except Exception as exc:  # noqa: BLE001 - a broken install: say what failed
            out.append(("cupy", f"not importable ({_short(exc)})"))
        else:
            out.append(("cupy", cupy.__version__))
    out.append(("jax", _installed_version("jax", "jax")))
    if cupy is None:
        out.append(("NVRTC", f"{NOT_INSTALLED} (it comes with CuPy's CUDA extra: cuda13 or cuda12)"))
    else:
        try:
            out.append(("NVRTC", ".".join(map(str, compiler.nvrtc_version()))))
        except Exception as exc:  # noqa: BLE001 - CuPy without the NVRTC library
            out.append(("NVRTC", f"{NOT_INSTALLED} ({_short(exc)})"))
        try:
            out.append(("CUDA runtime", _cuda_version(cupy.cuda.runtime.runtimeGetVersion())))
        except Exception as exc:  # noqa: BLE001
            out.append(("CUDA runtime", f"{NOT_INSTALLED} ({_short(exc)})"))
    return out


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _cache_dir_text() -> str:
    try:
        return str(compiler.cache_dir())
    except OSError as exc:
        return f"not writable ({exc})"


def _device_line(d: dict, current: bool) -> str:
    return (f"CUDA device {d['id']} of {d['count']}{' (current)' if current and d['count'] > 1 else ''}: "
            f"{d['name']}, {d['arch']}, {d['sms']} SMs, {d['smem_optin']} bytes opt-in shared memory per block\n"
            f"  {d['arch']}: {kernel_specs.kernel_family(d['arch'])}")


def _runs_kernels(arch: str) -> bool:
    """Whether a device of ``arch`` runs the kernels (as cubins or PTX): sm_80 and newer."""
    number = arch.removeprefix("sm_")
    return number.isdigit() and int(number) >= 80


def cmd_info(args) -> int:
    print(_table(("component", "version"), _versions()))
    print(f"kernel cache: {_cache_dir_text()}")
    print("kernels by arch:")
    for archs, family in kernel_specs.kernel_families():
        print(f"  {archs}: {family}")
    print(f"  other archs from sm_80 on: {kernel_specs.PTX_FAMILY.format(target='the newest of those above, below their own')}")
    print("  archs below sm_80: not supported")
    print()
    devices, why = cuda_devices()
    status = 0
    if not devices:
        print(why)
        archs = [CHECK_ARCH_WITHOUT_GPU]
        print(f"Compiling one kernel for {archs[0]} as a check that NVRTC works "
              f"(every kernel: python -m sagebwd_cp compile --arch {archs[0]}).")
    else:
        current, _ = cuda_device()
        for d in devices:
            print(_device_line(d, d["id"] == current["id"]))
        if not _runs_kernels(current["arch"]):
            print(f"the kernels need sm_80 or newer, not {current['arch']} (CUDA device "
                  f"{current['id']}); host arrays still run on the CPU emulator", file=sys.stderr)
            status = 1
        archs = list(dict.fromkeys(d["arch"] for d in devices if _runs_kernels(d["arch"])))
        if not archs:
            return status
        print(f"Compiling one kernel for {', '.join(archs)} (every kernel: python -m sagebwd_cp compile).")
    print()
    try:
        rows = compile_pairs([(representative_spec(arch), arch) for arch in archs])
    except ImportError as exc:
        print(f"cannot compile: {exc} (install the cuda13 or cuda12 extra)", file=sys.stderr)
        return 1
    print(_table(("kernel", "arch", "registers", "spills", "seconds"),
                 [(_kernel_name(r), r.arch, "-" if r.error else r.registers, "ERROR" if r.error else r.spill_bytes,
                   f"{r.seconds:.1f}") for r in rows]))
    return _report_failures(rows) or status


def cmd_compile(args) -> int:
    archs = list(dict.fromkeys((args.arch or []) + (list(compiler.SUPPORTED_ARCHS) if args.all_archs else [])))
    if not archs:
        device, why = cuda_device()
        if device is None:
            print(f"no --arch given and no CUDA device to take it from ({why}); "
                  f"name one, e.g. --arch sm_89, or --all-archs", file=sys.stderr)
            return 2
        archs = [device["arch"]]
    from tqdm import tqdm

    jobs = args.jobs or compiler.default_jobs()
    print(f"kernel cache: {_cache_dir_text()}", flush=True)
    start = time.perf_counter()
    try:
        listed = kernel_specs.all_specs_many(archs, jobs=jobs)
        pairs = [(spec, arch) for arch in archs for spec in listed[arch]
                 if not args.only or any(fnmatch.fnmatchcase(spec.key, p) for p in args.only)]
        if args.once:  # a key's first pair: the first named arch that launches it
            pairs = list({spec.key: (spec, arch) for spec, arch in reversed(pairs)}.values())[::-1]
        if args.cover:
            pairs = coverage.covering_pairs(pairs)
        if not pairs:
            print(f"no specialization matches --only {' '.join(args.only)} (keys look like "
                  f"{representative_spec(archs[0]).key})", file=sys.stderr)
            return 2
        workers = min(jobs, len(pairs))
        print(f"compiling {len(pairs)} specializations for {', '.join(archs)} in {workers} "
              f"process{'es' if workers > 1 else ''}", flush=True)
        # The bar goes to stderr and shows only on a terminal; the table below goes to stdout.
        with tqdm(total=len(pairs), unit="kernel", desc="compiling", file=sys.stderr, disable=None) as bar:
            rows = compile_pairs(pairs, use_disk_cache=not args.no_cache, jobs=jobs, progress=bar.update)
    except ImportError as exc:
        print(f"cannot compile: {exc} (install the cuda13 or cuda12 extra)", file=sys.stderr)
        return 1
    print(_table(("kernel", "arch", "registers", "stack", "spill bytes", "ptxas", "seconds"),
                 [(_kernel_name(r), r.arch,
                   *(("-",) * 4 if r.error else (r.registers, r.stack_bytes, r.spill_bytes, f"-O{r.ptxas_level}")),
                   "ERROR" if r.error else f"{r.seconds:.2f}") for r in rows]))
    status = _report_failures(rows)
    if status == 0:
        lowered = sum(r.ptxas_level != 3 for r in rows)
        print(f"{len(rows)} kernels compiled for {', '.join(archs)} without register spills "
              f"in {time.perf_counter() - start:.0f} s" +
              (f" ({lowered} at ptxas -O{compiler.SPILL_FALLBACK_LEVEL}, where -O3 spilled)" if lowered else ""))
    return status


def _arch(value: str) -> str:
    if value not in compiler.SUPPORTED_ARCHS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(compiler.SUPPORTED_ARCHS)}, got {value!r}")
    return value


def _jobs(value: str) -> int:
    try:
        jobs = int(value)
    except ValueError:
        jobs = -1
    if jobs < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of processes (0: one per core), got {value!r}")
    return jobs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sagebwd-cp", description="SageBwd INT8 attention: device report and kernel pre-compilation.")
    sub = parser.add_subparsers(dest="command", metavar="{info,compile}")
    info = sub.add_parser("info", help="versions (library, torch, CuPy, JAX, NVRTC), the kernel cache, each CUDA "
                                       "device and the kernels it runs, and a compile check of one kernel")
    info.set_defaults(func=cmd_info)
    comp = sub.add_parser("compile", help="compile every kernel for named archs (no GPU needed); "
                                          "exit 1 on a failure or a register spill")
    comp.add_argument("--arch", action="append", type=_arch, metavar="sm_XX",
                      help="target arch; repeat for several (default: the current device's)")
    comp.add_argument("--all-archs", action="store_true",
                      help=f"every supported arch: {', '.join(compiler.SUPPORTED_ARCHS)}")
    comp.add_argument("--jobs", "-j", type=_jobs, default=0, metavar="N",
                      help="compile in N processes (default 0: one per core)")
    comp.add_argument("--only", action="append", metavar="PATTERN",
                      help="only the specializations whose key matches this glob, e.g. 'forward.hd128.*'; repeatable")
    comp.add_argument("--once", action="store_true",
                      help="each specialization once, for the first named arch that launches it (CI: --arch sm_86 "
                           "--arch sm_80 --arch sm_90 --once --cover)")
    comp.add_argument("--cover", action="store_true",
                      help="a covering set of them: per kernel file and arch, every option of the keys, present or "
                           "absent, alone, in pairs and in triples, in some compiled specialization (a quarter of them)")
    comp.add_argument("--no-cache", action="store_true", help="recompile even if the disk cache has the cubin")
    comp.set_defaults(func=cmd_compile)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # no command: what there is to run
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
