"""Qwen3-MoE's megatron side, ``transformer_config`` and ``layer_spec`` (what
:mod:`neon_hpc.models.megatron` calls): GQA with q/k RMSNorm per head, RoPE, every layer MoE,
softmax top-k router with renormalised top-k weights (HF ``norm_topk_prob=True`` == megatron
``moe_router_pre_softmax=False``), SwiGLU experts, untied embeddings."""

from __future__ import annotations

from typing import Any, Mapping

from neon_hpc.arch.model import ModelConfig


def transformer_config(cfg: ModelConfig, tp: int, ep: int, routing_replay: bool, base: dict,
                       overrides: Mapping[str, Any]):
    """The TransformerConfig of ``cfg``: ``base`` (the fields every architecture shares) plus this
    architecture's, then ``overrides``."""
    from megatron.core.transformer.transformer_config import TransformerConfig  # deferred: heavy (megatron)
    if cfg.num_query_groups % tp:
        raise ValueError(f"tensor_parallel={tp} must divide model.num_query_groups={cfg.num_query_groups}")
    kw = dict(base, num_query_groups=cfg.num_query_groups, kv_channels=cfg.head_dim, qk_layernorm=True,
              add_qkv_bias=False, moe_router_score_function="softmax", moe_router_pre_softmax=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def layer_spec(cfg: ModelConfig, tcfg, vp_stage: int | None = None):   # one spec for every layer
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # deferred: heavy (megatron)
    return get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=True, normalization="RMSNorm")
