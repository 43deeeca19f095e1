"""Every public function refuses bad array arguments, each with an error that names the argument.

Two tables: the functions of ``sagebwd_cp.torch`` (on CPU tensors) and the framework-neutral ones
(on NumPy arrays), each a list of (function, its array arguments, how to call it).  Every array
argument of every function is replaced in turn by each kind of bad input in BAD: not an array at
all (None, a list, a scalar, a string, a dict, a tuple, a duck-typed object), an array of another
framework (a mix), or an array of the right kind with the wrong rank.  The first two must raise a
TypeError, the last a ValueError (or TypeError), all naming the argument.  torch's operators parse
their arguments in torch's dispatcher, which refuses a non-tensor with a RuntimeError naming the
argument and the type that came; None, which it lets through, gets the adapter's TypeError.
Nothing is computed but each function's call on good inputs, once (tiny shapes, the emulator).
"""
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sagebwd_cp  # noqa: E402
import sagebwd_cp.torch as st  # noqa: E402
from sagebwd_cp.options import AttentionOptions  # noqa: E402
from sagebwd_cp.torch import transformers as st_transformers  # noqa: E402
from sagebwd_cp.torch import varlen as st_varlen  # noqa: E402

B, H, L, D = 1, 2, 16, 16
CU = [0, 7, 16]


class FakeCupyArray:
    """What a CuPy array looks like to the library without a GPU: DLPack methods, a CUDA device."""

    __module__ = "cupy._core.core"
    shape, dtype = (B, H, L, D), np.dtype("float16")

    def __dlpack__(self, stream=None):
        raise AssertionError("read before the framework check")

    def __dlpack_device__(self):
        return (2, 0)


class DuckTensor:
    """Attributes of a tensor, but no array behind them."""

    shape, dtype, ndim, is_cuda, device = (B, H, L, D), torch.float16, 4, False, "cpu"

    def is_contiguous(self):
        return True

    def stride(self, dim=None):
        return (1,) * 4


def _other_framework(good, dtype=None):
    """``good``'s values in the other framework (torch <-> NumPy), optionally in ``dtype``."""
    if isinstance(good, torch.Tensor):
        x = good.detach().float().numpy() if good.is_floating_point() else good.numpy()
        return x.astype(dtype or x.dtype)
    x = torch.from_numpy(np.ascontiguousarray(good))
    return x.to(getattr(torch, dtype)) if dtype else x


def _float16(good):
    return _other_framework(good, "float16" if "float" in str(good.dtype) else None)


def _drop_a_dim(good):
    return good[0]


BAD = {  # kind: (make the bad value from the good one, wrong kind (TypeError) or wrong value)
    "None": (lambda good: None, True),
    "nested list": (lambda good: good.tolist(), True),
    "float": (lambda good: 1.0, True),
    "int": (lambda good: 3, True),
    "bool": (lambda good: True, True),
    "str": (lambda good: "q", True),
    "dict": (lambda good: {"q": good}, True),
    "tuple of the array": (lambda good: (good,), True),
    "duck-typed tensor": (lambda good: DuckTensor(), True),
    "CuPy-like array without a GPU": (lambda good: FakeCupyArray(), True),
    "other framework": (_other_framework, True),
    "other framework, float16": (_float16, True),
    "wrong rank": (_drop_a_dim, False),
}


MIXES = ("CuPy-like array without a GPU", "other framework", "other framework, float16")


def _named(name: str, message: str) -> bool:
    return re.search(rf"(?<![\w.\[]){re.escape(name)}(?![\w\[])", message) is not None


def _check(call, args: dict, name: str, kind: str, operator: bool = False, optional=()):
    make, wrong_kind = BAD[kind]
    if kind == "None" and name in optional:
        call(dict(args, **{name: None}))  # an optional argument left out
        return
    bad = dict(args, **{name: make(args[name])})
    expected = (TypeError,) if wrong_kind else (ValueError, TypeError)
    if operator and wrong_kind and kind != "None":
        expected = (TypeError, RuntimeError)  # torch's dispatcher parses the operator's arguments
    with pytest.raises(expected) as info:
        call(bad)
    assert _named(name, str(info.value)), f"{kind} as {name}: the error does not name it: {info.value!r}"
    if wrong_kind and not operator:
        assert info.type is TypeError


# ----------------------------------------------------------------------------------------- torch

def _t(*shape, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _torch_args():
    q, k, v = _t(B, H, L, D, seed=1), _t(B, H, L, D, seed=2), _t(B, H, L, D, seed=3)
    out, lse = st.attention_lse(q, k, v)
    nhd = {n: x.transpose(1, 2).contiguous() for n, x in (("q", q), ("k", k), ("v", v))}
    packed = {n: x[0] for n, x in nhd.items()}
    cu = torch.tensor(CU, dtype=torch.int32)
    fwd = st.attention_forward_op(q, k, v, *AttentionOptions())
    packed_fwd = st_varlen.varlen_forward_op(*packed.values(), cu, cu, 9, 9, *AttentionOptions(layout="THD"))
    return dict(q=q, k=k, v=v, out=out, lse=lse, dout=_t(B, H, L, D, seed=4), k_mean=st.key_mean([k]),
                nhd=nhd, packed=packed, cu=cu, fwd=fwd, packed_fwd=packed_fwd, mask=torch.ones(B, L, dtype=torch.int64))


A = _torch_args()
Q, K, V = A["q"], A["k"], A["v"]
HALF = [Q[:, :, :8], Q[:, :, 8:]]
OPTIONS = tuple(AttentionOptions())
THD_OPTIONS = tuple(AttentionOptions(layout="THD"))


def _ring(q, k, v):
    try:
        return st.ring_attention(q, k, v)
    except RuntimeError as exc:  # the arguments passed; no process group in this test
        assert "torch.distributed is not initialized" in str(exc)


TORCH = [  # (id, {argument: good value}, call, operator[, arguments that may be None])
    ("attention", dict(q=Q, k=K, v=V), lambda a: st.attention(a["q"], a["k"], a["v"]), False),
    ("scaled_dot_product_attention", dict(query=Q, key=K, value=V),
     lambda a: st.scaled_dot_product_attention(a["query"], a["key"], a["value"]), False),
    ("flash_attn_func", dict(A["nhd"]), lambda a: st.flash_attn_func(a["q"], a["k"], a["v"]), False),
    ("flash_attn_varlen_func", dict(A["packed"], cu_seqlens_q=A["cu"], cu_seqlens_k=A["cu"]),
     lambda a: st.flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 9, 9), False),
    ("SageAttention", dict(q=Q, k=K, v=V), lambda a: st.SageAttention(causal=True)(a["q"], a["k"], a["v"]), False),
    ("SageAttentionFunction", dict(q=Q, k=K, v=V),
     lambda a: st.SageAttentionFunction.apply(a["q"], a["k"], a["v"], *OPTIONS), False),
    ("attention_lse", dict(q=Q, k=K, v=V, k_mean=A["k_mean"]),
     lambda a: st.attention_lse(a["q"], a["k"], a["v"], k_mean=a["k_mean"]), False, ("k_mean",)),
    ("attention_backward_lse", dict(q=Q, k=K, v=V, out=A["out"], lse=A["lse"], dout=A["dout"], k_mean=A["k_mean"]),
     lambda a: st.attention_backward_lse(a["q"], a["k"], a["v"], a["out"], a["lse"], a["dout"], k_mean=a["k_mean"]),
     False, ("k_mean",)),
    ("merge_attention", {"outs[0]": A["out"], "outs[1]": A["out"], "lses[0]": A["lse"], "lses[1]": A["lse"]},
     lambda a: st.merge_attention([a["outs[0]"], a["outs[1]"]], [a["lses[0]"], a["lses[1]"]]), False),
    ("key_mean", {"ks[0]": K, "ks[1]": V}, lambda a: st.key_mean([a["ks[0]"], a["ks[1]"]]), False),
    ("chunked_attention", {"q": Q, "ks[0]": HALF[0], "ks[1]": HALF[1], "vs[0]": HALF[0], "vs[1]": HALF[1]},
     lambda a: st.chunked_attention(a["q"], [a["ks[0]"], a["ks[1]"]], [a["vs[0]"], a["vs[1]"]]), False),
    ("ring_attention", dict(q=Q, k=K, v=V), lambda a: _ring(a["q"], a["k"], a["v"]), False),
    ("zigzag_shard", dict(x=Q), lambda a: st.zigzag_shard(a["x"], 0, 2, dim=2), False),
    ("zigzag_unshard", {"shards[0]": Q, "shards[1]": K},
     lambda a: st.zigzag_unshard([a["shards[0]"], a["shards[1]"]], 2),
     False),
    ("transformers attention function", dict(query=Q, key=K, value=V, attention_mask=A["mask"]),
     lambda a: st_transformers.attention_forward(None, a["query"], a["key"], a["value"], a["attention_mask"]), False,
     ("attention_mask",)),
    ("score_step", dict(q=Q, k=K), lambda a: st.score_step(a["q"], a["k"]), False),
    ("attention_op", dict(q=Q, k=K, v=V), lambda a: st.attention_op(a["q"], a["k"], a["v"], *OPTIONS), True),
    ("attention_forward_op", dict(q=Q, k=K, v=V),
     lambda a: st.attention_forward_op(a["q"], a["k"], a["v"], *OPTIONS), True),
    ("attention_backward_op",
     dict(q=Q, k=K, v=V, out=A["fwd"][0], lse2=A["fwd"][1], k_mean=A["fwd"][2], dout=A["dout"]),
     lambda a: st.attention_backward_op(a["q"], a["k"], a["v"], a["out"], a["lse2"], a["k_mean"], a["dout"], *OPTIONS),
     True),
    ("attention_lse_op", dict(q=Q, k=K, v=V, k_mean=A["k_mean"]),
     lambda a: st.attention_lse_op(a["q"], a["k"], a["v"], a["k_mean"], *OPTIONS), True),
    ("varlen_forward_op", dict(A["packed"], cu_seqlens_q=A["cu"], cu_seqlens_k=A["cu"]),
     lambda a: st_varlen.varlen_forward_op(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 9, 9,
                                           *THD_OPTIONS), True),
    ("varlen_backward_op", dict(A["packed"], out=A["packed_fwd"][0], lse2=A["packed_fwd"][1], k_mean=A["packed_fwd"][2],
                                dout=A["packed_fwd"][0], cu_seqlens_q=A["cu"], cu_seqlens_k=A["cu"]),
     lambda a: st_varlen.varlen_backward_op(a["q"], a["k"], a["v"], a["out"], a["lse2"], a["k_mean"], a["dout"],
                                            a["cu_seqlens_q"], a["cu_seqlens_k"], 9, 9, *THD_OPTIONS), True),
]
TORCH = [t if len(t) == 5 else t + ((),) for t in TORCH]
# Functions that take arrays of any rank: "wrong rank" does not apply.
ANY_RANK = {"zigzag_shard", "zigzag_unshard"}


@pytest.mark.parametrize("fid,args,call,operator,optional", TORCH, ids=[t[0] for t in TORCH])
def test_torch_entry_point_runs_on_good_inputs(fid, args, call, operator, optional):
    call(args)


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("fid,args,call,operator,optional", TORCH, ids=[t[0] for t in TORCH])
def test_torch_entry_point_refuses(fid, args, call, operator, optional, kind):
    if kind == "wrong rank" and fid in ANY_RANK:
        pytest.skip(f"{fid} takes tensors of any rank")
    for name in args:
        _check(call, args, name, kind, operator, optional)


def test_torch_sequence_arguments_must_be_sequences_of_tensors():
    for bad in (None, Q, "ks", {"k": Q}, 3, np.zeros(3)):
        with pytest.raises(TypeError, match=r"^ks: expected a list or tuple of torch tensors, got "):
            st.key_mean(bad)
        with pytest.raises(TypeError, match=r"^ks: expected a list or tuple of torch tensors, got "):
            st.chunked_attention(Q, bad, [V])
        with pytest.raises(TypeError, match=r"^outs: expected a list or tuple of torch tensors, got "):
            st.merge_attention(bad, [A["lse"]])
        with pytest.raises(TypeError, match=r"^shards: expected a list or tuple of torch tensors, got "):
            st.zigzag_unshard(bad, 2)


def test_torch_messages_say_what_came():
    """The cases of the report that asked for these checks, word for word."""
    with pytest.raises(TypeError, match=r"^q: expected a torch\.Tensor, got list \[\[1\.0\]\]$"):
        st.attention([[1.0]], [[1.0]], [[1.0]])
    n = np.zeros((1, 2, 16, 16), np.float16)
    with pytest.raises(TypeError, match=r"^k: expected a torch\.Tensor, got a NumPy float16 array of shape "
                                        r"\(1, 2, 16, 16\); sagebwd_cp\.torch takes torch tensors only"):
        st.attention(Q, n, n)
    with pytest.raises(TypeError, match=r"^k: expected a NumPy array like q, got a torch float16 tensor of shape "
                                        r"\(1, 2, 16, 16\); the arrays of one call come from one framework$"):
        sagebwd_cp.attention(n, Q, Q)


# --------------------------------------------------------------------------------------- neutral

def _n(*shape, seed=0, dtype=np.float16):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _neutral_args():
    q, k, v = _n(B, H, L, D, seed=1), _n(B, H, L, D, seed=2), _n(B, H, L, D, seed=3)
    out, saved = sagebwd_cp.attention_forward(q, k, v)
    _, lse = sagebwd_cp.attention(q, k, v, return_lse=True)
    packed = [x.transpose(0, 2, 1, 3)[0].copy() for x in (q, k, v)]
    cu = np.array(CU, np.int32)
    _, packed_saved = sagebwd_cp.attention_varlen_forward(*packed, cu, cu, 9, 9)
    return dict(q=q, k=k, v=v, out=out, saved=saved, lse=lse, do=_n(B, H, L, D, seed=4),
                k_mean=sagebwd_cp.key_mean([k]),
                packed=packed, cu=cu, packed_saved=packed_saved)


N = _neutral_args()
NQ, NK, NV = N["q"], N["k"], N["v"]
DENSE = dict(q=NQ, k=NK, v=NV, out=np.empty_like(NQ), k_mean=N["k_mean"])
PQ, PK, PV = N["packed"]
PACKED = dict(q=PQ, k=PK, v=PV, cu_seqlens_q=N["cu"], cu_seqlens_k=N["cu"], out=np.empty_like(PQ))
PS = N["packed_saved"]


def _dense(fn):
    return lambda a: fn(a["q"], a["k"], a["v"], out=a["out"], k_mean=a["k_mean"])


def _packed(fn):
    return lambda a: fn(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 9, 9, out=a["out"])


NEUTRAL = [  # (id, {argument: good value}, call[, arguments that may be None])
    ("attention", DENSE, _dense(sagebwd_cp.attention), ("out", "k_mean")),
    ("attention_forward", DENSE, _dense(sagebwd_cp.attention_forward), ("out", "k_mean")),
    ("attention_backward", dict(do=N["do"]), lambda a: sagebwd_cp.attention_backward(N["saved"], a["do"])),
    ("attention_backward_arrays",
     dict(q=NQ, k=NK, v=NV, out=N["out"], lse2=N["saved"].lse2.obj, do=N["do"], k_mean=N["saved"].k_mean.obj),
     lambda a: sagebwd_cp.attention_backward_arrays(a["q"], a["k"], a["v"], a["out"], a["lse2"], a["do"],
                                                    k_mean=a["k_mean"]), ("k_mean",)),
    ("attention_varlen", PACKED, _packed(sagebwd_cp.attention_varlen), ("out",)),
    ("attention_varlen_forward", PACKED, _packed(sagebwd_cp.attention_varlen_forward), ("out",)),
    ("attention_varlen_backward_arrays",
     dict(q=PQ, k=PK, v=PV, out=PS.out.obj, lse2=PS.lse2.obj, do=PS.out.obj, cu_seqlens_q=N["cu"],
          cu_seqlens_k=N["cu"], k_mean=PS.k_mean.obj),
     lambda a: sagebwd_cp.attention_varlen_backward_arrays(a["q"], a["k"], a["v"], a["out"], a["lse2"], a["do"],
                                                           a["cu_seqlens_q"], a["cu_seqlens_k"], 9, 9,
                                                           k_mean=a["k_mean"]), ("k_mean",)),
    ("attention_backward_lse", dict(q=NQ, k=NK, v=NV, out=N["out"], lse=N["lse"], do=N["do"], k_mean=N["k_mean"]),
     lambda a: sagebwd_cp.attention_backward_lse(a["q"], a["k"], a["v"], a["out"], a["lse"], a["do"],
                                                 k_mean=a["k_mean"]), ("k_mean",)),
    ("merge_attention", {"outs[0]": N["out"], "outs[1]": N["out"], "lses[0]": N["lse"], "lses[1]": N["lse"]},
     lambda a: sagebwd_cp.merge_attention([a["outs[0]"], a["outs[1]"]], [a["lses[0]"], a["lses[1]"]])),
    ("key_mean", {"ks[0]": NK, "ks[1]": NV}, lambda a: sagebwd_cp.key_mean([a["ks[0]"], a["ks[1]"]])),
    ("prefix_key_mean", dict(k=NK), lambda a: sagebwd_cp.prefix_key_mean(a["k"])),
    ("lse_to_lse2", dict(lse=N["lse"], q=NQ, k_mean=N["k_mean"]),
     lambda a: sagebwd_cp.lse_to_lse2(a["lse"], a["q"], a["k_mean"]), ("k_mean",)),
    ("score_step", dict(q=NQ, k=NK), lambda a: sagebwd_cp.score_step(a["q"], a["k"])),
]
NEUTRAL = [t if len(t) == 4 else t + ((),) for t in NEUTRAL]


@pytest.mark.parametrize("fid,args,call,optional", NEUTRAL, ids=[t[0] for t in NEUTRAL])
def test_neutral_function_runs_on_good_inputs(fid, args, call, optional):
    call(args)


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("fid,args,call,optional", NEUTRAL, ids=[t[0] for t in NEUTRAL])
def test_neutral_function_refuses(fid, args, call, optional, kind):
    if kind in MIXES and len(args) == 1:
        pytest.skip(f"{fid} takes one array, of any framework the neutral API reads: nothing to mix")
    for name in args:
        _check(call, args, name, kind, optional=optional)


def test_neutral_sequence_arguments_must_be_sequences_of_arrays():
    for bad in (None, NK, "ks", {"k": NK}, 3):
        with pytest.raises(TypeError, match=r"^ks: expected a list or tuple of arrays, got "):
            sagebwd_cp.key_mean(bad)
        with pytest.raises(TypeError, match=r"^outs: expected a list or tuple of arrays, got "):
            sagebwd_cp.merge_attention(bad, [N["lse"]])


def test_neutral_backward_names_the_forwards_framework():
    with pytest.raises(TypeError, match=r"^do: expected a NumPy array like the forward's q, got a torch float16 "):
        sagebwd_cp.attention_backward(N["saved"], torch.from_numpy(N["do"]))


def test_one_framework_per_call_in_either_order():
    """Torch CPU tensors alone and NumPy arrays alone run; a mix is refused whichever comes first."""
    t = [torch.from_numpy(x) for x in (NQ, NK, NV)]
    assert isinstance(sagebwd_cp.attention(*t), torch.Tensor)
    with pytest.raises(TypeError, match=r"^v: expected a torch array like q, got a NumPy float16 array"):
        sagebwd_cp.attention(t[0], t[1], NV)
    with pytest.raises(TypeError, match=r"^out: expected a NumPy array like q, got a torch float16 tensor"):
        sagebwd_cp.attention(NQ, NK, NV, out=torch.empty(NQ.shape, dtype=torch.float16))
