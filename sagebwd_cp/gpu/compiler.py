"""Run-time kernel compiler: NVRTC (through CuPy's bindings), an in-process and an on-disk cache.

A kernel specialization (``KernelSpec``) is one ``kernels/*.cu`` file plus compile-time defines,
named by a readable key such as ``forward.hd128.float16.causal``.  Its source is flattened: every
``#include "x.cuh"`` of ours is inlined once, so the hash of the flattened text covers every
header (CuPy's own cache does not hash ``-I`` headers).  The cache key also covers the options,
the target arch and the NVRTC version.  NVRTC needs no GPU, so every specialization can be
compiled for any ``sm_XX`` on a CPU-only machine; loading the cubin needs the device.

The archs the library builds (``SUPPORTED_ARCHS``) get a cubin of their own.  A newer GPU whose arch
is not among them (or that this NVRTC cannot target) gets PTX for the newest built arch below its own
that NVRTC knows (``compile_target``), which the driver JIT-compiles when the module is loaded.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import os
import re
import threading
from pathlib import Path

from .. import numerics
from . import kernel_cache
from .device import device_arch

# The archs built as cubins (sm_90 also as sm_90a, its wgmma kernels); every other arch from sm_80 on
# runs PTX (compile_target).
SUPPORTED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")
# Blackwell's ptxas (NVRTC 13.5) spills kernels that sm_80-sm_90's allocate without: the mma.sync backward,
# 8-56 bytes in 14 of its 48 kernels at head dim 128 on sm_100; 8-176 bytes in 44 of 48 at 128 and 8-40
# in the 8 two-CTA kernels at 64 on sm_120. For these archs a kernel that spills at ptxas's default
# level (-O3) is compiled again at SPILL_FALLBACK_LEVEL, where none of them spills: in the kernels whose
# SASS was counted (tools/perf_model's counter) the main loop then issues 2% fewer to 24% more
# instructions than at -O3, mostly within 1% at head dim 128; not measured on a GPU. The log says so
# (CompiledKernel.ptxas_level). On the other archs a spill stays a failure (``compile`` exits 1).
SPILL_FALLBACK_ARCHS = ("sm_100", "sm_120")
SPILL_FALLBACK_LEVEL = 1
_LEVEL_LOG = "sagebwd_cp ptxas level: "
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_BASE_OPTIONS = ("-std=c++17", "-Xptxas=-v", "--device-as-default-execution-space")


class CompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries NVRTC's log."""


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"cannot locate the kernel sources (package {name!r} is missing)")
    return Path(list(spec.submodule_search_locations)[0])


def source_dirs() -> tuple:
    """Where the kernel sources live: ``kernels/`` first, then ``ptx/``."""
    return (_package_dir("sagebwd_cp.kernels"), _package_dir("sagebwd_cp.ptx"))


def flatten_source(filename: str, dirs=None) -> str:
    """The kernel file with each of our headers inlined once (``#pragma once`` semantics)."""
    dirs = tuple(dirs or source_dirs())
    seen = set()

    def find(name):
        for d in dirs:
            p = Path(d) / name
            if p.is_file():
                return p
        raise FileNotFoundError(f"kernel source {name!r} not found in {[str(d) for d in dirs]}")

    def expand(name):
        if name in seen:
            return ""
        seen.add(name)
        text = find(name).read_text()
        text = text.replace("#pragma once", "")
        body = _INCLUDE.sub(lambda m: expand(m.group(1)), text)
        return f"// ---- {name} ----\n{body}\n"

    return expand(filename)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One specialization: a source file, its defines and the kernels it exports."""

    key: str
    filename: str
    defines: tuple  # ((name, value), ...), sorted
    entries: tuple  # extern "C" kernel names
    layout: bool = False  # the file defines DYNAMIC_SHARED_BYTES, its kernels' shared layout (read back)

    def options(self, arch: str, ptxas_level: int = 3) -> tuple:
        """NVRTC's options for ``arch``: ``sm_XX`` (a cubin) or ``compute_XX`` (PTX); ptxas at
        ``ptxas_level`` (-O; 3, its default, unless SPILL_FALLBACK_ARCHS' retry asks for less)."""
        defs = dict(numerics.compile_defines())
        defs.update(dict(self.defines))
        if defs.get("SB_WGMMA"):  # wgmma needs the arch-specific target (sm_90a runs on sm_90 only)
            arch = arch if arch.endswith("a") else arch + "a"
        flags = [f"--gpu-architecture={arch}", *_BASE_OPTIONS]
        if ptxas_level != 3:
            flags.append(f"-Xptxas=-O{ptxas_level}")
        flags += [f"-D{k}={v}" for k, v in sorted(defs.items())]
        return tuple(flags)


def make_spec(key: str, filename: str, entries, layout: bool = False, **defines) -> KernelSpec:
    return KernelSpec(key, filename, tuple(sorted(defines.items())), tuple(entries), layout)


def nvrtc_version() -> tuple:
    from cupy_backends.cuda.libs import nvrtc

    return tuple(nvrtc.getVersion())


def _arch_number(arch: str) -> int:
    """30 of ``sm_30``, 120 of ``sm_120a`` or ``compute_120``; ValueError for anything else."""
    m = re.fullmatch(r"(?:sm|compute)_(\d+)a?", arch)
    if not m:
        raise ValueError(f"arch: expected sm_XX, e.g. {', '.join(SUPPORTED_ARCHS)}, got {arch!r}")
    return int(m.group(1))


@functools.lru_cache(maxsize=None)
def nvrtc_archs() -> tuple:
    """The ``sm_XX`` this NVRTC can target (``nvrtcGetSupportedArchs``); where CuPy's binding lacks the
    call or it fails, the archs the library builds, assumed known (compiling one then says if not)."""
    from cupy_backends.cuda.libs import nvrtc

    try:
        numbers = nvrtc.getSupportedArchs()
    except Exception:  # noqa: BLE001 - an older binding (AttributeError) or NVRTC's own error
        return SUPPORTED_ARCHS
    return tuple(f"sm_{n}" for n in numbers)


def compile_target(arch: str, known=None) -> str:
    """What a device of ``arch`` runs: ``arch`` itself (a cubin) where the library builds it and NVRTC
    (``known``: its archs, default ``nvrtc_archs()``) can target it; else ``compute_XX``, PTX for the
    newest such arch below ``arch`` (PTX runs on its own arch and every later one), which the driver
    JIT-compiles at load. ``sm_90a`` stays itself. ValueError below sm_80."""
    number = _arch_number(arch)
    if number < 80 or arch.startswith("compute_"):
        raise ValueError(f"arch: expected sm_80 or newer (e.g. {', '.join(SUPPORTED_ARCHS)}), got {arch!r}; "
                         "the kernels' INT8 tensor-core products and asynchronous copies need sm_80")
    known = set(nvrtc_archs() if known is None else known)
    base = arch.removesuffix("a")
    if base in SUPPORTED_ARCHS and base in known:
        return arch
    below = [a for a in SUPPORTED_ARCHS if a in known and _arch_number(a) <= number]
    if not below:
        raise ValueError(f"arch: this NVRTC ({'.'.join(map(str, nvrtc_version()))}) targets none of "
                         f"{', '.join(SUPPORTED_ARCHS)} up to {arch}")
    return "compute_" + str(max(_arch_number(a) for a in below))


def is_ptx(target: str) -> bool:
    return target.startswith("compute_")


def cache_key(spec: KernelSpec, arch: str, source: str | None = None) -> str:
    src = flatten_source(spec.filename) if source is None else source
    h = hashlib.sha256()
    fallback = f"-O{SPILL_FALLBACK_LEVEL} where -O3 spills" if arch in SPILL_FALLBACK_ARCHS else ""
    for part in (src, "\0".join(spec.options(arch)), arch, repr(nvrtc_version()), repr(spec.entries), repr(spec.layout),
                 fallback):
        h.update(part.encode())
        h.update(b"\1")
    return h.hexdigest()[:32]


def cache_dir() -> Path:
    d = os.environ.get("SAGEBWD_CP_CACHE_DIR")
    path = Path(d) if d else Path.home() / ".cache" / "sagebwd_cp"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclasses.dataclass
class ResourceReport:
    """ptxas's report for one kernel entry."""

    name: str
    registers: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    shared_bytes: int = 0

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def parse_ptxas_report(log: str) -> dict:
    """Per-entry registers, stack frame, spills and static shared memory from ``-Xptxas=-v``."""
    reports = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([A-Za-z_]\w*)'?", line)
        if m:
            current = reports.setdefault(m.group(1), ResourceReport(m.group(1)))
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current.registers = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            current.shared_bytes = int(m.group(1))
    return reports


# The dynamic shared memory of a file's launches (its layout struct's size) is read back without a
# device: NVRTC names the instantiation below by its mangled name, which spells the value.
_LAYOUT_EXPRESSION = "&sb_dynamic_shared_bytes<DYNAMIC_SHARED_BYTES>"
_LAYOUT_LOG = "sagebwd_cp dynamic shared bytes: "


def _layout_bytes(log: str) -> int | None:
    m = re.search(re.escape(_LAYOUT_LOG) + r"(\d+)", log)
    return int(m.group(1)) if m else None


@dataclasses.dataclass
class CompiledKernel:
    spec: KernelSpec
    arch: str  # the compile target: sm_XX (a cubin) or compute_XX (PTX, compile_target)
    key: str
    cubin_path: Path  # the image the driver loads: the cubin, or the PTX it JIT-compiles
    log: str
    reports: dict  # ptxas's, per kernel entry (none for PTX: ptxas runs in the driver)

    @property
    def ptx(self) -> bool:
        return is_ptx(self.arch)

    @property
    def ptxas_level(self) -> int:
        """ptxas's -O of the cubin: 3, or SPILL_FALLBACK_LEVEL where -O3 spilled."""
        m = re.search(re.escape(_LEVEL_LOG) + r"(\d+)", self.log)
        return int(m.group(1)) if m else 3

    @property
    def shared_bytes(self) -> int:
        """The dynamic shared memory a launch of this spec needs (``layout`` specs only)."""
        value = _layout_bytes(self.log)
        if value is None:
            raise ValueError(f"{self.spec.key}: no shared layout was read back (KernelSpec.layout is not set)")
        return value


_memory_cache: dict = {}
_lock = threading.Lock()


def compile_spec(spec: KernelSpec, arch: str, *, use_disk_cache: bool = True) -> CompiledKernel:
    """Compile ``spec`` for a device of ``arch`` (no GPU needed): a cubin, or PTX where
    ``compile_target`` says so (its own cache entries: the target is part of the key and the name);
    cached in memory and on disk."""
    target = compile_target(arch)
    source = flatten_source(spec.filename)
    key = cache_key(spec, target, source)
    with _lock:
        hit = _memory_cache.get(key)
    if hit is not None:
        return hit
    directory = cache_dir()
    cubin_path = directory / f"{spec.key}.{target}.{key}.{'ptx' if is_ptx(target) else 'cubin'}"
    # checked against the size and hashes recorded at write time; a damaged entry is recompiled
    log = kernel_cache.load_or_compile(cubin_path, lambda: _compile_image(source, spec, target), use_disk_cache)
    result = CompiledKernel(spec, target, key, cubin_path, log, parse_ptxas_report(log))
    with _lock:  # threads that raced here all get the first one's entry
        result = _memory_cache.setdefault(key, result)
    return result


def _compile_image(source: str, spec: KernelSpec, target: str):
    """(image, log) of ``spec`` for ``target``: ``_nvrtc_compile``'s, or, where ``target`` is one of
    SPILL_FALLBACK_ARCHS and ptxas's default level spills, the compile at SPILL_FALLBACK_LEVEL."""
    image, log = _nvrtc_compile(source, spec, target)
    if target in SPILL_FALLBACK_ARCHS and any(r.spills for r in parse_ptxas_report(log).values()):
        image, log = _nvrtc_compile(source, spec, target, SPILL_FALLBACK_LEVEL)
        log += f"\n{_LEVEL_LOG}{SPILL_FALLBACK_LEVEL} (-O3 spilled)\n"
    return image, log


def front_end_options(version: tuple) -> tuple:
    """Options that only shorten NVRTC's work: ``--minimal`` (NVRTC 12.4 on) leaves out the runtime API's
    declarations, which no kernel here uses; the machine code is the same (checked on 36 specs of
    sm_80-90, NVRTC 13.0 and 13.5), the compile 7-13% shorter.  Not part of the cache key: with a given
    NVRTC version (which the key holds) they never change."""
    return ("--minimal",) if tuple(version) >= (12, 4) else ()


def _nvrtc_compile(source: str, spec: KernelSpec, arch: str, ptxas_level: int = 3):
    """(image, log): the cubin for ``sm_XX`` (ptxas at ``ptxas_level``), the PTX for ``compute_XX``."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, f"{spec.key}.cu", [], [])
    try:
        if spec.layout:
            nvrtc.addNameExpression(prog, _LAYOUT_EXPRESSION)
        try:
            nvrtc.compileProgram(prog, [*spec.options(arch, ptxas_level), *front_end_options(nvrtc_version())])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(f"NVRTC failed on {spec.key} for {arch}: {exc}\n{log}") from None
        log = nvrtc.getProgramLog(prog)
        if spec.layout:  # e.g. _Z23sb_dynamic_shared_bytesILy50176EE: the template argument is the size
            size = re.search(r"IL[a-z](\d+)E", nvrtc.getLoweredName(prog, _LAYOUT_EXPRESSION)).group(1)
            log += f"\n{_LAYOUT_LOG}{size}\n"
        cubin = bytes(nvrtc.getPTX(prog)).rstrip(b"\0") if is_ptx(arch) else nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return cubin, log




_modules: dict = {}
_smem_opt_in: dict = {}  # (spec, entry, device) -> the dynamic shared memory the function may use


def dynamic_shared_bytes(spec: KernelSpec, arch: str) -> int:
    """The dynamic shared memory of ``spec``'s kernels on ``arch``, read from the compiled layout."""
    return compile_spec(spec, arch).shared_bytes


_function_lock = threading.Lock()  # the loaded functions and their shared memory opt-ins change together


def get_function(spec: KernelSpec, entry: str, device_id: int, dynamic_smem: int = 0):
    """The loaded kernel ``entry`` of ``spec`` on ``device_id`` (compiled on first use; thread-safe)."""
    with _function_lock:
        return _get_function(spec, entry, device_id, dynamic_smem)


def _get_function(spec: KernelSpec, entry: str, device_id: int, dynamic_smem: int = 0):
    mkey = (spec, entry, device_id)
    fn = _modules.get(mkey)
    if fn is None:
        import cupy

        with cupy.cuda.Device(device_id):
            compiled = compile_spec(spec, device_arch(device_id))
            fn = kernel_cache.load_function(  # an image the driver rejects is recompiled once
                lambda: cupy.RawModule(path=str(compiled.cubin_path)).get_function(entry),
                lambda: kernel_cache.load_or_compile(
                    compiled.cubin_path, lambda: _compile_image(flatten_source(spec.filename), spec, compiled.arch),
                    use_disk_cache=False),
                compiled.cubin_path)
        _modules[mkey] = fn
        _smem_opt_in[mkey] = 48 * 1024
    if dynamic_smem > _smem_opt_in[mkey]:
        # Opt in whenever a launch needs more than the function was last allowed (a first load
        # for inspection may have asked for none).
        import cupy

        with cupy.cuda.Device(device_id):
            fn.max_dynamic_shared_size_bytes = dynamic_smem
        _smem_opt_in[mkey] = dynamic_smem
    return fn


def get_function_pointer(spec: KernelSpec, entry: str, device_id: int, dynamic_smem: int = 0) -> int:
    """The driver handle (CUfunction) of ``get_function``'s kernel, loaded on ``device_id``."""
    import cupy

    fn = get_function(spec, entry, device_id, dynamic_smem)
    with cupy.cuda.Device(device_id):
        return fn.kernel.ptr  # RawKernel loads its module on the current device


# ---------------------------------------------------------------------------------------------
# Many specializations at once: one NVRTC compile per process, so a full build uses every core.

def default_jobs() -> int:
    """The cores this process may run on (the compile processes to start by default)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _compile_in_worker(spec: KernelSpec, arch: str, use_disk_cache: bool):
    """(CompiledKernel or the exception it raised, seconds): run in a compile process."""
    import time

    start = time.perf_counter()
    try:
        result = compile_spec(spec, arch, use_disk_cache=use_disk_cache)
    except (CompileError, FileNotFoundError, ValueError) as exc:
        result = exc
    return result, time.perf_counter() - start


def spawn_pool(jobs: int):
    import concurrent.futures
    import multiprocessing

    # spawned, not forked: a forked child would share this process's CUDA context, if it has one
    return concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))


def compile_many(items, *, jobs: int = 1, use_disk_cache: bool = True):
    """Compile ``(spec, arch)`` pairs; yields ``(index, CompiledKernel or exception, seconds)`` as each
    finishes (in any order).  ``jobs`` > 1 compiles in that many processes; 1 compiles here, one after
    another.  A compile error, a missing
    source or a bad arch comes back as the exception rather than stopping the others."""
    items = list(items)
    if jobs <= 1 or len(items) <= 1:
        for i, (spec, arch) in enumerate(items):
            yield (i, *_compile_in_worker(spec, arch, use_disk_cache))
        return
    import concurrent.futures

    # The longest compiles first, so no process is left with one at the end: the backward kernels
    # take several times the others' time.
    order = sorted(range(len(items)), key=lambda i: not items[i][0].filename.startswith("backward"))
    with spawn_pool(min(jobs, len(items))) as pool:
        futures = {pool.submit(_compile_in_worker, *items[i], use_disk_cache): i for i in order}
        try:
            for future in concurrent.futures.as_completed(futures):
                result, seconds = future.result()
                if isinstance(result, CompiledKernel):
                    with _lock:
                        _memory_cache[result.key] = result
                yield futures[future], result, seconds
        except BaseException:
            for future in futures:  # Ctrl-C or a closed generator: start no more compiles
                future.cancel()
            raise
