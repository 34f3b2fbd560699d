"""The ``env`` section of the experiment config (owned by ``neon_hpc/envs``): which environment.

``kind`` names a registered environment (``neon-hpc env list``); its own settings live in its
own section (``xrd:`` for ``kind: xrd``).  ``eval.split`` must be one of its held-out splits
(``neon_hpc/config/cross.py``: ``eval_split_errors``, a rule across sections).
"""
from dataclasses import dataclass

from neon_hpc import envs
from neon_hpc.util.constraints import Rule, section


@section
@dataclass
class EnvConfig:
    kind: str = "xrd"          # the mission's environment; any installed one (neon-hpc env list)

    RULES = (
        Rule("kind", lambda c: c.kind in envs.kinds(),
             lambda c: f"a registered environment: {envs.known()} (neon-hpc env list)"),
    )
