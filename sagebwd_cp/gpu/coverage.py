"""A covering set of specializations: the compile check that fits CI's time.

Compiling every specialization once takes about four minutes on two cores (~700 of them at ~0.6 s,
most of it NVVM's optimizer). Spills and compile failures come from options that meet in one
kernel (a mask with soft-capping and determinism at a head dim, say), so a set in which every
option word of the keys (head dim, dtype, mask, smoothing, granularity, determinism, tiles,
packed) and its absence (dense batches are keys without ``varlen``), alone, in pairs and in triples,
appears in some compiled specialization of each kernel family (the key's first word) and arch checks
what the full set would, in a quarter of the compiles.
``compile --all-archs`` (every specialization, every arch) stays the check a kernel change runs.
"""
from __future__ import annotations

import collections
import heapq
import itertools

DEPTH = 3  # options that must meet in some compiled specialization: singles, pairs and triples


def _vocabularies(pairs) -> dict:
    """{(family, arch): every option word its keys use}."""
    vocab = collections.defaultdict(set)
    for spec, arch in pairs:
        family, *words = spec.key.split(".")
        vocab[family, arch].update(words)
    return vocab


def _units(key: str, arch: str, vocab: dict, depth: int) -> frozenset:
    """The combinations of up to ``depth`` option words, present or absent (``no-`` + the word), of one key."""
    family, *words = key.split(".")
    words = sorted({*words, *("no-" + w for w in vocab[family, arch].difference(words))})
    return frozenset((family, arch, *combo) for n in range(depth + 1)
                     for combo in itertools.combinations(words, n))


def covering_pairs(pairs, depth: int = DEPTH) -> list:
    """A subset of ``(spec, arch)`` pairs, in their order, that covers every family's option combinations
    of up to ``depth`` words (greedy: the pair that covers most of what is left first, ties by order)."""
    pairs = list(pairs)
    vocab = _vocabularies(pairs)
    units = [_units(spec.key, arch, vocab, depth) for spec, arch in pairs]
    left = set().union(*units)
    heap = [(-len(u), i) for i, u in enumerate(units)]
    heapq.heapify(heap)
    chosen = []
    while left:
        _, i = heapq.heappop(heap)
        gain = len(units[i] & left)
        if heap and gain < -heap[0][0]:  # its count went stale: back in, at what it still covers
            heapq.heappush(heap, (-gain, i))
            continue
        chosen.append(i)
        left -= units[i]
    return [pairs[i] for i in sorted(chosen)]
