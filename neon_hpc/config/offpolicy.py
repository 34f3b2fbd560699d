"""The ``offpolicy:`` section: how far rollout may run ahead of the trainer, and what corrects for it.

One place for every off-policy setting (owned by ``neon_hpc/train/offpolicy.py`` and
``neon_hpc/train/corrections.py``; the rollout side reads the bound, the backpressure and the
engine end of route replay):

- ``max_staleness``: versions a generated token may lag the trainer (0 = on-policy); the
  rollout's admission rule (``protocol/admission.py``) and the trainer's stale policy both use it.
- ``stale_policy``: what the trainer does with a claimed token over the bound: ``mask`` gives it
  loss weight 0 (it stays in the context) and drops a trajectory only when none of its generated
  tokens is within the bound; ``drop`` drops a trajectory whose oldest token is over.
- ``backpressure_steps``: a rollout worker stops while ``ready/`` holds more than this many
  steps of data.
- ``correction``: the importance correction of the policy loss, a name registered in
  ``neon_hpc/train/corrections.py`` (``tis``, ``none``) or a user's function by import path
  (``pkg.mod:fn``, registered there with ``@correction``); ``correction_params`` its parameters
  (``{cap: 2.0}`` for ``tis``), the registered defaults otherwise.  ``neon-hpc config check``
  imports and validates it (the trainer's start-up check).
- route replay, both ends: ``replay_engine`` is what the rollout asks the engines to export
  (``delta``: each turn's new tokens, ``full``: every token every turn, ``off``: none);
  ``replay_trainer: replay`` replays those routes in the trainer's MoE routers.  The rule that
  ties them: the trainer replays only routes the engines export.
"""
from dataclasses import dataclass, field
from typing import Literal

from neon_hpc.util.constraints import Rule, at_least, section


@section
@dataclass
class OffpolicyConfig:
    max_staleness: int = 2
    stale_policy: Literal["mask", "drop"] = "mask"
    backpressure_steps: int = 4
    correction: str = "tis"
    correction_params: dict[str, float] = field(default_factory=dict)
    replay_engine: Literal["delta", "full", "off"] = "delta"
    replay_trainer: Literal["replay", "off"] = "replay"

    CHECKS = {
        "max_staleness": at_least(0, "0 = on-policy"),
    }
    RULES = (
        Rule("replay_trainer", lambda c: c.replay_trainer == "off" or c.replay_engine != "off",
             "'off' while offpolicy.replay_engine is 'off': the trainer would replay routes the engines "
             "never export; set offpolicy.replay_engine: delta (or full), or offpolicy.replay_trainer: 'off'"),
        Rule("correction", lambda c: _correction_name_ok(c.correction),
             "a registered correction name (tis, none; neon_hpc/train/corrections.py) or an import path "
             "'pkg.mod:fn' of a function registered with @correction"),
    )


def _correction_name_ok(name: str) -> bool:
    """A bare identifier (a registered name) or ``pkg.mod:fn`` (resolved by the trainer's check)."""
    mod, sep, fn = name.partition(":")
    if not sep:
        return name.isidentifier()
    return fn.isidentifier() and all(p.isidentifier() for p in mod.split("."))
