"""Qwen3-MoE: every layer MoE, GQA attention with per-head q/k RMSNorm, no shared experts.

``config.py``: its ``model:`` section; ``hfmap.py``: weight names and config.json fields;
``megatron.py``: megatron config and spec.
"""

from __future__ import annotations

from typing import Any

from neon_hpc.arch.base import Architecture, ShapeError, Shapes
from neon_hpc.arch.qwen3_moe import config as section, hfmap
from neon_hpc.arch.rules import QKVShape

# every layer's megatron weights (every layer is MoE), experts aside
_MOE_LAYER = ("input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.linear_qkv.weight",
              "self_attention.linear_proj.weight", "self_attention.q_layernorm.weight",
              "self_attention.k_layernorm.weight", "mlp.router.weight")


class Qwen3Moe(Architecture):
    name = hfmap.NAME
    mapping = hfmap
    config = section.Qwen3MoeConfig
    attention = "gqa"
    shape_fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "num_experts", "moe_intermediate_size")
    guessed_fields = ("intermediate_size", "norm_topk_prob")

    def model_errors(self, cfg: Any) -> list[tuple[str, str]]:
        return section.model_errors(cfg)

    def qkv_shape(self, cfg: Any) -> QKVShape:
        return QKVShape(cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim)

    def layer_suffixes(self, cfg: Any, layer: int) -> list[str]:
        return list(_MOE_LAYER)

    def fields_from_shapes(self, shapes: Shapes, proj, fc1) -> dict:
        """GQA shapes: k_layernorm = head_dim, linear_proj cols = heads x head_dim, linear_qkv rows =
        (heads + 2 groups) x head_dim.  The dense width is not in an all-MoE checkpoint: it is
        guessed as the expert width."""
        kn = shapes.layer("self_attention.k_layernorm.weight")
        qkv = shapes.layer("self_attention.linear_qkv.weight")
        if kn is None or qkv is None or proj is None:
            raise ShapeError("cannot derive head_dim / head counts (no k_layernorm, linear_qkv or linear_proj)")
        head_dim = kn[0]
        heads = proj[-1] // head_dim
        return dict(head_dim=head_dim, num_attention_heads=heads,
                    num_query_groups=(qkv[0] // head_dim - heads) // 2,
                    num_experts=fc1[0] if fc1 is not None and len(fc1) == 3 else None,
                    ffn_hidden_size=fc1[-2] // 2 if fc1 is not None else None)


ARCH = Qwen3Moe()
