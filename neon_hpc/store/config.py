"""Trajectory-store section of the experiment config (owned by ``neon_hpc/store``)."""
from dataclasses import dataclass
from typing import Literal


@dataclass
class StoreConfig:
    flush_trajectories: int = 8        # flush a shard after this many trajectories ...
    flush_seconds: float = 30.0        # ... or this many seconds, whichever first
    routed_experts_compression: Literal["none", "gzip", "lzf"] = "none"
    quarantine_invalid: bool = True

    def validate(self):
        errs = []
        if self.flush_trajectories < 1:
            errs.append(("flush_trajectories", "must be >= 1"))
        if self.flush_seconds <= 0:
            errs.append(("flush_seconds", "must be > 0"))
        return errs
