"""The filesystem trajectory store: HDF5 shards under ``RUN/trajectories/`` (README.md beside
this file has the layout and the claim protocol). The first ``TrajectoryStore``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from neon_hpc.config.store import StoreConfig
from neon_hpc.protocol.rundir import RunDir, remove_stale_tmp
from neon_hpc.store import schema as S
from neon_hpc.store.base import StoreCounts, TrajectoryStore
from neon_hpc.store.claim import ClaimResult, claim_step, claimed_steps, ready_count, ready_shards
from neon_hpc.store.readahead import ReadAhead
from neon_hpc.store.reader import read_shard
from neon_hpc.store.trajectory import Trajectory
from neon_hpc.store.writer import TMP_SUFFIX, ShardWriter, write_shard


def _count(d: Path, suffix: str) -> int:
    try:
        return sum(1 for n in os.listdir(d) if n.endswith(suffix) and not n.startswith("."))
    except FileNotFoundError:
        return 0


class FilesystemStore(TrajectoryStore):
    kind = "filesystem"

    def __init__(self, run_dir, cfg: StoreConfig = StoreConfig()):
        self.run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.cfg = cfg
        self._ahead: ReadAhead | None = None    # store.read_ahead (store/readahead.py), from read_ahead()

    def writer(self, writer_id: str, job_id: str | None = None) -> ShardWriter:
        return ShardWriter(self.run, writer_id, self.cfg, job_id=job_id)

    def ready_count(self) -> tuple[int, int]:
        return ready_count(self.run)

    def claim(self, step: int, want: int, consumer: str, **kwargs) -> ClaimResult:
        kwargs.setdefault("quarantine_invalid", self.cfg.quarantine_invalid)
        kwargs.setdefault("uid_window_steps", self.cfg.uid_window_steps)
        if self._ahead is not None:
            kwargs.setdefault("read", self._ahead.read)
        return claim_step(self.run, step, want, consumer, **kwargs)

    def read_ahead(self, want: int) -> None:
        if not self.cfg.read_ahead:
            return
        if self._ahead is None:
            self._ahead = ReadAhead(self.run.traj_ready, lambda: ready_shards(self.run))
        self._ahead.start(want)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.stop()

    def read_ahead_counts(self) -> tuple[int, int]:
        return (0, 0) if self._ahead is None else (self._ahead.hits, self._ahead.misses)

    def claimed_steps(self) -> list[int]:
        return claimed_steps(self.run)

    def _step_dirs(self) -> list[tuple[int, Path]]:
        """Every claim directory, committed or being filled (a claim's shards are the step's)."""
        return self.run.claim_dirs()

    def iter_trained(self, steps: int | None = None) -> Iterator[tuple[int, Trajectory]]:
        for step, d in self._step_dirs()[:steps]:
            for shard in sorted(d.glob(f"*{S.SHARD_SUFFIX}")):
                for t in read_shard(shard):
                    yield step, t

    def counts(self) -> StoreCounts:
        claimed = sum(_count(d, S.SHARD_SUFFIX) for _, d in self._step_dirs())
        try:   # shards being written are hidden temporaries (".<name>.tmp.part")
            writing = sum(1 for n in os.listdir(self.run.traj_tmp) if n.endswith(TMP_SUFFIX))
        except FileNotFoundError:
            writing = 0
        return StoreCounts(ready=self.ready_count()[0], claimed=claimed,
                           quarantined=_count(self.run.traj_quarantine, S.SHARD_SUFFIX), writing=writing)

    @classmethod
    def write_set(cls, folder, trajs: list[Trajectory], name: str, per_shard: int = 64) -> list[Path]:
        """Shards ``<name>-NNNN.h5`` of ``per_shard`` trajectories in ``folder``, each published by rename."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        parts = []
        for j in range(0, len(trajs), per_shard):
            final = out / f"{name}-{j // per_shard:04d}{S.SHARD_SUFFIX}"
            tmp = out / f".{final.name}.tmp"
            write_shard(tmp, trajs[j:j + per_shard], writer_id=name)
            tmp.replace(final)
            parts.append(final)
        return parts

    @classmethod
    def read_set(cls, folder) -> list[Trajectory]:
        """Every trajectory of every ``*.h5`` shard in ``folder``, shards sorted by file name."""
        p = Path(folder)
        shards = sorted(p.glob(f"*{S.SHARD_SUFFIX}")) if p.is_dir() else []
        return [t for s in shards for t in read_shard(s)]

    def sweep_staging(self) -> int:
        return remove_stale_tmp(self.run.traj_tmp)
