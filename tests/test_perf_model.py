"""tools/perf_model: the SASS counter, the card table, the bounds and the fit (on synthetic measurements).

The real SASS test compiles one forward kernel and disassembles it (a second or two); it skips, with
the reason, where nvdisasm is absent (``pip install nvidia-cuda-nvdisasm``)."""
import json
import math
import os
import random
import struct
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.perf_model import cards, fit, model, sass  # noqa: E402

COUNTS = os.path.join(ROOT, "benchmarks", "results", "perf_model", "sass_counts.json")

# A loop: a prefetch branch (skipped on the last tile), a masked/unmasked diamond, a rare rescale.
SYNTHETIC_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_9:
        /*0010*/               @P0 BRA `(.L_x_1) ;
        /*0020*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
.L_x_1:
        /*0030*/                   IMMA.16832.S8.S8 R8, R12, R16, R8 ;
        /*0040*/                   LDSM.16.M88.4 R20, [R3] ;
        /*0050*/               @P1 BRA `(.L_x_2) ;
        /*0060*/                   FMUL R5, R5, R6 ;
        /*0070*/                   BRA `(.L_x_3) ;
.L_x_2:
        /*0080*/                   FSEL R5, R5, -INF , P2 ;
        /*0090*/                   FSEL R6, R6, -INF , P2 ;
        /*00a0*/                   FMUL R5, R5, R6 ;
.L_x_3:
        /*00b0*/                   MUFU.EX2 R7, R5 ;
        /*00c0*/                   I2FP.F32.S32 R9, R8 ;
        /*00d0*/              @!P3 BRA `(.L_x_4) ;
        /*00e0*/                   FMUL R10, R10, R11 ;
        /*00f0*/                   FMUL R12, R12, R11 ;
.L_x_4:
        /*0100*/                   HMMA.16816.F32 R24, R28, R30, R24 ;
        /*0110*/                   STS.128 [R3], R24 ;
        /*0120*/               @P4 BRA `(.L_x_7) ;
        /*0130*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0140*/                   BRA `(.L_x_9) ;
.L_x_7:
        /*0150*/                   EXIT ;
.L_x_8:
        /*0160*/                   BRA `(.L_x_8);
"""


def test_synthetic_loop_paths():
    c = sass.count_function(SYNTHETIC_SASS)
    i, e = c["interior"], c["edge"]
    # interior: prefetch taken, unmasked side, rescale skipped
    assert i["ldgsts"] == 1 and i["tensor"] == 2
    assert i["macs_i8"] == 16 * 8 * 32 and i["macs_f16_f32acc"] == 16 * 8 * 16
    assert i["fma"] == 1 and i["issue"] == 15
    assert i["shared_bytes"] == 512 + 512 + 32 * 16 and i["global_bytes"] == 512
    assert i["xu"] == 1 and i["alu"] == 1  # MUFU; I2FP on the ALU pipe
    # edge: the masked side and the rescale
    assert e["issue"] == i["issue"] + 2 + 2 - 1 and e["fma"] == 3


# A wgmma loop whose mbarrier wait retries out of line: the stub after the last EXIT branches back into the
# loop and spans more of it than the loop's own back edge.
WGMMA_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*0030*/              @!P0 BRA `(.L_x_5) ;
.L_x_1:
        /*0040*/                   WARPGROUP.ARRIVE ;
        /*0050*/                   IGMMA.64x64x32.S8.S8 R24, gdesc[UR8], RZ, !UPT ;
        /*0060*/                   HGMMA.64x64x16.F32.BF16 R56, gdesc[UR12], RZ, !UPT, gsb0 ;
        /*0070*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0080*/                   I2FP.F32.S32 R3, R24 ;
        /*0090*/                   MUFU.EX2 R3, R3 ;
        /*00a0*/               @P1 BRA `(.L_x_0) ;
        /*00b0*/                   EXIT ;
.L_x_5:
        /*00c0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*00d0*/              @!P0 BRA `(.L_x_5) ;
        /*00e0*/                   BRA `(.L_x_1) ;
"""


def test_wgmma_loop_is_found_past_out_of_line_stubs():
    c = sass.count_function(WGMMA_SASS)
    assert c["loop"] == [1, 10]  # BAR.SYNC .. the back edge, not the stub's branch into the loop
    i = c["interior"]
    assert i["tensor"] == 2 and i["xu"] == 1 and i["alu"] == 1 and i["issue"] == 10


def test_functions_split_a_cubins_text_by_kernel():
    text = ("\t.section\t.text.first,\"ax\",@progbits\n.text.first:\n" + SYNTHETIC_SASS +
            "\t.section\t.text.second,\"ax\",@progbits\n.text.second:\n" + WGMMA_SASS)
    parts = sass.functions(text)
    assert list(parts) == ["first", "second"]
    assert sass.count_function(parts["second"])["loop"] == [1, 10]
    assert sass.count_function(parts["first"])["interior"]["issue"] == 15


def test_pad_cubin_reaches_the_header_tables():
    head = bytearray(64)
    head[:5] = b"\x7fELF\x02"
    struct.pack_into("<QQ", head, 0x20, 64, 200)  # program headers at 64, sections at 200
    struct.pack_into("<HHHH", head, 0x36, 56, 2, 64, 3)
    body = bytes(head) + b"\1" * 100
    padded = sass.pad_cubin(body)
    assert len(padded) == 200 + 64 * 3 and padded[:len(body)] == body


def test_card_rates_per_sm_and_clock():
    for key in cards.PREDICTED:
        c = cards.CARDS[key]
        assert c.macs_per_clk("i8") == pytest.approx(1024, rel=5e-3)
        assert c.macs_per_clk("f16") == pytest.approx(256, rel=5e-3)
    with pytest.raises(ValueError):
        cards.CARDS["H100"].macs_per_clk("i8")
    assert cards.card_for_device("NVIDIA H100 80GB HBM3").key == "H100"
    assert cards.card_for_device("NVIDIA H200").key == "H200"


def test_causal_units_and_schedule():
    k = model.fa2_kernel(False, 128, "sm_90", True, 232448)
    units = model.cta_units(k, 1024, causal=True)
    assert sum(a + e for a, e in units) == sum(math.ceil((qb + 1) * 128 / 64) for qb in range(8))
    assert units[0][0] + units[0][1] >= units[-1][0] + units[-1][1]
    card = cards.CARDS["RTX4090"]
    rates = {"i8": card.macs_per_clk("i8"), "f16": card.macs_per_clk("f16")}
    full = model.bounds(card, model.fa2_kernel(False, 128, "sm_89", False, 101376), 16, 4096, False, rates, 2.52e9, 0)
    causal = model.bounds(card, model.fa2_kernel(False, 128, "sm_89", True, 101376), 16, 4096, True, rates, 2.52e9, 0)
    zero = model.Latency()
    assert full.binding(zero) == "tensor" and 0.45 < causal.makespan(zero)[0] / full.makespan(zero)[0] < 0.65


def _greedy(tasks, slots):
    import heapq
    heap = [0.0] * slots
    for d in tasks:
        heapq.heapreplace(heap, heap[0] + d)
    return max(heap)


def test_list_schedule_is_the_greedy_order():
    rng = random.Random(1)
    for _ in range(30):
        slots = rng.randint(1, 40)
        groups = [(rng.choice([rng.uniform(0.1, 5.0), 1.0]), rng.randint(1, 90), [1.0, 0.0]) for _ in range(rng.randint(1, 12))]
        tasks = [d for d, n, _ in groups for _ in range(n)]
        span, grad = model.list_schedule(groups, slots)
        assert span == pytest.approx(_greedy(tasks, slots), rel=1e-12)


def test_gradient_and_tensor_bound_untouched_by_latency():
    """The stall latencies lengthen the warps' chains only: where the tensor pipe binds (FA2's forward
    on the 4090) a kernel takes its tensor time whatever was fitted; where the chains bind, the
    schedule's gradient is the finite difference."""
    card = cards.CARDS["RTX4090"]
    rates = {"i8": card.macs_per_clk("i8"), "f16": card.macs_per_clk("f16")}
    k = model.fa2_kernel(False, 128, "sm_89", False, card.shared_per_block)
    b = model.bounds(card, k, 16, 16384, False, rates, 2.52e9, 0)
    lat = model.Latency(2.0, 14.0)
    assert b.binding(lat) == "tensor" and b.seconds(lat) == b.seconds(model.Latency())
    flops = 4 * 16 * 16384 ** 2 * 128
    assert flops / b.seconds(lat) == pytest.approx(2 * card.sms * 2.52e9 * rates["f16"], rel=0.01)  # the peak
    slow = model.Latency(40.0, 40.0)
    assert b.binding(slow) == "latency" and b.seconds(slow) > b.seconds(lat)
    kc = model.fa2_kernel(False, 128, "sm_89", True, card.shared_per_block)
    bc = model.bounds(card, kc, 16, 8192, True, rates, 2.52e9, 0)
    t, g = bc.seconds_and_gradient(slow)
    for i, (dx, dy) in enumerate(((1e-3, 0.0), (0.0, 1e-3))):
        t2 = bc.seconds(model.Latency(slow.other + dx, slow.tensor + dy))
        assert (t2 - t) / 1e-3 == pytest.approx(g[i], rel=1e-6)


def _counts():
    with open(COUNTS) as f:
        return json.load(f)["kernels"]


def _synthetic_calibration(counts, latency, noise=0.0, seed=0):
    """Measurements made by the model itself (stall latencies known), in calibrate.py's format."""
    rng = random.Random(seed)
    card = cards.CARDS["H100"]
    ceil = {"int8_mma_tops": 1000.0, "fp16_mma_tflops": 500.0}
    rates = {k: card.macs_per_clk(k, dict(ceil, clock_mhz=1800.0)) for k in ("i8", "f16")}
    kernels = fit.kernels_for(card, counts)
    records = []
    for d in (64, 128):
        for causal in (False, True):
            for n in (2048, 4096, 8192, 16384):
                b, h = 16384 // n, 2048 // d
                bnd = fit.predict_bounds(card, kernels, (d, causal, n, b * h), rates, 1.8e9)
                t = {k: 1e3 * v.seconds(latency[k]) * (1 + rng.uniform(-noise, noise)) for k, v in bnd.items()}
                pre = {k: 1e3 * (2e-6 * model.prepost(k[0], k[1] == "bwd", b * h * n * d)[0] + 1.2 *
                                 model.prepost(k[0], k[1] == "bwd", b * h * n * d)[1] / (card.dram_gbps * 1e9))
                       for k in t}
                records.append({
                    "head_dim": d, "causal": causal, "seqlen": n, "batch": b, "heads": h,
                    "ours_fwd": {"call_ms": t["ours", "fwd"] + pre["ours", "fwd"],
                                 "steps_ms": {"token_sum": pre["ours", "fwd"], "attention_forward": t["ours", "fwd"]}},
                    "ours_bwd": {"call_ms": t["ours", "bwd"] + pre["ours", "bwd"],
                                 "steps_ms": {"quantize_tensors": pre["ours", "bwd"], "attention_backward": t["ours", "bwd"]}},
                    "fa2_fwd": {"call_ms": t["fa2", "fwd"], "kernels_us": {"flash_fwd_kernel<...>": 1e3 * t["fa2", "fwd"]}},
                    "fa2_bwd": {"call_ms": t["fa2", "bwd"] + pre["fa2", "bwd"],
                                "kernels_us": {"flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>": 1e3 * t["fa2", "bwd"],
                                               "flash_bwd_dot_do_o_kernel<...>": 1e3 * pre["fa2", "bwd"]}}})
    return {"command": "synthetic", "started": "synthetic", "device": {"name": "NVIDIA H100 80GB HBM3", "sms": 132},
            "clock_end": {"mhz_median": 1800.0}, "ceilings": ceil, "records": records}


KNOWN = {("ours", "fwd"): model.Latency(2.0, 5.0), ("ours", "bwd"): model.Latency(3.5, 15.0),
         ("fa2", "fwd"): model.Latency(2.0, 14.0), ("fa2", "bwd"): model.Latency(2.5, 20.0)}


def test_fit_recovers_known_latencies_and_reports(tmp_path):
    counts = _counts()
    cal = _synthetic_calibration(counts, KNOWN)
    pub = tmp_path / "published.json"
    pub.write_text(json.dumps({"fa2_fwd_rtx4090": {"source": "a synthetic figure", "card": "RTX4090", "head_dim": 128,
                                                   "seqlens": "2K-16K", "tops_low": 1.0, "tops_high": 1e6}}))
    text, summary = fit.report(cal, counts, "synthetic.json", str(pub))  # fits, then writes the tables
    for (impl, pas), value in KNOWN.items():
        got = summary["latency"][f"{impl}_{pas}"]
        assert got["c_other"] == pytest.approx(value.other, rel=1e-4), (impl, pas)
        assert got["c_tensor"] == pytest.approx(value.tensor, rel=1e-4), (impl, pas)
    assert summary["prepost"]["launch_s"] == pytest.approx(2e-6, rel=1e-6)
    assert summary["prepost"]["bw_factor"] == pytest.approx(1.2, rel=1e-6)
    assert max(abs(r["err_total"]) for r in summary["rows"]) < 1e-6
    assert sum(not r["fit"] for r in summary["rows"]) == 32  # 8 held-out shapes x (ours, FA2) x (fwd, bwd)
    assert "Predicted, not measured" in text and "RTX 4090" in text and "RTX 5090" in text
    assert "a synthetic figure" in text and summary["published_check"]["inside"]
    assert summary["held_out_shapes_within_15pct_fwd_and_bwd"] == 8
    pred = summary["predictions"]["RTX4090.sm_89"]
    assert len(pred) == 16 and all(p["ours_fwd_ms"] > 0 and p["fa2_bwd_ms"] > 0 for p in pred)


def test_fit_with_noise_stays_near_the_known_latencies():
    counts = _counts()
    f, rows, _ = fit.fit(_synthetic_calibration(counts, KNOWN, noise=0.02, seed=3), counts)
    held = [abs(r["err_kernel"]) for r in rows if not r["fit"]]
    assert max(held) < 0.06
    for key in (("ours", "fwd"), ("ours", "bwd")):  # W differs between d = 64 and 128: both stalls identified
        assert f.latency[key].other == pytest.approx(KNOWN[key].other, rel=0.25), key


def test_measured_split_of_a_record():
    rec = {"ours_fwd": {"call_ms": 1.2, "steps_ms": {"token_sum": 0.1, "quantize_tensors": 0.1, "attention_forward": 1.0}},
           "fa2_bwd": {"call_ms": 3.0, "kernels_us": {"flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": 2500.0,
                                                      "flash_bwd_convert_dq_kernel": 300.0}},
           "fa2_fwd": {"call_ms": 1.0}}
    m = fit.measured(rec)
    assert m["ours", "fwd"]["kernel"] == pytest.approx(1e-3) and m["ours", "fwd"]["prepost"] == pytest.approx(2e-4)
    assert m["fa2", "bwd"]["kernel"] == pytest.approx(2.5e-3) and m["fa2", "bwd"]["total"] == pytest.approx(2.8e-3)
    assert m["fa2", "fwd"]["kernel"] == pytest.approx(1e-3)  # no profile: the call


def test_committed_counts_cover_the_model():
    counts = _counts()
    for arch in ("sm_90", "sm_89", "sm_120"):
        for kind, d, causal in fit.SASS_KINDS:
            c = counts[fit.sass_key(kind, d, causal, arch)]
            macs = c["interior"]["macs_i8"] + c["interior"].get("macs_f16_f32acc", 0)
            per_warp = 16 * 64 * d * 2 if kind == "fwd" else 5 * 64 * 64 * d // 8
            assert macs == per_warp, (kind, d, causal, arch)


@pytest.mark.skipif(sass.nvdisasm_path() is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
def test_real_forward_sass():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    c = sass.profile_kernel("fwd", 64, False, "sm_89", cards.CARDS["RTX4090"].shared_per_block)
    i = c["interior"]
    assert i["macs_i8"] == 16 * 64 * 64 * 2 and i["tensor"] == 32
    assert i["xu"] >= 32  # one MUFU.EX2 a score at least (16 rows x 64 keys / 32 lanes)
    assert c["registers"] and c["shared_bytes"] and c["edge"]["issue"] >= i["issue"]


def test_ncu_check_splits_calls_on_markers(tmp_path):
    head = '"ID","Kernel Name","launch__grid_size","smsp__inst_executed.sum","gpu__time_duration.sum",' \
           '"smsp__issue_active.avg.pct_of_peak_sustained_active"\n"","","","inst","nsecond","%"\n'
    rows = ['"0","perfmodel_marker","1","10","1000","1"', '"1","token_sum","64","1,000","1000","50"',
            '"2","attention_forward","4096","2,000,000","100000","60"', '"3","perfmodel_marker","2","10","1000","1"',
            '"4","attention_backward","4096","5,000,000","300000","55"']
    (tmp_path / "ncu_base.csv").write_text("==PROF== noise\n" + head + "\n".join(rows) + "\n")
    cal = {"ncu_base": {"file": "ncu_base.csv", "calls": [[128, False, 4096, "ours_fwd"], [128, False, 4096, "ours_bwd"]]}}
    checks = fit.ncu_check(cal, str(tmp_path), _counts(), cards.CARDS["H100"])
    assert [c["pass"] for c in checks] == ["fwd", "bwd"]
    assert checks[0]["ncu_inst"] == 2e6 and checks[1]["ncu_inst"] == 5e6 and checks[0]["model_inst"] > 0
