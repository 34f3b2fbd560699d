"""Balancer section of the experiment config (owned by ``neon_hpc/balance``)."""
from dataclasses import dataclass
from typing import Literal

from neon_hpc.constraints import Rule, at_least


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

    CHECKS = {
        "tokens_per_microbatch": at_least(1),
        "min_microbatches": at_least(0, "0 = one per pipeline stage"),
        "cost_a": at_least(0, "0 = derive from the model config or cost_file"),
        "cost_b": at_least(0, "0 = derive from the model config or cost_file"),
        "split_threshold_tokens": at_least(0, "0 = auto"),
    }
    RULES = (
        Rule("cost_file", lambda c: not ((c.cost_a > 0 or c.cost_b > 0) and c.cost_file),
             "either cost_a/cost_b or cost_file, not both"),
    )
