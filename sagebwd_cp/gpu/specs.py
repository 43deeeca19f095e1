"""Every kernel specialization, named by a readable key, and the tile choice per device."""
from __future__ import annotations

import dataclasses
import math
import os

from .. import numerics
from ..numerics import PADDED_HEAD_DIMS, padded_head_dim  # noqa: F401 (the kernels' head dims, here with the tiles)
from ..options import AttentionOptions
from ..problem import wide_refusal
from . import compiler
from .compiler import KernelSpec, make_spec
from .launch import BLOCKS_FIRST, HEADS_BATCH_FIRST

DTYPES = ("float16", "bfloat16")
TOKEN_PAD = 128  # INT8 buffers hold a multiple of this many tokens (key-side: BackwardTiles.key_pad in the backward)

# Threads a CTA of the small kernels (each kernel's launch bounds and indexing: SB_THREADS, or for
# quantize.cu SB_QUANT_THREADS and SB_SUM_THREADS).
QUANT_THREADS = 128  # quantize_tensors: at most this many, D_pad a CTA (two 64-token blocks)
QUANT_CHUNKS = 16  # quantize_tensors: tokens a thread owns, each a 16-byte chunk of dynamic shared memory a column
SUM_THREADS = 512  # token_sum (and zero_counts)
ROWS_THREADS = 256  # backward_rows.cu: row_stats, dq_convert, pack_rows
LSE_THREADS = 128  # lse.cu: natural_lse, softcap_row_bias (D_pad / 8 threads a query row)
BIAS_THREADS = 128  # smooth_q_bias.cu: a key a thread
BIAS_QBLOCKS = 16  # smooth_q_bias.cu: query blocks a CTA (each key's staged row serves them all)
TMA_DO_COLS = 64  # the wgmma backward's dO boxes: 64 16-bit columns (128 bytes, the widest swizzle)
DQ_SWIZZLE_COLS = 32  # the pair backward's dQ boxes: 32 f32 columns (128 bytes, the widest swizzle)
PHASES_DQ_COLS = 64  # backward_phases.cu's dQ parts, each reduced on its own: a gradient product's columns (m64n64)


@dataclasses.dataclass(frozen=True)
class TmaBox:
    """A TMA tensor map's box (elements, innermost first) and swizzle (bytes: its rows' 64 or 128)."""
    box: tuple
    swizzle: int


# A spec's readable key is its family's name followed by the text of each define that names one of
# its choices, in this order; a family's implied defines (sizes that follow from its choices) are not
# spelled out. So the key and the defines come from one dict.
KEY_TEXT = {
    "SB_DP": lambda v: f".hd{v}",
    "SB_BF16": lambda v: ".bfloat16" if v else ".float16",
    "SB_CAUSAL": lambda v: ".causal" if v else ".full",
    "SB_WINDOW": lambda v: ".window" if v else "",
    "SB_SOFTCAP": lambda v: ".softcap" if v else "",
    "SB_BIAS": lambda v: ".qbias" if v else "",
    "SB_FINE": lambda v: ".fine" if v else ".paper",
    "SB_DETERMINISTIC": lambda v: ".det" if v else "",
    "SB_STAGES": lambda v: f".s{v}",
    "SB_WARPS": lambda v: f".w{v}",
    "SB_MT": lambda v: f"m{v}",
    "SB_WGMMA": lambda v: ".wgmma" if v else "",
    "SB_WS": lambda v: ".ws" if v else "",
    "SB_DQ_TILES": lambda v: f".dq{v}" if v > 1 else "",
    "SB_QUAD": lambda v: ".quad" if v else "",
    "SB_PAIR": lambda v: ".pair" if v else "",
    "SB_PHASES": lambda v: ".phases" if v else "",
    "SB_TILE_KEYS": lambda v: f".k{v}" if v != numerics.BLOCK_KV else "",
    "SB_DQK": lambda v: f".qk{v}",
    "SB_DPV": lambda v: f".v{v}",
    "SB_CONSUMERS": lambda v: f".c{v}",
    "SB_KV_STAGES": lambda v: f"s{v}",
    "SB_PINGPONG": lambda v: ".pp" if v else "",
    "SB_VARLEN": lambda v: ".varlen" if v else "",
}


def _spec(family: str, filename: str, entries, choices: dict, implied: dict | None = None,
          layout: bool = False) -> KernelSpec:
    """The spec of ``choices`` (every one a KEY_TEXT define: the key spells them) and ``implied``
    defines (the sizes and constants the choices and the family fix), with the key built from them."""
    implied = dict(implied or {})
    assert set(choices) <= set(KEY_TEXT), set(choices) - set(KEY_TEXT)
    assert not set(choices) & set(implied), set(choices) & set(implied)
    key = family + "".join(KEY_TEXT[name](choices[name]) for name in KEY_TEXT if name in choices)
    return make_spec(key, filename, entries, layout=layout, **choices, **implied)


def _dtype(dtype: str, varlen: bool = False) -> dict:
    """The choices of a 16-bit dtype (kernels/config.cuh SB_BF16) and a packed batch (seqinfo.cuh SB_VARLEN)."""
    assert dtype in DTYPES, dtype
    return {"SB_BF16": int(dtype == "bfloat16"), **({"SB_VARLEN": 1} if varlen else {})}


def _token_pad() -> dict:
    """Every kernel that reads token rows (seqinfo.cuh): the INT8 buffers' padding."""
    return {"SB_TOKEN_PAD": TOKEN_PAD}


def quantize_spec(dp: int, dtype: str, varlen: bool = False) -> KernelSpec:
    """The pre-pass of one padded head dim (a module holds that head dim's instantiations alone)."""
    return _spec("quantize", "quantize.cu", ["quantize_tensors", "quantize_tensors_fused", "token_sum", "zero_counts"],
                 {"SB_DP": dp, **_dtype(dtype, varlen)},
                 {**_token_pad(), "SB_QUANT_THREADS": QUANT_THREADS, "SB_QUANT_CHUNKS": QUANT_CHUNKS,
                  "SB_SUM_THREADS": SUM_THREADS})


def bias_spec(dtype: str) -> KernelSpec:
    return _spec("smooth_q_bias", "smooth_q_bias.cu", ["smooth_q_bias"], _dtype(dtype),
                 {**_token_pad(), "SB_THREADS": BIAS_THREADS, "SB_BIAS_QBLOCKS": BIAS_QBLOCKS})


def ceiling_spec(wgmma: bool = False) -> KernelSpec:
    """Tensor-core ceilings: mma.sync chains, or (sm_90a) warpgroup products from shared memory."""
    if wgmma:
        return _spec("ceiling", "ceiling.cu", ["int8_wgmma_ceiling", "fp16_wgmma_ceiling"], {"SB_WGMMA": 1})
    return _spec("ceiling", "ceiling.cu", ["int8_mma_ceiling", "fp16_mma_ceiling"], {})


def lse_spec(dtype: str, varlen: bool = False) -> KernelSpec:
    return _spec("natural_lse", "lse.cu", ["natural_lse", "softcap_row_bias"], _dtype(dtype, varlen),
                 {**_token_pad(), "SB_THREADS": LSE_THREADS})


@dataclasses.dataclass(frozen=True)
class ForwardTiles:
    warps: int
    m_tiles: int  # 16-row m-tiles per warp
    wgmma: bool = False  # sm_90a warpgroup products (one warpgroup: 4 warps x 1 m-tile)
    key_tile: int = numerics.BLOCK_KV  # keys per tile: 64, or 128 with wgmma (kernels/forward.cu SB_TILE_KEYS)
    value_cols: int = 0  # wgmma above d=128: V's padded head dim where narrower than the padded one (SB_DPV), else 0

    @property
    def cta_q(self) -> int:
        return self.warps * 16 * self.m_tiles

    @property
    def threads(self) -> int:
        return self.warps * 32

    def choices(self) -> dict:
        narrow = {"SB_DPV": self.value_cols} if self.value_cols else {}
        return {"SB_WARPS": self.warps, "SB_MT": self.m_tiles, "SB_WGMMA": int(self.wgmma), "SB_TILE_KEYS": self.key_tile,
                **narrow}

    def implied(self) -> dict:
        """kernels/forward.cu's CTA: SB_THREADS threads, SB_CTA_Q query rows."""
        return {"SB_THREADS": self.threads, "SB_CTA_Q": self.cta_q}


# Best measured on an H200 that spills on no arch (docs/history/PERFORMANCE_LOG.md, forward v1).
FORWARD_TILES = {64: ForwardTiles(warps=4, m_tiles=1), 128: ForwardTiles(warps=4, m_tiles=1),
                 256: ForwardTiles(warps=4, m_tiles=1)}


WGMMA_ARCHS = ("sm_90",)  # compiled as sm_90a


def use_wgmma(arch: str | None) -> bool:
    """The wgmma paths (forward and backward) on Hopper; SAGEBWD_WGMMA=0 selects mma.sync there too."""
    return arch in WGMMA_ARCHS and os.environ.get("SAGEBWD_WGMMA", "1") != "0"


# Built (every kernel compiled for them, without spills, by CI) but never run on such a GPU: Blackwell,
# B200 (sm_100) and the RTX 50xx (sm_120), through the mma.sync kernels.
NOT_MEASURED_ARCHS = ("sm_100", "sm_120")
PTX_FAMILY = "mma.sync kernels as PTX for {target}, JIT-compiled by the driver; not measured"


def kernel_family(arch: str) -> str:
    """In words, the kernels a device of ``arch`` runs, or that the library has none for it."""
    if arch in WGMMA_ARCHS:
        return ("wgmma kernels (sm_90a)" if use_wgmma(arch) else
                "mma.sync kernels (SAGEBWD_WGMMA=0; wgmma kernels (sm_90a) without it)")
    if arch in NOT_MEASURED_ARCHS:
        return "mma.sync kernels, built, not measured"
    if arch in compiler.SUPPORTED_ARCHS:
        return "mma.sync kernels"
    number = arch.removeprefix("sm_")
    if not number.isdigit():
        return f"unknown arch {arch!r}; host arrays run on the CPU emulator"
    if int(number) < 80:
        return "not supported: the kernels need sm_80 or newer; host arrays run on the CPU emulator"
    try:
        target = compiler.compile_target(arch)
    except ImportError:  # no NVRTC to ask: the built archs, assumed known to it
        target = compiler.compile_target(arch, known=compiler.SUPPORTED_ARCHS)
    except ValueError as exc:
        return f"not built: {exc}"
    return PTX_FAMILY.format(target=target)


def kernel_families() -> list:
    """``(archs, family)`` for every arch the library builds, archs of one family together."""
    groups: dict = {}
    for arch in compiler.SUPPORTED_ARCHS:
        groups.setdefault(kernel_family(arch), []).append(arch)
    return [(", ".join(archs), family) for family, archs in groups.items()]


def env_choice(name: str, choices: tuple) -> int | None:
    """The integer an override variable names (one of ``choices``), or None where it is unset."""
    value = os.environ.get(name)
    if value is None:
        return None
    if value not in {str(c) for c in choices}:
        raise ValueError(f"{name}: expected one of {', '.join(map(str, choices))}, got {value!r}")
    return int(value)


# Sliding windows at most this many keys wide (left + right) take the wgmma forward's 64-key tiles: the keys a
# query block reads past its band's edges shrink by half a tile, which outweighs the 64-key kernel's higher cost a
# key (docs/PERFORMANCE.md, sliding windows: 1024 and 512 faster, 4096 slower).
NARROW_BAND_KEYS = 2048


def forward_key_tile(options: AttentionOptions | None = None) -> int:
    """Keys per tile of the wgmma forward: 128 (one row max, P̂ scale and O update per two V blocks;
    docs/history/PERFORMANCE_LOG.md, forward v4), 64 under a sliding window of at most NARROW_BAND_KEYS keys;
    SAGEBWD_FORWARD_KEY_TILE=64 or 128 selects one kernel for every call up to head dim 128 (above:
    wide_forward_tiles)."""
    forced = env_choice("SAGEBWD_FORWARD_KEY_TILE", (64, 128))
    if forced is not None:
        return forced
    return 64 if options is not None and options.windowed and sum(options.band()) <= NARROW_BAND_KEYS else 128


# The wgmma forward above head dim 128: a warpgroup of 64 query rows on 64-key tiles (O takes 128 registers a thread;
# kernels/forward.cu), two CTAs an SM; windowed and soft-capped calls, and the narrow V head dims below.
WIDE_WGMMA_FORWARD_TILES = ForwardTiles(warps=4, m_tiles=1, wgmma=True, key_tile=numerics.BLOCK_KV)
# The plain masks (none, causal) with V's whole padded head dim: two warpgroups sharing 128-key tiles, one CTA an SM
# (one row maximum, P̂ scale and O update per 128 keys): forward 1.08-1.19x the 64-key kernel at d=256; 0.94x with a
# window and a soft cap, 0.89-0.96x for 128 columns of V on three warpgroups (H200, docs/PERFORMANCE.md). Dense batches
# take the warp-specialized forward there (forward_ws_tiles: the same results), packed ones and SAGEBWD_FORWARD_WS=0 this.
WIDE_PLAIN_FORWARD_TILES = ForwardTiles(warps=8, m_tiles=1, wgmma=True, key_tile=2 * numerics.BLOCK_KV)
# V head dims that the wide wgmma forward holds O for when V is narrower than the padded head dim (SB_DPV: MLA's 128
# under a Q·K head dim of 192, and d=192 itself): three CTAs an SM instead of two. Built for the plain masks (none,
# causal; dense and packed); windowed and soft-capped calls keep the 256-column kernel (fewer specs for CI to compile).
NARROW_VALUE_COLS = (128, 192)


def narrow_value_dim(options: AttentionOptions, value_dim: int) -> int | None:
    """V's head dim where the narrow wide kernels are built for ``options``' mask (wide_forward_tiles,
    narrow_backward_tiles), else None."""
    return None if options.windowed or options.softcap else value_dim


def wide_forward_tiles(value_dim: int | None) -> ForwardTiles:
    """The wide wgmma forward's tiles for V's head dim ``value_dim`` (narrow_value_dim: None under a window or a soft
    cap, which take the 256-column 64-key kernel)."""
    if value_dim is None:
        return WIDE_WGMMA_FORWARD_TILES
    cols = min((c for c in NARROW_VALUE_COLS if c >= value_dim), default=None)  # (a V of 64 columns takes 128's)
    if cols is not None:
        return dataclasses.replace(WIDE_WGMMA_FORWARD_TILES, value_cols=cols)
    return WIDE_PLAIN_FORWARD_TILES


def forward_tiles(dp: int, arch: str | None = None, value_dim: int | None = None,
                  options: AttentionOptions | None = None) -> ForwardTiles:
    """Tiles for the forward (the plan checks that the kernel's shared layout fits the device); ``value_dim``: V's
    head dim, which the wide wgmma forward holds O for; ``options``: the call's mask (forward_key_tile)."""
    if use_wgmma(arch):
        if dp > numerics.WIDE_HEAD_DIM:
            return wide_forward_tiles(value_dim)
        return ForwardTiles(warps=4, m_tiles=1, wgmma=True, key_tile=forward_key_tile(options))
    return FORWARD_TILES[dp]


def _window(options: AttentionOptions) -> dict:
    """SB_WINDOW where the kernel reads the band's edges (a sliding window, or a soft cap without a causal mask),
    SB_SOFTCAP where the scores are soft-capped (absent otherwise: the other kernels' keys stay)."""
    return {**({"SB_WINDOW": 1} if options.band_test else {}), **({"SB_SOFTCAP": 1} if options.softcap else {})}


def forward_grid_order(causal: bool) -> int:
    """The order of the forward's grid (launch.attention_grid; kernels/forward.cu SB_GRID_ORDER): causal
    query blocks differ in work, and the heads-and-batch-first grid starts every (head, batch entry)'s
    heaviest block before any one's next."""
    return HEADS_BATCH_FIRST if causal else BLOCKS_FIRST


def forward_spec(dp: int, dtype: str, options: AttentionOptions, tiles: ForwardTiles, varlen: bool = False) -> KernelSpec:
    """The forward of ``options``' mask (causal or windowed: SB_CAUSAL, the band) and Q-smoothing (its other
    options do not change the kernel)."""
    causal, bias = options.banded, options.smooth_q
    assert not (bias and varlen), "Q-smoothing takes dense batches"
    choices = {"SB_DP": dp, **_dtype(dtype, varlen), "SB_CAUSAL": int(causal), **_window(options), "SB_BIAS": int(bias),
               **tiles.choices()}
    implied = {**_token_pad(), **tiles.implied(), "SB_GRID_ORDER": forward_grid_order(causal)}
    return _spec("forward", "forward.cu", ["attention_forward"], choices, implied, layout=True)


@dataclasses.dataclass(frozen=True)
class WsForwardTiles:
    """The warp-specialized sm_90 forward (kernels/forward_ws.cu): a producer warpgroup and
    ``consumers`` warpgroups of 64 query rows, ``stages`` key tiles (``key_tile``: 128, or 192 in dense
    batches) in flight, the consumers
    taking turns to issue their products (``pingpong``), one CTA per work tile or a ``persistent``
    grid of ``ctas_per_sm`` CTAs an SM."""
    consumers: int = 2
    stages: int = 3
    pingpong: bool = True
    persistent: bool = True
    key_tile: int = 128

    @property
    def cta_q(self) -> int:
        return 64 * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    @property
    def ctas_per_sm(self) -> int:
        """Resident CTAs an SM (the kernel's register split: two with one consumer)."""
        return 2 if self.consumers == 1 else 1

    def key_maps(self, dp: int) -> tuple:
        """The TMA boxes of the key tiles (K̂: key_tile rows of dp bytes, or at d=256 two boxes of 128; V̂ᵀ: dp rows
        of key_tile bytes, or of 64 for a 192-key tile, three boxes a tile), each in the swizzle of its row's
        bytes (the wgmma descriptors')."""
        vt_keys = 128 if self.key_tile == 128 else 64
        k_cols = min(dp, 128)
        return TmaBox((k_cols, self.key_tile), k_cols), TmaBox((vt_keys, dp), vt_keys)

    def choices(self) -> dict:
        wide = {"SB_TILE_KEYS": self.key_tile} if self.key_tile != 128 else {}  # (128: implied, unnamed in the key)
        return {"SB_CONSUMERS": self.consumers, "SB_KV_STAGES": self.stages,
                "SB_PINGPONG": int(self.pingpong and self.consumers > 1), **wide}

    def implied(self, dp: int) -> dict:
        """kernels/forward_ws.cu's CTA and key tiles (the grid, persistent or not, is the launch's choice:
        one kernel serves both)."""
        k, vt = self.key_maps(dp)
        implied_tile = {"SB_TILE_KEYS": self.key_tile} if self.key_tile == 128 else {}  # (else a choice)
        return {"SB_WGMMA": 1, **implied_tile, "SB_THREADS": self.threads, "SB_CTA_Q": self.cta_q,
                "SB_MIN_BLOCKS": self.ctas_per_sm, "SB_TMA_SWIZZLE_K": k.swizzle, "SB_TMA_SWIZZLE_VT": vt.swizzle}


# The warp-specialized forward is the default up to this many keys (forward_ws_tiles).
WS_FORWARD_MAX_KEYS = 8192


def ws_forward_shape(dp: int) -> WsForwardTiles:
    """The warp-specialized forward's shape at head dim ``dp``, the fastest measured: three consumers, one
    product at a time, at 64; one consumer, two CTAs an SM, a CTA per work tile, at 128."""
    if dp == 64:
        return WsForwardTiles(consumers=3, pingpong=False)
    if dp > numerics.WIDE_HEAD_DIM:  # (O's 128 registers: two consumers at 240; three stages measured 0.88-0.96x)
        return WsForwardTiles(consumers=2, stages=2, pingpong=True, persistent=False)
    return WsForwardTiles(consumers=1, pingpong=False, persistent=False)


def forward_ws_tiles(dp: int, arch: str | None, options: AttentionOptions, varlen: bool = False,
                     len_k: int = 0, value_dim: int | None = None) -> WsForwardTiles | None:
    """The warp-specialized forward's tiles, or None for the one-warpgroup kernel (forward.cu). sm_90, no
    Q-smoothing, sliding window or soft cap. By default where it measured faster than that kernel, in dense
    batches: head dim 128 without a mask up to WS_FORWARD_MAX_KEYS keys (H100, bf16 and fp16, MHA and
    GQA: 1.02-1.07x at 2K-8K in three runs; H200 1.00-1.06x; at 16K 0.96-1.22x between runs, causal
    0.94-1.07x and head dim 64 0.95-0.99x: forward.cu stays there), and head dim 256 with or without the
    causal mask (H200: 1.05-1.18x its two-warpgroup forward.cu kernel at 2K-8K; docs/PERFORMANCE.md).
    SAGEBWD_FORWARD_WS=0 keeps forward.cu everywhere (as SAGEBWD_FORWARD_KEY_TILE does), =1 takes this
    kernel wherever it is built. Its shape is ws_forward_shape's, which SAGEBWD_FORWARD_CONSUMERS (1-3),
    SAGEBWD_FORWARD_STAGES (2-4), SAGEBWD_FORWARD_PINGPONG and SAGEBWD_FORWARD_PERSISTENT (0, 1) and
    SAGEBWD_FORWARD_WS_KEYS (128, 192; packed batches keep 128) override. Above head dim 128 (V wider than 192
    columns: the narrower take forward.cu's narrow kernels) the shape is two consumers and 128-key tiles, which
    O's registers leave, and two or three stages (shared memory); ping-pong and persistence may be switched."""
    if not use_wgmma(arch) or options.smooth_q or options.windowed or options.softcap:
        return None
    if dp > numerics.WIDE_HEAD_DIM and wide_forward_tiles(value_dim or dp) != WIDE_PLAIN_FORWARD_TILES:
        return None  # (O for V's head dim: forward.cu's narrow kernels; this kernel takes the two-warpgroup one's calls)
    asked = env_choice("SAGEBWD_FORWARD_WS", (0, 1))
    # (SAGEBWD_FORWARD_KEY_TILE forces forward.cu's key tile: that kernel, then, unless this one is asked for.)
    measured_faster = ((dp == 128 and not options.causal and len_k <= WS_FORWARD_MAX_KEYS
                        and env_choice("SAGEBWD_FORWARD_KEY_TILE", (64, 128)) is None)
                       or dp > numerics.WIDE_HEAD_DIM) and not varlen
    if asked == 0 or (asked is None and not measured_faster):
        return None
    tiles, fixed = ws_forward_shape(dp), dp > numerics.WIDE_HEAD_DIM
    overrides = {"consumers": None if fixed else env_choice("SAGEBWD_FORWARD_CONSUMERS", (1, 2, 3)),
                 "stages": env_choice("SAGEBWD_FORWARD_STAGES", (2, 3) if fixed else (2, 3, 4)),
                 "pingpong": env_choice("SAGEBWD_FORWARD_PINGPONG", (0, 1)),
                 "persistent": env_choice("SAGEBWD_FORWARD_PERSISTENT", (0, 1)),
                 "key_tile": None if varlen or fixed else env_choice("SAGEBWD_FORWARD_WS_KEYS", (128, 192))}
    return dataclasses.replace(tiles, **{k: type(getattr(tiles, k))(v) for k, v in overrides.items() if v is not None})


def forward_ws_spec(dp: int, dtype: str, options: AttentionOptions, tiles: WsForwardTiles,
                    varlen: bool = False) -> KernelSpec:
    assert not options.smooth_q, "the warp-specialized forward has no Q-smoothing"
    assert not options.windowed, "the warp-specialized forward has no sliding windows"
    choices = {"SB_DP": dp, **_dtype(dtype, varlen), "SB_CAUSAL": int(options.causal), **tiles.choices()}
    return _spec("forward_ws", "forward_ws.cu", ["attention_forward"], choices, {**_token_pad(), **tiles.implied(dp)},
                 layout=True)


def backward_rows_spec(dtype: str, varlen: bool = False) -> KernelSpec:
    return _spec("backward_rows", "backward_rows.cu", ["row_stats", "dq_convert", "pack_rows"], _dtype(dtype, varlen),
                 {**_token_pad(), "SB_THREADS": ROWS_THREADS})


WGMMA_GROUPS = 2  # computing warpgroups of the wgmma backward, a warpgroup per 64 keys


@dataclasses.dataclass(frozen=True)
class BackwardTiles:
    stages: int  # query-side buffers in flight (SB_STAGES)
    wgmma: bool = False  # sm_90a: kernels/backward_wgmma.cu (a warpgroup per 64 keys)
    ws: bool = False  # wgmma: a producer warpgroup beside the two computing ones (SB_WS; backward_tiles says where)
    dq_tiles: int = 1  # wgmma: dQ partial tiles in shared memory (SB_DQ_TILES; 2 needs ws: dq_tiles_for)
    quad: bool = False  # wgmma at head dim 128: kernels/backward_quad.cu (four warpgroups split by queries)
    # wgmma above head dim 128: kernels/backward_pair.cu (a CTA of 64 keys, two warpgroups splitting the queries for
    # the scores and the head dims for the gradients; narrow_backward_tiles says where)
    pair: bool = False
    # the pair kernel's warpgroups specialized by phase (kernels/backward_phases.cu: one forms the scores and codes, the
    # other the gradient products an iteration behind; V's head dim at most 128; narrow_backward_tiles says where)
    phases: bool = False
    # wgmma above head dim 128: the Q·K and V head dims the passes split where narrower than the padded one (SB_DQK,
    # SB_DPV; narrow_backward_tiles), else 0
    qk_cols: int = 0
    value_cols: int = 0

    @property
    def filename(self) -> str:
        if self.pair:
            return "backward_phases.cu" if self.phases else "backward_pair.cu"
        return "backward_quad.cu" if self.quad else "backward_wgmma.cu" if self.wgmma else "backward.cu"

    @property
    def threads(self) -> int:
        """The launch's: mma.sync 4 key groups x 2 query halves of a 64x64 tile; wgmma 128 per warpgroup, and
        the producer's 128 (ws); quad four warpgroups, pair two."""
        if self.quad:
            return 4 * 128
        if self.pair:
            return 2 * 128
        return 128 * (WGMMA_GROUPS + self.ws) if self.wgmma else 256

    @property
    def block_keys(self) -> int:
        """Keys per CTA (the grid's x extent is the key length over this)."""
        if self.pair:
            return numerics.BLOCK_KV
        return WGMMA_GROUPS * numerics.BLOCK_KV if self.wgmma else numerics.BLOCK_KV

    @property
    def key_pad(self) -> int:
        """Key-side INT8 buffers hold a multiple of this many tokens: CTAs load whole key tiles."""
        return math.lcm(TOKEN_PAD, self.block_keys)

    def dq_row(self, dp: int) -> int:
        """Row pitch (floats) of the FP32 dQ accumulator: padded by 8 where bulk reductions add a tile's zero columns
        into it (wgmma), the Q·K head dim's columns alone where the pair kernel's swizzled boxes add none."""
        if self.pair:
            return self.pass_dims(dp)
        return dp + 8 if self.wgmma else dp

    def query_maps(self, dp: int) -> dict:
        """The TMA boxes of the wgmma kernel's query-side tiles (BackwardParams tm_*): Q̂ (a query block
        of dp-byte rows as its 128-byte column blocks one after the other: columns x rows x blocks), Q̂ᵀ and
        dÔᵀ (a pass's rows, ``pass_dims``, of a query block's bytes), dO (a query block's rows x TMA_DO_COLS
        16-bit columns, 128 bytes, the widest swizzle), each in the swizzle of its row's bytes; and the dQ
        accumulator's box that a pass's partial tile adds into (its ``pass_dims`` columns and the tile's 8 zero
        ones, unswizzled). The pair kernels' dQ tiles are DQ_SWIZZLE_COLS-column blocks in the 128-byte swizzle
        (columns x rows x blocks), which need no padding against bank conflicts, so that the reductions add no zeros:
        each of the pair kernel's warpgroups adds half the columns, the phase-specialized kernel a 64-column
        product's at a time."""
        bq, q_cols = numerics.BLOCK_Q, min(dp, 128)
        if self.pair:
            cols = PHASES_DQ_COLS if self.phases else self.pass_dims(dp) // 2
            dq = TmaBox((DQ_SWIZZLE_COLS, bq, cols // DQ_SWIZZLE_COLS), 4 * DQ_SWIZZLE_COLS)
        else:
            dq = TmaBox((self.pass_dims(dp) + 8, bq), 0)
        return {"rows": TmaBox((q_cols, bq, dp // q_cols), q_cols), "cols": TmaBox((bq, self.pass_dims(dp)), bq),
                "value_cols": TmaBox((bq, self.value_pass_dims(dp)), bq),
                "grad": TmaBox((TMA_DO_COLS, bq, 1, 1), 2 * TMA_DO_COLS), "dq": dq}

    def passes(self, dp: int) -> int:
        """CTAs a key block, each computing dK, dV and dQ for ``pass_dims`` head-dim columns: two for the wgmma
        kernel above head dim 128 (kernels/backward_wgmma.cu PASSES; neighbours on the grid's blocks axis),
        else one (the mma.sync kernel takes its halves in passes of its own, the pair kernel in its warpgroups)."""
        return 2 if self.wgmma and not self.pair and dp > numerics.WIDE_HEAD_DIM else 1

    def pass_dims(self, dp: int) -> int:
        """dK's and dQ's columns a CTA (Q̂ᵀ's and K̂ᵀ's rows)."""
        return (self.qk_cols or dp) // self.passes(dp)

    def value_pass_dims(self, dp: int) -> int:
        """dV's columns a CTA (dÔᵀ's rows)."""
        return (self.value_cols or dp) // self.passes(dp)

    def choices(self) -> dict:
        narrow = {"SB_DQK": self.qk_cols, "SB_DPV": self.value_cols} if self.qk_cols else {}
        return {"SB_STAGES": self.stages, "SB_WGMMA": int(self.wgmma),
                **({"SB_WS": int(self.ws), "SB_DQ_TILES": self.dq_tiles} if self.wgmma else {}),
                **({"SB_QUAD": 1} if self.quad else {}), **({"SB_PAIR": 1} if self.pair else {}),
                **({"SB_PHASES": 1} if self.phases else {}), **narrow}

    def implied(self, dp: int, causal: bool, deterministic: bool) -> dict:
        """The kernel's CTA (SB_THREADS threads over SB_CTA_KEYS keys), its key-side padding, dQ's row
        pitch and the grid order (-1: the launch's); the wgmma kernel's TMA boxes."""
        order = backward_fixed_grid_order(self.wgmma, causal, deterministic)
        # SB_THREADS: the threads that compute (the wgmma kernel's producer warpgroup is not among them)
        out = {"SB_THREADS": self.threads - 128 * self.ws, "SB_CTA_KEYS": self.block_keys, "SB_KEY_PAD": self.key_pad,
               "SB_DQ_PITCH": self.dq_row(dp), "SB_GRID_ORDER": -1 if order is None else order}
        if self.wgmma:
            maps = self.query_maps(dp)
            out.update(SB_PASSES=self.passes(dp), SB_TMA_QROWS=maps["rows"].box[1], SB_TMA_Q_COLS=maps["rows"].box[0],
                       SB_TMA_QT_ROWS=maps["cols"].box[1], SB_TMA_DO_COLS=maps["grad"].box[0], SB_TMA_DQ_COLS=maps["dq"].box[0],
                       SB_TMA_SWIZZLE_Q=maps["rows"].swizzle, SB_TMA_SWIZZLE_QT=maps["cols"].swizzle,
                       SB_TMA_SWIZZLE_DO=maps["grad"].swizzle)
            if self.qk_cols or self.pair:
                out.update(SB_TMA_DOT_ROWS=maps["value_cols"].box[1])
            if self.pair:
                out.update(SB_TMA_DQ_BLOCKS=maps["dq"].box[2])
        return out


def backward_fixed_grid_order(wgmma: bool, causal: bool, deterministic: bool) -> int | None:
    """The grid order the backward kernel is compiled for (backward.backward_grid; kernels/backward_common.cuh
    SB_GRID_ORDER): the mma.sync kernel's (heads and batch first where causal and deterministic, else key
    blocks first: an order argument costs it a register it does not have at d=64), or None for the wgmma
    kernel, which reads the launch's (BackwardParams.grid_order)."""
    if wgmma:
        return None
    return HEADS_BATCH_FIRST if causal and deterministic else BLOCKS_FIRST


def backward_tiles(dp: int, arch: str | None = None, deterministic: bool = False) -> BackwardTiles:
    """The wgmma kernel on sm_90, else the mma.sync kernel with two stages (``backward_kernel`` takes
    one where two do not fit the device's shared memory). The deterministic wgmma kernel has a producer
    warpgroup (stage loads, dQ's reductions and their turns; kernels/backward_wgmma.cu SB_WS): there the computing
    warps stop waiting for turns, measured 1.12-1.35x at head dim 128 and, with two dQ tiles, 1.00-1.08x at head
    dim 64 causal MHA 8K against the three-warpgroup kernel it replaced (docs/PERFORMANCE.md); not deterministic
    it measured 0.95-1.00x. SAGEBWD_BACKWARD_WS=0 or 1 forces it off or on. Above head dim 128 the wgmma
    kernel runs two CTAs a key block, a half of dK, dV and dQ each (``BackwardTiles.passes``), with one stage
    (the tiles fill shared memory) that only the producer can reload in time: one stage, a producer, one dQ
    tile."""
    wg = use_wgmma(arch)
    if wg and dp > numerics.WIDE_HEAD_DIM:
        return BackwardTiles(stages=1, wgmma=True, ws=True, dq_tiles=1)
    if wg and dp == 128 and not deterministic and env_choice("SAGEBWD_BACKWARD_QUAD", (0, 1)) == 1:
        # kernels/backward_quad.cu, opt-in: 0.84-0.88x this kernel's speed (docs/PERFORMANCE.md)
        return BackwardTiles(stages=2, wgmma=True, quad=True)
    forced = env_choice("SAGEBWD_BACKWARD_WS", (0, 1))
    ws = wg and (forced == 1 if forced is not None else deterministic)
    return BackwardTiles(stages=2, wgmma=wg, ws=ws, dq_tiles=dq_tiles_for(ws))


# The wide wgmma backward's Q·K head dim where a call's fits it (SB_DQK): the passes then split 192 columns, not 256,
# and V's tiles hold V's head dim rounded up to NARROW_VALUE_COLS (SB_DPV). Built for the plain masks, as the
# narrow-V forward (narrow_value_dim), not deterministic.
NARROW_QK_COLS = 192


def narrow_backward_tiles(tiles: BackwardTiles, dp: int, head_dim: int, value_dim: int,
                          options: AttentionOptions, pair: bool | None = None,
                          phases: bool | None = None) -> BackwardTiles:
    """``tiles`` for a wide wgmma backward of ``options`` whose head dim ``head_dim`` (V's ``value_dim``) fits
    NARROW_QK_COLS, where that kernel is built (the plain masks, not deterministic); else ``tiles``. There (both
    head dims fit 192) the pair kernel (kernels/backward_pair.cu: a CTA of 64 keys, each score formed once;
    H200, bf16, causal: fwd+bwd 1.02-1.13x the two-pass kernel at 192/128 and 1K-8K keys, 1.11-1.14x at d=192 and
    4K-8K), unless ``pair`` is False (None: SAGEBWD_BACKWARD_PAIR=0 keeps the two-pass kernel). Where V's tiles hold
    128 columns (MLA's 192/128) the pair kernel's phase-specialized form (kernels/backward_phases.cu; fwd+bwd 1.04-1.08x
    the pair kernel, H200, bf16, causal, 2K-8K keys), unless ``phases`` is False (None: SAGEBWD_BACKWARD_PHASES=0
    keeps the pair kernel)."""
    value_dim = None if options.deterministic else narrow_value_dim(options, value_dim)
    if not (tiles.wgmma and dp > numerics.WIDE_HEAD_DIM and value_dim is not None and head_dim <= NARROW_QK_COLS):
        return tiles
    cols = [c for c in NARROW_VALUE_COLS if c >= min(value_dim, NARROW_QK_COLS)]
    if not cols:
        return tiles
    # Two stages where they fit (V's 128 columns: 204,528 bytes), measured 1.04-1.05x one split stage at 192/128.
    narrow = dataclasses.replace(tiles, qk_cols=NARROW_QK_COLS, value_cols=cols[0], stages=2 if cols[0] == 128 else 1)
    if pair is None:
        pair = env_choice("SAGEBWD_BACKWARD_PAIR", (0, 1)) != 0
    if pair:  # (two stages, no producer warpgroup; at V's 192 columns Q̂ᵀ and dÔᵀ in one buffer: SPLIT)
        if phases is None:
            phases = env_choice("SAGEBWD_BACKWARD_PHASES", (0, 1)) != 0
        return dataclasses.replace(narrow, pair=True, phases=phases and cols[0] == 128, ws=False, dq_tiles=1, stages=2)
    return narrow


def dq_tiles_for(ws: bool) -> int:
    """dQ partial tiles of the wgmma backward: two where a producer warpgroup reduces them (the computing warps
    write one while the other is read), else one. SAGEBWD_BACKWARD_DQ_TILES=1 forces one."""
    return 2 if ws and env_choice("SAGEBWD_BACKWARD_DQ_TILES", (1, 2)) != 1 else 1


def backward_kernel(dp: int, dtype: str, options: AttentionOptions, tiles: BackwardTiles, arch: str, shared_limit: int,
                    varlen: bool = False) -> tuple:
    """(tiles, spec) of the backward: ``tiles``, with one stage instead of two for the mma.sync kernel
    where its layout compiled for ``arch`` exceeds ``shared_limit`` (e.g. sm_86/89 at head dim 128); the
    mma.sync kernel in place of the wgmma one for a deterministic sliding window at head dim 128.
    backward.cu's layout depends on the head dim and the stages alone, so one specialization of them
    is compiled to measure it (the plan checks every launch's own layout against the device)."""
    if tiles.wgmma and options.band_test and options.deterministic and dp == 128:
        # The wgmma kernel of a dense batch spills here (its band tests at 255 registers): the mma.sync
        # kernel, for packed batches too (so that a packed sequence's gradients are its dense call's).
        tiles = BackwardTiles(stages=2)
    if tiles.quad and (varlen or not options.fine or options.smooth_q or options.softcap or options.deterministic):
        # The four-warpgroup kernel takes dense batches, fine granularity, no Q-smoothing or soft cap (packed, it
        # spilled 4-8 bytes under NVRTC 13.0): elsewhere the two-warpgroup kernel of the same tiles.
        tiles = dataclasses.replace(tiles, quad=False)
    if tiles.pair and (not options.fine or options.smooth_q or options.softcap or options.deterministic):
        # The pair kernel takes fine granularity without Q-smoothing, soft cap or a deterministic order: elsewhere
        # the wide kernel of the same head dims, with its producer.
        tiles = dataclasses.replace(tiles, pair=False, ws=True)
    if tiles.ws and dp == 128 and (not options.fine or options.smooth_q):
        # With the producer's registers taken, the paper granularity's tile maxima spilled 4-8 bytes, and causal
        # Q-smoothing 8 bytes (NVRTC 13.0).
        tiles = dataclasses.replace(tiles, ws=False, dq_tiles=1)
    if not tiles.wgmma and dp > numerics.WIDE_HEAD_DIM and options.deterministic:
        raise ValueError(f"deterministic: head dims above {numerics.WIDE_HEAD_DIM} take deterministic=True on sm_90 "
                         f"(its wgmma kernels) alone, and {arch} runs the mma.sync ones")
    if not tiles.wgmma:
        probe = backward_spec(dp, "float16", AttentionOptions(), tiles)
        if compiler.dynamic_shared_bytes(probe, arch) > shared_limit:
            tiles = dataclasses.replace(tiles, stages=1)
            needed = compiler.dynamic_shared_bytes(backward_spec(dp, "float16", AttentionOptions(), tiles), arch)
            if needed > shared_limit:
                raise ValueError(f"head_dim: the backward at head dim {dp} needs {needed} bytes of shared memory a "
                                 f"block, and {arch} allows {shared_limit}; head dims above 128 train on sm_80, sm_90 "
                                 f"and sm_100 (the forward alone runs everywhere)")
    return tiles, backward_spec(dp, dtype, options, tiles, varlen)


def backward_spec(dp: int, dtype: str, options: AttentionOptions, tiles: BackwardTiles,
                  varlen: bool = False) -> KernelSpec:
    """The backward of ``options``' mask (causal or windowed: SB_CAUSAL, the band), Q-smoothing, granularity
    and deterministic order."""
    causal, bias, fine, deterministic = options.banded, options.smooth_q, options.fine, options.deterministic
    assert not (bias and varlen), "Q-smoothing takes dense batches"
    choices = {"SB_DP": dp, **_dtype(dtype, varlen), "SB_CAUSAL": int(causal), **_window(options), "SB_BIAS": int(bias),
               "SB_FINE": int(fine), "SB_DETERMINISTIC": int(deterministic), **tiles.choices()}
    return _spec("backward", tiles.filename, ["attention_backward"], choices,
                 {**_token_pad(), **tiles.implied(dp, causal, deterministic)}, layout=True)


# Opt-in shared memory per block of each target (CUDA C Programming Guide, the technical
# specifications per compute capability: 163 KB on 8.0, 99 KB on 8.6, 8.9 and 12.0, 227 KB on 9.0 and
# 10.0): what the tile choice sees on a device of that arch (a device's plans read its own).
ARCH_SHARED_LIMIT = {"sm_80": 166912, "sm_86": 101376, "sm_89": 101376, "sm_90": 232448, "sm_100": 232448,
                     "sm_120": 101376}


def arch_shared_limit(arch: str) -> int:
    """``ARCH_SHARED_LIMIT``'s value for ``arch``, or, for an arch that runs PTX, its target's."""
    if arch in ARCH_SHARED_LIMIT:
        return ARCH_SHARED_LIMIT[arch]
    try:
        target = compiler.compile_target(arch)
    except (ValueError, ImportError):
        return ARCH_SHARED_LIMIT["sm_90"]
    return ARCH_SHARED_LIMIT.get(target.replace("compute_", "sm_"), ARCH_SHARED_LIMIT["sm_90"])


def all_specs(arch: str | None = None) -> list:
    """Every specialization the library launches with the tiles it picks on ``arch`` (default sm_90).
    The mma.sync backward's stage count is read from its compiled layout, so this compiles those."""
    arch = arch or "sm_90"
    limit = arch_shared_limit(arch)
    specs = [s(dt, varlen) for s in (lse_spec, backward_rows_spec) for dt in DTYPES for varlen in (False, True)]
    specs += [quantize_spec(dp, dt, varlen) for dp in PADDED_HEAD_DIMS for dt in DTYPES for varlen in (False, True)]
    specs += [bias_spec(dt) for dt in DTYPES]
    specs += [ceiling_spec()] + ([ceiling_spec(wgmma=True)] if arch in WGMMA_ARCHS else [])
    # Packed batches (varlen) have no Q-smoothing variants.
    for dp in PADDED_HEAD_DIMS:
        wide = dp > numerics.WIDE_HEAD_DIM
        try:
            wide_backward = wide and bool(backward_kernel(dp, "float16", AttentionOptions(), BackwardTiles(2), arch, limit))
        except ValueError:  # its shared memory exceeds the arch's
            wide_backward = False
        for dt in DTYPES:
            # Masks: none, causal, a sliding window; soft-capped causal and windowed
            # attention (granularity "fine", no Q-smoothing: AttentionOptions; the soft cap without a causal
            # mask takes the windowed kernels: options.band_test).
            for causal, window, cap in ((False, -1, 0.0), (True, -1, 0.0), (True, 1, 0.0), (True, -1, 1.0),
                                        (True, 1, 1.0)):
                for bias, varlen in ((False, False), (True, False), (False, True)):
                    if bias and (cap or wide):
                        continue
                    fwd = AttentionOptions(causal=causal, smooth_q=bias, window_left=window, softcap=cap)
                    specs.append(forward_spec(dp, dt, fwd, FORWARD_TILES[dp], varlen))
                    if wide:  # the mma.sync kernels, fine and not deterministic (the backward where it fits), and
                              # the wgmma ones (their backward deterministic too)
                        if wide_backward:
                            specs.append(backward_kernel(dp, dt, fwd, BackwardTiles(2), arch, limit, varlen)[1])
                        if arch in WGMMA_ARCHS:
                            specs.append(forward_spec(dp, dt, fwd, wide_forward_tiles(narrow_value_dim(fwd, dp)), varlen))
                            if window < 0 and not cap and not varlen:  # (V wider than 192 columns: forward_ws_tiles)
                                specs.append(forward_ws_spec(dp, dt, fwd, ws_forward_shape(dp), varlen))
                            for cols in NARROW_VALUE_COLS:  # (the plain masks only: narrow_value_dim)
                                if narrow_value_dim(fwd, cols):
                                    specs.append(forward_spec(dp, dt, fwd, wide_forward_tiles(cols), varlen))
                            wide_tiles = backward_tiles(dp, arch)
                            specs.append(backward_kernel(dp, dt, fwd, wide_tiles, arch, limit, varlen)[1])
                            det = fwd._replace(deterministic=True)
                            if wide_refusal(dp, det) is None:  # (the same tiles)
                                specs.append(backward_kernel(dp, dt, det, wide_tiles, arch, limit, varlen)[1])
                            for cols in NARROW_VALUE_COLS:  # (the plain masks only)
                                # (the pair kernel, its phase-specialized form, or the two passes)
                                for pair, phases in ((True, False), (True, True), (False, False)):
                                    narrow = narrow_backward_tiles(wide_tiles, dp, NARROW_QK_COLS, cols, fwd, pair, phases)
                                    spec = backward_kernel(dp, dt, fwd, narrow, arch, limit, varlen)[1]
                                    if narrow != wide_tiles and spec not in specs:
                                        specs.append(spec)
                        continue
                    if arch in WGMMA_ARCHS:
                        for key_tile in (64, 128):
                            specs.append(forward_spec(dp, dt, fwd, ForwardTiles(4, 1, True, key_tile), varlen))
                        if not bias and window < 0 and not cap:  # (one kernel serves a persistent grid too)
                            specs.append(forward_ws_spec(dp, dt, fwd, ws_forward_shape(dp), varlen))
                    for granularity in ("fine",) if cap else ("fine", "paper"):
                        for det in (False, True):
                            bwd = fwd._replace(granularity=granularity, deterministic=det)
                            specs.append(backward_kernel(dp, dt, bwd, BackwardTiles(2), arch, limit, varlen)[1])
                            if arch in WGMMA_ARCHS:
                                wg = backward_tiles(dp, arch, det)
                                spec = backward_kernel(dp, dt, bwd, wg, arch, limit, varlen)[1]
                                if spec not in specs:  # (backward_kernel keeps some on mma.sync: deterministic d=128 windows)
                                    specs.append(spec)
                                if granularity == "fine" and not det and not bias and window < 0 and not cap and not varlen:
                                    # SAGEBWD_BACKWARD_WS=1: the producer warpgroup's variant (opt-in), its plain masks
                                    ws = dataclasses.replace(wg, ws=True, dq_tiles=dq_tiles_for(True))
                                    specs.append(backward_kernel(dp, dt, bwd, ws, arch, limit, varlen)[1])
                                if dp == 128 and not det:
                                    # SAGEBWD_BACKWARD_QUAD=1: four warpgroups (opt-in); backward_kernel says which
                                    # options take them (the others fall back to the spec listed above)
                                    quad = BackwardTiles(stages=2, wgmma=True, quad=True)
                                    spec = backward_kernel(dp, dt, bwd, quad, arch, limit, varlen)[1]
                                    if spec not in specs:
                                        specs.append(spec)
    return specs


def all_specs_many(archs, *, jobs: int = 1) -> dict:
    """``{arch: all_specs(arch)}``, the archs listed in ``jobs`` processes at once: listing compiles
    the kernels whose tiles are read back from a compiled layout, which fills the disk cache."""
    archs = list(dict.fromkeys(archs))
    if jobs <= 1 or len(archs) <= 1:
        return {arch: all_specs(arch) for arch in archs}
    with compiler.spawn_pool(min(jobs, len(archs))) as pool:
        return dict(zip(archs, pool.map(all_specs, archs)))
