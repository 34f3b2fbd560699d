"""Balancer section of the experiment config (owned by ``neon_hpc/balance``)."""
from dataclasses import dataclass
from typing import Literal

from neon_hpc.util.constraints import Rule, at_least, section


@section
@dataclass
class BalanceConfig:
    method: Literal["cost", "tokenkk", "flopkk", "sequential"] = "cost"
    tokens_per_microbatch: int = 4096   # token cap of one micro-batch of a DP rank (across its CP group)
    min_microbatches: int = 0           # fewest micro-batches per DP rank; 0 = train.pipeline_parallel
    shadow: bool = True                 # also report the baselines' predicted step time
    cost_a: float = 0.0                 # per-token cost; 0 = derive from the model config (or cost_file)
    cost_b: float = 0.0                 # per-token-pair cost; 0 = derive from the model config (or cost_file)
    cost_file: str = ""                 # JSON written by `neon-hpc costfit` (its cost_model is used)
    split_threshold_tokens: int = 0     # pieces this long are zigzagged across CP ranks; 0 = auto
                                        # (only with train.context_parallel > 1)
    split_sequences: bool | None = None  # the cost method cuts long sequences across DP ranks (the
                                        # trainer runs the pieces with a K/V exchange); None = true
                                        # for method: cost, false otherwise (only cost can split)

    CHECKS = {
        "tokens_per_microbatch": at_least(1),
        "min_microbatches": at_least(0, "0 = one per pipeline stage"),
        "cost_a": at_least(0, "0 = derive from the model config or cost_file"),
        "cost_b": at_least(0, "0 = derive from the model config or cost_file"),
        "split_threshold_tokens": at_least(0, "0 = auto"),
    }
    # renamed ("plan" and "planner" mean the capacity planner, neon_hpc/plan): an old config or
    # run.yaml that still sets it is told where it went
    MOVED = {"planner": "balance.method"}
    RULES = (
        Rule("cost_file", lambda c: not ((c.cost_a > 0 or c.cost_b > 0) and c.cost_file),
             "either cost_a/cost_b or cost_file, not both"),
        Rule("split_sequences", lambda c: not (c.split_sequences and c.method != "cost"),
             "true, but method {method!r} keeps sequences whole (only 'cost' splits): "
             "set balance.method: cost or balance.split_sequences: false"),
    )

    @property
    def splits(self) -> bool:
        """Whether the method may cut sequences across DP ranks (``split_sequences`` resolved)."""
        return self.method == "cost" if self.split_sequences is None else bool(self.split_sequences)
