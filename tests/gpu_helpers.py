"""Shared helpers for the GPU tests: inputs through torch, poisoned workspaces, error metrics."""
from __future__ import annotations

import contextlib

import numpy as np

import sagebwd_cp

# The shape grid every kernel is tested on: N = 1, ragged N, Lq != Lk, GQA 4:1, a padded head dim.
SHAPES = [
    # (B, Hq, Hkv, Lq, Lk, D)
    (1, 2, 2, 1, 1, 64),
    (2, 2, 2, 17, 17, 128),
    (1, 4, 1, 64, 64, 64),
    (1, 2, 2, 1000, 1000, 128),
    (1, 1, 1, 4097, 4097, 64),
    (1, 4, 1, 100, 1000, 128),
    (1, 2, 2, 1000, 100, 64),
    (1, 2, 1, 300, 257, 80),
]

# Both kernel families, for the ``kernels`` fixture (conftest.py): the default (wgmma on sm_90) and mma.sync.
KERNELS = [{}, {"SAGEBWD_WGMMA": "0"}]
KERNEL_IDS = ["default", "mma.sync"]

POISON = {"int8": 0x55, "float32": float("nan"), "float16": float("nan"), "bfloat16": float("nan")}


@contextlib.contextmanager
def poisoned_workspaces():
    """Every buffer the library allocates starts as garbage (INT8 0x55, NaN floats)."""
    import torch

    from sagebwd_cp.arrays import _torch_dtype

    def alloc(shape, dtype, device_id):
        t = torch.empty(shape, dtype=_torch_dtype(dtype), device=f"cuda:{device_id}")
        t.fill_(POISON.get(dtype, 0x55))
        return t

    sagebwd_cp.set_allocator(alloc)
    try:
        yield
    finally:
        sagebwd_cp.set_allocator(None)


def forward_key_tile(head_dim: int, device_id: int = 0, causal: bool = False, window=(-1, -1), softcap: float = 0.0,
                     value_dim: int | None = None) -> int:
    """Keys per tile of the forward kernel this device runs (the emulator's ``key_tile``) under the mask, for V's head
    dim ``value_dim`` (default ``head_dim``), as the forward's plan chooses it."""
    from sagebwd_cp.gpu import specs
    from sagebwd_cp.gpu.device import device_arch
    from sagebwd_cp.options import AttentionOptions

    options = AttentionOptions(causal=causal, window_left=window[0], window_right=window[1], softcap=softcap)
    narrow = specs.narrow_value_dim(options, head_dim if value_dim is None else value_dim)
    return specs.forward_tiles(specs.padded_head_dim(head_dim), device_arch(device_id), narrow, options).key_tile


def make_qkv(b, hq, hk, lq, lk, d, dtype, layout="HND", sigma=1.0, seed=0, strided=False):
    """Random q, k, v on the GPU (std sigma for q and k, 1 for v); ``strided`` slices them out of
    one fused tensor, so they are non-contiguous views."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = getattr(torch, dtype)

    def rand(h, n, std):
        x = torch.randn((b, n, h, d), generator=g, device="cuda", dtype=torch.float32) * std
        return x.to(tdt)

    if strided:
        assert hq == hk and lq == lk
        fused = torch.randn((b, lq, 3, hq, d), generator=g, device="cuda", dtype=torch.float32)
        fused[:, :, :2] *= sigma
        fused = fused.to(tdt)
        q, k, v = fused[:, :, 0], fused[:, :, 1], fused[:, :, 2]
    else:
        q, k, v = rand(hq, lq, sigma), rand(hk, lk, sigma), rand(hk, lk, 1.0)
    if layout == "HND":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return q, k, v


def to_hnd_numpy(x, layout):
    """A float32 NumPy copy in (B, H, N, D) order."""
    a = x.float().cpu().numpy()
    return a if layout == "HND" else a.transpose(0, 2, 1, 3)


def rel_l2(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    n = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (n if n > 0 else 1.0))


def cos_sim(x, ref):
    x, ref = np.asarray(x, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    return float(x @ ref / (np.linalg.norm(x) * np.linalg.norm(ref) + 1e-300))
