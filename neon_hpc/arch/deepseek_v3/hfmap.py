"""DeepSeek-V3 (and Kimi-K2, the same weights): the megatron <-> HF weight names and the
``config.json`` fields, both ways (``hf_config_dict``, ``model_config_from_hf``).

Multi-latent attention (query/KV LoRA projections and their norms), dense first layers
(``first_k_dense_replace``), shared experts, a sigmoid router with an expert-score bias
(megatron ``expert_bias``, HF ``e_score_correction_bias``), YaRN RoPE when ``yarn_factor`` is set.
MLA needs no reordering: megatron's q/kv up-projections are per head ``[nope, rope]`` /
``[k_nope, v]`` like HF's, and megatron de-interleaves the rope dims as HF does with
``rope_interleave: true``.
"""

from __future__ import annotations

from typing import Any, Mapping

from neon_hpc.arch.model import ModelConfig
from neon_hpc.arch.rules import COMMON_LAYER_RULES, NameRule, hf_getter

NAME = "deepseek_v3"
HF_MODEL_TYPE = "deepseek_v3"
HF_ARCHITECTURE = "DeepseekV3ForCausalLM"

LAYER_RULES: dict[str, NameRule] = {
    **COMMON_LAYER_RULES,
    "mlp.router.expert_bias": NameRule(("mlp.gate.e_score_correction_bias",)),
    "mlp.shared_experts.linear_fc1.weight": NameRule(("mlp.shared_experts.gate_proj.weight",
                                                  "mlp.shared_experts.up_proj.weight"), "swiglu", "swiglu"),
    "mlp.shared_experts.linear_fc2.weight": NameRule(("mlp.shared_experts.down_proj.weight",), tp="cols"),
    "self_attention.linear_q_proj.weight": NameRule(("self_attn.q_proj.weight",), tp="rows"),
    "self_attention.linear_q_down_proj.weight": NameRule(("self_attn.q_a_proj.weight",), tp="rows"),
    "self_attention.linear_q_up_proj.weight": NameRule(("self_attn.q_b_proj.weight",), tp="rows"),
    "self_attention.q_layernorm.weight": NameRule(("self_attn.q_a_layernorm.weight",)),
    "self_attention.linear_kv_down_proj.weight": NameRule(("self_attn.kv_a_proj_with_mqa.weight",), tp="rows"),
    "self_attention.linear_kv_up_proj.weight": NameRule(("self_attn.kv_b_proj.weight",), tp="rows"),
    "self_attention.kv_layernorm.weight": NameRule(("self_attn.kv_a_layernorm.weight",)),
    # Transformer Engine spellings of the two MLA norms (fused into the up-projections)
    "self_attention.linear_q_up_proj.layer_norm_weight": NameRule(("self_attn.q_a_layernorm.weight",), alias=True),
    "self_attention.linear_kv_up_proj.layer_norm_weight": NameRule(("self_attn.kv_a_layernorm.weight",), alias=True),
}

# config.json field -> ModelConfig field (the same value under the two names; MLA has one
# latent KV per head, so num_key_value_heads is the head count)
HF_FIELDS: dict[str, str] = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "ffn_hidden_size",
    "moe_intermediate_size": "moe_ffn_hidden_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_attention_heads",
    "n_shared_experts": "num_shared_experts", "n_routed_experts": "num_experts",
    "routed_scaling_factor": "routed_scaling_factor", "kv_lora_rank": "kv_lora_rank",
    "q_lora_rank": "q_lora_rank", "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "qk_nope_head_dim": "qk_nope_head_dim", "n_group": "router_groups", "topk_group": "router_group_topk",
    "num_experts_per_tok": "moe_router_topk", "first_k_dense_replace": "first_dense_layers",
    "rms_norm_eps": "norm_epsilon", "max_position_embeddings": "max_position_embeddings",
}


def hf_fields(values: Mapping[str, Any]) -> dict:
    """The ``config.json`` fields of the ModelConfig fields in ``values`` (absent ones left out),
    plus what the architecture fixes (model type, renormalised top-k, interleaved rope dims).
    ``q_lora_rank`` 0 (no query compression) is HF's ``null``."""
    out = {"model_type": HF_MODEL_TYPE, "architectures": [HF_ARCHITECTURE], "norm_topk_prob": True,
           "rope_interleave": True}
    out.update({hf: values[f] for hf, f in HF_FIELDS.items() if f in values})
    if "q_lora_rank" in out:
        out["q_lora_rank"] = out["q_lora_rank"] or None
    return out


def rope_parameters(cfg: Any) -> dict:
    if not cfg.yarn_factor:
        return {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    return {"rope_type": "yarn", "rope_theta": float(cfg.rope_theta), "factor": float(cfg.yarn_factor),
            "original_max_position_embeddings": int(cfg.yarn_original_max_position_embeddings),
            "beta_fast": float(cfg.yarn_beta_fast), "beta_slow": float(cfg.yarn_beta_slow),
            "mscale": float(cfg.yarn_mscale), "mscale_all_dim": float(cfg.yarn_mscale_all_dim)}


def hf_config_dict(cfg: Any) -> dict:
    """The whole ``config.json`` of a ModelConfig (what the trainer writes and reshard reads)."""
    d = hf_fields({f: getattr(cfg, f) for f in HF_FIELDS.values()})
    d.update(routed_scaling_factor=float(cfg.routed_scaling_factor), hidden_act="silu",
             rope_parameters=rope_parameters(cfg), tie_word_embeddings=False, attention_bias=False,
             num_nextn_predict_layers=0, initializer_range=0.02, dtype="float32")
    return d


def model_config_from_hf(hf_cfg: Any) -> ModelConfig:
    """The ``model:`` section of an HF config (a dict or a transformers config object)."""
    g = hf_getter(hf_cfg)
    rope = g("rope_parameters") or g("rope_scaling") or {}
    yarn = rope.get("rope_type", rope.get("type")) == "yarn"
    heads = g("num_attention_heads")
    return ModelConfig(
        arch="deepseek_v3", vocab_size=g("vocab_size"), hidden_size=g("hidden_size"),
        num_layers=g("num_hidden_layers"), num_attention_heads=heads, num_query_groups=heads,
        ffn_hidden_size=g("intermediate_size"), moe_ffn_hidden_size=g("moe_intermediate_size"),
        num_experts=g("n_routed_experts"), moe_router_topk=g("num_experts_per_tok"),
        rope_theta=float(rope.get("rope_theta", g("rope_theta") or 10000.0)),
        max_position_embeddings=g("max_position_embeddings"), norm_epsilon=g("rms_norm_eps"),
        q_lora_rank=g("q_lora_rank") or 0, kv_lora_rank=g("kv_lora_rank"),
        qk_nope_head_dim=g("qk_nope_head_dim"), qk_rope_head_dim=g("qk_rope_head_dim"),
        v_head_dim=g("v_head_dim"), first_dense_layers=g("first_k_dense_replace") or 0,
        num_shared_experts=g("n_shared_experts") or 0, router_groups=g("n_group") or 1,
        router_group_topk=g("topk_group") or 1, routed_scaling_factor=float(g("routed_scaling_factor") or 1.0),
        yarn_factor=float(rope.get("factor", 0.0)) if yarn else 0.0,
        yarn_original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 4096)),
        yarn_beta_fast=float(rope.get("beta_fast", 32.0)), yarn_beta_slow=float(rope.get("beta_slow", 1.0)),
        yarn_mscale=float(rope.get("mscale", 1.0)), yarn_mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)))
