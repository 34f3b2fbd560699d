"""One adapter per architecture: the HF config it implies, the megatron config and layer spec,
the Megatron <-> HF name and slicing rules, and the route layout.

Adding an architecture = one module here defining an :class:`~.base.Adapter` subclass, plus
its line in ``_ADAPTERS``, its name and config tables in :mod:`neon_hpc.hfmap`, and its config
rules in ``ARCH_RULES`` of :mod:`neon_hpc.models.config` (the adapter's ``validate``).
Importing this package imports no torch, transformers or megatron; the methods that need them
import them.
"""

from __future__ import annotations

from neon_hpc import hfmap
from neon_hpc.models.adapters.base import (EXPERT_RULES, TOP_RULES, Adapter, QKVShape, RouteLayout,
                                           RouteLayoutError, Rule)
from neon_hpc.models.adapters.deepseek_v3 import DeepseekV3Adapter
from neon_hpc.models.adapters.qwen3_moe import Qwen3MoeAdapter

_ADAPTERS: dict[str, Adapter] = {a.name: a for a in (Qwen3MoeAdapter(), DeepseekV3Adapter())}
ARCHES = tuple(_ADAPTERS)
# names (config ``model.arch`` and HF ``model_type``) -> architecture: the mapping's (neon_hpc.hfmap)
MODEL_TYPES = hfmap.MODEL_TYPES


def get_adapter(arch: str) -> Adapter:
    """The adapter of ``arch`` (a config ``model.arch`` or an HF ``model_type``); ValueError naming
    the supported ones otherwise (:func:`neon_hpc.hfmap.table`)."""
    return _ADAPTERS[hfmap.table(arch).NAME]


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
