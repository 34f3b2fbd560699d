"""Trainer section of the experiment config (owned by ``neon_hpc/train``)."""
from dataclasses import dataclass
from typing import Literal

from neon_hpc.constraints import Range, above, at_least, between


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
    data_parallel: int = 1               # the DP size: world = tp * pp * cp * dp (train/layout.py)
    pipeline_first_stage_layers: int = 0   # uneven PP: layers on the first stage (0 = even share)
    pipeline_last_stage_layers: int = 0    # uneven PP: layers on the last stage (0 = even share)
    virtual_pipeline_stages: int = 1     # > 1: interleaved 1F1B with this many model chunks per stage
    checkpoint_every: int = 4
    publish_every: int = 1
    publish_via: Literal["direct", "reshard"] = "direct"   # HF export: in-memory gather, or reshard the checkpoint
    wait_for_data_s: float = 600.0
    checkpoint_write_timeout_s: float = 1800.0   # a save whose megatron writers have not all reported by then fails
    seed: int = 1234

    CHECKS = {
        "steps": between(1, 10**9),
        "lr": above(0, le=1.0),
        "weight_decay": at_least(0),
        "grad_clip": at_least(0, "0 = no clipping"),
        "clip_eps": Range(gt=0, lt=1),
        "tis_cap": at_least(1.0, "it truncates importance ratios from above"),
        "kl_coef": at_least(0),
        **{k: at_least(1) for k in ("trajectories_per_step", "checkpoint_every", "publish_every",
                                    "tensor_parallel", "pipeline_parallel", "expert_parallel",
                                    "context_parallel", "data_parallel", "virtual_pipeline_stages")},
        "wait_for_data_s": above(0, note="seconds"),
        "checkpoint_write_timeout_s": above(0, note="seconds (train/writers.py: stuck checkpoint writers)"),
    }
