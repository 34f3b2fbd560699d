"""The trajectory-store interface: what the roles, the launcher and the operator tools may ask
of the place trajectories pass through between rollout workers and the trainer.

One implementation per module (``filesystem.py`` today), registered by its ``kind`` in
``registry.py`` and chosen by ``store.kind`` in the experiment config. Contract tests any
implementation must pass: ``tests/unit/store/test_store_contract.py`` (add the new kind to its fixture).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterator, Protocol

from neon_hpc.store.claim import ClaimResult
from neon_hpc.store.trajectory import Trajectory


class TrajectoryWriter(Protocol):
    """One writer's handle (``ShardWriter`` for the filesystem store): buffers and publishes."""

    def add(self, traj: Trajectory) -> object: ...
    def flush_if_due(self) -> object: ...
    def flush(self) -> object: ...
    def close(self) -> None: ...
    def stats(self) -> dict[str, float]: ...
    def __enter__(self) -> "TrajectoryWriter": ...
    def __exit__(self, exc_type, exc, tb) -> None: ...


@dataclass(frozen=True)
class StoreCounts:
    """What ``neon-hpc status`` shows: shards published and waiting, claimed by trainer steps,
    set aside as invalid, and being written now."""

    ready: int
    claimed: int
    quarantined: int
    writing: int


class TrajectoryStore(ABC):
    """Trajectories published by writers, claimed exactly once per trainer step."""

    kind: ClassVar[str]

    @abstractmethod
    def writer(self, writer_id: str, job_id: str | None = None) -> TrajectoryWriter:
        """A writer; ``writer_id`` unique among live writers of the run (e.g. ``w3-<job>-<pid>``)."""

    @abstractmethod
    def ready_count(self) -> tuple[int, int]:
        """(shards, trajectories) published and not yet claimed; cheap (the workers poll it)."""

    @abstractmethod
    def claim(self, step: int, want: int, consumer: str, **kwargs) -> ClaimResult:
        """Claim at least ``want`` trajectories for ``step`` exactly once (``claim_step``'s
        keyword arguments and semantics); a committed step returns the same trajectories again."""

    def read_ahead(self, want: int) -> None:
        """Start reading, beside the caller's work, what the next claim of ``want`` trajectories
        would read first (the claim then takes it from memory); a store without one ignores it."""

    def close(self) -> None:
        """Stop what :meth:`read_ahead` started (the store stays usable)."""

    def read_ahead_counts(self) -> tuple[int, int]:
        """(shards this store's claims took from the read-ahead's memory, shards they read
        themselves) since it opened; (0, 0) for a store without a read-ahead."""
        return 0, 0

    @abstractmethod
    def claimed_steps(self) -> list[int]:
        """Steps whose claim is committed, ascending."""

    @abstractmethod
    def iter_trained(self, steps: int | None = None) -> Iterator[tuple[int, Trajectory]]:
        """``(step, trajectory)`` for every trajectory claimed by the first ``steps`` claimed steps
        (all: None), step by step, as written (the claim's stale masking not applied)."""

    @abstractmethod
    def counts(self) -> StoreCounts:
        """Shard counts for operators (no shard is opened)."""

    # fixed sets: trajectories in a folder of their own that no claim consumes (demonstrations,
    # the SFT data of ``train.sft_data``); a store kind writes and reads its own
    @classmethod
    @abstractmethod
    def write_set(cls, folder: str | Path, trajs: list[Trajectory], name: str, per_shard: int = 64) -> list[Path]:
        """Write ``trajs`` as a fixed set in ``folder`` (each part published whole); returns the parts."""

    @classmethod
    @abstractmethod
    def read_set(cls, folder: str | Path) -> list[Trajectory]:
        """Every trajectory of the fixed set in ``folder``, in a stable order ([] when there is none)."""

    @abstractmethod
    def sweep_staging(self) -> int:
        """Remove what writers killed mid-write left; only when no writer of the run lives
        (the launcher holds the run's lease). Returns how many entries went."""
