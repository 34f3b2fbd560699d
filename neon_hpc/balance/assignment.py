"""The assignment of one training step: which pieces of which sequences each DP rank runs, in
which micro-batch, and what that is predicted to cost.

Shape: ``asg.ranks[r][j]`` is micro-batch ``j`` of DP rank ``r``, a list of
:class:`Piece` ``(seq, start, end)``: tokens ``[start, end)`` of sequence ``seq`` (an
index into the ``lengths`` given to :func:`assign_step`).  A whole sequence is the piece
``(i, 0, n_i)``.  Every rank has the same number of micro-batches (``num_microbatches``;
expert-parallel all-to-alls need every rank to run the same number of forward passes); a
micro-batch may be empty when a rank has less work than slots.

Split sequences: a sequence too long or too costly for one micro-batch is cut into
``2k`` equal-token chunks and spread over ``k`` *different* DP ranks, each getting the
zigzag pair (chunk ``u``, chunk ``2k-1-u``) in the *same* micro-batch slot ``j``, so the
``k`` ranks run it together like a context-parallel group (they exchange K/V of the
prefix).  Each pair has the same tokens and, under the cost model, the same cost.

Predicted time of a rank under a 1F1B pipeline of ``p`` stages with micro-batch costs
``t_j`` (the whole model's forward + backward of micro-batch ``j``):
``(sum_j t_j + (p - 1) * max_j t_j) / p``: every micro-batch passes every stage, and the
warm-up and drain bubbles last as long as the slowest micro-batch's stage time.  With ``V``
virtual stages (interleaved 1F1B) the bubbles are ``V`` times shorter, and the step lasts at
least ``max_j t_j`` (:mod:`neon_hpc.balance.pipeline`, with the schedule it models).
With ``cp > 1`` a micro-batch is shared by a CP group; its time is the slowest CP rank's
share (see :mod:`neon_hpc.balance.cp`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from neon_hpc.balance.cost import CostModel
from neon_hpc.balance.pipeline import pipeline_time


class Piece(NamedTuple):
    seq: int
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


Microbatch = list  # list[Piece]


@dataclass
class StepAssignment:
    method: str
    lengths: tuple[int, ...]
    cost: CostModel
    dp: int
    pp_stages: int
    cp: int
    token_cap: int
    cp_split_threshold: int
    ranks: list[list[Microbatch]]
    rank_time: list[float] = field(default_factory=list)
    makespan: float = 0.0
    imbalance: float = 1.0
    shadow: dict[str, float] = field(default_factory=dict)          # other method -> makespan
    shadow_imbalance: dict[str, float] = field(default_factory=dict)  # other method -> max/mean
    oversize: list[int] = field(default_factory=list)   # sequences in a micro-batch over the cap
    chosen_from: str = ""                                # which candidate won (cost method)
    method_s: float = 0.0
    images: tuple[int, ...] | None = None
    vpp: int = 1                                         # virtual pipeline stages (model chunks per stage)

    # ---- shape ----------------------------------------------------------------------------
    @property
    def num_microbatches(self) -> int:
        return len(self.ranks[0]) if self.ranks else 0

    def microbatch_tokens(self, r: int, j: int) -> int:
        return sum(p.end - p.start for p in self.ranks[r][j])

    def split_sequences(self) -> dict[int, list[tuple[int, int, Piece]]]:
        """Sequences cut into pieces: seq -> [(rank, micro-batch, piece), ...]."""
        seen: dict[int, list] = {}
        for r, mbs in enumerate(self.ranks):
            for j, mb in enumerate(mbs):
                for p in mb:
                    seen.setdefault(p.seq, []).append((r, j, p))
        return {s: v for s, v in seen.items()
                if len(v) > 1 or v[0][2].start != 0 or v[0][2].end != self.lengths[s]}

    def whole_sequences(self, r: int) -> list[list[int]]:
        """Per micro-batch of rank ``r``, the indices of the sequences it holds whole
        (for a trainer that only runs whole sequences; split pieces are left out)."""
        return [[p.seq for p in mb if p.start == 0 and p.end == self.lengths[p.seq]]
                for mb in self.ranks[r]]

    # ---- costs ------------------------------------------------------------------------------
    def microbatch_cost(self, r: int, j: int) -> float:
        return microbatch_cost(self.ranks[r][j], self.cost, self.cp, self.cp_split_threshold,
                               self.images)

    def cp_shards(self, r: int, j: int) -> list[list[Piece]]:
        """Micro-batch ``j`` of rank ``r``, per CP rank (zigzag for long pieces)."""
        from neon_hpc.balance.cp import cp_shards  # deferred: cycle (neon_hpc.balance.cp imports this module)
        return cp_shards(self.ranks[r][j], self.cost, self.cp, self.cp_split_threshold, self.images)

    def speedup_vs(self, method: str) -> float:
        return self.shadow[method] / self.makespan if self.makespan else 1.0

    def summary(self) -> dict:
        """Small JSON-able record for metrics.jsonl."""
        return {
            "method": self.method, "chosen_from": self.chosen_from, "dp": self.dp,
            "pp_stages": self.pp_stages, "vpp": self.vpp, "cp": self.cp, "token_cap": self.token_cap,
            "microbatches": self.num_microbatches, "sequences": len(self.lengths),
            "split_sequences": len(self.split_sequences()), "oversize": list(self.oversize),
            "makespan": self.makespan, "imbalance": self.imbalance,
            "shadow": dict(self.shadow), "shadow_imbalance": dict(self.shadow_imbalance),
            "method_s": self.method_s,
        }

    def to_dict(self) -> dict:
        d = self.summary()
        d["ranks"] = [[[list(p) for p in mb] for mb in mbs] for mbs in self.ranks]
        d["rank_time"] = list(self.rank_time)
        return d


def microbatch_cost(pieces: Sequence[Piece], cost: CostModel, cp: int = 1,
                    cp_split_threshold: int = 0, images: Sequence[int] | None = None) -> float:
    """Predicted forward + backward time of one micro-batch (slowest CP rank when ``cp > 1``)."""
    # deferred: cycle (neon_hpc.balance.cp imports this module)
    from neon_hpc.balance.cp import cp_shard_costs, piece_cost
    if not pieces:
        return 0.0
    if cp > 1:
        return max(cp_shard_costs(pieces, cost, cp, cp_split_threshold, images)) + cost.mb_overhead
    return sum(piece_cost(cost, p[0], p[1], p[2], images) for p in pieces) + cost.mb_overhead


def score(asg: StepAssignment) -> StepAssignment:
    """Fill in ``rank_time``, ``makespan`` and ``imbalance`` from the asg of pieces to ranks."""
    times = []
    for r, mbs in enumerate(asg.ranks):
        costs = [asg.microbatch_cost(r, j) for j in range(len(mbs))]
        times.append(pipeline_time(costs, asg.pp_stages, asg.vpp))
    asg.rank_time = times
    asg.makespan = max(times) if times else 0.0
    mean = float(np.mean(times)) if times else 0.0
    asg.imbalance = asg.makespan / mean if mean > 0 else 1.0
    return asg


def check_assignment(asg: StepAssignment) -> None:
    """Raise ``ValueError`` unless every token of every sequence is assigned exactly once,
    the pieces of a split sequence sit in one micro-batch slot, and all ranks have the
    same number of micro-batches.  (Two pieces of one sequence may share a rank: they then
    share its micro-batch.)  Cheap enough to run on every step."""
    n_mb = asg.num_microbatches
    covered: dict[int, list[tuple[int, int]]] = {}
    slots: dict[int, set] = {}
    for r, mbs in enumerate(asg.ranks):
        if len(mbs) != n_mb:
            raise ValueError(f"assignment: rank {r} has {len(mbs)} micro-batches, rank 0 has {n_mb}")
        for j, mb in enumerate(mbs):
            for p in mb:
                if not (0 <= p.seq < len(asg.lengths)) or not (0 <= p.start < p.end <= asg.lengths[p.seq]):
                    raise ValueError(f"assignment: rank {r} micro-batch {j}: bad piece {p}")
                covered.setdefault(p.seq, []).append((p.start, p.end))
                slots.setdefault(p.seq, set()).add(j)
    for s, n in enumerate(asg.lengths):
        if n == 0:
            continue
        spans = sorted(covered.get(s, []))
        pos = 0
        for a, b in spans:
            if a != pos:
                raise ValueError(f"assignment: sequence {s} (length {n}): tokens from {pos} "
                                 f"{'missing' if a > pos else 'assigned twice'}")
            pos = b
        if pos != n:
            raise ValueError(f"assignment: sequence {s} (length {n}): tokens from {pos} missing")
        if len(spans) > 1:
            if len(slots[s]) != 1:
                raise ValueError(f"assignment: split sequence {s} spans micro-batch slots {sorted(slots[s])}")
