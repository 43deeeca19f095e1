"""benchmarks/sanitize_cases.py, the case set that compute-sanitizer runs on a GPU (gpu_check.py --sanitize), runs
as written: each case on the emulator, in float32 (the CPU's), its gradients finite and of the inputs' shapes."""
import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _case_module():
    path = os.path.join(ROOT, "benchmarks", "sanitize_cases.py")
    spec = importlib.util.spec_from_file_location("sanitize_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASE_SET = _case_module()


@pytest.mark.parametrize("index", range(len(CASE_SET.CASES)))
def test_each_sanitizer_case_runs_on_the_emulator(index):
    case = list(CASE_SET.CASES[index])
    case[7] = "float32"
    grads = CASE_SET.run_case(tuple(case), device="cpu")
    assert len(grads) >= 3  # dq, dk, dv (and the sinks' gradient)
    for g in grads:
        g = torch.as_tensor(g)
        assert g.numel() > 0 and torch.isfinite(g).all()
    b, hq, hkv, lq, lk, d = case[:6]
    dq = torch.as_tensor(grads[0])
    assert dq.shape[-1] == d and hq in dq.shape
