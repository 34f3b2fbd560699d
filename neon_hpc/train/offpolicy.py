"""The trainer's stale policy: what happens to claimed tokens more than ``offpolicy.max_staleness``
versions behind the weights being trained (``offpolicy.stale_policy``).

The store's claim is a pipe (exactly once, uid dedupe, quarantine: ``neon_hpc/store/claim.py``); it
asks the consumer's admission rule, :class:`StalePolicy`, for a :class:`~neon_hpc.store.claim.Verdict` on
each trajectory it reads, keeps claiming until ``want`` trajectories are kept, and records the verdicts
(``CLAIM.json``, ``dropped_stale.json``) with the rule's parameters.  After the claim the trainer
applies the rule to what it trains (:func:`apply`), with the parameters the claim recorded, so a resumed
claim trains the same tokens as the first:

* ``mask`` (the default): a generated token whose version is more than ``max_staleness`` behind
  ``trainer_version`` gets loss weight 0 (cleared in ``loss_mask``; it stays in ``tokens``, so it is
  still context for the tokens after it).  A trajectory is dropped only when none of its generated
  tokens is within the bound.  The shard on disk keeps the engine's mask.
* ``drop``: a trajectory whose *oldest* generated token is over the bound is dropped whole.

Either way the waste is counted in generated tokens (``masked_stale_tokens``, ``dropped_stale_tokens``
over ``generated_tokens``: the claim's counts, the step's metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from neon_hpc.store.claim import ClaimResult, Verdict
from neon_hpc.store.trajectory import Trajectory

STALE_POLICIES = ("mask", "drop")


def stale_token_mask(loss_mask, versions, trainer_version: int, max_staleness: int):
    """The trainable tokens: generated (``loss_mask != 0``) and at most ``max_staleness``
    versions behind ``trainer_version``. uint8, the shape of ``loss_mask``."""
    gen = np.asarray(loss_mask) != 0
    fresh = np.asarray(versions) >= trainer_version - max_staleness
    return (gen & fresh).astype(np.uint8)


@dataclass(frozen=True)
class StalePolicy:
    """The rule for one claim: tokens of ``trainer_version`` minus more than ``max_staleness``."""

    trainer_version: int
    max_staleness: int
    policy: str = "mask"

    def __post_init__(self) -> None:
        if self.policy not in STALE_POLICIES:
            raise ValueError(f"offpolicy.stale_policy must be one of {STALE_POLICIES}, got {self.policy!r}")

    @classmethod
    def of(cls, offpolicy: Any, trainer_version: int) -> "StalePolicy":
        """The ``offpolicy`` section's rule for a step that trains ``trainer_version``."""
        return cls(trainer_version, offpolicy.max_staleness, offpolicy.stale_policy)

    def record(self) -> dict:
        """What the claim records of the rule (``CLAIM.json``, ``dropped_stale.json``)."""
        return {"trainer_version": self.trainer_version, "max_staleness": self.max_staleness,
                "stale_policy": self.policy}

    def verdict(self, t: Trajectory) -> Verdict:
        """Keep ``t`` (with how many generated tokens the rule masks) or drop it; ``t`` is not changed."""
        if t.num_generated == 0:
            return Verdict(True)
        stale = t.staleness(self.trainer_version)
        if self.policy == "drop":
            return Verdict(True) if stale <= self.max_staleness else self._drop(t, stale)
        kept = int(self._trainable(t).sum())
        return Verdict(True, t.num_generated - kept) if kept else self._drop(t, stale)

    def _drop(self, t: Trajectory, stale: int) -> Verdict:
        return Verdict(False, why={"version_min": t.version_min, "staleness": stale})

    def _trainable(self, t: Trajectory) -> np.ndarray:
        return stale_token_mask(t.loss_mask, t.versions, self.trainer_version, self.max_staleness)

    def apply(self, trajs: list[Trajectory]) -> None:
        """Give the over-bound tokens of kept trajectories loss weight 0 (``mask``; ``drop`` keeps them whole)."""
        if self.policy != "mask":
            return
        for t in trajs:
            if t.num_generated and int(self._trainable(t).sum()) != t.num_generated:
                t.loss_mask = self._trainable(t)


def apply(res: ClaimResult) -> ClaimResult:
    """Apply the rule the claim recorded (``res.admission``) to its trajectories, in place; returns ``res``."""
    a = res.admission
    if a.get("trainer_version") is not None and a.get("max_staleness") is not None:
        StalePolicy(a["trainer_version"], a["max_staleness"], a.get("stale_policy", "mask")).apply(res.trajectories)
    return res
