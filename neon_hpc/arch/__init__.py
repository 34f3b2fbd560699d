"""Architectures: one folder each (``neon_hpc/arch/<name>/``), registered here by name.

A folder holds everything specific to its architecture: ``__init__.py`` (``ARCH``, its
:class:`~neon_hpc.arch.base.Architecture`: MoE / dense layers, shared experts, attention kind,
megatron weight suffixes per layer, the HF fields reshard derives and checks), ``config.py`` (its
``model:`` section and rules), ``hfmap.py`` (megatron <-> HF weight names and ``config.json``
fields, both ways) and ``megatron.py`` (the megatron config and layer spec; imported by
``neon_hpc.models`` only).  The rule vocabulary every folder's ``hfmap.py`` uses is
:mod:`neon_hpc.arch.rules`.  Everything else asks :func:`get`; no other module spells an
architecture's name (tests/structure/test_arch_names.py).

Adding an architecture: a new folder with those four files, and its line in ``_REGISTERED``.
"""

from __future__ import annotations

from neon_hpc.arch import deepseek_v3, qwen3_moe
from neon_hpc.arch.base import Architecture, AttentionParams, RouteRows, RouteRowsError, ShapeError, Shapes

_REGISTERED: tuple[Architecture, ...] = (qwen3_moe.ARCH, deepseek_v3.ARCH)

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in _REGISTERED}
ARCHES = tuple(ARCHITECTURES)
# names (config ``model.arch`` and HF ``model_type``) -> architecture name
MODEL_TYPES: dict[str, str] = {**{a: a for a in ARCHES}, **{al: a.name for a in _REGISTERED for al in a.aliases}}
# the first registered: the ``model:`` section's default, and the synthetic checkpoints'
DEFAULT = ARCHES[0]


def known() -> str:
    """The registered names for an error message: ``a, b (and c as b)``."""
    aliases = [f"{al} as {n}" for al, n in MODEL_TYPES.items() if al != n]
    return ", ".join(ARCHES) + (f" (and {', '.join(aliases)})" if aliases else "")


def get(name: str) -> Architecture:
    """The architecture of ``name`` (a config ``model.arch`` or an HF ``model_type``); ValueError
    naming the registered ones otherwise."""
    try:
        return ARCHITECTURES[MODEL_TYPES[name]]
    except (KeyError, TypeError):
        raise ValueError(f"unknown architecture {name!r}; supported: {known()}") from None


def for_hf_config(cfg: dict) -> Architecture:
    """The architecture of an HF ``config.json`` (by ``model_type``; ``text_config`` unwrapped);
    ValueError naming the supported model types otherwise."""
    cfg = cfg.get("text_config", cfg)
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        raise ValueError(f"config.json model_type={mt!r} is not a supported architecture "
                         f"({', '.join(MODEL_TYPES)})")
    return get(mt)


__all__ = ["ARCHES", "ARCHITECTURES", "Architecture", "AttentionParams", "DEFAULT", "MODEL_TYPES", "RouteRows",
           "RouteRowsError", "ShapeError", "Shapes", "for_hf_config", "get", "known"]
