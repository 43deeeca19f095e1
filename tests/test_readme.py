"""Every command and snippet of README.md runs as written.

Commands that run on any machine in seconds are run; the install and test commands are the ones
.ci/run runs (checked to be there, word for word); GPU and long benchmark scripts must exist and
take the options the README gives them.  A command in none of these lists fails the test, so a new
one is classified when it is added.  Python snippets run as they are, JAX's where JAX is installed.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # render_report
README = (REPO / "README.md").read_text()

RUN = {  # run as written, on any machine, in seconds
    "python -m sagebwd_cp info",
    "python examples/train_tiny.py --device cpu --steps 3 --d-model 64 --layers 1 --seq-len 64 "
    "--out out/tiny_cpu.png",
}
CI = {  # .ci/run runs these as written
    'pip install -e ".[cuda13,test]" torch==2.13.0',
    "python -m pytest -q",
    "python -m pytest",
    "python -m sagebwd_cp compile --arch sm_86 --arch sm_80 --arch sm_90 --once --cover",
}
SCRIPTS = {  # a GPU or minutes: the script exists and takes the README's options
    "python examples/train_tiny.py",
    "python benchmarks/bench_overhead.py",
    "python benchmarks/bench_host.py",
    "python benchmarks/bench_varlen.py",
    "python benchmarks/gpu_check.py",
    "python benchmarks/gpu_check.py --sanitize",
    "python benchmarks/bench_attention.py --seqlens 4096 16384 --head-dims 64 128 --passes fwd bwd",
    "python -m sagebwd_cp",
    "python -m sagebwd_cp compile --all-archs",
    "python -m sagebwd_cp compile",
}
TORCHRUN = {  # several processes (GPUs, or minutes on the CPU): the script exists and takes the options
    "torchrun --nproc-per-node 2 benchmarks/bench_distributed.py",
    "torchrun --nproc-per-node 8 benchmarks/bench_distributed.py --parts ring --ring-contexts 32768 65536 131072",
    "torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --smoke",
}


def _fenced(lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.MULTILINE | re.DOTALL)


def _commands():
    """Shell commands: the lines of the bash blocks and the inline `python ...` / `pip ...` spans,
    each without its trailing comment."""
    lines = [line for block in _fenced("bash") for line in block.splitlines()]
    lines += re.findall(r"`((?:python|pip) [^`]+)`", README)
    return sorted({line.split("  #")[0].split(" #")[0].strip() for line in lines if line.strip()})


def _is_pip_extras(command):
    return command.startswith("pip install") and command not in CI


def test_every_readme_command_is_classified():
    unknown = [c for c in _commands() if c not in RUN | CI | SCRIPTS | TORCHRUN and not _is_pip_extras(c)]
    assert not unknown, f"README commands in no list of tests/test_readme.py: {unknown}"
    gone = (RUN | CI | SCRIPTS | TORCHRUN) - set(_commands())
    assert not gone, f"listed in tests/test_readme.py but no longer in the README: {gone}"


def test_ci_runs_the_readme_setup():
    """The quick start's two commands are the first bash block, and .ci/run runs them as written."""
    ci = (REPO / ".ci" / "run").read_text()
    for command in CI:
        assert command in ci, command
    assert _fenced("bash")[0].splitlines() == ['pip install -e ".[cuda13,test]" torch==2.13.0', "python -m pytest -q"]


def test_pip_commands_name_existing_extras():
    tomllib = pytest.importorskip("tomllib")
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = [c for c in _commands() if c.startswith("pip install")]
    assert named
    for command in named:
        for group in re.findall(r'"\.\[([^\]]+)\]"', command):
            assert set(group.split(",")) <= extras, command


@pytest.mark.parametrize("command", sorted(RUN))
def test_readme_command_runs(command, tmp_path):
    args = command.split()
    args[0] = sys.executable
    args = [str(REPO / a) if a.endswith(".py") else a for a in args]
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
    assert {p.name for p in tmp_path.iterdir()} <= {"out"}, "outputs go under out/ or where --out says"


@pytest.mark.parametrize("command", sorted(SCRIPTS | TORCHRUN))
def test_readme_scripts_exist_and_take_their_options(command):
    args = command.split()
    if args[0] == "torchrun":  # torchrun's own options up to the script
        args = ["python"] + args[next(i for i, a in enumerate(args) if a.endswith(".py")):]
    if args[1] == "-m":
        proc = subprocess.run([sys.executable, "-m", args[2], "--help"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return
    script = REPO / args[1]
    assert script.is_file(), command
    compile(script.read_text(), str(script), "exec")
    options = [a for a in args[2:] if a.startswith("--")]
    if options:  # only these load the script's imports (torch), for its --help
        proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        for option in options:
            assert option in proc.stdout, f"{command}: {option} is not an option of {args[1]}"


@pytest.mark.parametrize("index", range(len(_fenced("python"))))
def test_readme_python_snippet_runs(index, tmp_path, monkeypatch):
    block = _fenced("python")[index]
    for module in re.findall(r"^import (\w+)", block, re.MULTILINE):
        pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})


def test_readme_verdict_is_the_rendered_results():
    """The verdict by GPU at the top is what benchmarks/render_report.py makes of every committed
    results folder: never edited by hand."""
    import render_report

    block = README.split(render_report.VERDICT_START)[1].split(render_report.VERDICT_END)[0]
    folders = render_report.result_folders(str(REPO / "benchmarks" / "results"))
    assert len(folders) >= 2
    assert block.strip("\n") == render_report.verdict(folders, str(REPO)).strip("\n")
    assert README.index(render_report.VERDICT_END) < README.index("```bash")  # above the quick start


def test_readme_headline_is_the_rendered_report():
    """The block between the headline markers is what benchmarks/render_report.py makes of the
    committed results: its figures are never edited by hand."""
    import render_report

    block = README.split(render_report.START)[1].split(render_report.END)[0]
    results = re.search(r"\]\((benchmarks/results/[^/]+)/speed\.md\)", block).group(1)
    data = [render_report.load(str(REPO / results / f"{n}.json")) for n in ("speed", "accuracy", "memory")]
    assert block.strip("\n") == render_report.headline(*data, results).strip("\n")


def test_the_test_command_counts_skips_instead_of_listing_them(tmp_path):
    """`python -m pytest -q` ends with one line per skip reason and pytest's own final line last (.ci/run
    reads it); `-rs` still lists every skip."""
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('repo_conftest', {str(REPO / 'tests' / 'conftest.py')!r})\n"
        "module = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(module)\n"
        "pytest_terminal_summary = module.pytest_terminal_summary\n")
    (tmp_path / "test_some.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(5))\ndef test_gpu(i):\n    pytest.skip('needs a GPU')\n\n"
        "def test_jax():\n    pytest.importorskip('no_such_module_here')\n\ndef test_ok():\n    pass\n")
    run = lambda *extra: subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra],
                                        cwd=tmp_path, capture_output=True, text=True, timeout=120).stdout
    lines = run().strip().splitlines()
    assert lines[-1].startswith("1 passed, 6 skipped"), lines
    assert "6 skipped, by reason" in lines[-4] and lines[-3].split() == ["5", "needs", "a", "GPU"], lines
    assert "could not import 'no_such_module_here'" in lines[-2] and not any("SKIPPED" in x for x in lines)
    assert sum("SKIPPED" in x for x in run("-rs").splitlines()) == 2 and "by reason" not in run("-rs")
