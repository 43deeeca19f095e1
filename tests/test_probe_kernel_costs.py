"""tools/probe_kernel_costs.py: every probe's edits still find their text in the kernels (CPU only), and a
probe tree differs from the checkout exactly by them."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import probe_kernel_costs  # noqa: E402


@pytest.mark.parametrize("name", sorted(probe_kernel_costs.PROBES))
def test_every_probe_applies_to_the_current_kernels(name):
    edited = probe_kernel_costs.probe_sources(name)
    for path, text in edited.items():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            original = f.read()
        assert text != original and "PROBE" in text


def test_a_probe_whose_text_is_gone_says_which(monkeypatch):
    monkeypatch.setitem(probe_kernel_costs.PROBES, "gone",
                        ("nothing", {}, [(probe_kernel_costs.BACKWARD, "no such line in the kernel", "x")]))
    with pytest.raises(ValueError, match="probe gone: expected its text once in kernels/backward_wgmma.cu, found it 0"):
        probe_kernel_costs.probe_sources("gone")


def test_a_built_probe_tree_is_the_checkout_with_the_edits(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_kernel_costs, "BASE_DIR", str(tmp_path))
    out = probe_kernel_costs.build("backward_stores")
    edited = probe_kernel_costs.probe_sources("backward_stores")
    for folder in ("kernels", "ptx"):
        for name in os.listdir(os.path.join(ROOT, folder)):
            if not name.endswith((".cu", ".cuh")):
                continue
            rel = os.path.join(folder, name)
            with open(os.path.join(out, rel), encoding="utf-8") as f:
                built = f.read()
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                assert built == edited.get(rel, f.read()), rel


def test_build_takes_the_named_probes_and_leaves_the_rest_to_ab_kernels(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_kernel_costs, "BASE_DIR", str(tmp_path))
    assert probe_kernel_costs.main(["build", "--probes", "backward_loads", "--", "--passes", "bwd"]) == 0
    assert os.listdir(tmp_path) == ["backward_loads"]
