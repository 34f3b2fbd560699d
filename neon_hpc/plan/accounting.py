"""The simulation's books: slot time held, what was trained, dropped and masked, and the result.

Two pieces, both fed by :mod:`neon_hpc.plan.sim` and :mod:`neon_hpc.plan.slots` and neither
deciding anything:

* :class:`Occupancy`: rollout slots free and slot-seconds held (rollout idle = slot-time not
  held by any group or episode);
* :class:`Accounts`: per trained batch, the trajectories, their staleness (per trajectory:
  its oldest *trained* token; per token: a group's tokens spread evenly over the versions it
  saw), masked and dropped tokens (``stale_policy``), the trainer's time, and
  :meth:`Accounts.result`, the :class:`SimResult` of a run.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SimResult:
    policy: str
    steps: int
    wall_s: float
    compute_s: float
    publish_s: float
    wait_s: float
    rollout_busy_s: float          # slot-seconds with an episode running
    slots: int
    consumed: int                  # trajectories trained on
    dropped: int                   # trajectories over the staleness bound
    started: int
    staleness: Counter             # staleness -> trajectories
    step_compute_s: list[float] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)
    step_wait_s: list[float] = field(default_factory=list)
    step_busy_s: list[float] = field(default_factory=list)
    step_staleness: list[tuple[int, float, int]] = field(default_factory=list)
    rollout_phase_s: float = 0.0   # sync/one_step_off: time from batch start to batch complete
    versions_spanned_mean: float = 1.0
    aborted: int = 0               # trajectories stopped early for being beyond the bound (in dropped)
    staleness_token_mean: float = 0.0  # estimate: midpoint of each trajectory's version span
    engine_stall_mean: float = 0.0
    engine_stall_full: float = 0.0
    step_time_source: str = ""
    sim_seconds: float = 0.0
    claimed_tokens: float = 0.0    # tokens of every trajectory a claim took or dropped
    masked_tokens: float = 0.0     # ... of those given loss weight 0 (stale_policy mask)
    dropped_tokens: float = 0.0    # ... of the dropped trajectories
    token_staleness: Counter = field(default_factory=Counter)   # staleness -> trained tokens

    @property
    def wasted_tokens_frac(self) -> float:
        """(dropped + masked) tokens over all tokens claimed: rollout work that trained nothing."""
        return (self.masked_tokens + self.dropped_tokens) / self.claimed_tokens if self.claimed_tokens else 0.0

    @property
    def token_staleness_mean(self) -> float:
        total = sum(self.token_staleness.values())
        return sum(k * v for k, v in self.token_staleness.items()) / total if total else 0.0

    def token_staleness_quantile(self, q: float) -> int:
        total = sum(self.token_staleness.values())
        acc = 0.0
        for k in sorted(self.token_staleness):
            acc += self.token_staleness[k]
            if acc >= q * total - 1e-9:
                return k
        return max(self.token_staleness, default=0)

    @property
    def trainer_idle_frac(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def rollout_idle_frac(self) -> float:
        cap = self.slots * self.wall_s
        return min(1.0, max(0.0, 1.0 - self.rollout_busy_s / cap)) if cap > 0 else 0.0

    @property
    def samples_per_hour(self) -> float:
        return 3600.0 * self.consumed / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def time_per_step_s(self) -> float:
        return self.wall_s / self.steps if self.steps else 0.0

    @property
    def dropped_frac(self) -> float:
        done = self.consumed + self.dropped
        return self.dropped / done if done else 0.0

    def window(self, first_step: int) -> dict[str, float]:
        """Idle fractions and staleness from step ``first_step`` (0-based) on: steady state
        without the start-up, for comparing with a measured run."""
        k = min(max(first_step, 0), max(len(self.step_end_s) - 1, 0))
        t0 = self.step_end_s[k - 1] if k > 0 else 0.0
        b0 = self.step_busy_s[k - 1] if k > 0 else 0.0
        span = self.wall_s - t0
        n = sum(x[0] for x in self.step_staleness[k:])
        return {
            "trainer_idle": sum(self.step_wait_s[k:]) / span if span > 0 else 0.0,
            "rollout_idle": min(1.0, max(0.0, 1.0 - (self.rollout_busy_s - b0) / (self.slots * span)))
            if span > 0 else 0.0,
            "staleness_mean": sum(x[1] for x in self.step_staleness[k:]) / n if n else 0.0,
            "staleness_max": float(max((x[2] for x in self.step_staleness[k:]), default=0)),
        }

    def staleness_quantile(self, q: float) -> int:
        total = sum(self.staleness.values())
        if not total:
            return 0
        acc = 0
        for k in sorted(self.staleness):
            acc += self.staleness[k]
            if acc >= q * total:
                return k
        return max(self.staleness)

    @property
    def staleness_mean(self) -> float:
        total = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / total if total else 0.0

    @property
    def staleness_max(self) -> int:
        return max(self.staleness) if self.staleness else 0

    def summary(self) -> dict:
        return {
            "policy": self.policy, "steps": self.steps, "wall_h": self.wall_s / 3600,
            "time_per_step_s": self.time_per_step_s,
            "step_compute_s": float(np.mean(self.step_compute_s)) if self.step_compute_s else 0.0,
            "trainer_idle": self.trainer_idle_frac, "rollout_idle": self.rollout_idle_frac,
            "samples_per_hour": self.samples_per_hour, "staleness_mean": self.staleness_mean,
            "staleness_p95": self.staleness_quantile(0.95), "staleness_max": self.staleness_max,
            "dropped": self.dropped_frac, "versions_spanned": self.versions_spanned_mean,
            "engine_stall": self.engine_stall_mean, "wasted_tokens": self.wasted_tokens_frac,
            "token_staleness_mean": self.token_staleness_mean,
            "token_staleness_p95": self.token_staleness_quantile(0.95),
        }


class Occupancy:
    """Rollout slots: how many are free, and the slot-seconds held so far."""
    __slots__ = ("total", "idle", "busy_s", "occ_start_sum")

    def __init__(self, slots: int):
        self.total = slots
        self.idle = slots
        self.busy_s = 0.0               # slot-seconds of groups/episodes that have ended
        self.occ_start_sum = 0.0        # sum of the start times of the slots held now

    def occupy(self, n: int, now: float) -> None:
        self.idle -= n
        self.occ_start_sum += n * now

    def vacate(self, n: int, t_start: float, now: float) -> None:
        self.idle += n
        self.occ_start_sum -= n * t_start
        self.busy_s += n * (now - t_start)

    def busy_until(self, t: float) -> float:
        """Slot-seconds held from the start until ``t`` (the slots held now count up to ``t``)."""
        occupied = self.total - self.idle
        return self.busy_s + occupied * t - self.occ_start_sum


class Accounts:
    """What the trainer consumed and what was lost, per trajectory and per token."""

    def __init__(self) -> None:
        self.started = 0                # episodes started
        self.consumed = 0               # trajectories trained on
        self.dropped = 0                # trajectories dropped as stale
        self.staleness: Counter = Counter()          # staleness -> trained trajectories
        self.token_staleness: Counter = Counter()    # staleness -> trained tokens
        self.claimed_tokens = self.masked_tokens = self.dropped_tokens = 0.0
        self.spanned_sum = 0.0          # sum over trained trajectories of the versions they span
        self.token_staleness_sum = 0.0  # ... of their token staleness (midpoint estimate)
        self.stall_sum = 0.0            # sum over started episodes of the engine stall at their start
        self.compute_s = self.publish_s = self.wait_s = self.rollout_phase_s = 0.0
        self.step_compute: list[float] = []
        self.step_end: list[float] = []
        self.step_wait: list[float] = []
        self.step_busy: list[float] = []      # rollout slot-seconds held, at each step's end
        self.step_staleness: list[tuple[int, float, int]] = []   # (trajectories, token staleness sum, max)

    def discard(self, lengths: list[float]) -> None:
        """A stale group of these sequence lengths is dropped: its trajectories and tokens count as waste."""
        self.dropped += len(lengths)
        t = float(sum(lengths))
        self.claimed_tokens += t
        self.dropped_tokens += t

    def account(self, batch: list, step: int, lo_ok: int, mask: bool) -> None:
        """The trainer's step ``step`` trains ``batch`` (groups with ``lengths``, ``vmin``, ``vmax``);
        with ``mask``, the tokens of versions below ``lo_ok`` get loss weight 0."""
        n_step, tok_step, max_step = 0, 0.0, 0
        for g in batch:
            n = len(g.lengths)
            self.consumed += n
            span = g.vmax - g.vmin + 1
            tokens = float(sum(g.lengths))
            self.claimed_tokens += tokens
            lo = g.vmin
            if mask and g.vmin < lo_ok:   # masked versions vmin..lo_ok-1
                lo = lo_ok
                self.masked_tokens += tokens * (lo_ok - g.vmin) / span
            per_version = tokens / span
            for v in range(lo, g.vmax + 1):
                self.token_staleness[step - v] += per_version
            self.staleness[step - lo] += n
            tok = n * (step - 0.5 * (lo + g.vmax))
            self.token_staleness_sum += tok
            self.spanned_sum += n * span
            n_step, tok_step, max_step = n_step + n, tok_step + tok, max(max_step, step - lo)
        self.step_staleness.append((n_step, tok_step, max_step))

    def result(self, *, policy: str, steps: int, wall_s: float, rollout_busy_s: float, slots: int,
               engine_stall_full: float, aborted: int, step_time_source: str, sim_seconds: float) -> SimResult:
        return SimResult(
            policy=policy, steps=steps, wall_s=wall_s, compute_s=self.compute_s,
            publish_s=self.publish_s, wait_s=self.wait_s, rollout_busy_s=rollout_busy_s,
            slots=slots, consumed=self.consumed, dropped=self.dropped,
            started=self.started, staleness=self.staleness, step_compute_s=self.step_compute,
            step_end_s=self.step_end, step_wait_s=self.step_wait, step_busy_s=self.step_busy,
            step_staleness=self.step_staleness, rollout_phase_s=self.rollout_phase_s,
            versions_spanned_mean=self.spanned_sum / self.consumed if self.consumed else 1.0,
            staleness_token_mean=self.token_staleness_sum / self.consumed if self.consumed else 0.0,
            engine_stall_mean=self.stall_sum / self.started if self.started else 0.0,
            engine_stall_full=engine_stall_full, aborted=aborted, step_time_source=step_time_source,
            sim_seconds=sim_seconds, claimed_tokens=self.claimed_tokens,
            masked_tokens=self.masked_tokens, dropped_tokens=self.dropped_tokens, token_staleness=self.token_staleness)
