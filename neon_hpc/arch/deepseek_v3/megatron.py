"""DeepSeek-V3 (and Kimi-K2, the same weights under ``model_type: kimi_k2``).

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
- MLA runs on megatron's local spec with :class:`neon_hpc.models.core_attention.SDPACoreAttention`
  (megatron's local ``DotProductAttention`` cannot take a v head dim different from q/k).
"""

from __future__ import annotations

from typing import Any, Mapping

from neon_hpc.arch.deepseek_v3 import hfmap as _map
from neon_hpc.models.adapters.base import Adapter, _getter
from neon_hpc.config.model import ModelConfig

LAYER_RULES = _map.LAYER_RULES        # the rules live in hfmap.py beside this file (reshard reads them too)


class DeepseekV3Adapter(Adapter):
    name = _map.NAME
    hf_model_type = _map.HF_MODEL_TYPE
    hf_architecture = _map.HF_ARCHITECTURE
    layer_rules = LAYER_RULES

    # --- pure (validate / experiment_errors: this folder's config.py, via Adapter) ----------------
    def layer_suffixes(self, cfg: ModelConfig, layer: int) -> list[str]:
        att = ["self_attention.linear_kv_down_proj.weight", "self_attention.linear_kv_up_proj.weight",
               "self_attention.kv_layernorm.weight", "self_attention.linear_proj.weight"]
        att += (["self_attention.linear_q_down_proj.weight", "self_attention.linear_q_up_proj.weight",
                 "self_attention.q_layernorm.weight"] if cfg.q_lora_rank else ["self_attention.linear_q_proj.weight"])
        if layer < cfg.first_dense_layers:
            mlp = ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
        else:
            mlp = ["mlp.router.weight", "mlp.router.expert_bias"]
            if cfg.num_shared_experts:
                mlp += ["mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"]
        return ["input_layernorm.weight", "pre_mlp_layernorm.weight"] + att + mlp

    def rope_parameters(self, cfg: ModelConfig) -> dict:
        return _map.rope_parameters(cfg)

    def hf_config_dict(self, cfg: ModelConfig) -> dict:
        return _map.hf_config_dict(cfg)

    def model_config_from_hf(self, hf_cfg: Any) -> ModelConfig:
        g = _getter(hf_cfg)
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

    # --- heavy ------------------------------------------------------------------------------
    def transformer_config(self, cfg: ModelConfig, tp: int, ep: int, routing_replay: bool, base: dict,
                           overrides: Mapping[str, Any]):
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

    def layer_spec(self, cfg: ModelConfig, tcfg, vp_stage: int | None = None):
        """Per-layer local specs (dense first layers, then MoE) with MLA's core attention swapped
        for :class:`~neon_hpc.models.core_attention.SDPACoreAttention`."""
        # deferred: heavy (megatron)
        import megatron.core.transformer.multi_latent_attention as mla
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        # deferred: heavy (neon_hpc.models.core_attention: torch, numpy)
        from neon_hpc.models.core_attention import SDPACoreAttention
        if not isinstance(mla.TELinear, type):
            # Without Transformer Engine the name is a placeholder object; MLA's `spec in [TELinear]`
            # checks then compare a class with it. A class that nothing is an instance of keeps them false.
            mla.TELinear = type("NoTELinear", (), {})
        spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization="RMSNorm",
                                          vp_stage=vp_stage)
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        return spec


ADAPTER = DeepseekV3Adapter()
