"""``assign_step``: one step's sequences -> a :class:`~neon_hpc.balance.assignment.StepAssignment`.

Methods (all deterministic, metadata only):

``sequential``  Megatron-style: contiguous, equal-count blocks of sequences per DP rank, each
                block cut into equal-count consecutive micro-batches (more of them until each
                fits the token cap).
``tokenkk``     verl-style: Karmarkar-Karp on token counts across DP ranks, then again into
                ``ceil(tokens / cap)`` micro-batches per rank (more until each fits).
``flopkk``      the same on the cost model's cost: FLOP-balanced, but whole sequences only and
                blind to the pipeline's bubbles.
``cost``        ours (below): splits what no single micro-batch can balance, places split
                units in one micro-batch slot across distinct ranks, fills the rest largest-first
                under the pipeline time of each rank (1F1B or interleaved), then moves items off the slowest rank while
                that helps and, when every move overshoots, cuts a piece between the slowest and
                the fastest rank at the cost-even token.  On small problems it also scores the
                flopkk/tokenkk assignments and keeps the best, so its predicted step time is never
                worse than theirs there.

Baselines never split a sequence: one longer than the cap sits alone in its micro-batch and is
listed in ``assignment.oversize`` (ours splits it across DP ranks instead, and lists it only when
even ``dp`` pieces would not fit).
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Sequence

import numpy as np

from neon_hpc.balance.assignment import Piece, StepAssignment, check_assignment, score
from neon_hpc.balance.cost import CostModel
from neon_hpc.balance.cp import auto_threshold, zigzag_pairs
from neon_hpc.balance.kk import karmarkar_karp
from neon_hpc.balance.pipeline import combine

METHODS = ("cost", "tokenkk", "flopkk", "sequential")
# the cost method also scores the KK assignments as candidates when len(lengths) * dp is at most this
# (KK on 10k sequences x 1024 ranks takes seconds; at that size ours wins anyway)
CANDIDATE_LIMIT = 200_000
DEFAULT_TOKEN_CAP = 4096
# the refinement stops once the slowest rank is within this fraction of the mean
REFINE_TOLERANCE = 0.005
CAP_HEADROOM = 0.75
MAX_EXTRA_SLOTS = 3


def assign_step(lengths: Sequence[int], dp: int, pp_microbatches: int = 1, cp: int = 1,
              token_cap: int = DEFAULT_TOKEN_CAP, cost: CostModel | None = None,
              method: str = "cost", shadow: bool = True, *, pp_stages: int | None = None,
              images: Sequence[int] | None = None, cp_split_threshold: int = 0,
              split: bool = True, check: bool = True, vpp: int = 1) -> StepAssignment:
    """Plan one training step.

    ``lengths``: tokens per sequence (zero-length ones are ignored).  ``dp``: data-parallel
    ranks.  ``pp_microbatches``: the fewest micro-batches per DP rank (more when the cap
    needs them).  ``pp_stages``: pipeline stages for the 1F1B time model; defaults to
    ``pp_microbatches`` (the "PP size sets the micro-batch count" convention).  ``cp``:
    context-parallel ranks per micro-batch; ``cp_split_threshold`` the piece length from
    which a piece is zigzagged across them (0 = auto).  ``token_cap``: tokens per
    micro-batch of a DP rank (across its CP group).  ``cost``: defaults to the embedded
    model's FLOP cost.  ``shadow``: also run the other methods and report their
    predicted makespans in ``assignment.shadow``.  ``split=False``: the cost method keeps every
    sequence whole (for a trainer that cannot run split pieces yet).  ``vpp``: model chunks
    per pipeline stage (``train.virtual_pipeline_stages``; the interleaved schedule's shorter
    bubbles, :mod:`neon_hpc.balance.pipeline`).
    """
    t0 = time.perf_counter()
    lens = _validate(lengths, dp, pp_microbatches, cp, token_cap, method, pp_stages, images)
    cost = cost or _default_cost()
    p = pp_stages if pp_stages is not None else pp_microbatches
    if isinstance(vpp, bool) or not isinstance(vpp, (int, np.integer)) or vpp < 1:
        raise ValueError(f"assign_step: vpp must be an integer >= 1, got {vpp!r}")
    if vpp > 1 and p == 1:
        raise ValueError(f"assign_step: vpp={vpp} (virtual pipeline stages) needs pp_stages > 1")
    thr = cp_split_threshold or auto_threshold(token_cap, cp)
    imgs = tuple(int(x) for x in images) if images is not None else None
    ctx = _Ctx(lens, cost.seq_costs(lens, imgs), dp, pp_microbatches, p, cp, token_cap, cost, thr,
               imgs, split, int(vpp))

    assignments: dict[str, StepAssignment] = {}
    names = [method] + [n for n in METHODS if n != method and shadow]
    want_candidates = "cost" in names and len(lens) * dp <= CANDIDATE_LIMIT
    if want_candidates:
        names += [n for n in ("flopkk", "tokenkk") if n not in names]
    for name in names:
        assignments[name] = _BUILDERS[name](ctx)
    if want_candidates:
        assignments["cost"] = _best_candidate(assignments["cost"], [assignments["flopkk"], assignments["tokenkk"]])
    assignment = assignments[method]
    if shadow:
        assignment.shadow = {n: q.makespan for n, q in assignments.items() if n != method}
        assignment.shadow_imbalance = {n: q.imbalance for n, q in assignments.items() if n != method}
    else:
        assignment.shadow, assignment.shadow_imbalance = {}, {}
    assignment.method = method
    if check:
        check_assignment(assignment)
    assignment.method_s = time.perf_counter() - t0
    return assignment


# ---------------------------------------------------------------------------------------------
# shared context and helpers

class _Ctx:
    def __init__(self, lens, costs, dp, m_min, p, cp, cap, cost, thr, images, split=True, vpp=1):
        self.lens, self.costs = lens, costs
        self.split, self.vpp = split, vpp
        self.dp, self.m_min, self.p, self.cp, self.cap = dp, max(1, m_min), p, cp, cap
        self.cost, self.thr, self.images = cost, thr, images
        self.active = [i for i in range(len(lens)) if lens[i] > 0]

    def make_assignment(self, name: str, ranks, oversize=()) -> StepAssignment:
        assignment = StepAssignment(method=name, lengths=tuple(int(x) for x in self.lens), cost=self.cost,
                    dp=self.dp, pp_stages=self.p, cp=self.cp, token_cap=self.cap,
                    cp_split_threshold=self.thr, ranks=ranks, oversize=sorted(oversize),
                    chosen_from=name, images=self.images, vpp=self.vpp)
        return score(assignment)


def _default_cost() -> CostModel:
    from neon_hpc.config.model import ModelConfig  # deferred: heavy (neon_hpc.config.model: pydantic)
    return CostModel.from_model_config(ModelConfig())


def _validate(lengths, dp, m, cp, cap, method, pp_stages, images) -> np.ndarray:
    for name, v in (("dp", dp), ("pp_microbatches", m), ("cp", cp), ("token_cap", cap)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"assign_step: {name} must be an integer >= 1, got {v!r}")
    if pp_stages is not None and (not isinstance(pp_stages, (int, np.integer)) or pp_stages < 1):
        raise ValueError(f"assign_step: pp_stages must be an integer >= 1, got {pp_stages!r}")
    if method not in METHODS:
        raise ValueError(f"assign_step: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    lens = np.asarray(lengths)
    if lens.ndim != 1 or (lens.size and not np.issubdtype(lens.dtype, np.integer)):
        raise ValueError("assign_step: lengths must be a flat sequence of integers (tokens per sequence)")
    lens = lens.astype(np.int64)
    if lens.size and lens.min() < 0:
        raise ValueError(f"assign_step: lengths[{int(lens.argmin())}] is negative ({int(lens.min())})")
    if images is not None and len(images) != len(lens):
        raise ValueError(f"assign_step: images has {len(images)} entries, lengths has {len(lens)}")
    return lens


def _whole_ranks(ctx: _Ctx, rank_mbs: list[list[list[int]]]) -> list[list[list[Piece]]]:
    """Sequence-index micro-batches -> Piece micro-batches, padded to one count per rank."""
    m = max(ctx.m_min, max((len(x) for x in rank_mbs), default=0))
    out = []
    for mbs in rank_mbs:
        mbs = [[Piece(i, 0, int(ctx.lens[i])) for i in sorted(mb)] for mb in mbs]
        out.append(mbs + [[] for _ in range(m - len(mbs))])
    return out


def _pack_rank(ctx: _Ctx, items: list[int], weights: np.ndarray, method: str):
    """One rank's whole sequences into micro-batches under the cap.  Sequences over the cap
    go alone; the rest into the fewest groups (>= what the pipeline asks) that fit."""
    lens, cap = ctx.lens, ctx.cap
    big = [i for i in items if lens[i] > cap]
    rest = [i for i in items if lens[i] <= cap]
    total = int(lens[rest].sum()) if rest else 0
    m = max(ctx.m_min - len(big), math.ceil(total / cap), 1 if rest else 0)
    groups: list[list[int]] = []
    while rest:
        if method == "kk":
            groups = [[rest[x] for x in part] for part in karmarkar_karp(weights[rest], m)]
        else:
            groups = [list(map(int, g)) for g in np.array_split(np.asarray(rest), m)]
        if all(int(lens[g].sum()) <= cap for g in groups if g):
            break
        m += 1
    return [[i] for i in big] + groups + [[] for _ in range(ctx.m_min - len(big) - len(groups))], big


def _assign_baseline(ctx: _Ctx, name: str, rank_items: list[list[int]], weights, method: str) -> StepAssignment:
    rank_mbs, oversize = [], []
    for items in rank_items:
        mbs, big = _pack_rank(ctx, items, weights, method)
        rank_mbs.append(mbs)
        oversize += big
    return ctx.make_assignment(name, _whole_ranks(ctx, rank_mbs), oversize)


def _sequential(ctx: _Ctx) -> StepAssignment:
    blocks = [list(map(int, b)) for b in np.array_split(np.asarray(ctx.active, dtype=np.int64), ctx.dp)]
    return _assign_baseline(ctx, "sequential", blocks, ctx.lens, "sequential")


def _kk(ctx: _Ctx, name: str, weights: np.ndarray) -> StepAssignment:
    act = ctx.active
    parts = karmarkar_karp(weights[act], ctx.dp)
    rank_items = [[act[x] for x in part] for part in parts]
    return _assign_baseline(ctx, name, rank_items, weights, "kk")


def _tokenkk(ctx: _Ctx) -> StepAssignment:
    return _kk(ctx, "tokenkk", ctx.lens.astype(np.float64))


def _flopkk(ctx: _Ctx) -> StepAssignment:
    return _kk(ctx, "flopkk", ctx.costs)


def _best_candidate(ours: StepAssignment, others: list[StepAssignment]) -> StepAssignment:
    """Keep ours unless a candidate is strictly faster and respects the cap at least as well."""
    best = ours
    for q in others:
        if len(q.oversize) <= len(ours.oversize) and q.makespan < best.makespan * (1 - 1e-12):
            best = q
    if best is not ours:
        best = StepAssignment(**{**best.__dict__, "chosen_from": best.method})
    return best


# ---------------------------------------------------------------------------------------------
# ours

def _cost(ctx: _Ctx) -> StepAssignment:
    lens = ctx.lens
    total_tokens = int(lens.sum())
    # cost-balanced ranks hold unequal tokens (short-sequence ranks need more), so start
    # with some headroom under the cap
    m = max(ctx.m_min, math.ceil(total_tokens / (ctx.dp * ctx.cap * CAP_HEADROOM)), 1)
    # with one slot per sequence everything fits (a split sequence needs one slot), so
    # the retries end there
    m_max = max(m, len(ctx.active) + ctx.m_min)
    while True:
        packer = _CostPacker(ctx, m)
        placed = packer.run()
        if placed is not None:
            break
        if m >= m_max:
            raise RuntimeError(f"cost method: no packing found up to {m} micro-batches per rank "
                               f"(token_cap={ctx.cap}); raise the cap")
        m = min(m_max, m + max(1, m // 8))
    # when the cap, not the cost, holds the fastest rank back, one more slot may balance better
    for _ in range(MAX_EXTRA_SLOTS):
        if packer.imbalance() <= 1 + 2 * REFINE_TOLERANCE or not packer.fastest_rank_is_full():
            break
        more = _CostPacker(ctx, packer.m + 1)
        more_placed = more.run()
        if more_placed is None or more.makespan() >= packer.makespan() * (1 - REFINE_TOLERANCE):
            break
        packer, placed = more, more_placed
    ranks, oversize = placed
    return ctx.make_assignment("cost", ranks, oversize)


class _CostPacker:
    """One attempt with ``m`` micro-batch slots per rank; ``run()`` returns None if the cap
    leaves something unplaced (the caller retries with more slots)."""

    def __init__(self, ctx: _Ctx, m: int):
        self.ctx, self.m = ctx, m
        dp = ctx.dp
        self.load = np.zeros((dp, m))
        self.toks = np.zeros((dp, m), dtype=np.int64)
        self.bins: list[list[list[Piece]]] = [[[] for _ in range(m)] for _ in range(dp)]
        # what each rank holds, as movable items: (cost, seq, slot, pieces, tokens, whole);
        # a whole sequence may move to any slot, a split unit only to its own slot
        self.items: list[list[tuple]] = [[] for _ in range(dp)]
        self.oversize: list[int] = []

    # -- the rank's predicted pipeline time from its slot loads (balance.pipeline)
    def rank_time(self, r: int) -> float:
        if self.m == 1:                               # the common dp-only case, kept cheap
            return float(self.load[r, 0])
        row = self.load[r]
        if self.ctx.p == 1:
            return float(row.sum())
        return float(combine(row.sum(), row.max(), self.ctx.p, self.ctx.vpp))

    def times(self) -> np.ndarray:
        return self._row_times(self.load)

    def makespan(self) -> float:
        return float(self.times().max())

    def imbalance(self) -> float:
        t = self.times()
        return float(t.max() / t.mean()) if t.mean() > 0 else 1.0

    def fastest_rank_is_full(self) -> bool:
        """True when the fastest rank has no slot with room for the shortest sequence."""
        lo = int(np.argmin(self.times()))
        shortest = int(self.ctx.lens[self.ctx.active].min()) if self.ctx.active else 1
        return bool((self.toks[lo] + shortest > self.ctx.cap).all())

    def run(self):
        ctx = self.ctx
        total = float(ctx.costs[ctx.active].sum()) if ctx.active else 0.0
        if total <= 0:
            return self._emit()
        unit_target = total / ctx.dp if ctx.p == 1 else total / (ctx.dp * self.m)
        splits, wholes = [], []
        for i in ctx.active:
            k = self._pieces_needed(i, unit_target)
            (splits if k > 1 else wholes).append((i, k))
        # largest units first, then whole sequences largest first (ties: lower index)
        splits.sort(key=lambda x: (-ctx.costs[x[0]] / x[1], x[0]))
        for i, k in splits:
            if not self._place_split(i, k):
                return None
        wholes.sort(key=lambda x: (-ctx.costs[x[0]], x[0]))
        if not self._place_wholes([i for i, _ in wholes]):
            return None
        self._refine()
        return self._emit()

    def _pieces_needed(self, i: int, unit_target: float) -> int:
        ctx = self.ctx
        n, c = int(ctx.lens[i]), float(ctx.costs[i])
        if not ctx.split:
            if n > ctx.cap:
                self.oversize.append(i)
            return 1
        k = math.ceil(n / ctx.cap)
        if c > unit_target * (1 + 1e-9):
            k = max(k, math.ceil(c / unit_target - 1e-9))
        k = min(k, ctx.dp, max(1, n // 2))
        if math.ceil(n / k) > ctx.cap:
            self.oversize.append(i)
        return k

    def _place_split(self, i: int, k: int) -> bool:
        """k zigzag units of sequence i -> k least-loaded ranks, all in one slot."""
        ctx = self.ctx
        units = zigzag_pairs(0, int(ctx.lens[i]), k)
        unit_toks = np.array([sum(e - s for s, e in u) for u in units])
        unit_cost = np.array([sum(ctx.cost.chunk_cost(s, e) for s, e in u) for u in units])
        if ctx.images is not None:
            unit_cost[0] += ctx.cost.image_cost * ctx.images[i]
        key = combine(self.load.sum(axis=1), self.load.max(axis=1), ctx.p, ctx.vpp)
        ranks = np.lexsort((np.arange(ctx.dp), key))[:k]
        sub_toks = self.toks[ranks] + unit_toks[:, None]
        fits = (sub_toks <= ctx.cap).all(axis=0) | (i in self.oversize)
        if not fits.any():
            return False
        col = np.where(fits, (self.load[ranks] + unit_cost[:, None]).max(axis=0), np.inf)
        j = int(np.argmin(col))
        for u, r in enumerate(ranks):
            self._add_item(int(r), j, i, tuple(Piece(i, s, e) for s, e in units[u]),
                           float(unit_cost[u]), whole=False)
        return True

    def _place_wholes(self, order: list[int]) -> bool:
        """Largest first onto the rank with the least predicted time, into its lightest slot
        with room (LPT under the 1F1B time).  ``order`` is by cost, so by length too
        (cost grows with length): a rank without room for this sequence is parked until
        the sequences get short enough for its roomiest slot."""
        ctx = self.ctx
        heap = [(self.rank_time(r), r) for r in range(ctx.dp)]
        heapq.heapify(heap)
        parked: list[tuple[int, int]] = []          # (-room, rank)
        for i in order:
            n, c = int(ctx.lens[i]), float(ctx.costs[i])
            while parked and (-parked[0][0] >= n or n > ctx.cap):
                _, r = heapq.heappop(parked)
                heapq.heappush(heap, (self.rank_time(r), r))
            while heap:
                t, r = heapq.heappop(heap)
                j = self._lightest_slot_with_room(r, n)
                if j is None:
                    heapq.heappush(parked, (-int(ctx.cap - self.toks[r].min()), r))
                    continue
                self._put_whole(r, j, i, n, c)
                heapq.heappush(heap, (self.rank_time(r), r))
                break
            else:
                return False
        return True

    def _lightest_slot_with_room(self, r: int, n: int):
        if self.m == 1:
            t = int(self.toks[r, 0])
            return 0 if (t + n <= self.ctx.cap or (n > self.ctx.cap and t == 0)) else None
        if n > self.ctx.cap:                    # oversize (dp too small to split it): alone
            empty = np.flatnonzero(self.toks[r] == 0)
            return int(empty[0]) if empty.size else None
        room = self.toks[r] + n <= self.ctx.cap
        if not room.any():
            return None
        return int(np.argmin(np.where(room, self.load[r], np.inf)))

    def _put_whole(self, r, j, i, n, c):
        self._add_item(r, j, i, (Piece(i, 0, n),), c, whole=True)

    def _add_item(self, r, j, seq, pieces, c, whole):
        tokens = sum(p.end - p.start for p in pieces)
        self.bins[r][j].extend(pieces)
        self.load[r, j] += c
        self.toks[r, j] += tokens
        self.items[r].append((c, seq, j, pieces, tokens, whole))

    def _take_item(self, r, idx):
        item = self.items[r].pop(idx)
        c, _seq, j, pieces, tokens, _whole = item
        for p in pieces:
            self.bins[r][j].remove(p)
        self.load[r, j] -= c
        self.toks[r, j] -= tokens
        return item

    def _refine(self) -> None:
        """Move items from the slowest rank to the fastest while the slower of the two ends
        below the old maximum; when every move overshoots, cut one piece between them, but
        only while the slowest rank is more than ``REFINE_TOLERANCE`` over the mean (each cut
        is a real split with K/V traffic the model does not charge for)."""
        ctx = self.ctx
        if ctx.dp < 2:
            return
        times = np.array([self.rank_time(r) for r in range(ctx.dp)])
        for _ in range(4 * ctx.dp + 64):
            hi, lo = int(np.argmax(times)), int(np.argmin(times))
            if self._best_move(hi, lo, times):
                continue
            if (not ctx.split or times[hi] <= times.mean() * (1 + REFINE_TOLERANCE)
                    or not self._best_cut(hi, lo, times)):
                return

    def _item_arrays(self, r: int, whole_only: bool = False):
        w = [x for x in self.items[r] if x[5] or not whole_only]
        idx = [k for k, x in enumerate(self.items[r]) if x[5] or not whole_only]
        c = np.array([x[0] for x in w], dtype=np.float64)
        slot = np.array([x[2] for x in w], dtype=np.int64)
        tokens = np.array([x[4] for x in w], dtype=np.int64)
        whole = np.array([x[5] for x in w], dtype=bool)
        return np.array(idx, dtype=np.int64), c, slot, tokens, whole

    def _row_times(self, rows: np.ndarray) -> np.ndarray:
        return combine(rows.sum(axis=1), rows.max(axis=1), self.ctx.p, self.ctx.vpp)

    def _best_transfer(self, hi: int, lo: int, slot_hi, taken, slot_lo, given, ok, times: np.ndarray,
                       rel_tol: float) -> int | None:
        """Candidate k takes ``taken[k]`` from ``hi``'s slot ``slot_hi[k]`` and gives ``given[k]`` to
        ``lo``'s slot ``slot_lo[k]``: the candidate (among ``ok``) that leaves the slower of the two
        ranks fastest, or None when it would not beat ``times[hi]`` by ``rel_tol``."""
        k = len(taken)
        ar = np.arange(k)
        rows_hi = np.repeat(self.load[hi][None, :], k, axis=0)
        rows_hi[ar, slot_hi] -= taken
        rows_lo = np.repeat(self.load[lo][None, :], k, axis=0)
        rows_lo[ar, slot_lo] += given
        worst = np.maximum(self._row_times(rows_hi), self._row_times(rows_lo))
        worst[~ok] = np.inf
        b = int(np.argmin(worst))
        return b if worst[b] < times[hi] * (1 - rel_tol) else None

    def _best_move(self, hi: int, lo: int, times: np.ndarray) -> bool:
        """All items of ``hi`` evaluated at once (whole sequences into ``lo``'s lightest slot
        with room, split units into their own slot); the move that leaves the slower of
        the two ranks fastest wins."""
        if not self.items[hi]:
            return False
        ctx = self.ctx
        idx, c, jh, n, whole = self._item_arrays(hi)
        toks_lo = self.toks[lo][None, :]
        room = np.where((n > ctx.cap)[:, None], toks_lo == 0, toks_lo + n[:, None] <= ctx.cap)
        own_slot = np.arange(self.m)[None, :] == jh[:, None]
        room &= whole[:, None] | own_slot
        ok = room.any(axis=1)
        j = np.argmin(np.where(room, self.load[lo][None, :], np.inf), axis=1)
        b = self._best_transfer(hi, lo, jh, c, j, c, ok, times, 1e-9)
        if b is None:
            return False
        cost_b, seq_b, _j, pieces, _t, whole_b = self._take_item(hi, int(idx[b]))
        self._add_item(lo, int(j[b]), seq_b, pieces, cost_b, whole_b)
        times[hi], times[lo] = self.rank_time(hi), self.rank_time(lo)
        return True

    def _best_cut(self, hi: int, lo: int, times: np.ndarray) -> bool:
        """When no move helps (each overshoots), cut the last piece ``[s, e)`` of one of the
        slowest rank's items at the token ``x`` where both ranks end up even: the fastest rank
        takes ``[x, e)`` in the item's slot (attending to the K/V before ``x``), the slowest
        keeps the rest."""
        if not self.items[hi]:
            return False
        ctx = self.ctx
        a, b = ctx.cost.a, ctx.cost.b
        items = self.items[hi]
        jh = np.array([it[2] for it in items], dtype=np.int64)
        s = np.array([it[3][-1].start for it in items], dtype=np.float64)
        e = np.array([it[3][-1].end for it in items], dtype=np.float64)
        target = (times[hi] - times[lo]) / 2
        # [x, e) costs target: a (e - x) + b (e^2 - x^2) = target
        rhs = np.maximum(a * e + b * e * e - target, 0.0)
        x = (-a + np.sqrt(a * a + 4 * b * rhs)) / (2 * b) if b > 0 else rhs / a
        room = ctx.cap - self.toks[lo, jh]
        x = np.maximum(np.maximum(np.rint(x), e - room), s + 1)
        ok = (x < e) & (room >= 1) & (e - s <= ctx.cap)
        tail = a * (e - x) + b * (e * e - x * x)             # what the head no longer computes
        tail_lo = tail + ctx.cost.piece_overhead              # the new piece's cost
        best = self._best_transfer(hi, lo, jh, tail, jh, tail_lo, ok, times, 1e-6)
        if best is None:
            return False
        xi, t = int(x[best]), float(tail[best])
        cost_i, i, j, pieces, _t, _w = self._take_item(hi, best)
        last = pieces[-1]
        self._add_item(hi, j, i, pieces[:-1] + (Piece(i, last.start, xi),), cost_i - t, whole=False)
        self._add_item(lo, j, i, (Piece(i, xi, last.end),), t + ctx.cost.piece_overhead, whole=False)
        times[hi], times[lo] = self.rank_time(hi), self.rank_time(lo)
        return True

    def _emit(self):
        m = self.m
        used = [j for j in range(m) if any(self.bins[r][j] for r in range(self.ctx.dp))]
        keep = used + [j for j in range(m) if j not in used][:max(0, self.ctx.m_min - len(used))]
        keep.sort()
        ranks = [[sorted(self.bins[r][j]) for j in keep] for r in range(self.ctx.dp)]
        return ranks, sorted(set(self.oversize))


_BUILDERS = {"cost": _cost, "tokenkk": _tokenkk, "flopkk": _flopkk, "sequential": _sequential}
