"""DeepSeek-V3 (and Kimi-K2, the same weights): the megatron <-> HF weight names and the
``config.json`` fields.

Multi-latent attention (query/KV LoRA projections and their norms), dense first layers
(``first_k_dense_replace``), shared experts, a sigmoid router with an expert-score bias
(megatron ``expert_bias``, HF ``e_score_correction_bias``), YaRN RoPE when ``yarn_factor`` is set.
MLA needs no reordering: megatron's q/kv up-projections are per head ``[nope, rope]`` /
``[k_nope, v]`` like HF's, and megatron de-interleaves the rope dims as HF does with
``rope_interleave: true``.
"""

from __future__ import annotations

from typing import Any, Mapping

from neon_hpc.hfmap.rules import COMMON_LAYER_RULES, Rule

NAME = "deepseek_v3"
HF_MODEL_TYPE = "deepseek_v3"
HF_ARCHITECTURE = "DeepseekV3ForCausalLM"

LAYER_RULES: dict[str, Rule] = {
    **COMMON_LAYER_RULES,
    "mlp.router.expert_bias": Rule(("mlp.gate.e_score_correction_bias",)),
    "mlp.shared_experts.linear_fc1.weight": Rule(("mlp.shared_experts.gate_proj.weight",
                                                  "mlp.shared_experts.up_proj.weight"), "swiglu", "swiglu"),
    "mlp.shared_experts.linear_fc2.weight": Rule(("mlp.shared_experts.down_proj.weight",), tp="cols"),
    "self_attention.linear_q_proj.weight": Rule(("self_attn.q_proj.weight",), tp="rows"),
    "self_attention.linear_q_down_proj.weight": Rule(("self_attn.q_a_proj.weight",), tp="rows"),
    "self_attention.linear_q_up_proj.weight": Rule(("self_attn.q_b_proj.weight",), tp="rows"),
    "self_attention.q_layernorm.weight": Rule(("self_attn.q_a_layernorm.weight",)),
    "self_attention.linear_kv_down_proj.weight": Rule(("self_attn.kv_a_proj_with_mqa.weight",), tp="rows"),
    "self_attention.linear_kv_up_proj.weight": Rule(("self_attn.kv_b_proj.weight",), tp="rows"),
    "self_attention.kv_layernorm.weight": Rule(("self_attn.kv_a_layernorm.weight",)),
    # Transformer Engine spellings of the two MLA norms (fused into the up-projections)
    "self_attention.linear_q_up_proj.layer_norm_weight": Rule(("self_attn.q_a_layernorm.weight",), alias=True),
    "self_attention.linear_kv_up_proj.layer_norm_weight": Rule(("self_attn.kv_a_layernorm.weight",), alias=True),
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
