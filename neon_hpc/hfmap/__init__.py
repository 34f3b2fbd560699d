"""Megatron-core <-> HF: weight names and splits, and the ``config.json`` fields, written once.

The rules every architecture shares are :mod:`neon_hpc.hfmap.rules`; each architecture's own
table is ``hfmap.py`` in its folder (``neon_hpc/arch/<name>/``), reached through the registry
(:mod:`neon_hpc.arch`).  The trainer's side (the adapters in :mod:`neon_hpc.models.adapters`, the
direct exporter :mod:`neon_hpc.models.convert`) and the post-run converter (:mod:`neon_hpc.reshard`)
both read these tables; reshard imports nothing of the models or the trainer.  Nothing here
imports torch, transformers or megatron.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from neon_hpc import arch as _arch
from neon_hpc.hfmap.rules import (COMMON_LAYER_RULES, EXPERT_RULES, IGNORED_SUFFIXES, TOP_RULES, QKVShape, Rule,
                                  qkv_join, qkv_part, qkv_rows, tp_join, tp_shard)



def __getattr__(name: str) -> Any:
    """``ARCHES``, ``MODEL_TYPES`` (config ``model.arch`` / HF ``model_type`` -> architecture) and
    ``LAYER_RULES`` (architecture -> decoder-layer weight suffix -> rule): the registry's, read
    when asked (an architecture's ``hfmap.py`` imports ``rules`` from this package while the
    registry is still being built)."""
    if name in ("ARCHES", "MODEL_TYPES"):
        return getattr(_arch, name)
    if name == "LAYER_RULES":
        return {a.name: a.layer_rules for a in _arch.ARCHITECTURES.values()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def table(name: str) -> ModuleType:
    """The mapping module of ``name`` (a config ``model.arch`` or an HF ``model_type``)."""
    return _arch.get(name).mapping


def hf_config_dict(model_cfg: Any) -> dict:
    """The HF ``config.json`` (a dict) that a ``model:`` section (a ModelConfig) implies."""
    return table(model_cfg.arch).hf_config_dict(model_cfg)


__all__ = ["ARCHES", "COMMON_LAYER_RULES", "EXPERT_RULES", "IGNORED_SUFFIXES", "LAYER_RULES", "MODEL_TYPES",
           "QKVShape", "Rule", "TOP_RULES", "hf_config_dict", "qkv_join", "qkv_part", "qkv_rows", "table",
           "tp_join", "tp_shard"]
