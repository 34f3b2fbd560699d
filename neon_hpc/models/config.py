"""Model section of the experiment config (owned by ``neon_hpc/models``)."""
from dataclasses import dataclass
from typing import Literal


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

    def validate(self):
        errs = []
        if self.num_attention_heads % self.num_query_groups:
            errs.append(("num_attention_heads", f"must be a multiple of num_query_groups ({self.num_query_groups})"))
        if not 1 <= self.moe_router_topk <= self.num_experts:
            errs.append(("moe_router_topk", f"must be in 1..num_experts ({self.num_experts})"))
        for k in ("vocab_size", "hidden_size", "num_layers", "head_dim", "num_experts"):
            if getattr(self, k) <= 0:
                errs.append((k, "must be positive"))
        return errs
