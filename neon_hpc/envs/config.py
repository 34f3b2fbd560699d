"""The ``env`` section of the experiment config (owned by ``neon_hpc/envs``): which environment.

``kind`` names a registered environment (``neon-hpc env list``); its own settings live in its
own section (``xrd:`` for ``kind: xrd``).  ``eval.split`` must be one of its held-out splits
(:func:`eval_split_errors`, a rule across sections).
"""
from dataclasses import dataclass

from neon_hpc import envs
from neon_hpc.util.bounded import short_repr
from neon_hpc.constraints import Rule, section


@section
@dataclass
class EnvConfig:
    kind: str = envs.DEFAULT

    RULES = (
        Rule("kind", lambda c: c.kind in envs.kinds(),
             lambda c: f"a registered environment: {envs.known()} (neon-hpc env list)"),
    )


def eval_split_errors(cfg) -> list[tuple[str, str]]:
    """``eval.split`` against the held-out splits of the environment ``env.kind`` chooses (its
    registry line; a rule across sections: :func:`neon_hpc.config.cross_errors`)."""
    splits = envs.eval_splits(cfg.env.kind)
    if cfg.eval.split in splits:
        return []
    return [("eval.split", f"got {short_repr(cfg.eval.split)}; allowed: a held-out split of environment "
                           f"{cfg.env.kind}: {', '.join(splits)}")]
