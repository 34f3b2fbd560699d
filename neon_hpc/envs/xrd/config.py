"""XRD task section of the experiment config (owned by ``neon_hpc/envs/xrd/science``): the settings of the XRD
environment, its variant of the ``env:`` section (``env.kind: xrd``, ``neon_hpc/envs/xrd/``): its task set, its
tools and its prompts."""
from dataclasses import dataclass
from typing import Literal

from neon_hpc.envs.base import EnvSettings
from neon_hpc.util.constraints import at_least, section


@section
@dataclass
class XRDConfig(EnvSettings):
    kind: Literal["xrd"] = "xrd"
    preset: Literal["tiny", "easy", "medium", "realistic"] = "tiny"
    split: Literal["train", "test_id", "test_ood", "test_temporal"] = "train"
    num_tasks: int = 64
    seed: int = 0
    tools: Literal["full", "minimal"] = "full"     # the agent's toolset (minimal: get_pattern, simulate_phase)
    prompt_style: Literal["auto", "compact", "full"] = "auto"  # auto: compact for the tiny preset

    CHECKS = {"num_tasks": at_least(1)}
