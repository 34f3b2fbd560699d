"""Qwen3-MoE: the megatron <-> HF weight names and the ``config.json`` fields, both ways
(``hf_config_dict``, ``model_config_from_hf``).

Every layer MoE, GQA attention with fused ``linear_qkv`` (per query group ``[q heads, k, v]``)
and per-head q/k RMSNorm, softmax top-k router with renormalised weights.
"""

from __future__ import annotations

from typing import Any, Mapping

from neon_hpc.arch.model import ModelConfig
from neon_hpc.arch.rules import COMMON_LAYER_RULES, NameRule, hf_getter

NAME = "qwen3_moe"
HF_MODEL_TYPE = "qwen3_moe"
HF_ARCHITECTURE = "Qwen3MoeForCausalLM"

LAYER_RULES: dict[str, NameRule] = {
    **COMMON_LAYER_RULES,
    "self_attention.linear_qkv.weight": NameRule(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                              "self_attn.v_proj.weight"), "qkv", "rows"),
    "self_attention.linear_qkv.bias": NameRule(("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                            "self_attn.v_proj.bias"), "qkv", "rows"),
    "self_attention.q_layernorm.weight": NameRule(("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": NameRule(("self_attn.k_norm.weight",)),
}

# config.json field -> ModelConfig field (the same value under the two names)
HF_FIELDS: dict[str, str] = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "ffn_hidden_size",
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups", "head_dim": "head_dim",
    "moe_intermediate_size": "moe_ffn_hidden_size", "num_experts": "num_experts",
    "num_experts_per_tok": "moe_router_topk", "rms_norm_eps": "norm_epsilon",
    "max_position_embeddings": "max_position_embeddings",
}


def hf_fields(values: Mapping[str, Any]) -> dict:
    """The ``config.json`` fields of the ModelConfig fields in ``values`` (absent ones left out),
    plus what the architecture fixes (model type, renormalised top-k)."""
    out = {"model_type": HF_MODEL_TYPE, "architectures": [HF_ARCHITECTURE], "norm_topk_prob": True}
    out.update({hf: values[f] for hf, f in HF_FIELDS.items() if f in values})
    return out


def hf_config_dict(cfg: Any) -> dict:
    """The whole ``config.json`` of a ModelConfig (what the trainer writes and reshard reads)."""
    d = hf_fields({f: getattr(cfg, f) for f in HF_FIELDS.values()})
    d.update(decoder_sparse_step=1, mlp_only_layers=[],
             rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
             tie_word_embeddings=False, attention_bias=False, initializer_range=0.02, dtype="float32")
    return d


def model_config_from_hf(hf_cfg: Any) -> ModelConfig:
    """The ``model:`` section of an HF config (a dict or a transformers config object)."""
    g = hf_getter(hf_cfg)
    rope = g("rope_parameters") or {}
    return ModelConfig(
        arch=NAME, vocab_size=g("vocab_size"), hidden_size=g("hidden_size"),
        num_layers=g("num_hidden_layers"), num_attention_heads=g("num_attention_heads"),
        num_query_groups=g("num_key_value_heads"), head_dim=g("head_dim"),
        ffn_hidden_size=g("intermediate_size"), moe_ffn_hidden_size=g("moe_intermediate_size"),
        num_experts=g("num_experts"), moe_router_topk=g("num_experts_per_tok"),
        rope_theta=float(rope.get("rope_theta", g("rope_theta") or 10000.0)),
        max_position_embeddings=g("max_position_embeddings"), norm_epsilon=g("rms_norm_eps"))
