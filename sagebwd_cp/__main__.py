"""Command line: ``python -m sagebwd_cp info`` and ``python -m sagebwd_cp compile --arch sm_89``.

``compile`` needs no GPU (NVRTC compiles for any ``sm_XX``), so it doubles as a pre-compile step
that fills the disk cache and as a check that no kernel spills registers.
"""
from __future__ import annotations

import argparse
import dataclasses
import platform
import re
import sys
import time

from . import __version__, compiler

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

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def ok(self) -> bool:
        return not self.error and self.spill_bytes == 0


def compile_all(arch: str, specs=None, *, use_disk_cache: bool = True) -> list:
    """Compile every specialization for ``arch``; one row per kernel entry, failures included."""
    if specs is None:
        from . import specs as specs_module

        specs = specs_module.all_specs(arch)
    rows = []
    for spec in specs:
        start = time.perf_counter()
        try:
            compiled = compiler.compile_spec(spec, arch, use_disk_cache=use_disk_cache)
        except (compiler.CompileError, FileNotFoundError) as exc:
            rows.append(KernelRow(spec.key, ",".join(spec.entries), arch, error=str(exc)))
            continue
        seconds = time.perf_counter() - start
        if not compiled.reports:
            # Some NVRTC builds ignore -Xptxas=-v: no report to check, which is not a failure.
            rows.extend(KernelRow(spec.key, entry, arch, -1, 0, 0, 0, seconds) for entry in spec.entries)
            continue
        for entry in spec.entries:
            report = compiled.reports.get(entry)
            if report is None:
                # ptxas reports every entry it compiled: a missing one is a misnamed kernel.
                rows.append(KernelRow(spec.key, entry, arch, seconds=seconds,
                                      error=f"ptxas reported no kernel named {entry!r}"))
                continue
            rows.append(KernelRow(spec.key, entry, arch, report.registers, report.stack_bytes,
                                  report.spill_stores, report.spill_loads, seconds))
    return rows


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


def _cuda_device():
    """(properties dict or None, why there is none)."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any import failure means no GPU path
        return None, f"cupy is not importable: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - the driver's message is the useful detail
        return None, str(exc)
    if count == 0:
        return None, "the CUDA driver reports 0 devices"
    device_id = cupy.cuda.Device().id
    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"]
    return {
        "id": device_id,
        "count": count,
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "arch": compiler.device_arch(device_id),
        "sms": props["multiProcessorCount"],
        "smem_optin": props["sharedMemPerBlockOptin"],
    }, ""


def _versions() -> list:
    out = [("python", platform.python_version()), ("sagebwd_cp", __version__)]
    try:
        import numpy

        out.append(("numpy", numpy.__version__))
    except ImportError as exc:
        out.append(("numpy", f"not importable ({exc})"))
    try:
        import cupy

        out.append(("cupy", cupy.__version__))
        out.append(("CUDA runtime", _cuda_version(cupy.cuda.runtime.runtimeGetVersion())))
    except Exception as exc:  # noqa: BLE001
        out.append(("cupy", f"not importable ({exc})"))
    try:
        out.append(("NVRTC", ".".join(map(str, compiler.nvrtc_version()))))
    except Exception as exc:  # noqa: BLE001
        out.append(("NVRTC", f"not available ({exc})"))
    return out


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def cmd_info(args) -> int:
    print(_table(("component", "version"), _versions()))
    print()
    device, why = _cuda_device()
    if device is None:
        print(f"No CUDA device present ({why}).")
        print("Host (NumPy) arrays run through the CPU emulator of the quantized algorithm.")
        print(f"Compiling every kernel for {CHECK_ARCH_WITHOUT_GPU} as a check that NVRTC works.")
        arch = CHECK_ARCH_WITHOUT_GPU
    else:
        arch = device["arch"]
        print(f"CUDA device {device['id']} of {device['count']}: {device['name']}")
        print(f"  arch {arch}, {device['sms']} SMs, "
              f"{device['smem_optin']} bytes opt-in shared memory per block")
        if arch not in compiler.SUPPORTED_ARCHS:
            print(f"  note: the kernels target {', '.join(compiler.SUPPORTED_ARCHS)}")
        print(f"Compiling every kernel for {arch}.")
    print()
    try:
        rows = compile_all(arch)
    except ImportError as exc:
        print(f"cannot compile: {exc} (install the cuda13 or cuda12 extra)", file=sys.stderr)
        return 1
    print(_table(("kernel", "registers", "spills"),
                 [(_kernel_name(r), "-" if r.error else r.registers, "ERROR" if r.error else r.spill_bytes)
                  for r in rows]))
    return _report_failures(rows)


def cmd_compile(args) -> int:
    archs = list(dict.fromkeys((args.arch or []) + (list(compiler.SUPPORTED_ARCHS) if args.all_archs else [])))
    if not archs:
        device, why = _cuda_device()
        if device is None:
            print(f"no --arch given and no CUDA device to take it from ({why}); "
                  f"name one, e.g. --arch sm_89, or --all-archs", file=sys.stderr)
            return 2
        archs = [device["arch"]]
    rows = []
    try:
        for arch in archs:
            rows += compile_all(arch, use_disk_cache=not args.no_cache)
    except ImportError as exc:
        print(f"cannot compile: {exc} (install the cuda13 or cuda12 extra)", file=sys.stderr)
        return 1
    print(_table(("kernel", "arch", "registers", "stack", "spill bytes", "seconds"),
                 [(_kernel_name(r), r.arch, *(("-",) * 3 if r.error else (r.registers, r.stack_bytes, r.spill_bytes)),
                   "ERROR" if r.error else f"{r.seconds:.2f}") for r in rows]))
    return _report_failures(rows)


def _arch(value: str) -> str:
    if not re.fullmatch(r"sm_\d+a?", value):
        raise argparse.ArgumentTypeError(f"expected an arch like sm_89, got {value!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sagebwd-cp", description="SageBwd INT8 attention: device report and kernel pre-compilation.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, the CUDA device, and a compile check of every kernel")
    info.set_defaults(func=cmd_info)
    comp = sub.add_parser("compile", help="compile every kernel for named archs (no GPU needed); "
                                          "exit 1 on a failure or a register spill")
    comp.add_argument("--arch", action="append", type=_arch, metavar="sm_XX",
                      help="target arch; repeat for several (default: the current device's)")
    comp.add_argument("--all-archs", action="store_true",
                      help=f"every supported arch: {', '.join(compiler.SUPPORTED_ARCHS)}")
    comp.add_argument("--no-cache", action="store_true", help="recompile even if the disk cache has the cubin")
    comp.set_defaults(func=cmd_compile)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
