"""Two processes where no CUDA device is present, skips for the ``gpu`` and ``torch`` markers, a per-session
kernel cache, the ``kernels`` fixture (a kernel family's switches, with plans cleared around the test), and
skipped tests counted by reason at the end of a run (``pytest -rs`` lists each one)."""
import collections
import os
from pathlib import Path

import pytest

# Processes the suite runs in where no CUDA device is present (pytest-xdist, a test extra): the CPU-only tests
# are independent, and CI's machine has two cores. With a device it runs in one process: its tests share the GPU.
CPU_ONLY_PROCESSES = 2


def _no_cuda_reason():
    """None when a CUDA device is usable, else why not (in the words of ``info``)."""
    from sagebwd_cp.gpu.device import cuda_device

    found, why = cuda_device()
    return None if found else why


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Without a CUDA device, and unless -n is given, run in CPU_ONLY_PROCESSES processes (before pytest-xdist
    reads -n; not in its workers, which would start their own)."""
    if getattr(config.option, "numprocesses", "absent") is not None or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # xdist absent, -n given, or a worker
    if config.option.collectonly or _no_cuda_reason() is None:
        return
    config.option.numprocesses = CPU_ONLY_PROCESSES


def _no_torch_reason():
    try:
        import torch  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"torch is not importable: {exc}"
    return None


def pytest_collection_modifyitems(config, items):
    # Probe only when a marked test was collected: importing torch costs seconds.
    for marker, probe, prefix in (("gpu", _no_cuda_reason, "needs a CUDA GPU"),
                                  ("torch", _no_torch_reason, "PyTorch unavailable")):
        marked = [item for item in items if item.get_closest_marker(marker)]
        reason = probe() if marked else None
        if reason:
            skip = pytest.mark.skip(reason=f"{prefix} ({reason})")
            for item in marked:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory):
    """A fresh kernel cache for the session: tests never touch ~/.cache and compile for real.  CI hands
    over the cache its compile step filled moments before (SAGEBWD_CP_TEST_KERNEL_CACHE, compiled by this
    checkout), so that the kernels it compiled are not compiled twice."""
    given = os.environ.get("SAGEBWD_CP_TEST_KERNEL_CACHE")
    path = Path(given) if given else tmp_path_factory.mktemp("kernel-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SAGEBWD_CP_CACHE_DIR", str(path))
        yield path


@pytest.fixture
def kernels(request, monkeypatch):
    """Parametrized indirectly with gpu_helpers.KERNELS: the environment switches of one kernel family (the
    default, or mma.sync on sm_90 too), set for the test, with the cached plans cleared before and after."""
    from sagebwd_cp.gpu import plan

    for name, value in request.param.items():
        monkeypatch.setenv(name, value)
    plan.clear_plans()
    yield request.param
    plan.clear_plans()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line per skip reason, with its count, above pytest's final line (which stays the last)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or "s" in getattr(terminalreporter, "reportchars", ""):
        return  # nothing skipped, or -rs / -ra asked pytest to list them one by one
    reasons = collections.Counter()
    for report in skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason (pytest -rs lists each)")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"{count:>5}  {reason}")
