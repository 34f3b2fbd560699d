"""XRD task section of the experiment config (owned by ``neon_hpc/xrd``)."""
from dataclasses import dataclass
from typing import Literal


@dataclass
class XRDConfig:
    preset: Literal["tiny", "easy", "medium", "realistic"] = "tiny"
    split: Literal["train", "test_id", "test_ood", "test_temporal"] = "train"
    num_tasks: int = 64
    seed: int = 0
    db: str = ""                        # SQLite path; "" = inside the run directory

    def validate(self):
        return [("num_tasks", "must be >= 1")] if self.num_tasks < 1 else []
