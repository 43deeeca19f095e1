"""The run-time compiler, on the CPU: NVRTC compiles for any sm_XX without a GPU.

A covering set of specializations (every option alone, in pairs and in triples, per kernel file and
arch) is compiled once, and checked for spills, by the CI step ``python -m sagebwd_cp compile --arch
sm_86 --arch sm_80 --arch sm_90 --once --cover`` (.ci/run; without ``--cover`` every specialization,
``--all-archs`` each for every arch, minutes more); here every kernel file is compiled for every arch once, in parallel, which
catches a source that fails on one arch in seconds."""
import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sagebwd_cp.gpu import compiler, coverage, device, specs
from sagebwd_cp.options import AttentionOptions
from sagebwd_cp.__main__ import compile_all, compile_pairs, main, representative_spec

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")
REPO = Path(__file__).resolve().parents[1]


def _require_ptxas_report():
    """Some NVRTC builds ignore -Xptxas=-v; then there are no register counts to check."""
    if not compiler.compile_spec(specs.ceiling_spec(), "sm_90").reports:
        pytest.skip(f"NVRTC {compiler.nvrtc_version()} prints no ptxas resource report")


def _one_spec_per_kernel_file(arch):
    """A specialization of every kernel file (and of both paths of sm_90's wgmma forward and
    backward), built without listing all_specs, which compiles a mma.sync backward to read its tiles."""
    chosen = [specs.lse_spec("bfloat16"), specs.bias_spec("float16"), specs.ceiling_spec(),
              specs.backward_rows_spec("bfloat16"), representative_spec(arch),
              specs.backward_spec(64, "float16", AttentionOptions(causal=True), specs.BackwardTiles(2))]
    if arch in compiler.SPILL_FALLBACK_ARCHS:
        # Blackwell's ptxas spills the d=128 backward at its default level: compiled again at a lower one.
        chosen.append(_blackwell_backward(arch))
    if arch in ("sm_80", "sm_90"):
        # quantize.cu takes seconds a compile, and registers fall the same way on sm_80, 86 and 89 (its
        # spills have been seen on sm_80-89 or sm_90): the two families here, every arch in CI.
        chosen.append(specs.quantize_spec(128, "float16"))
    if arch in specs.WGMMA_ARCHS:
        chosen += [specs.ceiling_spec(wgmma=True),
                   specs.forward_spec(64, "bfloat16", AttentionOptions(causal=True, smooth_q=True), specs.ForwardTiles(4, 1, True, 64)),
                   specs.backward_spec(128, "bfloat16", AttentionOptions(deterministic=True), specs.BackwardTiles(2, True, 2)),
                   specs.backward_spec(64, "float16", AttentionOptions(causal=True, granularity="paper", deterministic=True), specs.BackwardTiles(2, True, 3))]
    return chosen


def _blackwell_backward(arch):
    return specs.backward_kernel(128, "bfloat16", AttentionOptions(causal=True), specs.BackwardTiles(2), arch,
                                 specs.ARCH_SHARED_LIMIT[arch])[1]


def test_every_kernel_file_compiles_for_every_arch_without_spills():
    pairs = [(spec, arch) for arch in ARCHS for spec in _one_spec_per_kernel_file(arch)]
    assert {s.filename for s, _ in pairs} >= {"quantize.cu", "lse.cu", "smooth_q_bias.cu", "ceiling.cu",
                                              "backward_rows.cu", "forward.cu", "backward.cu", "backward_wgmma.cu"}
    rows = compile_pairs(pairs, jobs=compiler.default_jobs())
    assert {(r.key, r.arch) for r in rows} == {(s.key, a) for s, a in pairs}
    failed = [(r.key, r.arch, r.error) for r in rows if r.error]
    assert not failed
    _require_ptxas_report()
    spilled = [(r.key, r.arch, r.spill_stores, r.spill_loads) for r in rows if r.spill_bytes]
    assert not spilled
    stacked = [(r.key, r.arch, r.stack_bytes) for r in rows if r.stack_bytes]  # local arrays, not spills
    assert not stacked
    assert all(r.registers > 0 for r in rows)


def test_quantize_at_head_dim_256_fits_three_ctas_an_sm_on_hopper():
    """quantize.cu's static shared memory holds rows of column sums only where an entry adds columns across warps (the
    forward's fused token sums, two warps a row at D_pad = 256; Q-smoothing, up to head dim 128): at D_pad = 256 the
    backward's quantize_tensors and the forward's quantize_tensors_fused (256 threads, 64 KB of chunks) each fit three
    CTAs in an H100's or H200's 228 KB, not two."""
    _require_ptxas_report()
    reports = compiler.compile_spec(specs.quantize_spec(256, "bfloat16"), "sm_90").reports
    chunks, reserved, sm_shared = 256 * specs.QUANT_CHUNKS * 16, 1024, 228 * 1024  # (the driver's 1 KB a CTA)
    for entry in ("quantize_tensors", "quantize_tensors_fused"):
        assert 3 * (reports[entry].shared_bytes + chunks + reserved) <= sm_shared, entry
    assert reports["quantize_tensors_fused"].shared_bytes >= 256 // 64 * 256 * 8  # its float64 column sums


def test_front_end_options_leave_the_machine_code_alone(monkeypatch):
    """``--minimal`` (NVRTC 12.4 on, not before) shortens the compile and gives the same cubin."""
    assert compiler.front_end_options((12, 3)) == ()
    assert compiler.front_end_options((12, 4)) == compiler.front_end_options((13, 0)) == ("--minimal",)
    spec = specs.backward_rows_spec("bfloat16")
    source = compiler.flatten_source(spec.filename)
    with_options, _ = compiler._nvrtc_compile(source, spec, "sm_86")
    monkeypatch.setattr(compiler, "front_end_options", lambda version: ())
    without, _ = compiler._nvrtc_compile(source, spec, "sm_86")
    assert with_options == without


def test_compile_processes_return_results_and_errors_in_order():
    """compile_many in two processes: each pair's own result (a compile error or a bad arch comes
    back as the exception, the others still compile), and the results land in the memory cache."""
    good, other = specs.backward_rows_spec("bfloat16"), specs.lse_spec("float16")
    pairs = [(good, "sm_86"), (good, "sm_75"), (other, "sm_80")]
    results = {i: r for i, r, _ in compiler.compile_many(pairs, jobs=2)}
    assert sorted(results) == [0, 1, 2]
    assert isinstance(results[1], ValueError) and "sm_75" in str(results[1])
    for i in (0, 2):
        spec, arch = pairs[i]
        assert isinstance(results[i], compiler.CompiledKernel) and results[i].arch == arch
        assert results[i].cubin_path.stat().st_size > 0
        assert compiler.compile_spec(spec, arch) is results[i]  # taken from the memory cache
    rows = compile_pairs(pairs, jobs=2)
    # backward_rows' three entries, one row for the failed spec, lse.cu's two entries: in the pairs' order
    assert [r.arch for r in rows] == ["sm_86"] * 3 + ["sm_75"] + ["sm_80"] * 2
    assert rows[3].error and not any(r.error for i, r in enumerate(rows) if i != 3)


def test_ci_compiles_a_covering_set_once():
    """The guarantee the test suite leaves to CI: a covering set of the specializations, no spills, for the
    archs that launch them with the least shared memory (sm_86), with two stages (sm_80) and with wgmma (sm_90)."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "python -m sagebwd_cp compile --arch sm_86 --arch sm_80 --arch sm_90 --once --cover" in ci


def _fake(key):
    return specs.KernelSpec(key, "lse.cu", (), ("e",))


def _cover(keys, depth=coverage.DEPTH, arch="sm_90"):
    return [spec.key for spec, _ in coverage.covering_pairs([(_fake(k), arch) for k in keys], depth)]


def test_covering_set_keeps_the_combinations_only_one_specialization_has():
    # every single, pair and triple of f's words present or absent: f.a.b.c has a, b, c together, f.a
    # has a without b and c, and so on; g is another family
    assert _cover(["f.a.b", "f.a.c", "f.b.c", "f.a.b.c", "f.a", "g"]) == ["f.a.b", "f.a.c", "f.b.c", "f.a.b.c", "f.a", "g"]
    # singles alone: a, b, c present and each absent (f.a.b has no c, f.a.c no b, f.b.c no a)
    assert _cover(["f.a.b", "f.a.c", "f.b.c", "f.a.b.c", "f.a", "g"], depth=1) == ["f.a.b", "f.a.c", "f.b.c", "g"]
    # pairs: f.a, f.b and f.a.b have a, b together, and apart both ways, but neither absent
    assert _cover(["f.a", "f.b", "f.a.b", "f.a.b"], depth=2) == ["f.a", "f.b", "f.a.b"]
    # the same key on another arch is another family to cover
    assert len(coverage.covering_pairs([(_fake("f.a"), "sm_90"), (_fake("f.a"), "sm_86")])) == 2


def test_covering_set_covers_every_triple_of_the_listed_specializations():
    pairs = [(spec, "sm_90") for spec in specs.all_specs("sm_90")]  # (sm_90 lists every kernel file)
    chosen = coverage.covering_pairs(pairs)
    assert len(chosen) < len(pairs) / 2
    keys = [spec.key for spec, _ in chosen]
    assert keys == [spec.key for spec, _ in pairs if spec.key in set(keys)]  # in the listed order
    vocab = coverage._vocabularies(pairs)
    want = set().union(*(coverage._units(spec.key, a, vocab, coverage.DEPTH) for spec, a in pairs))
    have = set().union(*(coverage._units(spec.key, a, vocab, coverage.DEPTH) for spec, a in chosen))
    assert have == want
    assert {k.split(".")[0] for k in keys} == {spec.key.split(".")[0] for spec, _ in pairs}


def test_spec_keys_are_unique():
    """Keys are spelled from the defines (specs.KEY_TEXT): one key per set of defines and file."""
    listed = specs.all_specs()
    keys = [s.key for s in listed]
    assert len(keys) == len(set(keys)) == len({(s.filename, s.defines) for s in listed})
    assert specs.forward_spec(128, "float16", AttentionOptions(causal=True), specs.ForwardTiles(4, 1)).key == \
        "forward.hd128.float16.causal.w4m1"
    assert specs.backward_spec(64, "bfloat16", AttentionOptions(granularity="paper", deterministic=True),
                               specs.BackwardTiles(2, True, ws=True, dq_tiles=2), varlen=True).key == \
        "backward.hd64.bfloat16.full.paper.det.s2.wgmma.ws.dq2.varlen"


@pytest.fixture
def source_copy(tmp_path):
    """kernels/ and ptx/ copied to a tmp dir, so a test can edit a header."""
    dirs = []
    for name, src in zip(("kernels", "ptx"), compiler.source_dirs()):
        dst = tmp_path / name
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
        dirs.append(dst)
    return tuple(dirs)


def _forward_spec():
    return next(s for s in specs.all_specs() if s.filename == "forward.cu")


def test_cache_key_follows_every_included_header(source_copy):
    spec = _forward_spec()
    _, ptx_dir = source_copy

    def key():
        return compiler.cache_key(spec, "sm_90", compiler.flatten_source(spec.filename, dirs=source_copy))

    original = key()
    assert key() == original
    included = [h for h in sorted(ptx_dir.glob("*.cuh"))
                if f"// ---- {h.name} ----" in compiler.flatten_source(spec.filename, dirs=source_copy)]
    assert included
    for header in included:
        text = header.read_text()
        header.write_text(text + "\n// edited\n")
        assert key() != original, header.name
        header.write_text(text)
    assert key() == original


def test_cache_key_follows_options_and_arch():
    spec = _forward_spec()
    source = compiler.flatten_source(spec.filename)
    key = compiler.cache_key(spec, "sm_90", source)
    assert compiler.cache_key(spec, "sm_89", source) != key
    other_defines = dataclasses.replace(spec, defines=spec.defines + (("SB_EXTRA", 1),))
    assert compiler.cache_key(other_defines, "sm_90", source) != key
    # The default source is the installed one, flattened the same way.
    assert compiler.cache_key(spec, "sm_90") == key


def test_flatten_inlines_each_header_once(tmp_path):
    (tmp_path / "common.cuh").write_text("#pragma once\nint common_marker;\n")
    (tmp_path / "a.cuh").write_text('#pragma once\n#include "common.cuh"\nint a_marker;\n')
    (tmp_path / "b.cuh").write_text('#pragma once\n#include "common.cuh"\n#include "a.cuh"\nint b_marker;\n')
    (tmp_path / "k.cu").write_text('#include "a.cuh"\n#include "b.cuh"\n#include "common.cuh"\nint k_marker;\n')
    flat = compiler.flatten_source("k.cu", dirs=(tmp_path,))
    for marker in ("common_marker", "a_marker", "b_marker", "k_marker"):
        assert flat.count(marker) == 1
    assert flat.index("common_marker") < flat.index("a_marker") < flat.index("b_marker") < flat.index("k_marker")
    assert "#include" not in flat and "#pragma once" not in flat


def test_flatten_real_sources_inline_every_header_once():
    ptx_dir = compiler.source_dirs()[1]
    for filename in sorted({s.filename for s in specs.all_specs()}):
        flat = compiler.flatten_source(filename)
        assert '#include "' not in flat
        for header in ptx_dir.glob("*.cuh"):
            assert flat.count(f"// ---- {header.name} ----") <= 1


def test_flatten_names_a_missing_header(tmp_path):
    (tmp_path / "k.cu").write_text('#include "missing.cuh"\n')
    with pytest.raises(FileNotFoundError, match="missing.cuh"):
        compiler.flatten_source("k.cu", dirs=(tmp_path,))


SPILLING_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'fine' for 'sm_90'
ptxas info    : Function properties for fine
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 4096 bytes smem
ptxas info    : Compiling entry function 'spiller' for 'sm_90'
ptxas info    : Function properties for spiller
ptxas         .     96 bytes stack frame, 88 bytes spill stores, 72 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
"""


def test_parse_ptxas_report_finds_spills():
    reports = compiler.parse_ptxas_report(SPILLING_LOG)
    assert set(reports) == {"fine", "spiller"}
    fine, spiller = reports["fine"], reports["spiller"]
    assert (fine.registers, fine.shared_bytes, fine.spills) == (128, 4096, False)
    assert (spiller.registers, spiller.stack_bytes, spiller.spill_stores, spiller.spill_loads) == (255, 96, 88, 72)
    assert spiller.spills


def test_broken_kernel_raises_compile_error_with_nvrtc_log(tmp_path, monkeypatch):
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void broken() { undeclared_thing = 1; }\n')
    monkeypatch.setattr(compiler, "source_dirs", lambda: (tmp_path,))
    spec = compiler.make_spec("broken", "broken.cu", ["broken"])
    with pytest.raises(compiler.CompileError) as info:
        compiler.compile_spec(spec, "sm_90")
    message = str(info.value)
    assert "broken" in message and "sm_90" in message
    assert "undeclared_thing" in message and "error" in message  # NVRTC's own log


def test_compile_spec_rejects_a_bad_arch():
    with pytest.raises(ValueError, match="arch"):
        compiler.compile_spec(specs.bias_spec("float16"), "compute_90")


def test_cli_compile_exits_zero(capsys):
    assert main(["compile", "--arch", "sm_90", "--only", "natural_lse.*", "--only", "ceiling"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("natural_lse.", "ceiling:"))]
    lse = [f"natural_lse.{dt}{v}:{entry}" for dt in ("float16", "bfloat16") for v in ("", ".varlen")
           for entry in ("natural_lse", "softcap_row_bias")]
    assert sorted(rows) == sorted(["ceiling:fp16_mma_ceiling", "ceiling:int8_mma_ceiling"] + lse)
    assert f"kernel cache: {compiler.cache_dir()}" in out
    assert "compiling 5 specializations for sm_90" in out
    assert "10 kernels compiled for sm_90 without register spills" in out


def test_cli_compile_once_takes_each_key_for_the_first_arch_that_launches_it(capsys):
    assert main(["compile", "--arch", "sm_86", "--arch", "sm_90", "--once", "--only", "natural_lse.*",
                 "--only", "ceiling*"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[:2] for line in out.splitlines() if line.startswith(("natural_lse.", "ceiling"))]
    keys = [name.split(":")[0] for name, _ in rows]
    assert len(set(keys)) == 6 and all(arch == "sm_86" for name, arch in rows if name.startswith("natural_lse."))
    # the wgmma ceiling is launched on sm_90 alone; the mma.sync one is sm_86's
    ceilings = {(name.split(":")[0], arch) for name, arch in rows if name.startswith("ceiling")}
    assert sorted(arch for _, arch in ceilings) == ["sm_86", "sm_90"]
    assert "compiling 6 specializations for sm_86, sm_90" in out


def test_cli_compile_cover_compiles_the_covering_set(capsys):
    assert main(["compile", "--arch", "sm_90", "--once", "--cover", "--only", "natural_lse.*"]) == 0
    out = capsys.readouterr().out
    # natural_lse.{float16,bfloat16}[.varlen]: each dtype with and without varlen, the four of them (a
    # pair of words present or absent); the table lists each of their two entries
    keys = {line.split(":")[0] for line in out.splitlines() if line.startswith("natural_lse.")}
    assert sorted(keys) == sorted(f"natural_lse.{dt}{v}" for dt in ("float16", "bfloat16") for v in ("", ".varlen"))
    assert "compiling 4 specializations for sm_90" in out


def test_cli_compile_names_an_unmatched_pattern(capsys):
    assert main(["compile", "--arch", "sm_90", "--jobs", "1", "--only", "nothing.*"]) == 2
    assert "no specialization matches --only nothing.*" in capsys.readouterr().err


def test_cli_compile_exits_one_on_spills(monkeypatch, capsys):
    _require_ptxas_report()
    real = compiler.compile_spec

    def spilling(spec, arch, **kwargs):
        compiled = real(spec, arch, **kwargs)
        reports = {name: dataclasses.replace(r, spill_stores=8) for name, r in compiled.reports.items()}
        return dataclasses.replace(compiled, reports=reports)

    monkeypatch.setattr(compiler, "compile_spec", spilling)
    assert main(["compile", "--arch", "sm_90", "--jobs", "1", "--only", "natural_lse.*"]) == 1
    assert "SPILLS" in capsys.readouterr().err


def test_cli_compile_exits_one_on_a_compile_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void broken() { undeclared_thing = 1; }\n')
    monkeypatch.setattr(compiler, "source_dirs", lambda: (tmp_path,))
    monkeypatch.setattr(specs, "all_specs", lambda arch=None: [compiler.make_spec("broken", "broken.cu", ["broken"])])
    assert main(["compile", "--arch", "sm_90", "--jobs", "1"]) == 1
    assert "undeclared_thing" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["89", "sm_75", "sm_90a", "sm_121"])
def test_cli_rejects_an_unsupported_arch(arch, capsys):
    with pytest.raises(SystemExit) as info:
        main(["compile", "--arch", arch])
    assert info.value.code == 2  # argparse's usage error, not a traceback
    err = capsys.readouterr().err
    assert f"--arch: expected one of sm_80, sm_86, sm_89, sm_90, sm_100, sm_120, got '{arch}'" in err


def test_cli_rejects_a_bad_job_count(capsys):
    with pytest.raises(SystemExit):
        main(["compile", "--arch", "sm_90", "--jobs", "-2"])
    assert "expected a whole number of processes (0: one per core), got '-2'" in capsys.readouterr().err


def test_cli_info_reports_versions_and_compiles_one_kernel(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "NVRTC" in out and "numpy" in out
    assert f"kernel cache: {compiler.cache_dir()}" in out
    found, why = device.cuda_device()
    arch = found["arch"] if found else "sm_90"
    assert (why in out) if found is None else (f"CUDA device {found['id']}" in out)
    kernel_lines = [line for line in out.splitlines() if line.startswith(representative_spec(arch).key)]
    assert len(kernel_lines) == 1  # one kernel, not every specialization


def test_cli_info_is_quick_with_a_fresh_cache(tmp_path):
    """A new user's first command: under 15 seconds, cold cache included, and plain about no GPU."""
    env = dict(os.environ, SAGEBWD_CP_CACHE_DIR=str(tmp_path / "cache"))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sagebwd_cp", "info"], capture_output=True, text=True, env=env,
                          timeout=60)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert seconds < 15, f"info took {seconds:.1f} s"
    assert f"kernel cache: {tmp_path / 'cache'}" in proc.stdout
    if device.cuda_device()[0] is None:
        assert "no CUDA GPU found; host arrays run on the CPU emulator" in proc.stdout
        assert "insufficient" not in proc.stdout + proc.stderr


def test_the_producer_warpgroup_backward_is_the_deterministic_default(monkeypatch):
    """The wgmma backward with a producer warpgroup (384 threads, key ".ws"): by default where it is deterministic
    (not at d=128 with the paper granularity or Q-smoothing, which spill); SAGEBWD_BACKWARD_WS=1 everywhere it
    fits, =0 nowhere."""
    limit = specs.arch_shared_limit("sm_90")

    def ws(dp, opts, varlen=False):
        wanted = specs.backward_tiles(dp, "sm_90", opts.deterministic)
        tiles, spec = specs.backward_kernel(dp, "float16", opts, wanted, "sm_90", limit, varlen)
        assert ("ws" in spec.key.split(".")) == tiles.ws, spec.key
        assert tiles.threads == 128 * (2 + tiles.ws) and dict(spec.defines)["SB_THREADS"] == 256
        assert dict(spec.defines)["SB_CTA_KEYS"] == 128
        return tiles.ws

    det = AttentionOptions(causal=True, deterministic=True)
    monkeypatch.delenv("SAGEBWD_BACKWARD_WS", raising=False)
    assert ws(128, det) and ws(128, det, varlen=True) and ws(128, det._replace(softcap=5.0, smooth_k=False))
    assert ws(64, det) and ws(64, det._replace(granularity="paper", smooth_q=True)) and ws(64, det, varlen=True)
    assert ws(64, AttentionOptions(deterministic=True)) and not ws(128, AttentionOptions(causal=True))
    assert not ws(128, det._replace(granularity="paper")) and not ws(128, det._replace(smooth_q=True))
    monkeypatch.setenv("SAGEBWD_BACKWARD_WS", "1")
    for dp, opts, want in ((128, AttentionOptions(causal=True), True), (64, AttentionOptions(), True),
                           (128, AttentionOptions(granularity="paper"), False)):
        assert ws(dp, opts) == want, (dp, opts)
    # Two dQ tiles where the producer reduces them, or SAGEBWD_BACKWARD_DQ_TILES=1; and both fit sm_90 at d=128.
    monkeypatch.delenv("SAGEBWD_BACKWARD_WS", raising=False)
    tiles = lambda dp: specs.backward_tiles(dp, "sm_90", True)
    assert (tiles(64).dq_tiles, tiles(128).dq_tiles, specs.backward_tiles(64, "sm_90").dq_tiles) == (2, 2, 1)
    wide = specs.backward_spec(128, "float16", det, tiles(128))
    assert compiler.dynamic_shared_bytes(wide, "sm_90") <= specs.arch_shared_limit("sm_90")
    spec = specs.backward_spec(64, "float16", det, tiles(64))
    assert spec.key.endswith(".ws.dq2") and dict(spec.defines)["SB_DQ_TILES"] == 2
    monkeypatch.setenv("SAGEBWD_BACKWARD_DQ_TILES", "1")
    assert tiles(64).dq_tiles == 1
    monkeypatch.setenv("SAGEBWD_BACKWARD_WS", "0")
    assert not ws(128, det)
    assert not specs.backward_tiles(128, "sm_86", True).ws  # the mma.sync kernel


def test_the_warp_specialized_forward_is_the_default_where_it_measured_faster(monkeypatch):
    """forward_ws.cu at head dim 128 without a mask in dense batches (one consumer, a CTA per work tile);
    forward.cu for every other shape, everywhere with SAGEBWD_FORWARD_WS=0, and for none it is not built for."""
    for name in ("SAGEBWD_FORWARD_WS", "SAGEBWD_WGMMA", "SAGEBWD_FORWARD_CONSUMERS", "SAGEBWD_FORWARD_PERSISTENT",
                 "SAGEBWD_FORWARD_KEY_TILE"):
        monkeypatch.delenv(name, raising=False)
    ws = specs.forward_ws_tiles
    plain = AttentionOptions()
    assert ws(128, "sm_90", plain) == specs.WsForwardTiles(consumers=1, pingpong=False, persistent=False)
    assert ws(128, "sm_90", plain, len_k=specs.WS_FORWARD_MAX_KEYS) == ws(128, "sm_90", plain)
    assert ws(128, "sm_90", plain, len_k=specs.WS_FORWARD_MAX_KEYS + 1) is None
    for options, dp, arch, varlen in ((AttentionOptions(causal=True), 128, "sm_90", False), (plain, 64, "sm_90", False),
                                      (plain, 128, "sm_90", True), (plain, 128, "sm_80", False),
                                      (plain, 256, "sm_90", True), (plain, 256, "sm_80", False)):
        assert ws(dp, arch, options, varlen) is None, (options, dp, arch, varlen)
    # Head dim 256 (V wider than 192 columns; narrower V keeps forward.cu's narrow kernels): two consumers in turns.
    wide = specs.WsForwardTiles(consumers=2, stages=2, pingpong=True, persistent=False)
    for options in (plain, AttentionOptions(causal=True)):
        assert ws(256, "sm_90", options) == ws(256, "sm_90", options, value_dim=200) == wide
        assert ws(256, "sm_90", options, value_dim=192) is None and ws(256, "sm_90", options, value_dim=128) is None
    assert ws(256, "sm_90", AttentionOptions(causal=True, window_left=100)) is None
    for options in (AttentionOptions(window_left=100), AttentionOptions(softcap=5.0, smooth_k=False),
                    AttentionOptions(smooth_q=True)):  # (not built for these)
        monkeypatch.setenv("SAGEBWD_FORWARD_WS", "1")
        assert ws(128, "sm_90", options) is None
    assert ws(128, "sm_90", AttentionOptions(causal=True)) == ws(128, "sm_90", plain)
    assert ws(64, "sm_90", plain) == specs.WsForwardTiles(consumers=3, pingpong=False)
    monkeypatch.delenv("SAGEBWD_FORWARD_WS")
    monkeypatch.setenv("SAGEBWD_FORWARD_KEY_TILE", "64")  # forward.cu's tile forced: that kernel
    assert ws(128, "sm_90", plain) is None
    monkeypatch.delenv("SAGEBWD_FORWARD_KEY_TILE")
    monkeypatch.setenv("SAGEBWD_FORWARD_WS", "0")
    assert ws(128, "sm_90", plain) is None
    monkeypatch.setenv("SAGEBWD_FORWARD_WS", "1")
    monkeypatch.setenv("SAGEBWD_WGMMA", "0")
    assert ws(128, "sm_90", plain) is None
    # Its spec is among those CI compiles.
    monkeypatch.delenv("SAGEBWD_WGMMA")
    keys = {s.key for s in specs.all_specs("sm_90")}
    assert specs.forward_ws_spec(128, "bfloat16", plain, ws(128, "sm_90", plain)).key in keys


def test_forward_and_backward_use_wgmma_on_hopper_only(monkeypatch):
    monkeypatch.delenv("SAGEBWD_WGMMA", raising=False)
    assert specs.forward_tiles(128, "sm_90") == specs.ForwardTiles(4, 1, wgmma=True, key_tile=128)
    assert specs.backward_tiles(128, "sm_90") == specs.BackwardTiles(stages=2, wgmma=True)
    assert specs.backward_tiles(64, "sm_90") == specs.BackwardTiles(stages=2, wgmma=True)
    assert specs.backward_tiles(64, "sm_90", True) == specs.BackwardTiles(stages=2, wgmma=True, ws=True, dq_tiles=2)
    # The overrides: a listed value is taken, another is refused by name.
    for name, value, chosen in (("SAGEBWD_FORWARD_KEY_TILE", 64, lambda: specs.forward_tiles(64, "sm_90").key_tile),
                                ("SAGEBWD_BACKWARD_WS", 1, lambda: int(specs.backward_tiles(64, "sm_90").ws)),
                                ("SAGEBWD_BACKWARD_QUAD", 1, lambda: int(specs.backward_tiles(128, "sm_90").quad))):
        monkeypatch.setenv(name, str(value))
        assert chosen() == value
        monkeypatch.setenv(name, "96")
        with pytest.raises(ValueError, match=name):
            chosen()
        monkeypatch.delenv(name)
    # Sliding windows of at most NARROW_BAND_KEYS keys (left + right) take the 64-key forward; a wider one, causal
    # attention and the soft cap's open band the 128-key one; the override wins over either.
    key_tile = lambda **kw: specs.forward_tiles(128, "sm_90", options=AttentionOptions(**kw)).key_tile  # noqa: E731
    assert key_tile(causal=True, window_left=2048) == key_tile(window_left=300, window_right=500) == 64
    assert key_tile(causal=True, window_left=2049) == key_tile(window_left=1024, window_right=1025) == 128
    assert key_tile(causal=True) == key_tile(window_left=100) == key_tile(softcap=5.0, smooth_k=False) == 128
    monkeypatch.setenv("SAGEBWD_FORWARD_KEY_TILE", "128")
    assert key_tile(causal=True, window_left=100) == 128
    monkeypatch.delenv("SAGEBWD_FORWARD_KEY_TILE")
    # The four-warpgroup backward (opt-in) at head dim 128 where it applies; elsewhere backward_wgmma.cu.
    monkeypatch.setenv("SAGEBWD_BACKWARD_QUAD", "1")
    limit = specs.ARCH_SHARED_LIMIT["sm_90"]
    quad = specs.backward_tiles(128, "sm_90")
    assert quad.quad and quad.threads == 512 and not specs.backward_tiles(64, "sm_90").quad
    assert not specs.backward_tiles(128, "sm_90", True).quad and not specs.backward_tiles(128, "sm_80").quad
    for extra, varlen, expected in (({}, False, "backward_quad.cu"), (dict(window_left=100), False, "backward_quad.cu"),
                                    ({}, True, "backward_wgmma.cu"), (dict(granularity="paper"), False, "backward_wgmma.cu"),
                                    (dict(softcap=30.0, smooth_k=False), False, "backward_wgmma.cu"),
                                    (dict(smooth_q=True), False, "backward_wgmma.cu")):
        tiles, spec = specs.backward_kernel(128, "bfloat16", AttentionOptions(causal=True, **extra), quad, "sm_90", limit,
                                            varlen)
        assert spec.filename == expected and tiles.quad == (expected == "backward_quad.cu"), extra
    monkeypatch.delenv("SAGEBWD_BACKWARD_QUAD")
    for arch in ("sm_80", "sm_86", "sm_89", "sm_100", "sm_120", "sm_121", None):
        assert not specs.use_wgmma(arch)
        assert specs.forward_tiles(128, arch).key_tile == 64
        assert not specs.forward_tiles(128, arch).wgmma
        assert not specs.backward_tiles(128, arch).wgmma
    monkeypatch.setenv("SAGEBWD_WGMMA", "0")
    assert not specs.forward_tiles(64, "sm_90").wgmma
    assert not specs.backward_tiles(64, "sm_90").wgmma


def test_the_mma_sync_backward_takes_one_stage_where_two_do_not_fit():
    """The stage count follows the compiled layout: two fit sm_80's and sm_90's shared memory at every
    head dim, and sm_86's at head dim 64; at 128 there it is one."""
    for arch, dp, stages in (("sm_80", 128, 2), ("sm_90", 128, 2), ("sm_86", 64, 2), ("sm_86", 128, 1), ("sm_89", 128, 1),
                             ("sm_100", 128, 2), ("sm_120", 64, 2), ("sm_120", 128, 1)):
        tiles, spec = specs.backward_kernel(dp, "float16", AttentionOptions(), specs.BackwardTiles(2), arch,
                                            specs.ARCH_SHARED_LIMIT[arch])
        assert tiles.stages == stages and dict(spec.defines)["SB_STAGES"] == stages
        assert compiler.dynamic_shared_bytes(spec, arch) <= specs.ARCH_SHARED_LIMIT[arch]


def test_wide_head_dims_pick_the_wgmma_kernels_on_sm90(monkeypatch):
    """Above head dim 128 sm_90 runs the wgmma forward (two warpgroups on 128-key tiles for the plain masks with V's
    whole head dim, else one on 64-key tiles) and the wgmma backward as two CTAs a key
    block (one stage, the producer, one dQ tile), with a sliding window and a soft cap too; SAGEBWD_WGMMA=0 and
    the other archs keep the mma.sync kernels."""
    limit = specs.ARCH_SHARED_LIMIT["sm_90"]
    assert specs.forward_tiles(256, "sm_90") == specs.ForwardTiles(4, 1, wgmma=True, key_tile=64)
    # the plain masks with V's 256 columns: two warpgroups on 128-key tiles; under a window or a soft cap (no
    # narrow_value_dim) 64-key tiles
    for value_dim, options in ((256, AttentionOptions(causal=True)), (200, AttentionOptions())):
        assert specs.forward_tiles(256, "sm_90", specs.narrow_value_dim(options, value_dim), options) == \
            specs.ForwardTiles(8, 1, wgmma=True, key_tile=128)
    for options in (AttentionOptions(causal=True, window_left=100), AttentionOptions(causal=True, softcap=30.0)):
        assert specs.forward_tiles(256, "sm_90", specs.narrow_value_dim(options, 256), options).key_tile == 64
    tiles = specs.backward_tiles(256, "sm_90")
    assert tiles == specs.BackwardTiles(stages=1, wgmma=True, ws=True, dq_tiles=1)
    assert (tiles.passes(256), tiles.pass_dims(256), tiles.passes(128)) == (2, 128, 1)
    window, cap = dict(window_left=100), dict(softcap=30.0, smooth_k=False)
    for extra, wgmma in (({}, True), (cap, True), (window, True), ({**window, **cap}, True)):
        chosen, spec = specs.backward_kernel(256, "bfloat16", AttentionOptions(causal=True, **extra), tiles, "sm_90",
                                             limit)
        assert chosen.wgmma == wgmma and (spec.filename == "backward_wgmma.cu") == wgmma, extra
        if wgmma:
            assert dict(spec.defines)["SB_PASSES"] == 2 and dict(spec.defines)["SB_TMA_DQ_COLS"] == 136
    assert specs.forward_tiles(256, "sm_80") == specs.FORWARD_TILES[256]
    assert not specs.backward_tiles(256, "sm_80").wgmma
    monkeypatch.setenv("SAGEBWD_WGMMA", "0")
    assert specs.forward_tiles(256, "sm_90") == specs.FORWARD_TILES[256]
    assert not specs.backward_tiles(256, "sm_90").wgmma


def test_the_wide_wgmma_forward_holds_o_for_a_narrower_value_head_dim():
    """Above head dim 128 the wgmma forward holds O for 128 columns where V has at most 128 (MLA's 192/128), for 192
    where it has at most 192 (SB_DPV: three CTAs an SM), else for all 256 columns, under the plain masks; every such spec is
    listed, compiles without spills, and its shared layout leaves room for three CTAs an SM."""
    for value_dim, cols, keys in ((None, 0, 64), (256, 0, 128), (200, 0, 128), (192, 192, 64), (136, 192, 64),
                                  (128, 128, 64), (72, 128, 64), (64, 128, 64)):
        tiles = specs.forward_tiles(256, "sm_90", value_dim)
        assert tiles.value_cols == cols and tiles.key_tile == keys and tiles.wgmma, value_dim
    assert specs.forward_tiles(128, "sm_90", 64).value_cols == 0  # (the d=128 kernels hold O's 128 columns)
    assert specs.forward_tiles(256, "sm_80", 128) == specs.FORWARD_TILES[256]
    narrow = [s for s in specs.all_specs("sm_90") if "SB_DPV" in dict(s.defines) and s.key.startswith("forward.")]
    assert {dict(s.defines)["SB_DPV"] for s in narrow} == set(specs.NARROW_VALUE_COLS)
    # (none and causal masks, dense and packed, both dtypes; windowed and soft-capped calls keep the 256-column kernel)
    assert len(narrow) == 2 * 2 * 2 * len(specs.NARROW_VALUE_COLS)
    assert not any(dict(s.defines).get("SB_WINDOW") or dict(s.defines).get("SB_SOFTCAP") for s in narrow)
    window, cap = AttentionOptions(causal=True, window_left=8), AttentionOptions(causal=True, softcap=5.0, smooth_k=False)
    assert specs.narrow_value_dim(window, 128) is None and specs.narrow_value_dim(cap, 128) is None
    assert specs.narrow_value_dim(AttentionOptions(causal=True), 128) == 128
    for spec in narrow[:4]:
        kernel = compiler.compile_spec(spec, "sm_90")
        report = kernel.reports.get("attention_forward")
        assert report is None or (report.spill_stores == 0 and report.stack_bytes == 0), (spec.key, report)
        assert 3 * (compiler.dynamic_shared_bytes(spec, "sm_90") + 1024) <= 233472, spec.key


def test_the_wide_wgmma_backward_splits_192_columns_where_the_head_dims_fit_them():
    """Head dims up to 192 (MLA's 192/128, 192, 136/64) under the plain masks: the wide backward's two CTAs a key
    block take 96 columns of dK and dQ each and half of V's (SB_DQK 192, SB_DPV 128 or 192), not 128 of 256; with
    V's 128 columns two stages fit. Windowed and soft-capped calls and head dims above 192 keep the 256-column
    kernel. There the pair kernel (kernels/backward_pair.cu: one CTA a 64-key block, its two warpgroups splitting
    the columns; at V's 192 Q̂ᵀ and dÔᵀ in one buffer) takes the place of the two passes, unless
    asked not to. Every such spec is listed, compiles without spills and fits the shared memory of an sm_90 block."""
    wide = specs.backward_tiles(256, "sm_90")
    plain, window = AttentionOptions(causal=True), AttentionOptions(causal=True, window_left=8)
    for head_dim, value_dim, want in ((192, 128, (192, 128, 2)), (192, 192, (192, 192, 1)), (136, 64, (192, 128, 2)),
                                      (136, 136, (192, 192, 1)), (200, 200, (0, 0, 1)), (256, 128, (0, 0, 1))):
        for pair in (None, False):
            tiles = specs.narrow_backward_tiles(wide, 256, head_dim, value_dim, plain, pair)
            assert (tiles.qk_cols, tiles.value_cols, tiles.stages) == (want[:2] + (2,) if tiles.pair or want[1] == 128 else want)
            assert tiles.pair == (bool(want[0]) and pair is None), (head_dim, value_dim, pair)
            passes = 1 if tiles.pair else 2
            assert tiles.pass_dims(256) == (want[0] or 256) // passes
            assert tiles.value_pass_dims(256) == (want[1] or 256) // passes
    assert specs.narrow_backward_tiles(wide, 256, 192, 128, window) == wide
    assert specs.narrow_backward_tiles(specs.backward_tiles(128, "sm_90"), 128, 128, 128, plain).qk_cols == 0
    narrow = [s for s in specs.all_specs("sm_90") if "SB_DQK" in dict(s.defines)]
    # dtype x mask x packed x (V's columns x (the pair kernel, the two passes), and the phase-specialized pair
    # kernel at V's 128)
    assert len(narrow) == 2 * 2 * 2 * (len(specs.NARROW_VALUE_COLS) * 2 + 1)
    assert {dict(s.defines)["SB_DPV"] for s in narrow if s.filename == "backward_phases.cu"} == {128}
    assert not any(dict(s.defines).get("SB_WINDOW") or dict(s.defines).get("SB_SOFTCAP") for s in narrow)
    firsts = {}
    for spec in narrow:
        firsts.setdefault((spec.filename, dict(spec.defines)["SB_DPV"]), spec)
    assert set(firsts) == {(f, v) for f in ("backward_pair.cu", "backward_wgmma.cu") for v in specs.NARROW_VALUE_COLS} | \
        {("backward_phases.cu", 128)}
    for (filename, value_cols), spec in firsts.items():
        d = dict(spec.defines)
        if filename in ("backward_pair.cu", "backward_phases.cu"):
            # dQ's boxes: 32-column swizzled blocks of unpadded rows, a warpgroup's half (pair) or a product's 64 (phases)
            blocks = 3 if filename == "backward_pair.cu" else 2
            assert d["SB_TMA_QT_ROWS"] == 192 and d["SB_TMA_DOT_ROWS"] == value_cols and d["SB_TMA_DQ_COLS"] == 32
            assert d["SB_DQ_PITCH"] == 192 and d["SB_TMA_DQ_BLOCKS"] == blocks
        else:
            assert d["SB_TMA_QT_ROWS"] == 96 and d["SB_TMA_DOT_ROWS"] == value_cols // 2 and d["SB_TMA_DQ_COLS"] == 104
        report = compiler.compile_spec(spec, "sm_90").reports.get("attention_backward")  # (None: from the cache)
        assert report is None or (report.spill_stores == 0 and report.stack_bytes == 0), (spec.key, report)
        assert compiler.dynamic_shared_bytes(spec, "sm_90") <= specs.ARCH_SHARED_LIMIT["sm_90"], spec.key


def test_the_deterministic_wide_backward_is_built_for_sm90_alone():
    """deterministic=True above head dim 128 runs sm_90's wgmma backward (its two CTAs a key block in turns); the
    mma.sync kernels (other archs, SAGEBWD_WGMMA=0) refuse it by name, before compiling anything."""
    det = AttentionOptions(causal=True, deterministic=True)
    tiles, spec = specs.backward_kernel(256, "float16", det, specs.backward_tiles(256, "sm_90", True), "sm_90",
                                        specs.ARCH_SHARED_LIMIT["sm_90"])
    assert tiles.wgmma and ".det." in spec.key and dict(spec.defines)["SB_PASSES"] == 2
    assert not specs.narrow_backward_tiles(tiles, 256, 192, 128, det).qk_cols
    # (the forward of a deterministic call keeps its narrow-V kernel: deterministic orders the backward's dQ alone)
    assert specs.forward_tiles(256, "sm_90", specs.narrow_value_dim(det, 128)).value_cols == 128
    with pytest.raises(ValueError, match="deterministic: head dims above 128 take deterministic=True on sm_90"):
        specs.backward_kernel(256, "float16", det, specs.backward_tiles(256, "sm_80", True), "sm_80",
                              specs.ARCH_SHARED_LIMIT["sm_80"])


def test_wgmma_specs_target_sm90a_and_exist_for_sm90_only():
    wg = [s for s in specs.all_specs("sm_90") if dict(s.defines).get("SB_WGMMA")]
    # Forward: 2 head dims x 2 dtypes x (full, causal and window x (dense, Q-smoothing, packed) + soft-capped causal
    # and soft-capped window x (dense, packed)) x 64- or 128-key tiles. Backward: per head dim and dtype, full,
    # causal and window x 3 batches x granularity x deterministic, soft-capped causal and window x 2
    # batches x deterministic ("fine" only), less the deterministic d=128 window kernels, which are mma.sync ones
    # (specs.backward_kernel); and SAGEBWD_BACKWARD_WS=1's producer variants of the non-deterministic fine kernels,
    # full and causal, dense (the deterministic ones are the default kernels, counted above); and at head dim 128
    # SAGEBWD_BACKWARD_QUAD=1's four-warpgroup kernels: full, causal and window, dense, fine, not deterministic.
    # Head dim 256: per
    # dtype, full, causal, window, soft-capped causal and window x (dense, packed), 64-key-tile forwards holding O for
    # 256, 192 or 128 columns (a narrower V head dim) and a fine, not deterministic backward each.
    wide = [s for s in wg if ".hd256." in s.key]
    assert len([s for s in wide if s.key.startswith("forward.")]) == 2 * 5 * 2 + 2 * 2 * 2 * len(specs.NARROW_VALUE_COLS)
    # Backward: a fine kernel per mask and batch splitting 256 columns, deterministic too, and for the plain masks
    # two more splitting 192 (V's 128 or 192 columns: specs.narrow_backward_tiles) and the pair kernel at each, and
    # the pair kernel's phase-specialized form at V's 128.
    assert len([s for s in wide if s.key.startswith("backward.")]) == \
        2 * (5 + 5) * 2 + 2 * 2 * 2 * (len(specs.NARROW_VALUE_COLS) * 2 + 1)
    assert all(dict(s.defines)["SB_PASSES"] == (1 if ".pair" in s.key else 2)
               and dict(s.defines)["SB_STAGES"] == (2 if ".v128" in s.key or ".pair" in s.key else 1)
               and (".pair" not in s.key or dict(s.defines)["SB_THREADS"] == 256)
               for s in wide if s.key.startswith("backward."))
    wg = [s for s in wg if s not in wide]
    assert len([s for s in wg if s.key.startswith("forward.")]) == 2 * 2 * (3 * 3 + 2 + 2) * 2
    per_dtype = {64: 3 * 12 + 4 + 4, 128: 2 * 12 + (12 - 6) + 4 + (4 - 2)}
    backward = [s for s in wg if s.key.startswith("backward.")]
    quad = [s for s in backward if s.filename == "backward_quad.cu"]
    assert len(quad) == 2 * 3 and all(".hd128." in s.key and ".quad" in s.key and dict(s.defines)["SB_THREADS"] == 512
                                      and ".varlen" not in s.key for s in quad)
    assert len(backward) == 2 * sum(per_dtype.values()) + 2 * 2 * 2 + len(quad)
    assert len({s.key for s in backward}) == len(backward)
    assert all(".causal.window." in s.key for s in wg if dict(s.defines).get("SB_WINDOW"))
    assert {s.filename for s in wg if s.key.startswith("backward.")} == {"backward_wgmma.cu", "backward_quad.cu"}
    assert "--gpu-architecture=sm_90a" in wg[0].options("sm_90")
    assert "--gpu-architecture=sm_90" in specs.forward_spec(64, "float16", AttentionOptions(),
                                                            specs.ForwardTiles(4, 1)).options("sm_90")
    for arch in ("sm_80", "sm_86", "sm_89", "sm_100", "sm_120"):
        assert not [s for s in specs.all_specs(arch) if dict(s.defines).get("SB_WGMMA")]
    hopper_limit = specs.ARCH_SHARED_LIMIT["sm_90"]
    plain, wg = specs.BackwardTiles(2), specs.BackwardTiles(2, wgmma=True)
    for dp in (64, 128):
        assert wg.dq_row(dp) == dp + 8 and plain.dq_row(dp) == dp
    # The pair kernel's dQ tiles are 32-column blocks in the 128-byte swizzle: dq_acc rows hold the Q·K columns alone.
    pair = specs.BackwardTiles(2, wgmma=True, pair=True, qk_cols=192, value_cols=128)
    assert pair.dq_row(256) == 192 and pair.query_maps(256)["dq"] == specs.TmaBox((32, 64, 3), 128)
    phases = dataclasses.replace(pair, phases=True)  # (a 64-column product's part at a time)
    assert phases.dq_row(256) == 192 and phases.query_maps(256)["dq"] == specs.TmaBox((32, 64, 2), 128)
    assert (wg.block_keys, plain.block_keys, wg.threads, plain.threads) == (128, 64, 256, 256)
    assert (wg.filename, plain.filename) == ("backward_wgmma.cu", "backward.cu")
    assert (wg.key_pad, plain.key_pad, specs.BackwardTiles(2, wgmma=True, ws=True).threads) == (128, 128, 384)


def test_shared_layouts_are_read_back_from_the_compiled_kernels():
    """Each attention kernel's dynamic shared memory is its layout struct's size, read from the compile
    (no mirrored formula): a wgmma forward stage is K̂, V̂ᵀ and 1024 bytes, the 128-key kernel's three
    CTAs (and the 1 KB each reserves) fill an SM's 228 KB, and every wgmma backward fits Hopper."""
    hopper_limit = specs.ARCH_SHARED_LIMIT["sm_90"]
    fwd = lambda dp, tiles: compiler.dynamic_shared_bytes(specs.forward_spec(dp, "float16", AttentionOptions(causal=True), tiles), "sm_90")
    assert fwd(128, specs.ForwardTiles(4, 1, True, 64)) == 64 * 128 + 2 * (2 * 64 * 128 + 1024) + 1024
    assert 3 * (fwd(128, specs.ForwardTiles(4, 1, True, 128)) + 1024) <= 228 * 1024
    assert fwd(64, specs.ForwardTiles(4, 1)) == 64 * 64 + 2 * (2 * 64 * 64 + 4 * 64)  # mma.sync: no padding
    for dp, groups in ((64, 2), (128, 2), (64, 3)):
        spec = specs.backward_spec(dp, "float16", AttentionOptions(causal=True, deterministic=groups == 3), specs.BackwardTiles(2, True, groups))
        assert compiler.dynamic_shared_bytes(spec, "sm_90") <= hopper_limit
    with pytest.raises(ValueError, match="no shared layout"):
        compiler.compile_spec(specs.lse_spec("float16"), "sm_90").shared_bytes


def test_archs_past_the_built_ones_get_ptx_of_the_newest_built_arch_below_them():
    """A cubin for each built arch NVRTC knows; PTX (compute_XX, JIT-compiled by the driver) of the newest
    such arch below any other from sm_80 on; nothing below sm_80."""
    everything = ("sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_103", "sm_110", "sm_120", "sm_121")
    for arch in compiler.SUPPORTED_ARCHS + ("sm_90a",):
        assert compiler.compile_target(arch, known=everything) == arch
    for arch, target in (("sm_87", "compute_86"), ("sm_103", "compute_100"), ("sm_110", "compute_100"),
                         ("sm_121", "compute_120"), ("sm_130", "compute_120")):
        assert compiler.compile_target(arch, known=everything) == target
    # An NVRTC that knows no Blackwell arch (CUDA 12 before 12.8): sm_90's PTX, whose mma.sync kernels run there.
    older = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
    for arch in ("sm_100", "sm_120", "sm_121"):
        assert compiler.compile_target(arch, known=older) == "compute_90"
    for arch in ("sm_75", "sm_70", "compute_90", "90"):
        with pytest.raises(ValueError, match="arch"):
            compiler.compile_target(arch, known=everything)
    assert set(compiler.nvrtc_archs()) >= {"sm_80", "sm_90"}


def test_an_arch_nvrtc_builds_no_cubin_for_gets_ptx_in_its_own_cache_entries(tmp_path, monkeypatch):
    """sm_121 (or, to an older NVRTC, any arch past the built ones): the PTX is produced and cached
    apart from the cubins (the target is in the key and the file name); its shared layout is read back
    as a cubin's is. Loading it, where the driver JIT-compiles it, needs a GPU."""
    monkeypatch.setenv("SAGEBWD_CP_CACHE_DIR", str(tmp_path))
    target = compiler.compile_target("sm_121")
    assert compiler.is_ptx(target)
    spec = specs.forward_spec(64, "float16", AttentionOptions(), specs.forward_tiles(64, "sm_121"))
    ptx = compiler.compile_spec(spec, "sm_121")
    native = compiler.compile_spec(spec, target.replace("compute_", "sm_"))
    assert ptx.ptx and ptx.arch == target and not native.ptx
    assert ptx.key != native.key and ptx.cubin_path != native.cubin_path
    assert ptx.cubin_path.name.endswith(f".{target}.{ptx.key}.ptx") and ptx.cubin_path.parent == tmp_path
    text = ptx.cubin_path.read_text()
    assert ".entry attention_forward" in text and f".target {target.replace('compute_', 'sm_')}" in text
    assert f"--gpu-architecture={target}" in spec.options(target)
    assert ptx.reports == {}  # ptxas runs in the driver
    assert ptx.shared_bytes == native.shared_bytes
    assert compiler.compile_spec(spec, "sm_121") is ptx  # the memory cache
    rows = compile_pairs([(spec, "sm_121")])
    assert [(r.arch, r.registers, r.error) for r in rows] == [("sm_121", -1, "")]  # no report, no failure


def test_blackwell_takes_the_mma_sync_kernels_compiled_again_at_a_lower_ptxas_level_where_they_spill():
    """sm_100 and sm_120: mma.sync kernels (wgmma is sm_90a's) and the shared memory of their compute
    capability; a kernel that spills at ptxas -O3 there is compiled again at -O1 (the log says so), one
    that does not keeps -O3; elsewhere -O3 stays."""
    _require_ptxas_report()
    assert (specs.ARCH_SHARED_LIMIT["sm_100"], specs.ARCH_SHARED_LIMIT["sm_120"]) == (232448, 101376)
    ptx_arch = compiler.compile_target("sm_121").replace("compute_", "sm_")  # sm_120 with NVRTC 12.8 or newer
    assert specs.arch_shared_limit("sm_121") == specs.ARCH_SHARED_LIMIT[ptx_arch]
    spec = _blackwell_backward("sm_120")
    assert spec.key == "backward.hd128.bfloat16.causal.fine.s1"  # one stage in sm_120's 99 KB
    source = compiler.flatten_source(spec.filename)
    _, first = compiler._nvrtc_compile(source, spec, "sm_120")
    lowered = compiler.compile_spec(spec, "sm_120")
    report = lowered.reports["attention_backward"]
    if compiler.parse_ptxas_report(first)["attention_backward"].spills:  # NVRTC 13.5 spills it
        assert lowered.ptxas_level == compiler.SPILL_FALLBACK_LEVEL and "-O3 spilled" in lowered.log
    assert not report.spills and report.stack_bytes == 0
    assert compiler.compile_spec(specs.lse_spec("float16"), "sm_120").ptxas_level == 3
    assert compiler.compile_spec(spec, "sm_89").ptxas_level == 3
    assert "-Xptxas=-O1" in spec.options("sm_120", 1) and not any("-O1" in o for o in spec.options("sm_120"))
    assert compiler.cache_key(spec, "sm_120", source) != compiler.cache_key(spec, "sm_89", source)
    for arch in ("sm_100", "sm_120"):
        assert specs.kernel_family(arch) == "mma.sync kernels, built, not measured"
        assert {s.filename for s in specs.all_specs(arch)} == {
            "quantize.cu", "lse.cu", "backward_rows.cu", "smooth_q_bias.cu", "ceiling.cu", "forward.cu", "backward.cu"}
