"""DeepSeek-V3 (and Kimi-K2, the same weights): multi-latent attention, dense first layers,
shared experts, a sigmoid router with expert-score bias and grouped top-k.

``config.py``: its ``model:`` section; ``hfmap.py``: weight names and config.json fields;
``megatron.py``: megatron config and spec.
"""

from __future__ import annotations

from typing import Any

from neon_hpc.arch.base import Architecture, AttentionParams, ShapeError, Shapes
from neon_hpc.arch.deepseek_v3 import config as section, hfmap


class DeepseekV3(Architecture):
    name = hfmap.NAME
    aliases = ("kimi_k2",)
    mapping = hfmap
    config = section.DeepSeekV3Config
    attention = "mla"
    default_dense_layers = 1      # DeepSeek-V3's first layer is dense (first_k_dense_replace)
    default_shared_experts = 1
    shape_fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "n_routed_experts",
                    "moe_intermediate_size", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                    "v_head_dim", "first_k_dense_replace", "n_shared_experts")
    guessed_fields = ("norm_topk_prob", "rope_interleave")
    derive_guessed = ("routed_scaling_factor", "n_group", "topk_group")

    def model_errors(self, cfg: Any) -> list[tuple[str, str]]:
        return section.model_errors(cfg)

    def experiment_errors(self, exp: Any) -> list[tuple[str, str]]:
        return section.experiment_errors(exp)

    def dense_layers(self, cfg: Any) -> int:
        return cfg.first_dense_layers

    def layer_suffixes(self, cfg: Any, layer: int) -> list[str]:
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

    def shared_experts(self, cfg: Any) -> int:
        return cfg.num_shared_experts

    def attention_params(self, h: int, heads: int, groups: int, head_dim: int, *, q_lora: int | None,
                         kv_lora: int | None, rope_d: int | None, v_d: int) -> AttentionParams:
        """MLA when its ranks are known (else counted as GQA with ``head_dim``): ``head_dim`` is the
        no-RoPE part of a query/key head; query LoRA optional (``q_lora`` 0 or None: a full Q)."""
        if kv_lora is None or rope_d is None:
            return super().attention_params(h, heads, groups, head_dim, q_lora=q_lora, kv_lora=kv_lora,
                                            rope_d=rope_d, v_d=v_d)
        d_qk = head_dim + rope_d
        q_params = (h * q_lora + q_lora * heads * d_qk) if q_lora else h * heads * d_qk
        kv_params = h * (kv_lora + rope_d) + kv_lora * heads * (head_dim + v_d)
        return AttentionParams(q_params + kv_params + heads * v_d * h, d_qk, v_d, "mla")

    def kv_cache_values_per_token_layer(self, cfg: Any, attn_tp: int) -> float:
        """MLA caches the compressed latent and the RoPE key, replicated over the attention TP group
        (a config without a latent rank is counted as K and V heads, as the balancer's FLOPs are)."""
        if not getattr(cfg, "kv_lora_rank", 0):
            return super().kv_cache_values_per_token_layer(cfg, attn_tp)
        return float(cfg.kv_lora_rank + cfg.qk_rope_head_dim)

    def fields_from_shapes(self, shapes: Shapes, proj, fc1) -> dict:
        """MLA shapes.  With h heads, nope/rope/v head dims n/r/v: q_up rows = h(n+r), kv_up rows =
        h(n+v), linear_proj cols = h*v, kv_down rows = kv_rank + r."""
        kv_norm = shapes.layer("self_attention.kv_layernorm.weight") or \
            shapes.layer("self_attention.linear_kv_up_proj.layer_norm_weight")
        kv_down = shapes.layer("self_attention.linear_kv_down_proj.weight")
        kv_up = shapes.layer("self_attention.linear_kv_up_proj.weight")
        q_up = shapes.layer("self_attention.linear_q_up_proj.weight") or \
            shapes.layer("self_attention.linear_q_proj.weight")
        q_down = shapes.layer("self_attention.linear_q_down_proj.weight")
        if None in (kv_norm, kv_down, kv_up, q_up, proj):
            raise ShapeError("cannot derive the MLA dimensions (missing kv_layernorm, linear_kv_down_proj, "
                             "linear_kv_up_proj, linear_q_up_proj or linear_proj)")
        kv_rank = kv_norm[0]
        rope = kv_down[0] - kv_rank
        h_nope = kv_up[0] - proj[-1]
        heads = (q_up[0] - h_nope) // rope
        dense = shapes.dense_layers()
        dense_fc1 = shapes.tensor(f"decoder.layers.{dense[0]}.mlp.linear_fc1.weight") if dense else None
        shared = shapes.layer("mlp.shared_experts.linear_fc1.weight")
        moe_i = fc1[-2] // 2 if fc1 is not None else None
        return dict(num_attention_heads=heads, q_lora_rank=q_down[0] if q_down is not None else 0,
                    kv_lora_rank=kv_rank, qk_rope_head_dim=rope, qk_nope_head_dim=h_nope // heads,
                    v_head_dim=proj[-1] // heads, num_experts=fc1[0] if fc1 is not None else None,
                    first_dense_layers=len(dense), ffn_hidden_size=dense_fc1[0] // 2 if dense_fc1 else moe_i,
                    num_shared_experts=(shared[0] // 2) // moe_i if shared is not None and moe_i else 0)


ARCH = DeepseekV3()
