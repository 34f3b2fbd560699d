"""Trainer section of the experiment config, and the trainer's parallel layout arithmetic
(plain arithmetic on the config: no torch, no processes).

The layout rules, which read the model and launch sections too, are in
``neon_hpc/config/cross.py`` (``layout_errors``, ``launch_world_errors``): the trainer checks
them before it builds anything (:func:`neon_hpc.train.loop.check_config`) and the config loader
runs the same list with its other cross-section rules, so ``neon-hpc config check`` refuses a
layout the trainer cannot honour before any process starts, with the key to change.
:mod:`neon_hpc.train.layout` re-exports them beside the model-chunk assignment.

World: ``tp * pp * cp * dp`` ranks (``train.data_parallel`` is the DP size, not a hint).
Expert layout per pipeline stage: ``ep * expert_tp(=1) * expert_dp = tp * cp * dp``, so ``ep``
must divide ``tp * cp * dp``.  Layers per pipeline stage: even, or with
``train.pipeline_first_stage_layers`` / ``pipeline_last_stage_layers`` set the first/last
stage take that many and the others share the rest evenly (megatron-core's
``num_layers_in_first/last_pipeline_stage``).  With ``train.virtual_pipeline_stages: V > 1``
(interleaved 1F1B) V must divide every stage's layer count (megatron's rule, uneven first/last
stages included).
"""
from dataclasses import dataclass
from typing import Any, Literal

from neon_hpc.util.constraints import Range, Rule, above, at_least, between, section


@section
@dataclass
class TrainConfig:
    mode: Literal["rl", "sft"] = "rl"   # sft: cross-entropy on the loss-masked tokens of train.sft_data (train/sft.py)
    sft_data: str = ""                   # sft: a folder of HDF5 trajectory shards (e.g. `neon-hpc demos --out DIR`)
    steps: int = 8
    trajectories_per_step: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_eps: float = 0.2                # PPO ratio clip
    kl_coef: float = 0.0                 # k3 KL toward the behaviour (engine) policy, per token
    advantage_norm: Literal["std", "none"] = "std"   # GRPO: divide by the group's reward std, or only centre
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    context_parallel: int = 1
    data_parallel: int = 1               # the DP size: world = tp * pp * cp * dp (world_size below)
    pipeline_first_stage_layers: int = 0   # uneven PP: layers on the first stage (0 = even share)
    pipeline_last_stage_layers: int = 0    # uneven PP: layers on the last stage (0 = even share)
    virtual_pipeline_stages: int = 1     # > 1: interleaved 1F1B with this many model chunks per stage
    # checkpoints/step_N every this many steps (0: none by count) ...
    checkpoint_every: int = 0
    # ... and at the first step this many seconds after the last one (0: none by time); also at the
    # last step and on a preemption signal. By time by default: a count that suits a 0.2 s step
    # writes GBs every second; one that suits a 5-minute step loses an hour to a crash
    checkpoint_every_s: float = 600.0
    publish_every: int = 1
    publish_via: Literal["direct", "reshard"] = "direct"   # HF export: in-memory gather, or reshard the checkpoint
    wait_for_data_s: float = 600.0
    # true: the step pays for a host snapshot, the checkpoint is written beside the next steps and
    # renamed into place when complete (train/checkpoint.py AsyncCheckpointer); false: synchronous
    checkpoint_async: bool = True
    checkpoint_write_timeout_s: float = 1800.0   # a save whose megatron writers have not all reported by then fails
    seed: int = 1234
    # bf16: bf16 parameters and activations, fp32 main parameters, gradients and Adam state
    # (megatron's Float16Module + mixed-precision optimizer); auto = bf16 on CUDA, fp32 on CPU
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    # activation recomputation: full = each layer recomputed in backward from its input;
    # selective = the MoE layer and the norms (train/backend.recompute_overrides); the
    # capacity planner's memory term reads it (plan/memory.py)
    recompute: Literal["none", "selective", "full"] = "none"

    CHECKS = {
        "steps": between(1, 10**9),
        "lr": above(0, le=1.0),
        "weight_decay": at_least(0),
        "grad_clip": at_least(0, "0 = no clipping"),
        "clip_eps": Range(gt=0, lt=1),
        "kl_coef": at_least(0),
        "checkpoint_every": at_least(0, "0 = not by step count"),
        "checkpoint_every_s": at_least(0, "seconds; 0 = not by time"),
        **{k: at_least(1) for k in ("trajectories_per_step", "publish_every",
                                    "tensor_parallel", "pipeline_parallel", "expert_parallel",
                                    "context_parallel", "data_parallel", "virtual_pipeline_stages")},
        "wait_for_data_s": above(0, note="seconds"),
        "checkpoint_write_timeout_s": above(0, note="seconds (train/writers.py: stuck checkpoint writers)"),
    }
    # the off-policy settings (config/offpolicy.py): a config that sets one here is told where
    MOVED = {"off_policy_correction": "offpolicy.correction", "tis_cap": "offpolicy.correction_params.cap",
             "router_replay": "offpolicy.replay_trainer"}
    RULES = (
        Rule("sft_data", lambda c: c.mode != "sft" or bool(c.sft_data),
             "a folder of trajectory shards when train.mode is 'sft' (write demonstrations with "
             "`neon-hpc demos --out DIR`)"),
    )


# --------------------------------------------------------------------------------------
# the trainer's layout arithmetic (its rules across sections: neon_hpc/config/cross.py)


def world_size(cfg: Any) -> int:
    """Trainer ranks the config asks for: ``tp * pp * cp * dp``."""
    t = cfg.train
    return t.tensor_parallel * t.pipeline_parallel * t.context_parallel * t.data_parallel


def stage_layers(num_layers: int, pp: int, first: int = 0, last: int = 0) -> list[int]:
    """Decoder layers on each pipeline stage (``first``/``last`` 0 = even share); raises ValueError."""
    if pp == 1:
        if first or last:
            raise ValueError("only meaningful with train.pipeline_parallel > 1")
        return [num_layers]
    fixed = {}
    if first:
        fixed[0] = first
    if last:
        fixed[pp - 1] = last
    rest_stages = pp - len(fixed)
    rest = num_layers - sum(fixed.values())
    if rest_stages == 0:
        if rest:
            raise ValueError(f"first + last stage layers ({sum(fixed.values())}) != model.num_layers ({num_layers})")
        return [fixed[0], fixed[1]]
    if rest <= 0 or rest % rest_stages:
        raise ValueError(f"{rest} layer(s) left for {rest_stages} middle/even stage(s) do not divide evenly")
    return [fixed.get(i, rest // rest_stages) for i in range(pp)]
