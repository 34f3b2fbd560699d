"""DeepSeek-V3 / Kimi-K2's ``model:`` section and its rules (pure arithmetic on the config; the
semantics are pinned in :mod:`neon_hpc.arch.deepseek_v3.megatron`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from neon_hpc.arch.model import Errors, ModelConfig
from neon_hpc.util.constraints import section


@section
@dataclass
class DeepSeekV3Config(ModelConfig):
    """DeepSeek-V3 / Kimi-K2: multi-latent attention, dense first layers, shared experts, sigmoid
    router with expert-score bias and grouped top-k, optional YaRN RoPE scaling."""

    arch: Literal["deepseek_v3", "kimi_k2"] = "deepseek_v3"   # kimi_k2 = deepseek_v3
    q_lora_rank: int = 0                # 0 = no query compression (one linear_q_proj)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    first_dense_layers: int = 0         # HF first_k_dense_replace
    num_shared_experts: int = 0         # shared expert width = num_shared_experts * moe_ffn_hidden_size
    router_groups: int = 1              # HF n_group
    router_group_topk: int = 1          # HF topk_group
    routed_scaling_factor: float = 1.0
    # YaRN RoPE scaling (HF rope_parameters rope_type "yarn"); yarn_factor 0 = plain RoPE
    yarn_factor: float = 0.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0


def model_errors(cfg: Any) -> Errors:
    errs = []
    unset = [k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if getattr(cfg, k) < 1]
    if unset:
        errs.append((unset[0], f"multi-latent attention needs {', '.join(unset)} >= 1 (DeepSeek-V3/Kimi-K2: "
                               f"kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128)"))
    if cfg.qk_rope_head_dim % 2:
        errs.append(("qk_rope_head_dim", "must be even (RoPE rotates pairs)"))
    if cfg.num_query_groups != cfg.num_attention_heads:
        errs.append(("num_query_groups", f"MLA has one latent KV per head: set it to num_attention_heads "
                                         f"({cfg.num_attention_heads})"))
    if not 0 <= cfg.first_dense_layers < cfg.num_layers:
        errs.append(("first_dense_layers", f"must be in [0, num_layers={cfg.num_layers}) (at least one MoE layer)"))
    g, gk = cfg.router_groups, cfg.router_group_topk
    if g < 1 or cfg.num_experts % g:
        errs.append(("router_groups", f"must divide num_experts ({cfg.num_experts})"))
    elif not 1 <= gk <= g:
        errs.append(("router_group_topk", f"must be in 1..router_groups ({g})"))
    elif g > 1 and cfg.moe_router_topk != 2 * gk:
        errs.append(("router_group_topk", f"with router_groups > 1 megatron scores a group by its top "
                                          f"topk/group_topk experts and HF by its top 2: needs moe_router_topk "
                                          f"({cfg.moe_router_topk}) == 2 * router_group_topk"))
    elif g > 1 and cfg.num_experts // g < 2:
        errs.append(("router_groups", "each group needs at least 2 experts"))
    if cfg.routed_scaling_factor <= 0:
        errs.append(("routed_scaling_factor", "must be > 0"))
    if cfg.yarn_factor and cfg.yarn_factor < 1:
        errs.append(("yarn_factor", "0 (plain RoPE) or >= 1"))
    return errs


def experiment_errors(exp: Any) -> Errors:
    cfg, t = exp.model, exp.train
    errs = []
    tp = t.tensor_parallel
    for k, n in (("num_attention_heads", cfg.num_attention_heads),
                 ("kv_lora_rank + qk_rope_head_dim", cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                 ("q_lora_rank", cfg.q_lora_rank or tp)):
        if n % tp:
            errs.append(("train.tensor_parallel", f"{tp} must divide model.{k} ({n}): the local spec "
                                                  f"column-splits every MLA projection"))
    return errs
