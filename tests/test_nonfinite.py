"""Non-finite inputs on the CPU emulator: a NaN or inf in q, k, v or dO makes non-finite every output and
gradient that exact attention makes non-finite (docs/ALGORITHM.md, non-finite inputs), never turns into
a finite value, and stays inside its (batch, KV-head group)."""
import numpy as np
import pytest

import sagebwd_cp

from nonfinite_helpers import CASES, exact_nonfinite, heads_touched

# Two query heads per KV head, a ragged length (three 64-token blocks, the last partial).
B, HQ, HKV, N, D = 1, 4, 2, 150, 64
AT = (0, 2, 70, 5)  # (batch, head, token, column): query head 2 reads KV head 1


def _inputs(seed, dtype=np.float16):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, HQ, N, D)).astype(dtype)
    k, v = (rng.standard_normal((B, HKV, N, D)).astype(dtype) for _ in range(2))
    do = rng.standard_normal((B, HQ, N, D)).astype(dtype)
    return {"q": q, "k": k, "v": v, "do": do}


def _run(x, causal, granularity="fine", smooth_k=True, smooth_q=False):
    out, saved = sagebwd_cp.attention_forward(x["q"], x["k"], x["v"], causal=causal, smooth_k=smooth_k,
                                              smooth_q=smooth_q)
    dq, dk, dv = sagebwd_cp.attention_backward(saved, x["do"], granularity=granularity)
    return tuple(np.asarray(a, np.float32) for a in (out, dq, dk, dv))


def _check(x, tensor, causal, ours):
    at = AT if tensor in ("q", "do") else (AT[0], AT[1] // (HQ // HKV), AT[2], AT[3])
    exact = exact_nonfinite(x["q"], x["k"], x["v"], x["do"], causal)
    bound = heads_touched(x["q"].shape, x["k"].shape, tensor, at)
    for name, o, e, u in zip(("out", "dq", "dk", "dv"), ours, exact, bound):
        nonfinite = ~np.isfinite(o)
        assert not (e & ~nonfinite).any(), f"{name}: {int((e & ~nonfinite).sum())} entries finite where exact is not"
        assert not (nonfinite & ~u).any(), f"{name}: non-finite outside the value's batch entry and head group"
    return exact


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tensor,value", CASES)
def test_a_nonfinite_input_reaches_every_result_that_depends_on_it(tensor, value, causal):
    x = _inputs(seed=1)
    at = AT if tensor in ("q", "do") else (AT[0], AT[1] // (HQ // HKV), AT[2], AT[3])
    x[tensor][at] = float(value)
    ours = _run(x, causal)
    exact = _check(x, tensor, causal, ours)
    if tensor == "q":  # Q is coded per token: the output rows are exactly exact attention's
        assert np.array_equal(~np.isfinite(ours[0]), exact[0])
    if tensor == "do":  # the forward does not read dO
        assert np.isfinite(ours[0]).all()


@pytest.mark.parametrize("tensor,value", [("q", "nan"), ("k", "inf"), ("v", "-inf"), ("do", "nan")])
@pytest.mark.parametrize("granularity,smooth_k,smooth_q", [("paper", True, False), ("fine", False, True)])
def test_nonfinite_inputs_with_other_options(tensor, value, granularity, smooth_k, smooth_q):
    x = _inputs(seed=2)
    at = AT if tensor in ("q", "do") else (AT[0], AT[1] // (HQ // HKV), AT[2], AT[3])
    x[tensor][at] = float(value)
    _check(x, tensor, True, _run(x, True, granularity, smooth_k, smooth_q))


def test_finite_inputs_give_finite_results():
    x = _inputs(seed=3)
    for a in _run(x, True):
        assert np.isfinite(a).all()
