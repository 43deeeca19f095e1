"""What a failed launch reports: the kernel, its launch configuration, the call's shapes and options.

The driver's own error (``CUDADriverError: CUDA_ERROR_INVALID_VALUE: invalid argument``) names none of
these; a ``KernelLaunchError`` carries it (as ``__cause__`` and in its message) with them.
"""
from __future__ import annotations

import dataclasses


class KernelLaunchError(RuntimeError):
    """The driver refused a launch.  ``kernel`` is ``"<spec key>:<entry>"``, ``cuda_error`` the driver's
    message; ``__cause__`` is the driver's exception."""

    def __init__(self, message: str, kernel: str = "", cuda_error: str = ""):
        super().__init__(message)
        self.kernel, self.cuda_error = kernel, cuda_error


def _array_text(name: str, desc) -> str:
    return f"{name} {tuple(desc.shape)} {desc.dtype} strides {tuple(desc.strides)}"


def describe_problem(problem) -> str:
    """The call a plan was built for: its arrays' shapes, dtypes and strides, then its options."""
    if problem is None:
        return "no attention call (a one-off launch)"
    arrays, options = [], []
    for field in dataclasses.fields(problem):
        value = getattr(problem, field.name)
        if hasattr(value, "shape") and hasattr(value, "strides"):
            arrays.append(_array_text(field.name, value))
        elif hasattr(value, "_asdict"):  # the AttentionOptions
            options += [f"{k}={v!r}" for k, v in value._asdict().items()]
        elif value is None or isinstance(value, (bool, int, float, str)):
            options.append(f"{field.name}={value!r}")
    return "; ".join(arrays) + "; " + ", ".join(options)


def describe_step(step) -> str:
    """The launch: kernel, grid, block, dynamic shared memory and the kernel's compile-time options."""
    _, gx, gy, gz, bx, by, bz, shared = step.head
    defines = " ".join(f"{k}={v}" for k, v in step.spec.defines) or "none"
    return (f"kernel {step.entry} of {step.spec.key} (source {step.spec.filename}; compile options {defines}), "
            f"grid ({gx}, {gy}, {gz}), block ({bx}, {by}, {bz}), {shared} bytes of dynamic shared memory")


def launch_error(plan, step, exc: BaseException) -> KernelLaunchError:
    """The error to raise, from ``exc``, for ``step`` of ``plan`` (a LaunchPlan) that failed to launch."""
    cuda_error = f"{type(exc).__name__}: {exc}"
    message = (f"sagebwd_cp: launching {describe_step(step)} on device {plan.device_id} failed: {cuda_error}. "
               f"The call: {describe_problem(plan.problem)}. An error left by an earlier kernel (an illegal "
               f"address, a trap) also surfaces here: CUDA_LAUNCH_BLOCKING=1 makes each launch report its own.")
    return KernelLaunchError(message, f"{step.spec.key}:{step.entry}", cuda_error)


def note_allocation_failure(exc: BaseException, plan, nbytes: int) -> None:
    """Add to a framework's out-of-memory error (raised as it is) which workspace failed and for what call."""
    out_of_memory = isinstance(exc, MemoryError) or "OutOfMemory" in type(exc).__name__
    if out_of_memory and hasattr(exc, "add_note"):  # Python 3.11+
        kernels = ", ".join(dict.fromkeys(step.entry for step in plan.steps))
        exc.add_note(f"sagebwd_cp: the workspace of {nbytes} bytes ({nbytes / 2**20:.1f} MiB) for {kernels} on device "
                     f"{plan.device_id}; the call: {describe_problem(plan.problem)}")
