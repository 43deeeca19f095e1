"""A built wheel carries the CUDA sources and compiles a kernel when installed outside the repo."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Build from a copy: an in-tree build/ could be shared with a concurrent build and keeps stale files.
COPY_IGNORE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".venv",
                                     ".pytest_cache", ".whl", ".gl", "out")


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(REPO, source, ignore=COPY_IGNORE)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(tmp / "dist"), str(source)])
    (path,) = (tmp / "dist").glob("sagebwd_cp-*.whl")
    return path


def test_wheel_ships_the_cuda_sources_and_the_adapter(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, pattern in (("kernels", "*.cu"), ("ptx", "*.cuh")):
        sources = sorted(p.name for p in (REPO / folder).glob(pattern))
        assert sources, f"no {pattern} in {folder}/"
        missing = [s for s in sources if f"sagebwd_cp/{folder}/{s}" not in names]
        assert not missing, f"the wheel lacks {missing}"
    for name in ("sagebwd_cp/torch/__init__.py", "sagebwd_cp/jax/__init__.py", "sagebwd_cp/gpu/plan.py",
                 "sagebwd_cp/host/emulator.py", "sagebwd_cp/__main__.py",
                 "sagebwd_cp/kernels/__init__.py", "sagebwd_cp/ptx/__init__.py"):
        assert name in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "sagebwd-cp = sagebwd_cp.__main__:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


SNIPPET = textwrap.dedent("""
    import json, sagebwd_cp
    from sagebwd_cp.gpu import compiler, specs
    compiled = compiler.compile_spec(specs.bias_spec("float16"), "sm_90", use_disk_cache=False)
    print(json.dumps({
        "module": sagebwd_cp.__file__,
        "sources": [str(d) for d in compiler.source_dirs()],
        "registers": {k: r.registers for k, r in compiled.reports.items()},
        "cubin_bytes": compiled.cubin_path.stat().st_size,
    }))
""")


def test_installed_wheel_compiles_a_kernel(wheel, tmp_path):
    # Installed into its own folder (dependencies come from this interpreter), run from elsewhere.
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    result = json.loads(_run([sys.executable, "-c", SNIPPET], cwd=tmp_path, env=env))
    assert Path(result["module"]).is_relative_to(site), result["module"]
    assert all(Path(d).is_relative_to(site) for d in result["sources"]), result["sources"]
    assert result["cubin_bytes"] > 0
    usage = _run([str(site / "bin" / "sagebwd-cp"), "compile", "--help"], cwd=tmp_path, env=env)
    assert "--arch" in usage
