"""benchmarks/bench_wide_head_dims.py on the CPU: the Markdown table it renders from a run's records (the committed
H200 results included)."""
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import bench_wide_head_dims  # noqa: E402


def test_the_table_reads_each_peers_time_and_our_ratio_to_it():
    rec = {"shape": "2x16x4x4096x192x128", "ours": {"fwd_ms": 1.0, "fwdbwd_ms": 3.0},
           "cudnn": {"fwd_ms": 0.5, "fwdbwd_ms": 2.0}, "fa2": {"error": "No available kernel."}}
    table = bench_wide_head_dims.markdown({"device": "GPU", "torch": "2", "window": 4096, "softcap": 30.0,
                                           "records": [rec]})
    head, row = table.splitlines()[2], table.splitlines()[-1]
    assert "window 4096, soft cap 30" in table.splitlines()[0]
    assert "FlexAttention" not in head  # (no record timed it)
    assert row.startswith("| 2×16/4×4096, 192/128 | 1.000 / 3.000 | 0.500 / 2.000 | n/a |")
    assert row.endswith("| 1.50 |  |")  # 3 / 2 against cuDNN; no ratio to a peer without the kernel
    for name in ("wide_head_dims.json", "wide_head_dims_gemma2_global.json", "wide_head_dims_gemma2_local.json"):
        path = os.path.join(REPO, "benchmarks", "results", "NVIDIA_H200", name)
        with open(path) as f:
            rendered = bench_wide_head_dims.markdown(json.load(f))
        with open(path[:-len(".json")] + ".md") as f:
            assert f.read() == rendered  # the committed table is the committed records'


def test_the_committed_wide_accuracy_table_is_its_records_and_render_writes_it(tmp_path):
    """report.py --wide-head-dims's accuracy at d=192 and 256 gets the accuracy table of render_report.py (also
    written by render_report.render where the JSON is in the folder)."""
    import render_report

    folder = os.path.join(REPO, "benchmarks", "results", "NVIDIA_H200")
    data = render_report.load(os.path.join(folder, "accuracy_wide_head_dims.json"))
    table = render_report.accuracy_markdown(data)
    assert "d=192" in table and "d=256" in table
    with open(os.path.join(folder, "accuracy_wide_head_dims.md")) as f:
        assert f.read() == table
    for name in ("accuracy.json", "accuracy_wide_head_dims.json"):
        (tmp_path / name).write_text(json.dumps(render_report.load(os.path.join(folder, name))))
    render_report.render(str(tmp_path), readme=None, charts=False)
    assert (tmp_path / "accuracy_wide_head_dims.md").read_text() == table
