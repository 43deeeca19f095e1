"""tools/ncu_table.py reads ncu's CSV back (CPU only: ncu's output is faked)."""
import argparse
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import ncu_table  # noqa: E402

HEAD = '"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'


def _fake_run(stdout, returncode=0):
    def run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, returncode, stdout=stdout, stderr="")
    return run


def _args():
    return argparse.Namespace(tokens=16384, hidden=2048, gqa=1, dtype="bfloat16", causal=True,
                              deterministic=False)


@pytest.mark.parametrize("unit,value,us", [("nsecond", "15,762,016", 15762.016), ("ns", "2128500", 2128.5),
                                          ("usecond", "602.5", 602.5), ("ms", "4.25", 4250.0)])
def test_time_is_read_back_in_microseconds_whatever_the_unit(monkeypatch, unit, value, us):
    rows = [HEAD, f'"0","1","attention_backward","","gpu__time_duration.sum","{unit}","{value}"',
            '"0","1","attention_backward","","smsp__inst_executed.sum","inst","6,107,700,000"',
            '"0","1","attention_backward","","launch__registers_per_thread","register/thread","254"']
    monkeypatch.setattr(ncu_table.subprocess, "run", _fake_run("==PROF== noise\n" + "\n".join(rows) + "\n"))
    v = ncu_table.profile("ncu", ["gpu__time_duration.sum"], "ours", {}, "bwd", 128, 16384, _args())
    assert v["kernel"] == "attention_backward"
    assert float(v["gpu__time_duration.sum"]) == pytest.approx(us)
    assert float(v["smsp__inst_executed.sum"]) == 6.1077e9 and v["launch__registers_per_thread"] == "254"


def test_a_failed_profile_names_its_command(monkeypatch):
    monkeypatch.setattr(ncu_table.subprocess, "run", _fake_run("==ERROR== no kernels were profiled\n", 1))
    with pytest.raises(RuntimeError, match="ncu failed.*profile_step.py.*--impl cudnn"):
        ncu_table.profile("ncu", ["gpu__time_duration.sum"], "cudnn", {}, "fwd", 64, 2048, _args())


def test_tensor_pipes_are_the_ones_ncu_lists(monkeypatch):
    listing = ("sm__pipe_tensor_cycles_active      Counter  # of cycles where a tensor pipe was active\n"
               "sm__pipe_tensor_op_hmma_cycles_active  Counter  ...\n"
               "sm__pipe_fma_cycles_active  Counter  ...\n")
    monkeypatch.setattr(ncu_table.subprocess, "run", _fake_run(listing))
    assert ncu_table.tensor_pipe_metrics("ncu") == [
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"]


def test_base_sources_swap_the_kernels_in_and_restore_them(tmp_path):
    """--base (ab_kernels.swapped_sources): inside the block the checkout's kernel sources are the base's; after it
    (an error included), its own."""
    root, base = tmp_path / "checkout", tmp_path / "base"
    for tree, text in ((root, "new"), (base, "old")):
        for d in ("kernels", "ptx"):
            (tree / d).mkdir(parents=True)
            (tree / d / "a.cu").write_text(f"{text} {d}")
    (root / "kernels" / "only_new.cuh").write_text("new only")
    with pytest.raises(KeyError):
        with ncu_table.swapped_sources(str(base), str(root)):
            assert (root / "kernels" / "a.cu").read_text() == "old kernels"
            assert (root / "ptx" / "a.cu").read_text() == "old ptx"
            raise KeyError("a failed profile")
    assert (root / "kernels" / "a.cu").read_text() == "new kernels" and (root / "ptx" / "a.cu").read_text() == "new ptx"
    assert (root / "kernels" / "only_new.cuh").read_text() == "new only"
    with pytest.raises(SystemExit, match="--base: expected"):
        with ncu_table.swapped_sources(str(tmp_path / "missing"), str(root)):
            pass
