"""Trajectory-store section of the experiment config (owned by ``neon_hpc/store``)."""
from dataclasses import dataclass
from typing import Literal

from neon_hpc.util.constraints import above, at_least, section

# the trajectory stores (neon_hpc/store/registry.py STORES maps each to its implementation)
StoreKind = Literal["filesystem"]


@section
@dataclass
class StoreConfig:
    kind: StoreKind = "filesystem"     # where trajectories pass through (README, "Stores")
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
    # a claim skips a trajectory whose metadata.uid was consumed by a committed claim of one of
    # the last this-many steps (README, "Exactly once by trajectory uid")
    uid_window_steps: int = 1000
    # the trainer reads the next claim's shards while its step runs (store/readahead.py); the
    # claim takes them from memory (at most one step's claim held beyond the step's own)
    read_ahead: bool = True

    CHECKS = {
        **{k: at_least(1) for k in ("flush_trajectories", "flush_bytes", "compression_chunk_tokens",
                                    "uid_window_steps")},
        "flush_seconds": above(0, note="seconds"),
        "stale_tmp_s": above(0, note="seconds"),
    }
