"""The baseline solver (no LLM): the floor every agent must beat.

1. Candidates: answer-eligible library phases made of the task's elements, visible before the
   task's date (through the dated store, like an agent's search).
2. Peak screening with a strain grid: each candidate's strong sticks (>= 10 % of its maximum)
   are matched against the observed peaks (within ``MATCH_TOL`` deg); the score is the
   intensity-weighted fraction matched, best over lattice strains in +-1 %.
3. Greedy full-profile fitting: add the candidate that lowers Rwp most; stop when the relative
   gain is below ``MIN_GAIN`` or ``MAX_PHASES`` are in.
4. A final refinement (zero shift, per-phase strain and size); phases under ``MIN_FRACTION``
   are dropped and the rest refit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from neon_hpc.xrd.tools import TaskContext, _sticks, observed_peaks

SCREEN_STRAINS = np.linspace(-0.01, 0.01, 21)
SCREEN_ZEROS = np.linspace(-0.4, 0.4, 33)
MATCH_TOL = 0.12
MIN_SCORE = 0.4
MAX_CANDIDATES = 10
MAX_PHASES = 4
MIN_GAIN = 0.06
MIN_FRACTION = 0.02
GREEDY_SIZES_NM = (0.0, 60.0, 25.0)
GREEDY_STRAIN_STEPS = np.linspace(-0.002, 0.002, 9)


@dataclass
class Solution:
    phases: list[tuple[str, float]]
    rwp: float
    details: dict = field(default_factory=dict)


def _score(tt: np.ndarray, inten: np.ndarray, px: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """Intensity-weighted closeness of sticks to observed peaks, for each zero shift."""
    strong = inten >= 10.0
    if not np.any(strong):
        return np.zeros(len(shifts))
    pos = tt[strong][None, :] + shifts[:, None]                       # (shifts, sticks)
    dist = np.abs(pos[:, :, None] - px[None, None, :]).min(axis=2)
    closeness = np.clip(1.0 - dist / MATCH_TOL, 0.0, 1.0)
    return (closeness * inten[strong][None, :]).sum(axis=1) / inten[strong].sum()


def _best_over(pid: str, ctx: TaskContext, px: np.ndarray, shifts: np.ndarray) -> tuple[float, float, float]:
    """(score, strain, zero) maximising the match; ties go to the smallest |strain|, |zero|."""
    best = (-1.0, 0.0, 0.0)
    for eps in sorted(SCREEN_STRAINS, key=abs):
        tt, inten, _ = _sticks(pid, ctx, float(eps))
        scores = _score(tt, inten, px, shifts)
        k = int(np.argmax(scores - 1e-6 * np.abs(shifts)))
        if scores[k] > best[0] + 1e-6:
            best = (float(scores[k]), float(eps), float(shifts[k]))
    return best


def screen(ctx: TaskContext, candidates: list[str]) -> tuple[list[tuple[str, float, float, float]], np.ndarray]:
    """Candidates passing ``MIN_SCORE`` as (phase id, score, strain, zero shift), best first.

    Each candidate gets its own best zero shift over ``SCREEN_ZEROS`` (sample displacement
    shows up as one); the greedy step then fixes one shift for the whole pattern.
    Also returns the observed peak positions.
    """
    px, _, _ = observed_peaks(ctx.two_theta, ctx.intensity, 0.01, 200)
    if len(px) == 0 or not candidates:
        return [], px
    scored = []
    for pid in candidates:
        s, eps, zero = _best_over(pid, ctx, px, SCREEN_ZEROS)
        if s >= MIN_SCORE:
            scored.append((pid, s, eps, zero))
    scored.sort(key=lambda r: -r[1])
    return scored[:MAX_CANDIDATES], px


def candidate_ids(ctx: TaskContext) -> list[str]:
    rows = ctx.view.phases(elements=ctx.elements, limit=10_000)
    return [r["id"] for r in rows if r["answer_eligible"]]


def _greedy(ctx: TaskContext, screened: list[tuple[str, float, float, float]], px: np.ndarray):
    """Add the phase that lowers Rwp most until the gain is small; the first phase fixes the zero shift."""
    fitter = ctx.fitter()
    chosen, strains, sizes = [], [], []
    zero = None
    rwp = fitter.evaluate([], 0.0, [], [])[0]
    trail = [("background", rwp)]
    while len(chosen) < MAX_PHASES:
        best = None
        for pid, _score, eps, own_zero in screened:
            if pid in chosen:
                continue
            z = own_zero if zero is None else zero
            if zero is not None:
                _s, eps, _z = _best_over(pid, ctx, px, np.array([zero]))
            trial = None
            for size in GREEDY_SIZES_NM:
                r = fitter.evaluate(chosen + [pid], z, strains + [eps], sizes + [size])[0]
                if trial is None or r < trial[0]:
                    trial = (r, pid, eps, size, z)
            for e in eps + GREEDY_STRAIN_STEPS:
                r = fitter.evaluate(chosen + [pid], z, strains + [float(e)], sizes + [trial[3]])[0]
                if r < trial[0]:
                    trial = (r, pid, float(e), trial[3], z)
            if best is None or trial[0] < best[0]:
                best = trial
        if best is None or (rwp - best[0]) / rwp < MIN_GAIN:
            break
        rwp, pid, eps, size, zero = best
        chosen.append(pid)
        strains.append(eps)
        sizes.append(size)
        trail.append((pid, rwp))
    return chosen, strains, sizes, (zero or 0.0), trail


def solve(ctx: TaskContext, candidates: list[str] | None = None) -> Solution:
    cands = candidate_ids(ctx) if candidates is None else candidates
    screened, px = screen(ctx, cands)
    chosen, strains, sizes, zero, trail = _greedy(ctx, screened, px)
    if not chosen:
        return Solution([], 1.0, {"screened": screened, "trail": trail})
    fitter = ctx.fitter()
    res = fitter.fit(chosen, strains=strains, sizes=sizes, zero=zero, passes=1)
    keep = [i for i, p in enumerate(res.phases) if p.weight_fraction >= MIN_FRACTION]
    if len(keep) < len(chosen):
        chosen = [chosen[i] for i in keep]
        res = fitter.fit(chosen, strains=[res.phases[i].strain for i in keep],
                         sizes=[res.phases[i].size_nm for i in keep], zero=res.zero_shift, passes=1)
    return Solution([(p.phase_id, p.weight_fraction) for p in res.phases], res.rwp,
                    {"screened": [(p, round(s, 3), e, z) for p, s, e, z in screened], "trail": trail,
                     "fit": res.summary(), "screen_zero": zero})
