"""XRD task section of the experiment config (owned by ``neon_hpc/xrd``): the settings of the XRD
environment (``env.kind: xrd``, ``neon_hpc/envs/xrd/``).  Its tools are ``rollout.tools``."""
from dataclasses import dataclass
from typing import Literal

from neon_hpc.constraints import at_least, section


@section
@dataclass
class XRDConfig:
    preset: Literal["tiny", "easy", "medium", "realistic"] = "tiny"
    split: Literal["train", "test_id", "test_ood", "test_temporal"] = "train"
    num_tasks: int = 64
    seed: int = 0

    CHECKS = {"num_tasks": at_least(1)}
