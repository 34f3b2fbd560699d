"""Model section of the experiment config (owned by ``neon_hpc/models``).

The architecture-specific checks live in the adapters (:mod:`neon_hpc.models.adapters`);
the ``arch`` rule runs the adapter of ``arch``.
"""
from dataclasses import dataclass
from typing import Literal

from neon_hpc.constraints import Rule, above, at_least


@dataclass
class ModelConfig:
    """One MoE architecture, from which both the HF and the megatron-core models are built."""

    arch: Literal["qwen3_moe", "deepseek_v3", "kimi_k2"] = "qwen3_moe"   # kimi_k2 = deepseek_v3
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2           # qwen3_moe: KV heads (GQA); deepseek_v3 (MLA): must equal the heads
    head_dim: int = 16                  # qwen3_moe only (MLA uses the qk_*/v_head_dim fields)
    ffn_hidden_size: int = 128          # dense layers (DeepSeek-style first layers)
    moe_ffn_hidden_size: int = 64
    num_experts: int = 4
    moe_router_topk: int = 2
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    norm_epsilon: float = 1e-6
    # --- deepseek_v3 / kimi_k2 (multi-latent attention, dense first layers, shared experts,
    # sigmoid router with expert-score bias and grouped top-k); ignored by qwen3_moe
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
    init_checkpoint: str = ""           # HF or torch_dist path to start from; "" = random init from seed
    # the rollout's tokenizer: "xrd-tiny" (built in, 256 ids), a directory or file with
    # neon_tokenizer.json, a local HF tokenizer directory, or "" = the one saved in init_checkpoint
    tokenizer: str = "xrd-tiny"
    seed: int = 1234

    CHECKS = {
        **{k: at_least(1) for k in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                                    "num_query_groups", "head_dim", "ffn_hidden_size", "moe_ffn_hidden_size",
                                    "num_experts", "moe_router_topk", "max_position_embeddings")},
        "rope_theta": above(0),
        "norm_epsilon": above(0, le=1.0),
    }
    RULES = (
        Rule("num_attention_heads", lambda c: c.num_attention_heads % c.num_query_groups == 0,
             "a multiple of num_query_groups ({num_query_groups})"),
        Rule("moe_router_topk", lambda c: c.moe_router_topk <= c.num_experts, "in 1..num_experts ({num_experts})"),
        # the architecture's own rules (MLA dims, dense layers, router groups, ...): its adapter
        Rule("arch", lambda c: not arch_errors(c), lambda c: "; ".join(f"model.{k}: {m}" for k, m in arch_errors(c))),
    )


def arch_errors(cfg: ModelConfig) -> list[tuple[str, str]]:
    """``[(field, message)]`` from the adapter of ``cfg.arch`` (empty when the model fits it)."""
    from neon_hpc.models.adapters import get_adapter
    return get_adapter(cfg.arch).validate(cfg)
