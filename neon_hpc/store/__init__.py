"""Trajectory store: HDF5 shards on the shared filesystem, claimed exactly once, crash-safe.

See README.md beside this file for the format and the semantics.
"""

from neon_hpc.config.store import StoreConfig
from neon_hpc.store.base import StoreCounts, TrajectoryStore, TrajectoryWriter
from neon_hpc.store.claim import (
    ClaimConflict,
    ClaimResult,
    ClaimTimeout,
    claim_step,
    claimed_steps,
    quarantine,
    ready_count,
    ready_shards,
    staleness_stats,
)
from neon_hpc.store.filesystem import FilesystemStore
from neon_hpc.store.reader import ShardError, read_shard, shard_summary
from neon_hpc.store.registry import STORES, open_store, run_store, store_kind
from neon_hpc.store.trajectory import Trajectory
from neon_hpc.store.writer import ShardInfo, ShardWriter, write_shard

__all__ = ["StoreConfig", "Trajectory", "ShardError", "read_shard", "shard_summary", "ShardInfo", "ShardWriter",
           "write_shard", "ClaimConflict", "ClaimResult", "ClaimTimeout", "claim_step", "claimed_steps",
           "quarantine", "ready_count", "ready_shards", "staleness_stats",
           "StoreCounts", "TrajectoryStore", "TrajectoryWriter", "FilesystemStore", "STORES", "open_store", "run_store",
           "store_kind"]
