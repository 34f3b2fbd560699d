"""DeepSeek-V3 (and Kimi-K2, the same weights under ``model_type: kimi_k2``): the megatron side,
``transformer_config`` and ``layer_spec`` (what :mod:`neon_hpc.models.megatron` calls).

Multi-latent attention (query LoRA rank, KV LoRA rank, rope/nope q/k head dims, v head dim),
the first ``first_dense_layers`` layers dense (megatron ``moe_layer_freq``, HF
``first_k_dense_replace``), shared experts, a sigmoid router whose choice adds an expert-score
bias (HF ``e_score_correction_bias``, megatron ``expert_bias``) with grouped top-k, renormalised
top-k weights times ``routed_scaling_factor``, and YaRN RoPE when ``yarn_factor`` is set.

Semantics pinned here (both homes compute them the same way):

- group choice: each group scores the sum of its top ``topk // topk_group`` expert scores
  (megatron's rule); HF DeepseekV3 always sums the top 2, so ``router_groups > 1`` needs
  ``moe_router_topk == 2 * router_group_topk`` (true for DeepSeek-V3: 8 / 4).  Kimi-K2 uses one group.
- the expert bias is not updated by the trainer (``moe_router_bias_update_rate=0``): RL keeps
  the released routing balance instead of re-balancing it from rollout batches.
- MLA runs on megatron's local spec; the models give it :class:`neon_hpc.models.core_attention.SDPACoreAttention`
  (megatron's local ``DotProductAttention`` cannot take a v head dim different from q/k).
"""

from __future__ import annotations

from typing import Any, Mapping

from neon_hpc.arch.model import ModelConfig


def transformer_config(cfg: ModelConfig, tp: int, ep: int, routing_replay: bool, base: dict,
                       overrides: Mapping[str, Any]):
    """The TransformerConfig of ``cfg``: ``base`` (the fields every architecture shares) plus this
    architecture's, then ``overrides``."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig  # deferred: heavy (megatron)
    if cfg.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel={tp} must divide model.num_attention_heads={cfg.num_attention_heads}")
    for k, n in (("kv_lora_rank + qk_rope_head_dim", cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                 ("q_lora_rank", cfg.q_lora_rank or tp)):
        if n % tp:   # the local spec column-splits MLA's down-projections too
            raise ValueError(f"tensor_parallel={tp} must divide model.{k}={n}")
    yarn = bool(cfg.yarn_factor)
    kw = dict(
        base, multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim, qk_pos_emb_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        qk_layernorm=True, rope_type="yarn" if yarn else "rope", rotary_base=float(cfg.rope_theta),
        moe_layer_freq=[0 if i < cfg.first_dense_layers else 1 for i in range(cfg.num_layers)],
        moe_shared_expert_intermediate_size=(cfg.moe_ffn_hidden_size * cfg.num_shared_experts) or None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0, moe_router_pre_softmax=False, moe_router_dtype="fp32",
        moe_router_num_groups=cfg.router_groups if cfg.router_groups > 1 else None,
        moe_router_group_topk=cfg.router_group_topk if cfg.router_groups > 1 else None,
        moe_router_topk_scaling_factor=float(cfg.routed_scaling_factor))
    if yarn:
        kw.update(rotary_scaling_factor=float(cfg.yarn_factor),
                  original_max_position_embeddings=int(cfg.yarn_original_max_position_embeddings),
                  beta_fast=float(cfg.yarn_beta_fast), beta_slow=float(cfg.yarn_beta_slow),
                  mscale=float(cfg.yarn_mscale), mscale_all_dim=float(cfg.yarn_mscale_all_dim))
    kw.pop("kv_channels", None)
    kw.update(overrides)
    return MLATransformerConfig(**kw)


def layer_spec(cfg: ModelConfig, tcfg, vp_stage: int | None = None):
    """Per-layer local specs (dense first layers, then MoE); the models swap MLA's core attention
    for their fused one (``neon_hpc.models.megatron.layer_spec``: every ``attention = "mla"``
    architecture's)."""
    # deferred: heavy (megatron)
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    if not isinstance(mla.TELinear, type):
        # Without Transformer Engine the name is a placeholder object; MLA's `spec in [TELinear]`
        # checks then compare a class with it. A class that nothing is an instance of keeps them false.
        mla.TELinear = type("NoTELinear", (), {})
    return get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization="RMSNorm",
                                      vp_stage=vp_stage)
