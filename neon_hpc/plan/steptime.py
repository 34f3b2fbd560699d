"""Trainer step time for one batch of trajectory lengths.

The work of a step is the balancer's cost model (``a*n + b*n^2`` FLOPs per sequence) laid out
over DP x PP x CP by the balancer (``neon_hpc.balance.assign_step``), whose makespan
is the slowest DP rank's 1F1B pipeline time with each micro-batch shared by its CP group:
FLOPs that one (pipeline stage, CP rank) cell does, bubbles included.  Such a cell is
``train_gpus / (dp * pp * cp)`` GPUs (its TP/EP width), so the makespan becomes seconds at
that many GPUs x ``gpu_flops * mfu``.  The perfect-balance, bubble-free bound is
``sum(cost) / (dp * pp * cp)`` in the same unit.  Plus a fixed per-step overhead
(optimizer, gradient reduction) and, outside this class, the weight publish.

Running the balancer on every one of 10,000 simulated steps of 512 trajectories would cost
more than the whole simulation, so with ``balance_every = N`` it runs on every N-th step and
the steps between use the perfect-balance bound ``sum(cost) / dp`` times the balancer's last
makespan/bound ratio.  Without the balancer in this checkout a local fallback uses the same
cost formula and the bound alone (perfect balance for ``cost``; the longest whole sequence
(split over CP) as a floor for ``tokenkk``/``sequential``), plus the 1F1B bubble.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from neon_hpc.plan.params import SimParams

# The balancer plans at most this many sequences of a batch (the first ones) for its makespan/bound
# ratio: a larger batch balances at least as well, so its step is overestimated a little (Kimi tp8
# pp8 cp4: 1.047 planned on 2,048, 1.025 on 4,096), and a call stays ~2 s instead of ~8 s at 4,096.
RATIO_BATCH = 2048


def _balancer() -> tuple[Any, Any] | None:
    try:
        # deferred: optional (neon_hpc.balance: without it the cost bound)
        from neon_hpc.balance import CostModel, assign_step  # type: ignore[attr-defined]
    except ImportError:
        return None
    return CostModel, assign_step


class StepTimeModel:
    def __init__(self, p: SimParams, use_balancer: bool = True, ratio: float | None = None):
        """``ratio``: a makespan/bound ratio the balancer already gave for this layout and batch
        size (a sweep reuses it instead of planning again)."""
        self.p = p
        self.cells = max(p.dp, 1) * max(p.pp, 1) * max(p.cp, 1)
        self.flops_per_s_per_cell = p.train_flops_per_s / self.cells
        bal = _balancer() if use_balancer and p.fixed_step_s <= 0 and (p.cost_a > 0 or p.cost_b > 0) else None
        self.source = "neon_hpc.balance.assign_step" if bal else "plan fallback (cost bound)"
        self._assign_step = bal[1] if bal else None
        self._cost = bal[0](a=p.cost_a, b=p.cost_b, source="plan") if bal else None
        self._ratio = 1.0 if ratio is None else float(ratio)
        self._calls = 0
        self._fixed = ratio is not None             # a given ratio: the balancer is not run
        self.balance_calls = 0

    def bound_flops(self, lengths: np.ndarray) -> float:
        """Perfect balance, no pipeline bubble: sum of sequence costs / (dp * pp * cp)."""
        n = np.asarray(lengths, dtype=np.float64)
        return float(self.p.cost_a * n.sum() + self.p.cost_b * (n * n).sum()) / self.cells

    def compute_seconds(self, lengths: np.ndarray) -> float:
        """Forward+backward seconds of the slowest DP rank for this batch."""
        p = self.p
        if p.fixed_step_s > 0:
            return p.fixed_step_s
        if p.cost_a <= 0 and p.cost_b <= 0:
            return 0.0
        bound = self.bound_flops(lengths)
        if self._assign_step is not None:
            if not self._fixed and self._calls % p.balance_every == 0:
                self._ratio = self.planned_ratio(lengths)
            self._calls += 1
            return bound * self._ratio / self.flops_per_s_per_cell
        return self._fallback_flops(lengths, bound) / self.flops_per_s_per_cell

    def planned_ratio(self, lengths: np.ndarray) -> float:
        """The balancer's makespan/bound ratio for one batch (1 without the balancer), planned on
        its first :data:`RATIO_BATCH` sequences."""
        if self._assign_step is None:
            return 1.0
        lengths = np.asarray(lengths, dtype=np.float64)[:RATIO_BATCH]
        bound = self.bound_flops(lengths)
        return self._planned_flops(lengths) / bound if bound > 0 else 1.0

    @property
    def ratio(self) -> float:
        """The balancer's last makespan/bound ratio (1 before it ran, or without it)."""
        return self._ratio

    def step_seconds(self, lengths: np.ndarray) -> float:
        return self.compute_seconds(lengths) + (0.0 if self.p.fixed_step_s > 0 else self.p.step_overhead_s)

    def _planned_flops(self, lengths: np.ndarray) -> float:
        p = self.p
        self.balance_calls += 1
        asg = self._assign_step([int(x) for x in lengths], dp=p.dp, pp_microbatches=p.pp, cp=p.cp,
                               token_cap=p.token_cap, cost=self._cost, method=p.balance_method,
                               shadow=False, check=False, vpp=p.vpp if p.pp > 1 else 1)
        return float(asg.makespan)

    def _fallback_flops(self, lengths: np.ndarray, bound: float) -> float:
        p = self.p
        n = np.asarray(lengths, dtype=np.float64)
        work = bound
        if p.balance_method != "cost" and len(n):
            longest = float(p.cost_a * n.max() + p.cost_b * n.max() ** 2) / max(p.cp, 1)
            work = max(work, longest)
        if p.pp > 1:
            microbatches = max(1.0, math.ceil(n.sum() / max(p.dp, 1) / max(p.token_cap, 1)))
            work *= (microbatches + p.pp - 1) / microbatches
        return work
