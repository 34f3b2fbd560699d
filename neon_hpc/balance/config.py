"""Balancer section of the experiment config (owned by ``neon_hpc/balance``)."""
from dataclasses import dataclass
from typing import Literal


@dataclass
class BalanceConfig:
    planner: Literal["cost", "tokenkk", "sequential"] = "cost"
    tokens_per_microbatch: int = 4096
    shadow: bool = True                 # also report the baseline's predicted step time
    cost_a: float = 0.0                 # per-token cost; 0 = derive from the model config
    cost_b: float = 0.0                 # per-token-pair cost; 0 = derive from the model config
    split_threshold_tokens: int = 0     # split longer sequences into CP chunks; 0 = auto

    def validate(self):
        errs = []
        if self.tokens_per_microbatch < 1:
            errs.append(("tokens_per_microbatch", "must be >= 1"))
        if self.cost_a < 0 or self.cost_b < 0:
            errs.append(("cost_a", "cost coefficients must be >= 0"))
        return errs
