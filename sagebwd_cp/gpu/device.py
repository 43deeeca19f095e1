"""Device queries, in one place: is there a CUDA GPU here (and if not, why not, in words a user can
act on), and a device's arch, shared-memory limit and multiprocessor count (each read once).

CuPy reports a machine without the NVIDIA driver as "CUDA driver version is insufficient", which
reads as "upgrade the driver"; ``cuda_device`` tells that case apart (the driver library itself is
missing) and says plainly that there is no GPU.
"""
from __future__ import annotations

import ctypes
import sys

_device_limits: dict = {}  # device id -> opt-in shared memory per block
_device_archs: dict = {}  # device id -> "sm_XX"
_device_sms: dict = {}  # device id -> multiprocessor count

NO_GPU = "no CUDA GPU found; host arrays run on the CPU emulator"
_DRIVER_LIBRARIES = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")


def _driver_present() -> bool:
    for name in _DRIVER_LIBRARIES:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def cuda_device():
    """``(properties, "")`` for the current CUDA device, or ``(None, why)`` where there is none.

    ``properties``: id, count, name, arch, sms, smem_optin (opt-in shared memory per block, bytes).
    ``why`` is a sentence: NO_GPU where the machine has no GPU or no NVIDIA driver, else what failed."""
    devices, why = cuda_devices()
    if not devices:
        return None, why
    import cupy

    current = cupy.cuda.Device().id
    return next((d for d in devices if d["id"] == current), devices[0]), ""


def cuda_devices():
    """``(devices, "")``: the properties of every visible CUDA device (as ``cuda_device`` gives the
    current one's), in id order; or ``([], why)`` where there is none."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - a broken install also means no GPU path
        return [], (f"CuPy is not importable ({exc}): install the cuda13 or cuda12 extra, "
                      f"e.g. pip install \"sagebwd_cp[cuda13]\"; host arrays run on the CPU emulator")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - the driver's message is the detail to keep
        if not _driver_present() or "NoDevice" in str(exc):  # cudaErrorNoDevice: a driver, no GPU
            return [], NO_GPU
        return [], f"the CUDA driver failed: {exc}; host arrays run on the CPU emulator"
    if count == 0:
        return [], NO_GPU
    devices = []
    for device_id in range(count):
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
        name = props["name"]
        devices.append({
            "id": device_id,
            "count": count,
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "arch": device_arch(device_id),
            "sms": props["multiProcessorCount"],
            "smem_optin": props["sharedMemPerBlockOptin"],
        })
    return devices, ""


def device_arch(device_id: int) -> str:
    """The device's ``sm_XX`` (cached: plan building asks once per plan)."""
    arch = _device_archs.get(device_id)
    if arch is None:
        import cupy

        arch = _device_archs[device_id] = f"sm_{cupy.cuda.Device(device_id).compute_capability}"
    return arch


def _device_property(cache: dict, device_id: int, name: str) -> int:
    """The device's CUDA property ``name``, read once into ``cache``."""
    value = cache.get(device_id)
    if value is None:
        import cupy

        value = cache[device_id] = cupy.cuda.runtime.getDeviceProperties(device_id)[name]
    return value


def shared_memory_limit(device_id: int) -> int:
    """The device's opt-in shared memory per block, in bytes."""
    return _device_property(_device_limits, device_id, "sharedMemPerBlockOptin")


def sm_count(device_id: int) -> int:
    """The device's multiprocessor count."""
    return _device_property(_device_sms, device_id, "multiProcessorCount")
