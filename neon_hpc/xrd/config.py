"""XRD task section of the experiment config (owned by ``neon_hpc/xrd``)."""
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
    db: str = ""                        # SQLite path; "" = inside the run directory
    toolset: Literal["full", "minimal"] = "full"   # minimal = raw pattern + simulation only
    strict_grading: bool = False        # +-5 wt% instead of +-10 (see neon_hpc/xrd/grader.py)
    real_data: str = ""                 # xrd-real folder; "" = $NEON_XRD_REAL_DATA or ../shared/data/xrd-real

    CHECKS = {"num_tasks": at_least(1)}
