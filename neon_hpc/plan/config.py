"""Capacity-planning section of the experiment config (owned by ``neon_hpc/plan``)."""
from dataclasses import dataclass


@dataclass
class PlanConfig:
    total_gpus: int = 0                 # 0 = rollout + train groups of the launch section
    decode_tokens_per_s: float = 25.0   # per request, after PD disaggregation
    tool_latency_s: float = 2.0
    simulated_steps: int = 1000
    seed: int = 0

    def validate(self):
        errs = []
        if self.decode_tokens_per_s <= 0:
            errs.append(("decode_tokens_per_s", "must be > 0"))
        return errs
