"""What causal attention guarantees under quantization (docs/ALGORITHM.md, causality), on the emulator
through the public API (NumPy in, emulator run):

* a loss on rows 0..p gives exactly zero dQ, dK, dV at every later position, whatever the options;
* without K-smoothing, or with the μ_K of the first 64 keys (``prefix_key_mean``), the outputs, LSE and
  dQ of rows before the 64-key block of the first changed token are bit for bit unchanged;
* with the default μ_K (the whole sequence's) the other rows move by less than the stated bound;
* in a packed batch no sequence's output, LSE or gradients depend on another sequence at all.
The GPU side of the same is tests/test_gpu_causality.py.
"""
import numpy as np
import pytest

import sagebwd_cp

D = 64
P = 150  # the last unchanged token; the first changed one (151) is in the 64-key block 128..191
BOUNDARY = 128


def _rand(rng, shape):
    return rng.standard_normal(shape).astype(np.float16)


def _inputs(lq, lk, hq=2, hk=1, seed=0):
    rng = np.random.default_rng(seed)
    return _rand(rng, (1, hq, lq, D)), _rand(rng, (1, hk, lk, D)), _rand(rng, (1, hk, lk, D)), \
        _rand(rng, (1, hq, lq, D))


def _change_after(q, k, v, do, p, seed=99):
    """Copies with every query, key, value and dO row after token p redrawn (lq == lk)."""
    rng = np.random.default_rng(seed)
    out = []
    for x in (q, k, v, do):
        y = x.copy()
        y[:, :, p + 1:] = _rand(rng, y[:, :, p + 1:].shape)
        out.append(y)
    return out


def _run(q, k, v, do, mean, granularity="fine", smooth_q=False):
    kw = {"smooth_k": mean != "none", "smooth_q": smooth_q}
    if mean == "prefix":
        kw["k_mean"] = sagebwd_cp.prefix_key_mean(k)
    o, lse, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, return_lse=True, **kw)
    return (o, lse) + tuple(sagebwd_cp.attention_backward(saved, do, granularity=granularity))


def _exact(q, k, v):
    """Causal attention in float64 (bottom-right aligned), GQA by repeating KV heads."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    lq, lk = q.shape[2], k.shape[2]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(D)
    s = np.where(np.arange(lk)[None, :] <= np.arange(lq)[:, None] + lk - lq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("mean,smooth_q,granularity", [("sequence", False, "fine"), ("none", False, "fine"),
                                                       ("prefix", False, "fine"), ("sequence", True, "paper")])
@pytest.mark.parametrize("lq,lk", [(300, 300), (200, 300)], ids=["lq=lk", "lq<lk"])
def test_a_loss_on_early_rows_gives_later_positions_exactly_zero_gradients(mean, smooth_q, granularity, lq, lk):
    q, k, v, do = _inputs(lq, lk)
    do[:, :, P + 1:] = 0  # the loss reads rows 0..P only
    _, _, dq, dk, dv = _run(q, k, v, do, mean, granularity, smooth_q)
    offset = lk - lq  # row i sees keys up to i + offset
    assert dq[:, :, :P + 1].any() and dk[:, :, :P + 1 + offset].any() and dv[:, :, :P + 1 + offset].any()
    assert not dq[:, :, P + 1:].any()
    assert not dk[:, :, P + 1 + offset:].any()
    assert not dv[:, :, P + 1 + offset:].any()


@pytest.mark.parametrize("mean,smooth_q", [("none", False), ("prefix", False), ("none", True)])
def test_rows_before_the_block_of_the_first_changed_token_are_bit_identical(mean, smooth_q):
    q, k, v, do = _inputs(300, 300)
    o1, lse1, dq1, _, _ = _run(q, k, v, do, mean, smooth_q=smooth_q)
    q2, k2, v2, do2 = _change_after(q, k, v, do, P)
    v2[:, :, P + 1:] *= 2  # so that the changed V block's scale surely changes
    o2, lse2, dq2, _, _ = _run(q2, k2, v2, do2, mean, smooth_q=smooth_q)
    np.testing.assert_array_equal(o2[:, :, :BOUNDARY], o1[:, :, :BOUNDARY])
    np.testing.assert_array_equal(lse2[:, :, :BOUNDARY], lse1[:, :, :BOUNDARY])
    np.testing.assert_array_equal(dq2[:, :, :BOUNDARY], dq1[:, :, :BOUNDARY])
    # ... and no further: rows BOUNDARY..P share the changed token's V block (and Q block).
    assert (o2[:, :, BOUNDARY:P + 1] != o1[:, :, BOUNDARY:P + 1]).any()


def test_bottom_right_alignment_moves_the_boundary_by_the_offset():
    """Lq < Lk: row i sees keys up to i + 100, so the rows whose keys all lie before the changed key's block
    (key 151, block 128..191) are rows 0..27."""
    lq, lk = 200, 300
    q, k, v, do = _inputs(lq, lk)
    k2, v2 = k.copy(), v.copy()
    rng = np.random.default_rng(5)
    k2[:, :, P + 1:], v2[:, :, P + 1:] = _rand(rng, k2[:, :, P + 1:].shape), 2 * _rand(rng, v2[:, :, P + 1:].shape)
    o1 = _run(q, k, v, do, "none")[0]
    o2 = _run(q, k2, v2, do, "none")[0]
    rows = BOUNDARY - (lk - lq)
    np.testing.assert_array_equal(o2[:, :, :rows], o1[:, :, :rows])
    assert (o2[:, :, rows:P + 1 - (lk - lq)] != o1[:, :, rows:P + 1 - (lk - lq)]).any()


def test_with_the_sequence_mean_early_rows_move_at_quantization_noise_level():
    """The default μ_K is the whole sequence's, so every row but the first moves when later tokens change;
    docs/ALGORITHM.md's bound: Rel-L2 under 2% of O over rows 0..p, and less than the output's own error
    against exact attention on those rows (their exact values do not change); dQ's rows under 4%."""
    q, k, v, do = _inputs(300, 300)
    o1, _, dq1, _, _ = _run(q, k, v, do, "sequence")
    o2, _, dq2, _, _ = _run(*_change_after(q, k, v, do, P), "sequence")
    rows = slice(0, P + 1)
    assert (o2[:, :, 1:P + 1] != o1[:, :, 1:P + 1]).any()  # it is not exactly causal ...
    moved = _rel(o2[:, :, rows], o1[:, :, rows])
    error = _rel(o1[:, :, rows], _exact(q, k, v)[:, :, rows])
    assert moved < 0.02 and moved < error, (moved, error)  # ... but within quantization noise
    assert _rel(dq2[:, :, rows], dq1[:, :, rows]) < 0.04


LENS = [100, 130, 37]


@pytest.mark.parametrize("changed", range(len(LENS)))
@pytest.mark.parametrize("causal", [True, False])
def test_packed_sequences_do_not_depend_on_each_other(changed, causal):
    rng = np.random.default_rng(7)
    total, hq, hk = sum(LENS), 4, 2
    q, k, v, do = _rand(rng, (total, hq, D)), _rand(rng, (total, hk, D)), _rand(rng, (total, hk, D)), \
        _rand(rng, (total, hq, D))
    cu = np.array([0] + np.cumsum(LENS).tolist(), dtype=np.int32)

    def run(q, k, v, do):
        o, lse, saved = sagebwd_cp.attention_varlen_forward(q, k, v, cu, cu, max(LENS), max(LENS), causal=causal,
                                                           return_lse=True)
        return (o, lse.T) + tuple(sagebwd_cp.attention_backward(saved, do))

    first = run(q, k, v, do)
    span = slice(cu[changed], cu[changed + 1])
    for x in (q, k, v, do):
        x[span] = _rand(rng, x[span].shape)
    second = run(q, k, v, do)
    keep = np.ones(total, bool)
    keep[span] = False
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        np.testing.assert_array_equal(b[keep], a[keep], err_msg=name)
        assert (b[~keep] != a[~keep]).any(), name


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_prefix_key_mean(layout):
    rng = np.random.default_rng(3)
    k = _rand(rng, (2, 3, 200, D))
    want = (k[:, :, :64].astype(np.float64).sum(axis=2) / 64).astype(np.float32)
    arg = k if layout == "HND" else k.transpose(0, 2, 1, 3)
    got = sagebwd_cp.prefix_key_mean(arg, layout)
    assert got.dtype == np.float32 and got.shape == (2, 3, D)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(sagebwd_cp.prefix_key_mean(arg, layout, tokens=200),
                                  sagebwd_cp.key_mean([arg], layout))
    np.testing.assert_array_equal(sagebwd_cp.prefix_key_mean(arg[:, :, :10] if layout == "HND" else arg[:, :10],
                                                             layout), sagebwd_cp.key_mean([arg[..., :10, :]
                                                                                           if layout == "HND"
                                                                                           else arg[:, :10]], layout))
    with pytest.raises(ValueError, match="tokens"):
        sagebwd_cp.prefix_key_mean(arg, layout, tokens=0)


def test_prefix_key_mean_goes_to_the_backward_with_the_saved_state():
    q, k, v, do = _inputs(150, 150)
    mean = sagebwd_cp.prefix_key_mean(k)
    _, saved = sagebwd_cp.attention_forward(q, k, v, causal=True, k_mean=mean)
    np.testing.assert_array_equal(saved.k_mean.obj, mean)
    o, lse = sagebwd_cp.attention(q, k, v, causal=True, k_mean=mean, return_lse=True)
    # A decoding step over the first t + 1 >= 64 keys computes the same prefix mean, so its μ_K is the prefill's.
    np.testing.assert_array_equal(sagebwd_cp.prefix_key_mean(k[:, :, :100]), mean)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
