"""k-way Karmarkar-Karp (largest differencing method) on item weights.

The baselines use it the way verl does (token counts) and on FLOP costs.  Partitions are
kept sparse: a partial solution stores only its non-empty subsets, so merging two partial
solutions whose subsets fit side by side is a concatenation, and only the overlap of two
full ones is summed pairwise (largest of one with smallest of the other).  Deterministic:
ties break on insertion order.
"""

from __future__ import annotations

import bisect
import heapq
from operator import itemgetter
from typing import Sequence

import numpy as np

# from this many parts on, partial solutions are numpy arrays. The lists' merge has fast paths for
# what dominates a balancing method's packing (one subset joining a full partition, a concatenation already
# in order), so below this they are faster: 1,952 FLOP costs into 316 parts 6.5 ms vs 18.6 ms,
# 8,192 uniform weights into 1,024 41 vs 56 ms, 16,384 into 4,096 152 vs 216 ms (the same partitions)
VECTOR_FROM_K = 4096
_SUM = itemgetter(0)          # a subset's sum
_NEG_SUM = lambda s: -s[0]     # noqa: E731  (a largest-first list is ascending in it)


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
        if a[-1][0] >= b[0][0]:          # already largest first (what the stable sort would keep)
            return out
    elif nb == 1 and na == k:            # the common case: b's one subset joins a's smallest, and
        x = a[-1]                        # moves up past every subset smaller than it (ties stay first)
        y = b[0]
        merged = (x[0] + y[0], x[1] + y[1])
        out = a[:-1]
        out.insert(bisect.bisect_right(out, -merged[0], key=_NEG_SUM), merged)
        return out
    else:
        # pad conceptually to k and pair a[i] with b[k-1-i]: a's first k - nb alone, then the
        # overlap summed, then the rest of b (reversed) alone
        lo = k - nb
        rb = b[::-1]
        out = a[:lo] + [(x[0] + y[0], x[1] + y[1]) for x, y in zip(a[lo:na], rb)] + rb[na - lo:]
    out.sort(key=_SUM, reverse=True)     # largest first; stable, ties keep their order
    return out


def _karmarkar_karp_np(w: np.ndarray, k: int) -> list[list[int]]:
    """The same differencing, with subsets as node ids in a merge forest: leaves are items,
    a summed pair becomes a new node; the final subsets' labels flow down to the leaves."""
    n = len(w)
    merges: list[tuple[int, np.ndarray, np.ndarray]] = []   # (first new id, left ids, right ids)
    next_id = n
    heap: list = [(-x, i, np.array([x]), np.array([i])) for i, x in enumerate(w.tolist())]
    heapq.heapify(heap)
    counter = n
    pop, push, empty, arange, argsort = heapq.heappop, heapq.heappush, np.empty, np.arange, np.argsort
    while len(heap) > 1:
        _, _, sa, ia = pop(heap)
        _, _, sb, ib = pop(heap)
        na, nb = len(sa), len(sb)
        if na + nb <= k:
            sums = np.concatenate((sa, sb))
            ids = np.concatenate((ia, ib))
            if sa[-1] >= sb[0]:           # already largest first: the stable sort keeps it
                push(heap, (-(float(sums[0]) - (float(sums[-1]) if na + nb == k else 0.0)), counter, sums, ids))
                counter += 1
                continue
        elif nb == 1 and na == k:         # b's one subset joins a's smallest (as below) and moves up past
            x = float(sa[-1]) + float(sb[0])   # every subset smaller than it; ties stay first
            j = k - 1 - int(np.searchsorted(sa[-2::-1], x, side="left")) if k > 1 else 0
            sums = np.concatenate((sa[:j], (x,), sa[j:-1]))
            ids = np.concatenate((ia[:j], (next_id,), ia[j:-1]))
            merges.append((next_id, ia[-1:], ib))
            next_id += 1
            push(heap, (-(float(sums[0]) - float(sums[-1])), counter, sums, ids))
            counter += 1
            continue
        else:
            # pair a[i] with b[k-1-i] (as in _merge): positions [0, lo) a's alone, [lo, na)
            # summed (new node ids), [na, k) the rest of b reversed
            lo = k - nb
            m = na - lo
            rb, rib = sb[::-1], ib[::-1]
            sums = empty(k)
            ids = empty(k, dtype=np.int64)
            sums[:lo] = sa[:lo]
            ids[:lo] = ia[:lo]
            np.add(sa[lo:], rb[:m], out=sums[lo:na])
            ids[lo:na] = arange(next_id, next_id + m)
            sums[na:] = rb[m:]
            ids[na:] = rib[m:]
            merges.append((next_id, ia[lo:], rib[:m]))
            next_id += m
        order = argsort(-sums, kind="stable")
        sums, ids = sums[order], ids[order]
        spread = float(sums[0]) - (float(sums[-1]) if len(sums) == k else 0.0)
        push(heap, (-spread, counter, sums, ids))
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
