"""What the report's scripts share: the published numbers, the FLOP convention, result paths and
metadata.  report.py (one call for everything), the three measuring scripts (report_speed.py,
report_accuracy.py, report_memory.py) and render_report.py import it; it imports none of them.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_RESULTS = os.path.join(HERE, "results")

# ---------------------------------------------------------------------------------------------
# Published numbers (SB26 = "SageBwd: A Trainable Low-bit Attention", arXiv 2603.02170), CosSim /
# Rel-L2 against full precision.  The only copy in the benchmark code: the accuracy script and the
# renderer read them from here.

# SB26 Table 1: Gaussian q, k with std σ, v and dO with std 1.
SB26_TABLE1 = {
    1: {"O": (0.9999, 0.0160), "dQ": (0.9998, 0.0184), "dK": (0.9998, 0.0220), "dV": (0.9999, 0.0159)},
    3: {"O": (0.9992, 0.0389), "dQ": (0.9971, 0.0758), "dK": (0.9970, 0.0777), "dV": (0.9992, 0.0387)},
    5: {"O": (0.9982, 0.0603), "dQ": (0.9798, 0.2014), "dK": (0.9799, 0.2007), "dV": (0.9982, 0.0605)},
    8: {"O": (0.9953, 0.0972), "dQ": (0.8900, 0.4666), "dK": (0.8886, 0.4699), "dV": (0.9953, 0.0973)},
    10: {"O": (0.9933, 0.1161), "dQ": (0.7823, 0.6648), "dK": (0.7820, 0.6684), "dV": (0.9933, 0.1157)},
}

# SB26 Table 2: the intermediate tensors of one real layer.
SB26_TABLE2 = {"delta": (0.9973, 0.0736), "P": (0.9917, 0.1293), "dS": (0.9789, 0.2045), "O": (0.9969, 0.0793),
               "dQ": (0.9664, 0.2579), "dK": (0.9537, 0.3074), "dV": (0.9985, 0.0540)}

# ---------------------------------------------------------------------------------------------
# Shapes and FLOPs (docs/ALGORITHM.md): 16K tokens per batch, hidden 2048; forward 4·B·H·N²·d (half
# when causal), backward 2.5x that, forward+backward 3.5x.

# Keys every speed record carries (report_speed.py writes them, render_report.py checks them).
SPEED_RECORD_KEYS = ("impl", "pass", "dtype", "head_dim", "causal", "seqlen", "batch", "heads", "ms", "tflops")

TOKENS_PER_BATCH = 16384
HIDDEN = 2048
PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


def sweep_shape(seqlen: int, head_dim: int) -> tuple:
    """(batch, heads) of the speed and memory sweeps."""
    return max(1, TOKENS_PER_BATCH // seqlen), HIDDEN // head_dim


def flops(pass_: str, batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> float:
    fwd = 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    return fwd * PASS_FACTOR[pass_]


def device_slug(name: str) -> str:
    """The results folder of a device: its name with spaces turned into underscores."""
    return name.strip().replace(" ", "_").replace("/", "_")


def device_dir(results_dir: str, device_name: str) -> str:
    return os.path.join(results_dir, device_slug(device_name))


def cuda_device_name() -> str:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: these measurements need one (the accuracy script has --host)")
    return torch.cuda.get_device_name()


def _version(module: str):
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "unknown")
    except Exception:  # noqa: BLE001 - an absent or broken package is just "not there"
        return None


def git_commit():
    # A copy of the tree on another machine may carry a stale .git: SAGEBWD_COMMIT names the commit.
    if os.environ.get("SAGEBWD_COMMIT"):
        return os.environ["SAGEBWD_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001 - a copy of the tree without .git
        return None


def metadata(device: str, **extra) -> dict:
    """Device, versions and date of a measurement; ``extra`` is merged in (ceilings, options)."""
    import platform

    versions = {name: _version(name) for name in ("sagebwd_cp", "torch", "cupy", "numpy", "triton")}
    try:
        from importlib.metadata import version

        versions["sageattention"] = version("sageattention")
    except Exception:  # noqa: BLE001
        versions["sageattention"] = None
    versions["python"] = platform.python_version()
    meta = {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "versions": versions}
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            versions["cuda_runtime"] = torch.version.cuda
            meta["sm_count"] = props.multi_processor_count
            meta["compute_capability"] = f"{props.major}.{props.minor}"
    except Exception:  # noqa: BLE001
        pass
    meta.update(extra)
    return meta


def _flat(x) -> bool:
    """A scalar, or a list or dict of scalars only (a curve, a small table): one line at any length."""
    values = x.values() if isinstance(x, dict) else x if isinstance(x, list) else ()
    return not any(isinstance(v, (dict, list)) for v in values)


def json_text(obj, width: int = 120, _indent: int = 0) -> str:
    """``obj`` as JSON that reads and diffs by record: one line for a value whose one-line form fits
    in ``width`` characters, for a list or dict of scalars (a curve), and for every dict in a list (a
    record) whose values are such; anything else opens one key or element a line.  ``json.loads``
    gives back exactly what it gives back of ``json.dumps``."""
    flat = json.dumps(obj)
    if _flat(obj) or _indent + len(flat) <= width:
        return flat
    pad, inner = " " * (_indent + 1), _indent + 1
    if isinstance(obj, dict):
        key = lambda k: json.dumps({k: 0})[1:-4]  # noqa: E731 - a key as json.dumps writes it (1 -> "1")
        items = [f"{pad}{key(k)}: {json_text(v, width, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * _indent + "}"
    items = []
    for x in obj:
        record = isinstance(x, dict) and all(_flat(v) or len(json.dumps(v)) <= width for v in x.values())
        items.append(pad + (json.dumps(x) if record else json_text(x, width, inner)))
    return "[\n" + ",\n".join(items) + "\n" + " " * _indent + "]"


def write_json(path: str, obj) -> str:
    """Write ``obj`` as :func:`json_text` (one line a record) and say so on stderr."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(json_text(obj) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
