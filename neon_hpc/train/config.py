"""Trainer section of the experiment config (owned by ``neon_hpc/train``)."""
from dataclasses import dataclass
from typing import Literal


@dataclass
class TrainConfig:
    steps: int = 8
    trajectories_per_step: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_eps: float = 0.2                # PPO ratio clip
    off_policy_correction: Literal["tis", "none"] = "tis"
    tis_cap: float = 2.0                 # truncated importance sampling cap per token
    kl_coef: float = 0.0                 # k3 KL toward the behaviour (engine) policy, per token
    advantage_norm: Literal["std", "none"] = "std"   # GRPO: divide by the group's reward std, or only centre
    router_replay: Literal["off", "replay"] = "replay"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    context_parallel: int = 1
    data_parallel: int = 1
    checkpoint_every: int = 4
    publish_every: int = 1
    publish_via: Literal["direct", "reshard"] = "direct"   # HF export: in-memory gather, or reshard the checkpoint
    wait_for_data_s: float = 600.0
    seed: int = 1234

    def validate(self):
        errs = []
        if self.steps < 1:
            errs.append(("steps", "must be >= 1"))
        if self.lr <= 0:
            errs.append(("lr", "must be > 0"))
        if self.clip_eps <= 0 or self.clip_eps >= 1:
            errs.append(("clip_eps", "must be in (0, 1)"))
        if self.kl_coef < 0:
            errs.append(("kl_coef", "must be >= 0"))
        for k in ("publish_every", "checkpoint_every", "trajectories_per_step"):
            if getattr(self, k) < 1:
                errs.append((k, "must be >= 1"))
        if self.tis_cap < 1.0:
            errs.append(("tis_cap", "must be >= 1.0 (it truncates importance ratios from above)"))
        for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "context_parallel", "data_parallel"):
            if getattr(self, k) < 1:
                errs.append((k, "must be >= 1"))
        return errs
