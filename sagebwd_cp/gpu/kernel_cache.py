"""The kernel cache on disk, checked before anything in it is used.

An entry is two files named after the compile's cache key: the cubin, and its record: the cubin's size
and SHA-256, and NVRTC's log (ptxas's resource report and the read-back shared layout) with its own
SHA-256.  Each file is written atomically (a temporary file, then a rename), the record last: an entry
without its record is one still being written (or one from before records existed) and is a plain miss.
An entry whose cubin does not match its record (truncated, garbage, a flipped bit), or whose record is
damaged, is recompiled and rewritten, with a ``KernelCacheWarning`` naming the file; it never reaches the
driver.  Several processes (torchrun's ranks) may compile the same kernels into one directory at once:
each writes whole files, a reader only trusts a cubin its record vouches for, and the record holds the
log (which differs from compile to compile: it carries ptxas's timings) so a record and a log from two
writers cannot be paired.  NVRTC's cubins are the same from compile to compile, so two writers' cubins
and records agree.

In a process, one thread at a time builds a given entry (``load_or_compile`` holds a lock per entry),
so threads that ask for the same kernel at once compile it once.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import warnings
from pathlib import Path

RECORD_SUFFIX = ".record"
_FORMAT = 1


class KernelCacheWarning(RuntimeWarning):
    """A damaged kernel cache entry was found (and is being recompiled)."""


def record_path(cubin_path: Path) -> Path:
    return Path(cubin_path).with_suffix(RECORD_SUFFIX)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_record(cubin: bytes, log: str) -> dict:
    return {"format": _FORMAT, "cubin_bytes": len(cubin), "cubin_sha256": _sha256(cubin), "log": log,
            "log_sha256": _sha256(log.encode())}


def atomic_write(path: Path, data: bytes) -> None:
    """``data`` at ``path``, all or nothing: readers see the old file or the whole new one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_entry(cubin_path: Path, cubin: bytes, log: str) -> None:
    """Store a compile: the cubin, then the record (with the log) that makes the entry valid."""
    atomic_write(cubin_path, bytes(cubin))
    atomic_write(record_path(cubin_path), json.dumps(make_record(bytes(cubin), log), sort_keys=True).encode())


def check_entry(cubin_path: Path):
    """``(log, None)`` for a sound entry; ``(None, None)`` for a miss (no record yet); ``(None, why)``
    for a damaged entry: its cubin does not match the record, or the record is unreadable."""
    cubin_path = Path(cubin_path)
    try:
        raw = record_path(cubin_path).read_bytes()
    except FileNotFoundError:
        return None, None
    try:
        record = json.loads(raw)
        size, digest, log = int(record["cubin_bytes"]), str(record["cubin_sha256"]), record["log"]
        if _sha256(log.encode()) != record["log_sha256"]:
            raise ValueError("the log differs from its hash")
    except (ValueError, TypeError, KeyError, AttributeError):  # garbage, a truncated or an altered record
        return None, f"its record {record_path(cubin_path).name} is unreadable or altered"
    try:
        cubin = cubin_path.read_bytes()
    except FileNotFoundError:
        return None, "the cubin is missing"
    if len(cubin) != size:
        return None, f"the cubin has {len(cubin)} bytes, {size} were written"
    if _sha256(cubin) != digest:
        return None, "the cubin's SHA-256 differs from the one recorded when it was written"
    return log, None


def warn_damaged(cubin_path: Path, why: str, stacklevel: int = 3) -> None:
    warnings.warn(f"sagebwd_cp: damaged kernel cache entry {cubin_path} ({why}); recompiling it",
                  KernelCacheWarning, stacklevel=stacklevel)


_entry_locks: dict = {}
_entry_locks_lock = threading.Lock()


def _entry_lock(cubin_path: Path) -> threading.Lock:
    with _entry_locks_lock:
        lock = _entry_locks.get(str(cubin_path))
        if lock is None:
            lock = _entry_locks[str(cubin_path)] = threading.Lock()
        return lock


def load_or_compile(cubin_path: Path, compile_fn, use_disk_cache: bool = True) -> str:
    """The log of the entry at ``cubin_path``: read from a sound entry, or ``compile_fn() -> (cubin,
    log)`` run and its result written (also over a damaged entry, after a warning naming it)."""
    with _entry_lock(cubin_path):
        if use_disk_cache:
            log, why = check_entry(cubin_path)
            if log is not None:
                return log
            if why is not None:
                warn_damaged(cubin_path, why, stacklevel=4)
        cubin, log = compile_fn()
        write_entry(cubin_path, cubin, log)
        return log


# CUDA driver errors that mean the image itself is bad (not the device or the context).
IMAGE_ERRORS = ("CUDA_ERROR_INVALID_IMAGE", "CUDA_ERROR_INVALID_PTX", "CUDA_ERROR_NO_BINARY_FOR_GPU",
                "CUDA_ERROR_FILE_NOT_FOUND", "CUDA_ERROR_INVALID_SOURCE", "CUDA_ERROR_UNSUPPORTED_PTX_VERSION")


def is_image_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the driver rejecting a module's image (checked by name: the CUDA bindings differ)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(name in text for name in IMAGE_ERRORS)


def load_function(load, recompile, cubin_path: Path):
    """``load()``, the module loaded from a checked cubin; should the driver still reject the image (it
    changed on disk after the check), the entry is recompiled once (``recompile()``, after a warning
    naming it) and loaded again.  A rejected image leaves the CUDA context usable."""
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 - only image errors are handled, the rest re-raised
        if not is_image_error(exc):
            raise
        warn_damaged(cubin_path, f"the driver rejected it: {exc}", stacklevel=4)
    recompile()
    return load()


def entry_files(directory: Path) -> list:
    """The cache's files (entries and leftover temporaries), for reports of its size."""
    return sorted(p for p in Path(directory).iterdir() if p.is_file())


def cache_bytes(directory: Path) -> int:
    """The bytes the kernel cache takes on disk."""
    total = 0
    for p in entry_files(directory):
        try:
            total += p.stat().st_size
        except FileNotFoundError:  # replaced meanwhile
            pass
    return total
