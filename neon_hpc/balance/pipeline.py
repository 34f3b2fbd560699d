"""Pipeline step time of one DP rank: the balancer's closed form and the schedule it models.

The balancer charges a DP rank with micro-batch costs ``t_j`` (the whole model's forward +
backward of micro-batch ``j``) on ``p`` stages with ``V`` model chunks per stage
(``train.virtual_pipeline_stages``)::

    T = max( (sum_j t_j + (p - 1) / V * max_j t_j) / p ,  max_j t_j )

The first term is megatron's 1F1B (V = 1) or interleaved 1F1B (V > 1): every stage does
``sum t / p`` of work, and warm-up plus cool-down idle for ``p - 1`` *chunk* steps, each
``1 / V`` of a stage's share of a micro-batch (the slowest one's, a bound).  The second is a
floor: one micro-batch's forward runs through every virtual stage before its backward can
start, so the step lasts at least the slowest micro-batch (V = 1 never goes under it).

For equal micro-batches ``T`` is exact for the order megatron-core 0.16.1 runs
(:func:`simulate`, which plays that order event by event: warm-up forwards, then one forward
and one backward per step, then the cool-down backwards; tested).  For unequal ones it is an
estimate: the order of the schedule lets one slow micro-batch hold up several stages, which no
closed form in ``sum`` and ``max`` sees (measured against :func:`simulate` on random cases with
p <= 4, V <= 4: 0.86-1.85x at V = 1, 0.96-1.94x at V > 1; the README has the numbers).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# the forward's share of a micro-batch's forward + backward (the backward is two matmuls per
# forward one: the cost model's 3x), used by the simulation only
FORWARD_SHARE = 1.0 / 3.0


def pipeline_time(mb_costs: Sequence[float], pp_stages: int, vpp: int = 1) -> float:
    """Predicted step time of one DP rank (the closed form above)."""
    if not len(mb_costs):
        return 0.0
    total, top = float(sum(mb_costs)), float(max(mb_costs))
    return float(combine(total, top, pp_stages, vpp))


def combine(total, top, pp_stages: int, vpp: int = 1):
    """``T`` from the sum and the max of a rank's micro-batch costs (floats or numpy arrays)."""
    if pp_stages == 1:
        return total
    t = (total + (pp_stages - 1) / vpp * top) / pp_stages
    return t if vpp == 1 else np.maximum(t, top)


def microbatch_group_size(n: int, pp: int) -> int:
    """Micro-batches per virtual-stage group for the interleaved schedule with ``n`` micro-batches.

    megatron-core 0.16.1 needs the group size ``g`` in ``[pp, n]`` and ``n % g`` either 0 or
    ``>= pp``; its default ``g = pp`` then needs ``n % pp == 0``.  The balancer's micro-batch
    count is whatever the step's data gives (at least ``pp``), so this picks the smallest valid
    ``g`` (``pp`` whenever ``n % pp == 0``: megatron's depth-first schedule; always some ``g <= n``).
    """
    if n < pp:
        raise ValueError(f"the interleaved schedule needs at least pipeline_parallel={pp} micro-batches, "
                         f"the assignment has {n} (balance.min_microbatches below train.pipeline_parallel?)")
    return next(g for g in range(pp, n + 1) if n % g == 0 or n % g >= pp)


def schedule_order(n: int, pp: int, vpp: int, rank: int, group: int | None = None) -> list[tuple[str, int, int]]:
    """The order pipeline stage ``rank`` runs its work in: ``("F" | "B", micro-batch, chunk)``.

    As megatron-core 0.16.1's schedules do it: V = 1 (``..._without_interleaving``) runs
    ``pp - rank - 1`` warm-up forwards; V > 1 (``..._with_interleaving``) runs
    ``2 * (pp - rank - 1) + (V - 1) * group`` of them (``get_pp_rank_microbatches``), in the
    order of ``get_schedule_table`` (each group of ``group`` micro-batches through chunk 0,
    then chunk 1, ...), its backwards in the same order with the chunk reversed; then one
    forward and one backward per step; then the remaining backwards.
    """
    if vpp == 1:
        table = [(j, 0) for j in range(n)]
        warm = min(pp - rank - 1, n)
    else:
        g = group if group is not None else microbatch_group_size(n, pp)
        table = []
        for lo in range(0, n, g):
            hi = n if lo + g >= n else lo + g
            table += [(j, c) for c in range(vpp) for j in range(lo, hi)]
        warm = min(2 * (pp - rank - 1) + (vpp - 1) * g, len(table))
    total = len(table)
    back = [(j, vpp - 1 - c) for j, c in table]
    ops = [("F", *table[k]) for k in range(warm)]
    for k in range(total - warm):
        ops += [("F", *table[k + warm]), ("B", *back[k])]
    ops += [("B", *back[k]) for k in range(total - warm, total)]
    return ops


def simulate(mb_costs: Sequence[float], pp_stages: int, vpp: int = 1, group: int | None = None,
             forward_share: float = FORWARD_SHARE) -> float:
    """Play :func:`schedule_order` on every stage, event by event, and return when the last
    stage finishes.  Micro-batch ``j``'s forward of one virtual stage (chunk ``c`` of stage
    ``r`` is virtual stage ``c * pp + r``) takes ``forward_share * t_j / (pp * V)``, its
    backward the rest; a forward waits for the previous virtual stage's forward of that
    micro-batch, a backward for its own forward and the next virtual stage's backward; each
    stage runs its list in order, one thing at a time.  Transfers take no time."""
    n, p, v = len(mb_costs), pp_stages, vpp
    if n == 0:
        return 0.0
    stages = p * v
    ops = [schedule_order(n, p, v, r, group) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    while any(pos[r] < len(ops[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(ops[r]):
                kind, j, c = ops[r][pos[r]]
                s = c * p + r
                if kind == "F":
                    deps = [("F", j, s - 1)] if s > 0 else []
                else:
                    deps = [("F", j, s)] + ([("B", j, s + 1)] if s < stages - 1 else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                share = forward_share if kind == "F" else 1.0 - forward_share
                free[r] = start + float(mb_costs[j]) * share / stages
                done[(kind, j, s)] = free[r]
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"pipeline schedule deadlocks: pp={p} vpp={v} n={n}")
    return max(free)
