"""Trajectory-store section of the experiment config (owned by ``neon_hpc/store``)."""
from dataclasses import dataclass
from typing import Literal


@dataclass
class StoreConfig:
    flush_trajectories: int = 8        # flush a shard after this many trajectories ...
    flush_seconds: float = 30.0        # ... or this many seconds after the first buffered one ...
    flush_bytes: int = 1 << 30         # ... or once the buffer holds this many payload bytes
    # Measured (README, "Routed experts: dtype, chunking, compression"): "none" writes and
    # reads at disk speed; gzip/lzf shrink random routes little and cost far more CPU time.
    routed_experts_compression: Literal["none", "gzip", "lzf"] = "none"
    compression_chunk_tokens: int = 4096   # rows per chunk when compressed (contiguous otherwise)
    quarantine_invalid: bool = True    # False: a claim stops with ShardError on an invalid shard
    fsync: bool = True                 # fsync data + directory on publish (off only for tests/benchmarks)
    stale_tmp_s: float = 3600.0        # a writer removes tmp/.*.tmp.part files untouched this long

    def validate(self):
        errs = []
        if self.flush_trajectories < 1:
            errs.append(("flush_trajectories", "must be >= 1"))
        if self.flush_seconds <= 0:
            errs.append(("flush_seconds", "must be > 0"))
        if self.flush_bytes < 1:
            errs.append(("flush_bytes", "must be >= 1"))
        if self.stale_tmp_s <= 0:
            errs.append(("stale_tmp_s", "must be > 0"))
        if self.compression_chunk_tokens < 1:
            errs.append(("compression_chunk_tokens", "must be >= 1"))
        return errs
