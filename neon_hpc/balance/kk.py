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

import numpy as np


# from this many parts on, partial solutions are numpy arrays (the per-merge Python loop over
# k subsets dominates otherwise: seconds for 8k items into 1024 parts)
VECTOR_FROM_K = 256


def karmarkar_karp(weights: Sequence[float], k: int) -> list[list[int]]:
    """Partition item indices into ``k`` lists with near-equal weight sums (list order by
    sum, largest first; a list may be empty when there are fewer items than ``k``)."""
    if k < 1:
        raise ValueError(f"karmarkar_karp: k must be >= 1, got {k}")
    if not len(weights):
        return [[] for _ in range(k)]
    if k >= VECTOR_FROM_K:
        return _karmarkar_karp_np(np.asarray(weights, dtype=np.float64), k)
    return _karmarkar_karp_lists(weights, k)


def _karmarkar_karp_lists(weights: Sequence[float], k: int) -> list[list[int]]:
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


def _karmarkar_karp_np(w: np.ndarray, k: int) -> list[list[int]]:
    """The same differencing, with subsets as node ids in a merge forest: leaves are items,
    a summed pair becomes a new node; the final subsets' labels flow down to the leaves."""
    n = len(w)
    merges: list[tuple[int, np.ndarray, np.ndarray]] = []   # (first new id, left ids, right ids)
    next_id = n
    heap: list = []
    for i in range(n):
        heap.append((-float(w[i]), i, np.array([w[i]]), np.array([i])))
    heapq.heapify(heap)
    counter = n
    while len(heap) > 1:
        _, _, sa, ia = heapq.heappop(heap)
        _, _, sb, ib = heapq.heappop(heap)
        na, nb = len(sa), len(sb)
        if na + nb <= k:
            sums = np.concatenate([sa, sb])
            ids = np.concatenate([ia, ib])
        else:
            pa = np.zeros(k)
            pa[:na] = sa
            qa = np.full(k, -1, dtype=np.int64)
            qa[:na] = ia
            pb = np.zeros(k)
            pb[:nb] = sb
            qb = np.full(k, -1, dtype=np.int64)
            qb[:nb] = ib
            pb, qb = pb[::-1], qb[::-1]
            sums = pa + pb
            both = (qa >= 0) & (qb >= 0)
            ids = np.where(qa >= 0, qa, qb)
            m = int(both.sum())
            new = np.arange(next_id, next_id + m)
            merges.append((next_id, qa[both], qb[both]))
            ids[both] = new
            next_id += m
        order = np.argsort(-sums, kind="stable")
        sums, ids = sums[order], ids[order]
        spread = sums[0] - (sums[-1] if len(sums) == k else 0.0)
        heapq.heappush(heap, (-float(spread), counter, sums, ids))
        counter += 1
    _, _, sums, ids = heap[0]
    label = np.full(next_id, -1, dtype=np.int64)
    label[ids] = np.arange(len(ids))
    for first, lhs, rhs in reversed(merges):
        lab = label[first:first + len(lhs)]
        label[lhs] = lab
        label[rhs] = lab
    items = label[:n]
    parts = [[] for _ in range(k)]
    for i in np.argsort(items, kind="stable"):
        parts[int(items[i])].append(int(i))
    return parts
