"""The models' side of each architecture: the HF config it implies, the megatron config and
layer spec, the Megatron <-> HF name and slicing rules, and the route rows.

Each architecture's adapter is ``ADAPTER`` in its folder's ``megatron.py``
(``neon_hpc/arch/<name>/megatron.py``, an :class:`~.base.Adapter` subclass); this package finds
them through the architecture registry (:mod:`neon_hpc.arch`), so adding an architecture touches
its folder and the registry's line only (its config section and rules: the folder's ``config.py``,
the adapter's ``validate``).  Importing this package imports no
torch, transformers or megatron; the methods that need them import them.
"""

from __future__ import annotations

import importlib

from neon_hpc import arch, hfmap
from neon_hpc.models.adapters.base import (EXPERT_RULES, TOP_RULES, Adapter, QKVShape, RouteRows,
                                           RouteRowsError, Rule)

ARCHES = arch.ARCHES
# the adapter modules are named by the registry, not spelled here: the folder of each architecture.
# Loaded on first use: an adapter module imports this package's base, so importing them all here
# would be circular for whoever imports an adapter module first
_ADAPTERS: dict[str, Adapter] = {}


def _adapter(name: str) -> Adapter:
    if name not in _ADAPTERS:
        module = f"{type(arch.ARCHITECTURES[name]).__module__}.megatron"
        _ADAPTERS[name] = importlib.import_module(module).ADAPTER
    return _ADAPTERS[name]
# names (config ``model.arch`` and HF ``model_type``) -> architecture: the mapping's (neon_hpc.hfmap)
MODEL_TYPES = hfmap.MODEL_TYPES


def get_adapter(name: str) -> Adapter:
    """The adapter of ``name`` (a config ``model.arch`` or an HF ``model_type``); ValueError naming
    the supported ones otherwise (:func:`neon_hpc.arch.get`)."""
    return _adapter(arch.get(name).name)


def adapter_for_hf_config(cfg: dict) -> Adapter:
    """The adapter of an HF ``config.json`` (by ``model_type``; ``text_config`` unwrapped)."""
    cfg = cfg.get("text_config", cfg)
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        raise ValueError(f"config.json model_type={mt!r} is not a supported architecture "
                         f"({', '.join(MODEL_TYPES)})")
    return get_adapter(mt)


__all__ = ["ARCHES", "MODEL_TYPES", "Adapter", "EXPERT_RULES", "QKVShape", "RouteRows", "RouteRowsError",
           "Rule", "TOP_RULES", "adapter_for_hf_config", "get_adapter"]
