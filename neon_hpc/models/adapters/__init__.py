"""The models' side of each architecture: the HF config it implies, the megatron config and
layer spec, the Megatron <-> HF name and slicing rules, and the route layout.

Each architecture's adapter is ``ADAPTER`` in its folder's ``megatron.py``
(``neon_hpc/arch/<name>/megatron.py``, an :class:`~.base.Adapter` subclass); this package finds
them through the architecture registry (:mod:`neon_hpc.arch`), so adding an architecture touches
its folder and the registry's line only (its config rules: ``ARCH_RULES`` of
:mod:`neon_hpc.models.config`, the adapter's ``validate``).  Importing this package imports no
torch, transformers or megatron; the methods that need them import them.
"""

from __future__ import annotations

import importlib

from neon_hpc import arch, hfmap
from neon_hpc.models.adapters.base import (EXPERT_RULES, TOP_RULES, Adapter, QKVShape, RouteLayout,
                                           RouteLayoutError, Rule)

# the adapter modules are named by the registry, not spelled here: the folder of each architecture
_ADAPTERS: dict[str, Adapter] = {
    a.name: importlib.import_module(f"{type(a).__module__}.megatron").ADAPTER for a in arch.ARCHITECTURES.values()}
ARCHES = tuple(_ADAPTERS)
# names (config ``model.arch`` and HF ``model_type``) -> architecture: the mapping's (neon_hpc.hfmap)
MODEL_TYPES = hfmap.MODEL_TYPES


def get_adapter(name: str) -> Adapter:
    """The adapter of ``name`` (a config ``model.arch`` or an HF ``model_type``); ValueError naming
    the supported ones otherwise (:func:`neon_hpc.arch.get`)."""
    return _ADAPTERS[arch.get(name).name]


def adapter_for_hf_config(cfg: dict) -> Adapter:
    """The adapter of an HF ``config.json`` (by ``model_type``; ``text_config`` unwrapped)."""
    cfg = cfg.get("text_config", cfg)
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        raise ValueError(f"config.json model_type={mt!r} is not a supported architecture "
                         f"({', '.join(MODEL_TYPES)})")
    return get_adapter(mt)


__all__ = ["ARCHES", "MODEL_TYPES", "Adapter", "EXPERT_RULES", "QKVShape", "RouteLayout", "RouteLayoutError",
           "Rule", "TOP_RULES", "adapter_for_hf_config", "get_adapter"]
