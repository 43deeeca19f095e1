"""The NumPy emulator of SageBwd: exactness when unquantized, smoothing, ψ, and accuracy vs SB26."""
import itertools
import math

import numpy as np
import pytest

from sagebwd_cp import numerics
from sagebwd_cp.host.emulator import emulate_backward, emulate_forward, quantize_inputs
from sagebwd_cp.numerics import BLOCK_KV, BLOCK_Q, quantize_block, round_to_dtype
from sagebwd_cp.host.reference import attention_reference, attention_reference_backward

LENGTHS = (1, 17, 64, 100, 130)


def _inputs(seed, b, hq, hkv, lq, lk, d, sigma=1.0, dtype="float16", k_bias=None):
    rng = np.random.default_rng(seed)
    q = sigma * rng.standard_normal((b, hq, lq, d))
    k = sigma * rng.standard_normal((b, hkv, lk, d))
    if k_bias is not None:
        k = k + k_bias
    v = rng.standard_normal((b, hkv, lk, d))
    do = rng.standard_normal((b, hq, lq, d))
    return tuple(round_to_dtype(x, dtype) for x in (q, k, v, do))


def _rel(x, ref):
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / np.linalg.norm(ref))


def _cos(x, ref):
    x = np.asarray(x, np.float64).ravel()
    ref = np.asarray(ref, np.float64).ravel()
    return float(x @ ref / (np.linalg.norm(x) * np.linalg.norm(ref)))


def _assert_close(got, want, name, rtol=1e-5, atol=1e-5):
    # atol covers float32 noise where the exact result cancels to ~0 (e.g. dk with one key);
    # inputs are O(1), so 1e-5 per element is float32-level.
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    err = np.linalg.norm(np.asarray(got, np.float64) - want)
    bound = rtol * np.linalg.norm(want) + atol * math.sqrt(want.size)
    assert err <= bound, f"{name}: |err| {err:.3e} > {bound:.3e} (|ref| {np.linalg.norm(want):.3e})"


def _check_lse(lse, ref_lse, tol=1e-5):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.all(np.isfinite(lse[fin]))
    err = np.abs(lse[fin] - ref_lse[fin])
    assert np.all(err <= tol * np.maximum(1.0, np.abs(ref_lse[fin]))), err.max()


# ----------------------------------------------------------------------------- unquantized = exact

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", list(itertools.product(LENGTHS, LENGTHS)))
def test_unquantized_matches_reference(lq, lk, causal):
    d = 16
    q, k, v, do = _inputs(lq * 1000 + lk, b=1, hq=4, hkv=1, lq=lq, lk=lk, d=d,
                          k_bias=np.where(np.arange(d) < 3, 5.0, 0.0))
    o_ref, lse_ref = attention_reference(q, k, v, causal=causal)
    grads_ref = attention_reference_backward(q, k, v, do, causal=causal)
    for smooth_k, smooth_q in itertools.product((True, False), (False, True)):
        tag = f"smooth_k={smooth_k} smooth_q={smooth_q}"
        o, lse, saved = emulate_forward(q, k, v, causal=causal, smooth_k=smooth_k,
                                        smooth_q=smooth_q, quantize=False, dtype="float32")
        assert o.shape == q.shape and lse.shape == q.shape[:3]
        _assert_close(o, o_ref, f"o {tag}")
        _check_lse(lse, lse_ref)
        grads = emulate_backward(saved, do, quantize=False)
        for g, g_ref, name in zip(grads, grads_ref, ("dq", "dk", "dv")):
            assert g.shape == g_ref.shape and g.dtype == np.float32
            _assert_close(g, g_ref, f"{name} {tag}")
        if causal and lq > lk:  # rows that see no key: zero output, zero gradient
            dead = lq - lk
            assert np.all(o[:, :, :dead] == 0) and np.all(np.isneginf(lse[:, :, :dead]))
            assert np.all(grads[0][:, :, :dead] == 0)


@pytest.mark.parametrize("granularity", ["fine", "paper"])
def test_unquantized_both_granularities_exact(granularity):
    q, k, v, do = _inputs(7, b=2, hq=4, hkv=2, lq=130, lk=100, d=32)
    _, _, saved = emulate_forward(q, k, v, causal=True, quantize=False, dtype="float32")
    grads = emulate_backward(saved, do, granularity=granularity, quantize=False)
    for g, g_ref, name in zip(grads, attention_reference_backward(q, k, v, do, causal=True),
                              ("dq", "dk", "dv")):
        _assert_close(g, g_ref, name)


@pytest.mark.parametrize("causal", [False, True])
def test_smooth_k_is_exact(causal):
    d = 32
    bias = np.zeros(d)
    bias[[1, 5, 9]] = 5.0  # a strong K channel bias, the case K-smoothing exists for
    q, k, v, do = _inputs(11, b=1, hq=2, hkv=2, lq=100, lk=130, d=d, k_bias=bias)
    o_ref, lse_ref = attention_reference(q, k, v, causal=causal)
    results = {}
    for smooth_k in (True, False):
        o, lse, saved = emulate_forward(q, k, v, causal=causal, smooth_k=smooth_k,
                                        quantize=False, dtype="float32")
        results[smooth_k] = (o, lse) + emulate_backward(saved, do, quantize=False)
        _check_lse(lse, lse_ref)  # includes the c·q·μ_K add-back when smoothing
    assert np.abs(saved["inputs"]["k_mean"]).max() == 0
    for a, b, name in zip(results[True], results[False], ("o", "lse", "dq", "dk", "dv")):
        _assert_close(a, b.astype(np.float64), f"{name} smooth_k on vs off")


def test_smooth_k_lse_add_back_quantized():
    d = 64
    bias = np.zeros(d)
    bias[:4] = 5.0
    q, k, v, _ = _inputs(12, b=1, hq=2, hkv=1, lq=128, lk=192, d=d, k_bias=bias)
    _, lse_ref = attention_reference(q, k, v)
    _, lse, saved = emulate_forward(q, k, v)
    assert np.abs(saved["inputs"]["k_mean"][..., :4] - 5.0).max() < 0.5
    shift = np.abs(lse_ref).max()
    assert shift > 1.0
    assert np.abs(lse - lse_ref).max() < 0.02 * shift


# ----------------------------------------------------------------------------- ψ and the pre-pass

def test_quantize_block_properties():
    rng = np.random.default_rng(0)
    vals, scale = quantize_block(np.zeros((64, 64), np.float32))
    assert scale == 0 and np.all(vals == 0)  # a zero block's scale is 0 (numerics.py says why)
    vals, scale = quantize_block(np.zeros((3, 64, 64), np.float32), axis=(-2, -1))
    assert scale.shape == (3, 1, 1) and np.all(scale == 0)
    for mag in (1e-30, 1e-6, 1.0, 3e4):
        x = (mag * rng.standard_normal((4, 64, 64))).astype(np.float32)
        x[0, 0, :] = 0  # zero rows must not break a per-row scale
        for axis in (None, -1, -2, (-2, -1)):
            vals, scale = quantize_block(x, axis=axis)
            assert vals.dtype == np.int8 and scale.dtype == np.float32
            assert vals.min() >= -127 and vals.max() <= 127
            assert np.all(np.abs(vals).max(axis=axis, keepdims=axis is not None) == np.where(
                np.abs(x).max(axis=axis, keepdims=axis is not None) > 0, 127, 0))
            err = np.abs(vals.astype(np.float64) * scale - x)
            assert np.all(err <= scale.astype(np.float64) * (0.5 + 1e-4)), (mag, axis)


@pytest.mark.parametrize("smooth_q", [False, True])
def test_quantize_inputs_layout(smooth_q):
    d = 8
    q, k, v, _ = _inputs(3, b=2, hq=4, hkv=2, lq=70, lk=130, d=d)
    qi = quantize_inputs(q, k, v, smooth_q=smooth_q)
    assert qi["q_int8"].shape == (2, 4, 128, d) and qi["q_int8"].dtype == np.int8
    assert qi["q_scale"].shape == (2, 4, 128) and qi["q_scale"].dtype == np.float32  # per token
    assert qi["q_mean"].shape == (2, 4, 2, d)
    assert qi["k_int8"].shape == (2, 2, 192, d) and qi["k_scale"].shape == (2, 2, 192)
    assert qi["v_int8"].shape == (2, 2, 192, d) and qi["v_scale"].shape == (2, 2, 3)
    assert qi["k_mean"].shape == (2, 2, d)
    for name, n in (("q_int8", 70), ("k_int8", 130), ("v_int8", 130)):
        assert np.all(qi[name][:, :, n:] == 0), name  # padded rows stay zero
    for name, n in (("q_scale", 70), ("k_scale", 130)):
        assert np.all(qi[name][:, :, n:] == 0), name  # padded tokens count as zero: per-token scale 0
    np.testing.assert_array_equal(qi["k_mean"], numerics.token_mean(k, axis=2))
    x = q.astype(np.float32) * numerics.qk_prescale(1 / math.sqrt(d))
    if smooth_q:
        # block 1 holds rows 64..69 only: its mean must ignore the padding
        want = (x[:, :, 64:70].astype(np.float64).sum(2) / 6).astype(np.float32)
        np.testing.assert_array_equal(qi["q_mean"][:, :, 1], want)
        x = x - np.repeat(qi["q_mean"], 64, axis=2)[:, :, :70]
    else:
        assert np.all(qi["q_mean"] == 0)
    want_vals, want_scale = quantize_block(x, axis=-1)
    np.testing.assert_array_equal(qi["q_int8"][:, :, :70], want_vals)
    np.testing.assert_array_equal(qi["q_scale"][:, :, :70], want_scale[..., 0])
    k_sm = k.astype(np.float32) - qi["k_mean"][:, :, None, :]
    want_vals, want_scale = quantize_block(k_sm, axis=-1)
    np.testing.assert_array_equal(qi["k_int8"][:, :, :130], want_vals)
    np.testing.assert_array_equal(qi["k_scale"][:, :, :130], want_scale[..., 0])


# ----------------------------------------------------------------------------- forward = spec

def _spec_forward(qi, lq, lk, causal, group, smooth_q, key_tile=BLOCK_KV):
    """The forward pseudo-code, one query block and one (b, h) at a time, for cross-checking
    the vectorised emulator bit for bit (o before rounding, base-2 lse).  A key tile of two V
    blocks quantizes P̃·s_V/s_max per row (numerics.py)."""
    b, hq, lq_pad, d = qi["q_int8"].shape
    f32 = np.float32
    o = np.zeros((b, hq, lq_pad, d), f32)
    lse2 = np.full((b, hq, lq_pad), np.inf, f32)
    for bi, h, i in itertools.product(range(b), range(hq), range(lq_pad // BLOCK_Q)):
        hk = h // group
        rows = np.arange(i * BLOCK_Q, (i + 1) * BLOCK_Q)
        qh = qi["q_int8"][bi, h, rows].astype(np.float64)
        m = np.full(BLOCK_Q, -np.inf, f32)
        l = np.zeros(BLOCK_Q, f32)
        acc = np.zeros((BLOCK_Q, d), f32)
        n_keys = qi["v_scale"].shape[-1] * BLOCK_KV
        for j in range(-(-n_keys // key_tile)):
            cols = np.arange(j * key_tile, min((j + 1) * key_tile, n_keys))
            mask = (rows[:, None] < lq) & (cols[None, :] < lk)
            if causal:
                mask &= cols[None, :] <= rows[:, None] + lk - lq
            if not mask.any():
                continue
            kh = qi["k_int8"][bi, hk, cols].astype(np.float64)
            # per-token scales: (Q̂K̂ᵀ · s_K[key]) · s_Q[query]
            s = ((qh @ kh.T).astype(f32) * qi["k_scale"][bi, hk, cols][None, :]) * qi["q_scale"][bi, h, rows][:, None]
            if smooth_q:
                # all query blocks at once, the summation order the emulator uses
                bias = qi["q_mean"][bi, h] @ qi["k_smoothed"][bi, hk, cols].T
                s = s + bias[i][None, :]
            s = np.where(mask, s, f32(-np.inf)).astype(f32)
            rmax = s.max(axis=1)
            m_new = np.maximum(m, rmax)
            r0 = np.where(np.isinf(rmax), f32(0), rmax)
            m0 = np.where(np.isinf(m_new), f32(0), m_new)
            e = np.exp2(s - r0[:, None])
            s_v = qi["v_scale"][bi, hk, cols // BLOCK_KV]  # per key
            s_max = max(s_v[c] for c in range(0, len(cols), BLOCK_KV) if c == 0 or cols[c] < lk)
            coef = np.array([f32(255) if sv == s_max else f32(f32(255) * sv) * (f32(1) / s_max) for sv in s_v], f32)
            # numerics: unsigned P̂, 255 levels, the product of e and coef as float16 values (exact in float64)
            e16, c16 = e.astype(np.float16).astype(np.float64), coef.astype(np.float16).astype(np.float64)
            p = np.clip(np.rint(c16[None, :] * e16), 0, 255)
            beta, alpha = np.exp2(rmax - m0), np.exp2(m - m0)
            l = alpha * l + beta * e.sum(axis=1, dtype=f32)
            pv = (p.astype(np.float64) @ qi["v_int8"][bi, hk, cols].astype(np.float64)).astype(f32)
            acc = alpha[:, None] * acc + pv * (beta / f32(255) * s_max)[:, None]
            m = m_new
        live = l > 0
        o[bi, h, rows] = np.where(live[:, None], acc / np.where(live, l, 1)[:, None], 0)
        with np.errstate(divide="ignore"):
            lse2[bi, h, rows] = np.where(live, m + np.log2(l), np.inf)
    return o, lse2


@pytest.mark.parametrize("key_tile,lk", [(64, 100), (128, 100), (128, 60), (128, 230), (192, 150), (192, 300)])
@pytest.mark.parametrize("causal,smooth_q", [(False, False), (True, False), (True, True)])
def test_forward_matches_spec_pseudocode(causal, smooth_q, key_tile, lk):
    q, k, v, _ = _inputs(21, b=1, hq=4, hkv=2, lq=150, lk=lk, d=16)
    v[:, :, 64:128] *= 3  # V blocks of unequal scales: a 128- or 192-key tile folds their ratio into P̂
    o, _, saved = emulate_forward(q, k, v, causal=causal, smooth_q=smooth_q, dtype="float32", key_tile=key_tile)
    o_spec, lse2_spec = _spec_forward(saved["inputs"], 150, lk, causal, 2, smooth_q, key_tile)
    np.testing.assert_array_equal(o, o_spec[:, :, :150])
    np.testing.assert_array_equal(saved["lse2"], lse2_spec)


def test_forward_output_is_rounded_to_dtype():
    q, k, v, _ = _inputs(22, b=1, hq=2, hkv=1, lq=80, lk=80, d=32, dtype="bfloat16")
    o32, lse32, _ = emulate_forward(q, k, v, dtype="float32")
    for dtype in ("float16", "bfloat16"):
        o, lse, saved = emulate_forward(q, k, v, dtype=dtype)
        np.testing.assert_array_equal(o, round_to_dtype(o32, dtype))
        np.testing.assert_array_equal(saved["o"], o)
        np.testing.assert_array_equal(lse, lse32)


# ----------------------------------------------------------------------------- quantized accuracy

def test_quantized_fully_masked_rows_are_clean():
    q, k, v, do = _inputs(31, b=1, hq=2, hkv=1, lq=200, lk=70, d=32)
    o, lse, saved = emulate_forward(q, k, v, causal=True)
    dead = 200 - 70
    assert np.all(o[:, :, :dead] == 0) and np.all(np.isneginf(lse[:, :, :dead]))
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse[:, :, dead:]))
    for granularity in ("fine", "paper"):
        dq, dk, dv = emulate_backward(saved, do, granularity=granularity)
        assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
        assert np.all(dq[:, :, :dead] == 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("granularity", ["fine", "paper"])
def test_quantized_gradients_close_at_sigma_1(granularity, causal):
    q, k, v, do = _inputs(41, b=1, hq=4, hkv=2, lq=300, lk=200, d=64)
    o, _, saved = emulate_forward(q, k, v, causal=causal)
    o_ref, _ = attention_reference(q, k, v, causal=causal)
    grads = emulate_backward(saved, do, granularity=granularity)
    grads_ref = attention_reference_backward(q, k, v, do, causal=causal)
    cos = {name: _cos(g, r) for name, g, r in zip(("o", "dq", "dk", "dv"), (o,) + grads,
                                                   (o_ref,) + grads_ref)}
    print(f"\n{granularity} causal={causal} CosSim", {n: f"{c:.5f}" for n, c in cos.items()})
    # Measured here: fine > 0.9998; paper (one dS scale per 64x64 tile) 0.9992-0.9996 for
    # dq/dk, a thin margin: other shapes give 0.9989 (N=256 or 1024, non-causal).
    floor = 0.999
    for name, c in cos.items():
        assert c > floor, f"{name}: CosSim {c:.5f} <= {floor} ({cos})"


@pytest.mark.parametrize("key_tile", [BLOCK_KV, 2 * BLOCK_KV])
def test_zero_value_block_leaves_the_output_alone(key_tile):
    """A V block of 64 all-zero rows has scale 0: at scale 1 it was the 128-key tile's s_max, and the
    other block's P̂ = rint(255·e·s_V/s_max) kept a few levels (O Rel-L2 0.014 -> 0.13)."""
    q, k, v, _ = _inputs(44, b=1, hq=2, hkv=2, lq=256, lk=256, d=64)
    v = v.copy()
    v[:, :, 64:128] = 0
    v[:, 1, 128:] = 0  # head 1: both blocks of the second tile zero (s_max = 0)
    o, _, _ = emulate_forward(q, k, v, key_tile=key_tile)
    ref, _ = attention_reference(q, k, v)
    assert np.isfinite(o).all()
    assert _rel(o, ref) < 0.02


@pytest.mark.parametrize("granularity", ["fine", "paper"])
def test_zero_query_and_key_rows_leave_other_gradients_alone(granularity):
    """All-zero (or tiny) Q and K rows quantize with per-token scale 0 and leave the other rows'
    gradients as accurate as without them (when dK's operand was dS·s_Q, a zero query row at scale 1
    set its per-key max and coarsened every other code: dK Rel-L2 0.017 -> 0.18 fine).  The rows'
    own gradients stay right too."""
    q, k, v, do = _inputs(43, b=1, hq=1, hkv=1, lq=128, lk=128, d=64, dtype="bfloat16", k_bias=0.5)
    base = [_rel(g, r) for g, r in zip(emulate_backward(emulate_forward(q, k, v, dtype="bfloat16")[2], do,
                                                        granularity=granularity),
                                       attention_reference_backward(q, k, v, do))]
    q, k = q.copy(), k.copy()
    q[:, :, 5], q[:, :, 6] = 0, q[:, :, 6] * 1e-37  # zero, and under TINY_AMAX
    k[:, :, 9] = 0  # zero, and after K-smoothing the token mean: a plain row
    k[:, :, 20] = np.mean(k, axis=2)  # k - μ_K ~ 0 (rounded to bf16: small, not zero)
    q, k = round_to_dtype(q, "bfloat16"), round_to_dtype(k, "bfloat16")
    ref = attention_reference_backward(q, k, v, do)
    for smooth_k in (False, True):
        _, _, saved = emulate_forward(q, k, v, dtype="bfloat16", smooth_k=smooth_k)
        if not smooth_k:
            assert saved["inputs"]["q_scale"][0, 0, 5] == 0 and saved["inputs"]["k_scale"][0, 0, 9] == 0
        grads = emulate_backward(saved, do, granularity=granularity)
        for name, g, r, b0 in zip(("dq", "dk", "dv"), grads, ref, base):
            assert _rel(g, r) < 1.5 * b0 + 1e-3, f"{name} (smooth_k={smooth_k}): {_rel(g, r):.4f} vs {b0:.4f}"
        for row in (5, 6):  # a zero query row still gets dQ = Σ dS·K (paper: single rows 0.07-0.13 anyway)
            assert _rel(grads[0][:, :, row], ref[0][:, :, row]) < (0.05 if granularity == "fine" else 0.2), row


# SB26 Table 1, Rel-L2 of (O, dQ, dK, dV) against full precision.
PAPER_REL_L2 = {1: (0.0160, 0.0184, 0.0220, 0.0159),
                3: (0.0389, 0.0758, 0.0777, 0.0387),
                5: (0.0603, 0.2014, 0.2007, 0.0605)}
PAPER_COS = {1: (0.9999, 0.9998, 0.9998, 0.9999),
             3: (0.9992, 0.9971, 0.9970, 0.9992),
             5: (0.9982, 0.9798, 0.9799, 0.9982)}
QUANTITIES = ("o", "dq", "dk", "dv")
# Cells measured above 1.1x SB26 (none since P̂ became unsigned with 255 levels: a 127-level P̂
# put O and dV at ~1.18x at σ = 1).
KNOWN_GAPS = set()


@pytest.fixture(scope="module")
def sigma_sweep():
    b, h, n, d = 1, 4, 1024, 64
    rng = np.random.default_rng(2026)
    base = [rng.standard_normal((b, h, n, d)) for _ in range(4)]
    table = {}
    for sigma in PAPER_REL_L2:
        q, k = (round_to_dtype(sigma * x, "float16") for x in base[:2])
        v, do = (round_to_dtype(x, "float16") for x in base[2:])
        refs = (attention_reference(q, k, v)[0],) + attention_reference_backward(q, k, v, do)
        o, _, saved = emulate_forward(q, k, v)
        table["o128", sigma] = _rel(emulate_forward(q, k, v, key_tile=128)[0], refs[0])
        for granularity in ("fine", "paper"):
            outs = (o,) + emulate_backward(saved, do, granularity=granularity)
            for name, x, ref in zip(QUANTITIES, outs, refs):
                table[granularity, sigma, name] = (_cos(x, ref), _rel(x, ref))
    lines = [f"σ sweep (B={b}, H={h}, N={n}, D={d}, fp16), CosSim / Rel-L2 vs FP64:",
             f"{'mode':6} {'σ':>2}  " + "  ".join(f"{q:>15}" for q in QUANTITIES)]
    for granularity in ("fine", "paper"):
        for sigma in PAPER_REL_L2:
            cells = ("{:.4f} / {:.4f}".format(*table[granularity, sigma, n]) for n in QUANTITIES)
            lines.append(f"{granularity:6} {sigma:>2}  " + "  ".join(f"{c:>15}" for c in cells))
    for sigma in PAPER_REL_L2:
        cells = (f"{c:.4f} / {r:.4f}" for c, r in zip(PAPER_COS[sigma], PAPER_REL_L2[sigma]))
        lines.append(f"{'SB26':6} {sigma:>2}  " + "  ".join(f"{c:>15}" for c in cells))
    text = "\n".join(lines)
    print("\n" + text)
    return table, text


def _fine_vs_paper_cases():
    for sigma, name in itertools.product(PAPER_REL_L2, QUANTITIES):
        marks = ()
        if (name, sigma) in KNOWN_GAPS:
            marks = pytest.mark.xfail(strict=True, reason="measured above 1.1x SB26 (see KNOWN_GAPS)")
        yield pytest.param(sigma, name, marks=marks, id=f"{name}-sigma{sigma}")


@pytest.mark.parametrize("sigma,name", list(_fine_vs_paper_cases()))
def test_sigma_sweep_fine_within_sb26(sigma_sweep, sigma, name):
    table, text = sigma_sweep
    rel = table["fine", sigma, name][1]
    published = PAPER_REL_L2[sigma][QUANTITIES.index(name)]
    assert rel <= 1.1 * published, (
        f"fine {name} σ={sigma}: Rel-L2 {rel:.4f} > 1.1 x SB26 {published:.4f} "
        f"(ratio {rel / published:.3f})\n{text}")


@pytest.mark.parametrize("sigma", list(PAPER_REL_L2))
def test_sigma_sweep_128_key_tiles_within_sb26(sigma_sweep, sigma):
    """The wgmma forward's 128-key tiles (one P̂ row scale per two V blocks): O at least as
    accurate as SB26's."""
    table, text = sigma_sweep
    rel = table["o128", sigma]
    assert rel <= PAPER_REL_L2[sigma][0], f"O (128-key tiles) σ={sigma}: Rel-L2 {rel:.4f}\n{text}"


def test_sigma_sweep_paper_granularity_worse_for_dq(sigma_sweep):
    table, text = sigma_sweep
    fine, paper = table["fine", 1, "dq"][1], table["paper", 1, "dq"][1]
    assert paper > fine, f"paper-mode dq Rel-L2 {paper:.4f} <= fine {fine:.4f}\n{text}"
    # the forward is shared, so O is identical in both modes
    assert table["fine", 1, "o"] == table["paper", 1, "o"]


def test_quantize_tile_properties():
    """The backward's tile ψ: codes within ±levels (0..255 for P ≥ 0), error within half a step."""
    from sagebwd_cp.numerics import INT8_MAX, P_LEVELS, quantize_tile

    rng = np.random.default_rng(7)
    for mag in (1e-30, 1e-7, 1.0, 3e4):
        x = (mag * rng.standard_normal((4, 64, 64))).astype(np.float32)
        x[0, :, 0] = 0  # an all-zero column gets scale 1 and zero codes
        for levels, data in ((INT8_MAX, x), (P_LEVELS, np.abs(x))):
            for axis in (-1, -2, (-2, -1)):
                vals, scale = quantize_tile(data, axis, levels)
                assert vals.dtype == np.float32 and np.all(vals == np.rint(vals))
                assert vals.min() >= (0 if levels == P_LEVELS else -levels) and vals.max() <= levels
                err = np.abs(vals.astype(np.float64) * scale - data)
                assert np.all(err <= scale.astype(np.float64) * (0.5 + 1e-4)), (mag, axis, levels)
        vals, scale = quantize_tile(np.zeros((64, 64), np.float32), -1)
        assert np.all(vals == 0) and np.all(scale == 1)


def test_forward_p_codes_are_the_kernels_float16_rounding():
    """numerics.forward_p_codes, rint(fp16(e)·fp16(coef)), is what the kernel's fma.rn.f16x2(e, coef,
    1024) leaves in each half's low byte: the float16 nearest to 1024 + the exact product, less 1024.
    Within a float16 step of e·coef, 255 at e = 1 and coef = 255, 0 at e = 0."""
    from sagebwd_cp.numerics import forward_p_codes

    rng = np.random.default_rng(3)
    e = np.concatenate([rng.random(20000), np.exp2(-rng.random(20000) * 30), [0.0, 1.0]]).astype(np.float32)
    coef = np.concatenate([rng.random(e.size - 2) * 255, [255.0, 255.0]]).astype(np.float32)
    codes = forward_p_codes(e, coef)
    e16, c16 = e.astype(np.float16).astype(np.float64), coef.astype(np.float16).astype(np.float64)
    fma16 = (e16 * c16 + 1024.0).astype(np.float16)  # float64 holds the product exactly: one rounding
    assert np.array_equal(codes, fma16.astype(np.float32) - 1024)
    assert codes.min() >= 0 and codes.max() <= 255 and codes[-1] == 255 and codes[-2] == 0
    # fp16(e) and fp16(coef) are each within 2^-11 relatively, so the code stays within half a step plus that
    assert np.all(np.abs(codes - e.astype(np.float64) * coef) <= 0.5 + 255 * 2.0 ** -10)
    # ties go to even, as the FMA rounds: 2.5 -> 2, 3.5 -> 4
    assert list(forward_p_codes(np.float32([0.5, 0.5]), np.float32([5.0, 7.0]))) == [2.0, 4.0]
