"""Megatron-core <-> HF: weight names and splits, and the ``config.json`` fields, one table per
architecture, written once.

The trainer's side (the architecture adapters in :mod:`neon_hpc.models.adapters`, the direct
exporter :mod:`neon_hpc.models.convert`) and the post-run converter (:mod:`neon_hpc.reshard`)
both import these tables; reshard imports nothing of the models or the trainer.  This package
imports no torch, transformers or megatron, and nothing else of neon_hpc.

Adding an architecture = one module here (``NAME``, ``LAYER_RULES``, ``HF_FIELDS``,
``hf_fields``, ``hf_config_dict``) and its adapter in :mod:`neon_hpc.models.adapters`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from neon_hpc.hfmap import deepseek_v3, qwen3_moe
from neon_hpc.hfmap.rules import (COMMON_LAYER_RULES, EXPERT_RULES, IGNORED_SUFFIXES, TOP_RULES, QKVShape, Rule,
                                  qkv_join, qkv_part, qkv_rows, tp_join, tp_shard)

_TABLES: dict[str, ModuleType] = {m.NAME: m for m in (qwen3_moe, deepseek_v3)}
ARCHES = tuple(_TABLES)
# names (config ``model.arch`` and HF ``model_type``) -> architecture; Kimi-K2 ships DeepSeek-V3 weights
MODEL_TYPES = {**{a: a for a in ARCHES}, "kimi_k2": "deepseek_v3"}
# per architecture, decoder-layer weight suffix -> rule (the objects the adapters carry)
LAYER_RULES: dict[str, dict[str, Rule]] = {a: m.LAYER_RULES for a, m in _TABLES.items()}


def table(arch: str) -> ModuleType:
    """The mapping module of ``arch`` (a config ``model.arch`` or an HF ``model_type``)."""
    try:
        return _TABLES[MODEL_TYPES[arch]]
    except KeyError:
        raise ValueError(f"unknown architecture {arch!r}; supported: {', '.join(ARCHES)} "
                         f"(and kimi_k2 as deepseek_v3)") from None


def hf_config_dict(model_cfg: Any) -> dict:
    """The HF ``config.json`` (a dict) that a ``model:`` section (a ModelConfig) implies."""
    return table(model_cfg.arch).hf_config_dict(model_cfg)


__all__ = ["ARCHES", "COMMON_LAYER_RULES", "EXPERT_RULES", "IGNORED_SUFFIXES", "LAYER_RULES", "MODEL_TYPES",
           "QKVShape", "Rule", "TOP_RULES", "hf_config_dict", "qkv_join", "qkv_part", "qkv_rows", "table",
           "tp_join", "tp_shard"]
