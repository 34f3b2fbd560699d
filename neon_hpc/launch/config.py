"""Launch section of the experiment config (owned by ``neon_hpc/launch``)."""
from dataclasses import dataclass, field
from typing import Literal

from neon_hpc.constraints import above, at_least, between, section


@section
@dataclass
class GroupConfig:
    """One heterogeneous-job group (rollout or train)."""

    partition: str = ""
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem: str = ""                       # e.g. "0" for all, "8G"; "" = partition default

    CHECKS = {
        "nodes": at_least(1),
        "tasks_per_node": at_least(1),
        "cpus_per_task": at_least(1),
    }


@section
@dataclass
class LaunchConfig:
    backend: Literal["local", "slurm"] = "local"
    job_name: str = "neon-rl"
    time_limit: str = "00:30:00"
    signal_before_s: int = 120          # --signal=USR1@<s>: checkpoint and requeue before the limit
    requeue: bool = True
    account: str = ""
    rollout: GroupConfig = field(default_factory=lambda: GroupConfig(partition="rollout"))
    train: GroupConfig = field(default_factory=lambda: GroupConfig(partition="train"))
    extra_sbatch: list[str] = field(default_factory=list)

    CHECKS = {"signal_before_s": at_least(0, "seconds before the time limit")}


@section
@dataclass
class WarmStartConfig:
    """``neon-hpc run``'s warm start (``launch/warm.py``): demonstrations, then SFT, then RL from it.

    With ``enabled``, the run directory's ``warm_start/`` holds the demonstrations
    (``neon-hpc demos``) and an SFT run of the same trainer (``train.mode: sft``); the RL run's
    ``model.init_checkpoint`` is that run's last checkpoint. A run directory that has it reuses it.
    """

    enabled: bool = False
    demos: int = 256                    # train-split tasks, one demonstration each
    imperfect: float = 0.3              # share of imperfect demonstrations (wrong minor phase, rough fraction)
    steps: int = 40                     # SFT optimizer steps
    trajectories_per_step: int = 16
    lr: float = 3e-3

    CHECKS = {
        "demos": at_least(1),
        "imperfect": between(0.0, 1.0),
        "steps": between(1, 10**9),
        "trajectories_per_step": at_least(1),
        "lr": above(0, le=1.0),
    }
