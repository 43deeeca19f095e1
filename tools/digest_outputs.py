"""Digests of the GPU outputs over a fixed seed grid: shows that a change which should not alter any
result (a refactor of the host-kernel contract, say) leaves every output bit for bit as it was.

Each case runs the forward (O, base-2 LSE, returned LSE) and the deterministic backward (dQ, dK, dV)
through ``sagebwd_cp.attention_forward`` / ``attention_backward`` (whose outputs are bitwise
repeatable); with ``--nondeterministic`` the default backward's dK and dV too (its dQ is summed by
atomics in any order). Every kernel path is reached by running this once per setting of the
environment variables that choose kernels (``--env``, applied in a fresh process each):

    python tools/digest_outputs.py --json base.json          # at the old commit
    python tools/digest_outputs.py --json new.json           # at the new one
    python tools/digest_outputs.py --compare base.json new.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

# (B, Hq, Hkv, Lq, Lk, D, causal): N = 1, ragged N, Lq != Lk both ways, GQA, a padded head dim.
CASES = [
    (1, 2, 2, 1, 1, 64, False),
    (2, 2, 2, 17, 17, 128, True),
    (1, 4, 1, 300, 300, 64, True),
    (1, 2, 2, 1000, 1000, 128, False),
    (1, 4, 1, 100, 1000, 128, True),
    (1, 2, 2, 1000, 100, 64, True),
    (1, 2, 1, 300, 257, 80, False),
    (2, 4, 2, 2048, 2048, 128, True),
    (1, 8, 8, 1536, 1536, 64, False),
]
SETTINGS = [{}, {"SAGEBWD_WGMMA": "0"}, {"SAGEBWD_FORWARD_KEY_TILE": "64"}, {"SAGEBWD_BACKWARD_WS": "1"}]


def _digest(x) -> str:
    import torch

    t = x.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()[:16]


def run_cases(nondeterministic: bool) -> dict:
    import torch

    import sagebwd_cp

    out = {}
    for b, hq, hk, lq, lk, d, causal in CASES:
        for dtype in ("float16", "bfloat16"):
            for smooth_q in (False, True):
                g = torch.Generator(device="cuda").manual_seed(hash((b, hq, hk, lq, lk, d)) % 2**31)
                tdt = getattr(torch, dtype)
                q, k, v, do = (torch.randn((b, h, n, d), generator=g, device="cuda").to(tdt)
                               for h, n in ((hq, lq), (hk, lk), (hk, lk), (hq, lq)))
                name = f"{b}x{hq}/{hk}x{lq}/{lk}x{d}.{'causal' if causal else 'full'}.{dtype}{'.qsmooth' if smooth_q else ''}"
                o, saved = sagebwd_cp.attention_forward(q, k, v, causal=causal, layout="HND", smooth_q=smooth_q)
                lse = sagebwd_cp.attention(q, k, v, causal=causal, layout="HND", smooth_q=smooth_q, return_lse=True)[1]
                out[name + ".o"] = _digest(torch.as_tensor(o))
                out[name + ".lse2"] = _digest(torch.as_tensor(saved.lse2.obj))
                out[name + ".lse"] = _digest(torch.as_tensor(lse))
                for gran in ("fine", "paper"):
                    for det in (True, False) if nondeterministic else (True,):
                        dq, dk, dv = sagebwd_cp.attention_backward(saved, do, granularity=gran, deterministic=det)
                        tag = f"{name}.{gran}{'.det' if det else ''}"
                        grads = (("dq", dq), ("dk", dk), ("dv", dv)) if det else (("dk", dk), ("dv", dv))
                        for label, x in grads:
                            out[f"{tag}.{label}"] = _digest(torch.as_tensor(x))
    torch.cuda.synchronize()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the digests here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two digest files")
    ap.add_argument("--nondeterministic", action="store_true", help="also the default backward's dK, dV")
    ap.add_argument("--one-setting", help=argparse.SUPPRESS)  # internal: run this process's cases only
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        differ = sorted(k for k in a if a[k] != b.get(k))
        missing = sorted(set(a) ^ set(b))
        print(f"{len(a)} digests, {len(differ)} differ, {len(missing)} in one file only")
        for k in differ[:50]:
            print("  differs:", k)
        return 1 if differ or missing else 0
    if args.one_setting is not None:
        json.dump(run_cases(args.nondeterministic), sys.stdout)
        return 0
    digests = {}
    for setting in SETTINGS:
        env = {**os.environ, **setting}
        cmd = [sys.executable, os.path.abspath(__file__), "--one-setting", json.dumps(setting)]
        if args.nondeterministic:
            cmd.append("--nondeterministic")
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stderr, file=sys.stderr)
            return res.returncode
        label = ",".join(f"{k}={v}" for k, v in setting.items()) or "default"
        digests.update({f"{label}:{k}": v for k, v in json.loads(res.stdout).items()})
        print(f"{label}: {len(digests)} digests so far", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(digests, f, indent=0, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
