"""The kernel cache under faults, on the CPU: damaged entries are found before anything loads them and
recompiled with a warning naming the file, and processes compiling the same kernels into one empty
directory at once leave it whole."""
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from sagebwd_cp.gpu import compiler, kernel_cache, specs
from sagebwd_cp.gpu.kernel_cache import KernelCacheWarning

ARCH = "sm_80"


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache directory and an empty in-memory cache (so compile_spec reads the disk)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("SAGEBWD_CP_CACHE_DIR", str(path))
    monkeypatch.setattr(compiler, "_memory_cache", {})
    return path


def _compile(spec):
    compiler._memory_cache.clear()
    return compiler.compile_spec(spec, ARCH)


def _counting_nvrtc(monkeypatch):
    calls = []
    real = compiler._nvrtc_compile

    def counted(source, spec, arch):
        calls.append(spec.key)
        return real(source, spec, arch)

    monkeypatch.setattr(compiler, "_nvrtc_compile", counted)
    return calls


def test_an_entry_is_written_with_its_record_and_read_back_without_a_compile(fresh_cache, monkeypatch):
    spec = specs.lse_spec("float16")
    calls = _counting_nvrtc(monkeypatch)
    first = _compile(spec)
    cubin = first.cubin_path.read_bytes()
    record = json.loads(kernel_cache.record_path(first.cubin_path).read_text())
    assert record["cubin_bytes"] == len(cubin) > 0
    assert sorted(p.suffix for p in fresh_cache.iterdir()) == [".cubin", ".record"]
    assert record["log"] == first.log
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelCacheWarning)
        second = _compile(spec)
    assert calls == [spec.key] and second.log == first.log and second.reports == first.reports


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _garbage_same_size(path):
    path.write_bytes(os.urandom(path.stat().st_size))


def _garbage(path):
    path.write_bytes(b"\x7fELF not a cubin" * 3)


def _empty(path):
    path.write_bytes(b"")


def _one_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {"truncated": _truncate, "garbage of the same size": _garbage_same_size, "garbage": _garbage,
          "empty": _empty, "one bit flipped": _one_bit}


@pytest.mark.parametrize("target", ["cubin", "record"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_entry_is_recompiled_with_a_warning_naming_the_file(fresh_cache, monkeypatch, target, damage):
    """Every way of damaging each file of an entry: the next compile_spec warns, naming the cubin,
    recompiles, and leaves a sound entry with the original bytes (the log's shared layout too)."""
    spec = specs.ceiling_spec()
    first = _compile(spec)
    cubin = first.cubin_path.read_bytes()
    path = {"cubin": first.cubin_path, "record": kernel_cache.record_path(first.cubin_path)}[target]
    if target == "record" and damage == "one bit flipped":  # a record that still parses: its log altered
        record = json.loads(path.read_text())
        record["log"] = record["log"].replace("Used ", "Used 1", 1)
        path.write_text(json.dumps(record))
    else:
        DAMAGE[damage](path)
    calls = _counting_nvrtc(monkeypatch)
    with pytest.warns(KernelCacheWarning, match=r"damaged kernel cache entry .*" + first.cubin_path.name):
        again = _compile(spec)
    assert calls == [spec.key]
    assert again.cubin_path.read_bytes() == cubin and again.reports == first.reports
    assert kernel_cache.check_entry(again.cubin_path) == (again.log, None)


def test_a_missing_file_of_an_entry_is_recompiled(fresh_cache, monkeypatch):
    spec = specs.lse_spec("bfloat16")
    first = _compile(spec)
    first.cubin_path.unlink()
    calls = _counting_nvrtc(monkeypatch)
    with pytest.warns(KernelCacheWarning, match=first.cubin_path.name):
        _compile(spec)
    assert calls == [spec.key] and kernel_cache.check_entry(first.cubin_path)[1] is None


def test_an_entry_without_a_record_is_a_plain_miss(fresh_cache, monkeypatch):
    """A cubin without its record: a writer not finished yet, or a cache written before
    records existed. Recompiled without a warning, and the entry completed."""
    spec = specs.lse_spec("float16")
    first = _compile(spec)
    kernel_cache.record_path(first.cubin_path).unlink()
    calls = _counting_nvrtc(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelCacheWarning)
        _compile(spec)
    assert calls == [spec.key] and kernel_cache.check_entry(first.cubin_path)[1] is None


def test_an_image_the_driver_rejects_is_recompiled_once_and_loaded_again(tmp_path):
    """The last line of defence in get_function: a cubin that changed on disk after its check is
    rejected by the driver (CUDA_ERROR_INVALID_IMAGE); the entry is rewritten and loaded again."""
    loads, rewrites = [], []

    class CUDADriverError(Exception):
        pass

    def load():
        loads.append(1)
        if len(loads) == 1:
            raise CUDADriverError("CUDA_ERROR_INVALID_IMAGE: device kernel image is invalid")
        return "function"

    path = tmp_path / "k.sm_90.abc.cubin"
    with pytest.warns(KernelCacheWarning, match="k.sm_90.abc.cubin.*CUDA_ERROR_INVALID_IMAGE"):
        assert kernel_cache.load_function(load, lambda: rewrites.append(1), path) == "function"
    assert loads == [1, 1] and rewrites == [1]

    def out_of_memory():
        raise CUDADriverError("CUDA_ERROR_OUT_OF_MEMORY: out of memory")

    with pytest.raises(CUDADriverError, match="OUT_OF_MEMORY"):  # not an image error: not retried
        kernel_cache.load_function(out_of_memory, lambda: rewrites.append(1), path)
    assert rewrites == [1]


# ------------------------------------------------------------------ many processes, one empty cache

_WORKER = r"""
import sys, time, warnings
from pathlib import Path
warnings.simplefilter("error")  # a warning (a damaged entry seen) fails the worker
from sagebwd_cp.gpu import compiler, kernel_cache, specs
start = Path(sys.argv[1])
while not start.exists():
    time.sleep(0.005)
for spec in (specs.ceiling_spec(), specs.bias_spec("bfloat16")):
    for attempt in range(3):  # compile, then read back what the others wrote
        compiler._memory_cache.clear()
        c = compiler.compile_spec(spec, "sm_80")
        log, why = kernel_cache.check_entry(c.cubin_path)
        # sound (its log may be another writer's: logs carry ptxas's timings)
        assert why is None and log is not None, (c.cubin_path, why)
print("ok")
"""


def test_processes_compiling_into_one_empty_cache_at_once_leave_it_whole(tmp_path):
    """8 processes (as torchrun's ranks on first use) compile the same two kernels into one empty
    directory, released at once: none fails or sees a damaged entry, and the directory holds exactly
    two sound entries and no temporary files."""
    cache, start = tmp_path / "cache", tmp_path / "start"
    env = dict(os.environ, SAGEBWD_CP_CACHE_DIR=str(cache), PYTHONWARNINGS="error")
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(start)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    time.sleep(0.5)  # most have imported and wait for the start
    start.touch()
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    failed = [(rc, err[-2000:]) for out, err, rc in results if rc != 0 or out.strip() != "ok"]
    assert not failed
    files = sorted(p.name for p in cache.iterdir())
    assert not [f for f in files if f.endswith(".tmp")]
    cubins = [cache / f for f in files if f.endswith(".cubin")]
    assert len(cubins) == 2 and len(files) == 4
    assert all(kernel_cache.check_entry(c)[1] is None for c in cubins)


def test_cache_size_counts_every_file(fresh_cache):
    _compile(specs.lse_spec("float16"))
    total = sum(p.stat().st_size for p in fresh_cache.iterdir())
    assert kernel_cache.cache_bytes(fresh_cache) == total > 0
