"""The command line without a GPU: the help with no command, ``info``'s versions ("not installed"
for what is absent) and the kernels each visible GPU takes (devices faked: CuPy's answers stubbed)."""
import importlib.util

import pytest

from sagebwd_cp import __main__ as cli
from sagebwd_cp.gpu import specs


def test_no_command_prints_the_help(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: sagebwd-cp")
    assert "info" in out and "compile" in out and "the following arguments are required" not in out


def _rows(versions):
    return dict(versions)


def test_versions_name_every_framework_and_say_what_is_absent(monkeypatch):
    rows = _rows(cli._versions())
    assert list(rows)[:1] == ["sagebwd_cp"]
    for component in ("sagebwd_cp", "python", "numpy", "torch", "cupy", "jax", "NVRTC"):
        assert rows[component], component
    real = importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None if name in ("torch", "jax", "cupy")
                        else real(name))
    rows = _rows(cli._versions())
    assert rows["torch"] == rows["jax"] == rows["cupy"] == "not installed"
    assert rows["NVRTC"].startswith("not installed")
    assert "CUDA runtime" not in rows


def _device(i, count, arch, name):
    return {"id": i, "count": count, "name": name, "arch": arch, "sms": 132, "smem_optin": 232448}


@pytest.fixture
def no_compile(monkeypatch):
    """info's compile check, recorded instead of run (the test is about the device report)."""
    compiled = []

    def fake(pairs, **_):
        pairs = list(pairs)
        compiled.extend(arch for _, arch in pairs)
        return [cli.KernelRow(spec.key, spec.entries[0], arch, 100) for spec, arch in pairs]

    monkeypatch.setattr(cli, "compile_pairs", fake)
    return compiled


def test_info_reports_the_kernels_of_every_visible_gpu(monkeypatch, capsys, no_compile):
    monkeypatch.delenv("SAGEBWD_WGMMA", raising=False)
    devices = [_device(0, 4, "sm_90", "NVIDIA H100 80GB HBM3"), _device(1, 4, "sm_86", "NVIDIA RTX A6000"),
               _device(2, 4, "sm_75", "Tesla T4"), _device(3, 4, "sm_100", "NVIDIA B200"),
               _device(4, 4, "sm_121", "NVIDIA GB10")]
    monkeypatch.setattr(cli, "cuda_devices", lambda: (devices, ""))
    monkeypatch.setattr(cli, "cuda_device", lambda: (devices[0], ""))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "kernels by arch:\n  sm_80, sm_86, sm_89: mma.sync kernels\n  sm_90: wgmma kernels (sm_90a)\n" \
           "  sm_100, sm_120: mma.sync kernels, built, not measured\n" \
           "  other archs from sm_80 on: mma.sync kernels as PTX for the newest of those above, below their own, " \
           "JIT-compiled by the driver; not measured\n  archs below sm_80: not supported\n" in out
    assert "CUDA device 0 of 4 (current): NVIDIA H100 80GB HBM3, sm_90, 132 SMs" in out
    assert "\n  sm_90: wgmma kernels (sm_90a)\nCUDA device 1 of 4: NVIDIA RTX A6000, sm_86" in out
    assert "\n  sm_86: mma.sync kernels\n" in out
    assert "\n  sm_75: not supported: the kernels need sm_80 or newer" in out
    assert "\n  sm_100: mma.sync kernels, built, not measured\n" in out
    target = cli.compiler.compile_target("sm_121")
    assert f"\n  sm_121: mma.sync kernels as PTX for {target}, JIT-compiled by the driver; not measured" in out
    assert no_compile == ["sm_90", "sm_86", "sm_100", "sm_121"]  # one kernel per arch that runs the kernels


def test_info_fails_where_the_current_gpu_takes_no_kernels(monkeypatch, capsys, no_compile):
    t4 = _device(0, 1, "sm_75", "Tesla T4")
    monkeypatch.setattr(cli, "cuda_devices", lambda: ([t4], ""))
    monkeypatch.setattr(cli, "cuda_device", lambda: (t4, ""))
    assert cli.main(["info"]) == 1
    captured = capsys.readouterr()
    assert "CUDA device 0 of 1: Tesla T4, sm_75" in captured.out
    assert "the kernels need sm_80 or newer, not sm_75" in captured.err
    assert no_compile == []


def test_kernel_family_follows_the_wgmma_switch(monkeypatch):
    monkeypatch.setenv("SAGEBWD_WGMMA", "0")
    assert specs.kernel_family("sm_90").startswith("mma.sync kernels (SAGEBWD_WGMMA=0")
    monkeypatch.delenv("SAGEBWD_WGMMA")
    assert specs.kernel_family("sm_90") == "wgmma kernels (sm_90a)"
    assert specs.kernel_family("sm_89") == "mma.sync kernels"
