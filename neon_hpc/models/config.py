"""Model section of the experiment config (owned by ``neon_hpc/models``)."""
from dataclasses import dataclass
from typing import Literal

from neon_hpc.constraints import Rule, above, at_least


@dataclass
class ModelConfig:
    """One MoE architecture, from which both the HF and the megatron-core models are built."""

    arch: Literal["qwen3_moe", "deepseek_v3"] = "qwen3_moe"
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    head_dim: int = 16
    ffn_hidden_size: int = 128          # dense layers (DeepSeek-style first layers)
    moe_ffn_hidden_size: int = 64
    num_experts: int = 4
    moe_router_topk: int = 2
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    norm_epsilon: float = 1e-6
    init_checkpoint: str = ""           # HF or torch_dist path to start from; "" = random init from seed
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
    )
