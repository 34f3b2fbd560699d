"""Qwen3-MoE's ``model:`` section and its rules (pure arithmetic on the config)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from neon_hpc.arch.model import Errors, ModelConfig
from neon_hpc.util.constraints import section


@section
@dataclass
class Qwen3MoeConfig(ModelConfig):
    """Qwen3-MoE: GQA attention with per-head QK norm, every layer MoE, softmax top-k router."""

    arch: Literal["qwen3_moe"] = "qwen3_moe"


def model_errors(cfg: ModelConfig) -> Errors:
    errs = []
    if cfg.num_attention_heads % cfg.num_query_groups:
        errs.append(("num_attention_heads", f"must be a multiple of num_query_groups ({cfg.num_query_groups})"))
    if cfg.head_dim <= 0:
        errs.append(("head_dim", "must be positive"))
    return errs   # other architectures' fields are not fields of this section: the loader refuses them by name
