"""The admission rule, once: may a rollout worker start one more group now?

Pure functions of the run directory's records (or of the numbers they hold), called by the
rollout worker (:mod:`neon_hpc.rollout.worker`, over the real files) and by the simulator
(:mod:`neon_hpc.plan.sim`, over its modelled state), so the two cannot drift apart.

* **backpressure**: ``ready/`` holds more than ``backpressure_steps`` steps of data;
  producing more would only make it stale;
* **bounded staleness**: the trainer consumes FIFO by publish order, so a group started now
  is consumed ``ceil((ready + in_flight + group) / per_step) - 1`` steps after the trainer's
  next claim; its tokens are that stale plus the *version gap*, the versions between the
  weights the trainer's next claim trains and those the engines serve now.  Over
  ``max_staleness``: wait.  The trainer's claim still drops what is too stale (counted), so
  the bound holds even when the estimate is off.

The verdicts are also the names of the worker's wait events in ``metrics.jsonl``.
"""

from __future__ import annotations

import math
from typing import Iterable

from neon_hpc.protocol.records import EngineRecord, TrainerBeat, WorkerBeat

OK = "ok"
BACKPRESSURE = "backpressure"
ADMISSION_WAIT = "admission_wait"
VERDICTS = (OK, BACKPRESSURE, ADMISSION_WAIT)


def backpressured(ready: int, per_step: int, backpressure_steps: int) -> bool:
    """``ready/`` holds more than ``backpressure_steps`` steps of data."""
    return ready > backpressure_steps * per_step


def admit(ready: int, in_flight: int, group: int, per_step: int, backpressure_steps: int,
          max_staleness: int, lag: int = 0) -> tuple[str, float]:
    """(verdict, staleness estimate) for starting one more group of ``group`` trajectories.

    ``ready``: trajectories published in ready/; ``in_flight``: those live workers hold
    (their heartbeats); ``lag``: the :func:`version_gap`. Under backpressure the estimate is
    the steps of data ready.
    """
    if backpressured(ready, per_step, backpressure_steps):
        return BACKPRESSURE, ready / per_step
    steps_ahead = math.ceil((ready + in_flight + group) / per_step) - 1
    estimate = steps_ahead + lag
    return (ADMISSION_WAIT if estimate > max_staleness else OK), float(estimate)


def next_claim_version(trainer: TrainerBeat | None, published: int) -> int:
    """The weight version the trainer's *next* claim trains.

    Step N trains v_{N-1}: while step N still claims (:attr:`TrainerPhase.claiming`) that is N-1;
    once it has its data (training, stepped, done), the next claim is step N+1's, v_N.
    Without a trainer heartbeat (or before its first step): ``published`` (weights/LATEST).
    """
    if trainer is None or trainer.step is None:
        return published
    return trainer.step - 1 if trainer.phase.claiming else trainer.step


def version_gap(trains: int, serving: int | None, published: int) -> int:
    """Versions the engines are behind the trainer's next claim (never negative); engines
    with no record (started elsewhere, ``serving=None``) count as serving ``published``."""
    return max(0, trains - (published if serving is None else serving))


def gap_from_records(trainer: TrainerBeat | None, engines: EngineRecord | None, published: int) -> int:
    """:func:`version_gap` from the trainer's beat and a node's engine record."""
    serving = engines.serving if engines is not None else None
    return version_gap(next_claim_version(trainer, published), serving, published)


def in_flight(beats: Iterable[WorkerBeat], now: float, expiry_s: float) -> int:
    """Trajectories in flight across workers whose beat is younger than ``expiry_s`` (an older
    beat is a dead worker's)."""
    return sum(int(b.in_flight) for b in beats if now - b.time < expiry_s)
