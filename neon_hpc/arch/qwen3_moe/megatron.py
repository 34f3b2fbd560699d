"""Qwen3-MoE: GQA with q/k RMSNorm per head, RoPE, every layer MoE, softmax top-k router with
renormalised top-k weights (HF ``norm_topk_prob=True`` == megatron ``moe_router_pre_softmax=False``),
SwiGLU experts, untied embeddings."""

from __future__ import annotations

from typing import Any, Mapping

from neon_hpc.arch.qwen3_moe import hfmap as _map
from neon_hpc.models.adapters.base import Adapter, QKVShape, _getter
from neon_hpc.config.model import ModelConfig

LAYER_RULES = _map.LAYER_RULES        # the rules live in hfmap.py beside this file (reshard reads them too)
_MOE_LAYER = ("input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.linear_qkv.weight",
              "self_attention.linear_proj.weight", "self_attention.q_layernorm.weight",
              "self_attention.k_layernorm.weight", "mlp.router.weight")


class Qwen3MoeAdapter(Adapter):
    name = _map.NAME
    hf_model_type = _map.HF_MODEL_TYPE
    hf_architecture = _map.HF_ARCHITECTURE
    layer_rules = LAYER_RULES

    def qkv_shape(self, cfg: ModelConfig) -> QKVShape:
        return QKVShape(cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim)

    def layer_suffixes(self, cfg: ModelConfig, layer: int) -> list[str]:
        return list(_MOE_LAYER)

    def hf_config_dict(self, cfg: ModelConfig) -> dict:
        return _map.hf_config_dict(cfg)

    def model_config_from_hf(self, hf_cfg: Any) -> ModelConfig:
        g = _getter(hf_cfg)
        rope = g("rope_parameters") or {}
        return ModelConfig(
            arch=self.name, vocab_size=g("vocab_size"), hidden_size=g("hidden_size"),
            num_layers=g("num_hidden_layers"), num_attention_heads=g("num_attention_heads"),
            num_query_groups=g("num_key_value_heads"), head_dim=g("head_dim"),
            ffn_hidden_size=g("intermediate_size"), moe_ffn_hidden_size=g("moe_intermediate_size"),
            num_experts=g("num_experts"), moe_router_topk=g("num_experts_per_tok"),
            rope_theta=float(rope.get("rope_theta", g("rope_theta") or 10000.0)),
            max_position_embeddings=g("max_position_embeddings"), norm_epsilon=g("rms_norm_eps"))

    def transformer_config(self, cfg: ModelConfig, tp: int, ep: int, routing_replay: bool, base: dict,
                           overrides: Mapping[str, Any]):
        from megatron.core.transformer.transformer_config import TransformerConfig  # deferred: heavy (megatron)
        if cfg.num_query_groups % tp:
            raise ValueError(f"tensor_parallel={tp} must divide model.num_query_groups={cfg.num_query_groups}")
        kw = dict(base, num_query_groups=cfg.num_query_groups, kv_channels=cfg.head_dim, qk_layernorm=True,
                  add_qkv_bias=False, moe_router_score_function="softmax", moe_router_pre_softmax=False)
        kw.update(overrides)
        return TransformerConfig(**kw)

    def layer_spec(self, cfg: ModelConfig, tcfg, vp_stage: int | None = None):   # one spec for every layer
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # deferred: heavy (megatron)
        return get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False,
                                        qk_layernorm=True, normalization="RMSNorm")


ADAPTER = Qwen3MoeAdapter()
