"""k-way Karmarkar-Karp (largest differencing method) on item weights.

The baselines use it the way verl does (token counts) and on FLOP costs.  Partitions are
kept sparse: a partial solution stores only its non-empty subsets, so merging two partial
solutions whose subsets fit side by side is a concatenation, and only the overlap of two
full ones is summed pairwise (largest of one with smallest of the other).  Deterministic:
ties break on insertion order.
"""

from __future__ import annotations

import heapq
from typing import Sequence


def karmarkar_karp(weights: Sequence[float], k: int) -> list[list[int]]:
    """Partition item indices into ``k`` lists with near-equal weight sums (list order by
    sum, largest first; a list may be empty when there are fewer items than ``k``)."""
    if k < 1:
        raise ValueError(f"karmarkar_karp: k must be >= 1, got {k}")
    if not len(weights):
        return [[] for _ in range(k)]
    heap: list = []
    counter = 0
    for i, w in enumerate(weights):
        # subsets: list of (sum, members) sorted by sum descending; only non-empty ones
        heapq.heappush(heap, (-float(w), counter, [(float(w), [i])]))
        counter += 1
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = _merge(a, b, k)
        heapq.heappush(heap, (-_spread(merged, k), counter, merged))
        counter += 1
    subsets = heap[0][2]
    parts = [sorted(m) for _, m in subsets]
    return parts + [[] for _ in range(k - len(parts))]


def _spread(subsets, k) -> float:
    lo = subsets[-1][0] if len(subsets) == k else 0.0
    return subsets[0][0] - lo


def _merge(a, b, k):
    na, nb = len(a), len(b)
    if na + nb <= k:
        out = a + b
    else:
        # pad conceptually to k; pair a[i] with b[k-1-i]
        out = []
        for i in range(k):
            j = k - 1 - i
            x = a[i] if i < na else None
            y = b[j] if j < nb else None
            if x is None:
                out.append(y)
            elif y is None:
                out.append(x)
            else:
                out.append((x[0] + y[0], x[1] + y[1]))
    out.sort(key=lambda s: -s[0])
    return out
