"""The ``env`` section of the experiment config (owned by ``neon_hpc/envs``): which environment
and its settings, one section per environment chosen by ``env.kind`` (a discriminated union,
:data:`EnvSection`, as ``model:`` is by ``model.arch``).

Each installed environment's entry (:class:`~neon_hpc.envs.base.EnvEntry`) supplies its variant
(``settings``: ``kind: xrd`` with XRD's preset, task count, tools, ...); one without settings gets
``kind`` alone, so an environment's key under another kind is refused with the fix.  A kind not
installed (one registered at run time, or a misspelling) gets :class:`EnvConfig`, whose rule
names the registered ones.  ``eval.split`` must be one of its held-out splits
(``neon_hpc/config/cross.py``: ``eval_split_errors``, a rule across sections).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import model_validator

from neon_hpc import envs
from neon_hpc.envs.base import EnvSettings
from neon_hpc.util.constraints import RuleViolations, Violation, hints, section, union_of

OTHER = "*"          # the union's tag for a kind no installed entry supplies


@section
@dataclass
class EnvConfig(EnvSettings):
    """``env:`` of a kind no installed entry supplies: a run-time registration (no settings) or an
    unknown kind, refused naming the registered ones.  ``EnvConfig(kind=K)`` builds ``K``'s section."""

    kind: str = "xrd"          # the mission's environment; any installed one (neon-hpc env list)

    # before its keys are checked: a misspelt kind is told so, not that the settings it carries are foreign
    @model_validator(mode="before")
    @classmethod
    def _registered(cls, data: Any) -> Any:
        kind = data.get("kind", DEFAULT) if isinstance(data, dict) else getattr(data, "kind", None)
        if isinstance(kind, str) and kind not in envs.kinds():
            raise RuleViolations([Violation("kind", kind, f"a registered environment: {envs.known()} "
                                            "(neon-hpc env list)")])
        return data

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is EnvConfig and "kind" in kwargs:      # (pydantic builds it without arguments)
            cls = SECTIONS.get(kwargs["kind"], EnvConfig)
        return object.__new__(cls)


def _kind_only(name: str) -> type:
    """The ``env:`` section of an environment without settings: ``kind`` alone."""
    cls = dataclasses.make_dataclass(f"{name.title().replace('_', '')}EnvConfig",
                                     [("kind", Literal[name], dataclasses.field(default=name))],
                                     bases=(EnvSettings,), namespace={"__module__": __name__})
    return section(cls)


def _variant(e: Any) -> type:
    """The ``env:`` section an entry supplies, checked to carry its own ``kind`` tag."""
    if e.settings is None:
        return _kind_only(e.name)
    tag = hints(e.settings).get("kind") if hasattr(e.settings, "__neon_hints__") else None
    if not (isinstance(e.settings, type) and issubclass(e.settings, EnvSettings)) or tag != Literal[e.name]:
        raise RuntimeError(f"environment {e.name}: its settings {getattr(e.settings, '__name__', e.settings)} must "
                           f"subclass neon_hpc.envs.base.EnvSettings, declare kind: Literal[{e.name!r}] = {e.name!r} "
                           "and be marked @section")
    return e.settings


# env.kind -> its section (the installed entries'); any other kind -> EnvConfig
SECTIONS: dict[str, type] = {e.name: _variant(e) for e in envs.entries()}
DEFAULT = "xrd" if "xrd" in SECTIONS else next(iter(SECTIONS), OTHER)
# the ``env:`` section's type: the environment's section, chosen by its ``kind`` key
EnvSection = union_of({**SECTIONS, OTHER: EnvConfig}, "kind", DEFAULT, other=OTHER)
# the section a config without an ``env:`` block gets
DefaultEnvConfig: type = SECTIONS.get(DEFAULT, EnvConfig)
