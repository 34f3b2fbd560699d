"""Context parallelism inside one micro-batch: which tokens each of the ``cp`` ranks holds.

A piece at least ``threshold`` tokens long is cut into ``2*cp`` equal-token chunks and CP
rank ``q`` takes chunks ``q`` and ``2*cp-1-q`` (early + late, Megatron's zigzag): under
causal attention the pairs cost the same, so the long documents load every CP rank
evenly.  Shorter pieces stay whole (no K/V exchange for them) and go, largest first, to
the CP rank with the least cost so far; if that leaves the CP ranks more than
``CP_TOLERANCE`` apart, the largest whole piece is zigzagged too, and so on.  Deterministic.
"""

from __future__ import annotations

from typing import Sequence

from neon_hpc.balance.assignment import Piece
from neon_hpc.balance.cost import CostModel

# beyond this spread between CP ranks, long-enough pieces below the threshold are zigzagged too
CP_TOLERANCE = 0.02


def zigzag_bounds(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous equal-token chunks of ``[start, end)`` (sizes differ by <= 1)."""
    n = end - start
    return [(start + (i * n) // parts, start + ((i + 1) * n) // parts) for i in range(parts)]


def zigzag_pairs(start: int, end: int, k: int) -> list[list[tuple[int, int]]]:
    """Cut ``[start, end)`` into ``2k`` chunks; unit ``u`` = chunks ``u`` and ``2k-1-u``
    (empty chunks dropped)."""
    b = zigzag_bounds(start, end, 2 * k)
    units = []
    for u in range(k):
        pair = [b[u], b[2 * k - 1 - u]]
        units.append([(s, e) for s, e in pair if e > s])
    return units


def auto_threshold(token_cap: int, cp: int) -> int:
    """Default: split a piece across the CP group once it is over half a CP rank's share."""
    return max(2 * cp, token_cap // (2 * cp))


def cp_shards(pieces: Sequence, cost: CostModel, cp: int, threshold: int = 0,
              images: Sequence[int] | None = None):
    """Per CP rank, the pieces (``Piece(seq, start, end)``) it computes."""
    shards, _ = _assign(pieces, cost, cp, threshold, images)
    return [[Piece(*x) for x in shard] for shard in shards]


def cp_shard_costs(pieces: Sequence, cost: CostModel, cp: int, threshold: int = 0,
                   images: Sequence[int] | None = None) -> list[float]:
    return _assign(pieces, cost, cp, threshold, images)[1]


def piece_cost(cost: CostModel, seq: int, start: int, end: int,
               images: Sequence[int] | None = None) -> float:
    """A piece's cost; a sequence's images are encoded with the piece holding its first token."""
    c = cost.chunk_cost(start, end)
    if images is not None and start == 0 and cost.image_cost:
        c += cost.image_cost * images[seq]
    return c


def _assign(pieces, cost: CostModel, cp: int, threshold: int, images=None):
    """Zigzag the long pieces, spread the others largest first; while the CP ranks stay
    more than ``CP_TOLERANCE`` apart, zigzag the largest piece still whole as well."""
    entries = sorted(((piece_cost(cost, p[0], p[1], p[2], images), p[0], p[1], p[2]) for p in pieces),
                     key=lambda x: (-x[0], x[1], x[2]))
    if cp == 1:
        return [[(s, a, b) for _, s, a, b in entries]], [sum(x[0] for x in entries)]
    zig = [x for x in entries if threshold and x[3] - x[2] >= max(threshold, 2 * cp)]
    whole = [x for x in entries if x not in zig]
    while True:
        shards, loads = _spread(zig, whole, cost, cp, images)
        mean = sum(loads) / cp
        splittable = [x for x in whole if x[3] - x[2] >= 2 * cp]
        if not splittable or max(loads) <= mean * (1 + CP_TOLERANCE):
            return shards, loads
        zig.append(splittable[0])
        whole.remove(splittable[0])


def _spread(zig, whole, cost, cp, images):
    shards: list[list[tuple[int, int, int]]] = [[] for _ in range(cp)]
    loads = [0.0] * cp
    for _, seq, s, e in zig:
        for q, unit in enumerate(zigzag_pairs(s, e, cp)):
            for a, b in unit:
                shards[q].append((seq, a, b))
                loads[q] += piece_cost(cost, seq, a, b, images)
    for c, seq, s, e in whole:
        q = min(range(cp), key=lambda i: (loads[i], i))
        shards[q].append((seq, s, e))
        loads[q] += c
    return shards, loads
