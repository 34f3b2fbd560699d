"""Balancer section of the experiment config (owned by ``neon_hpc/balance``)."""
from dataclasses import dataclass
from typing import Literal


@dataclass
class BalanceConfig:
    planner: Literal["cost", "tokenkk", "flopkk", "sequential"] = "cost"
    tokens_per_microbatch: int = 4096   # token cap of one micro-batch of a DP rank (across its CP group)
    min_microbatches: int = 0           # fewest micro-batches per DP rank; 0 = train.pipeline_parallel
    shadow: bool = True                 # also report the baselines' predicted step time
    cost_a: float = 0.0                 # per-token cost; 0 = derive from the model config (or cost_file)
    cost_b: float = 0.0                 # per-token-pair cost; 0 = derive from the model config (or cost_file)
    cost_file: str = ""                 # JSON written by `neon-hpc balance calibrate` (its cost_model is used)
    split_threshold_tokens: int = 0     # pieces this long are zigzagged across CP ranks; 0 = auto
    split_sequences: bool = True        # let the cost planner split sequences across DP ranks
                                        # (false: whole sequences only, for a trainer without split pieces)

    def validate(self):
        errs = []
        if self.tokens_per_microbatch < 1:
            errs.append(("tokens_per_microbatch", "must be >= 1"))
        if self.min_microbatches < 0:
            errs.append(("min_microbatches", "must be >= 0 (0 = one per pipeline stage)"))
        if self.cost_a < 0:
            errs.append(("cost_a", "cost coefficients must be >= 0"))
        if self.cost_b < 0:
            errs.append(("cost_b", "cost coefficients must be >= 0"))
        if (self.cost_a > 0 or self.cost_b > 0) and self.cost_file:
            errs.append(("cost_file", "give either cost_a/cost_b or cost_file, not both"))
        if self.split_threshold_tokens < 0:
            errs.append(("split_threshold_tokens", "must be >= 0 (0 = auto)"))
        return errs
