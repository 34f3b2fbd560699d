"""Trajectory stores by ``store.kind``: the one place a kind is mapped to its implementation.

Adding a store: implement ``TrajectoryStore`` (``base.py``) in a module of its own, add its kind
to ``StoreKind`` (``neon_hpc/config/store.py``, so ``neon-hpc config check`` knows it) and to ``STORES`` below,
and add it to the contract tests' fixture (``tests/unit/store/test_store_contract.py``).
"""

from __future__ import annotations

import typing

from neon_hpc.config.store import StoreConfig, StoreKind
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.store.base import TrajectoryStore
from neon_hpc.store.filesystem import FilesystemStore

STORES: dict[str, type[TrajectoryStore]] = {FilesystemStore.kind: FilesystemStore}


def store_kind(kind: str = StoreConfig.kind) -> type[TrajectoryStore]:
    """The implementation of ``store.kind`` (its class: fixed sets are written and read through it)."""
    cls = STORES.get(kind)
    if cls is None:
        raise ValueError(f"store.kind: unknown trajectory store {kind!r}; registered: "
                         f"{', '.join(sorted(STORES))} (set store.kind in the config to one of them)")
    return cls


def open_store(run_dir: str | RunDir, cfg: StoreConfig = StoreConfig()) -> TrajectoryStore:
    """The store ``cfg.kind`` names, for the run directory ``run_dir``."""
    return store_kind(cfg.kind)(run_dir, cfg)


def run_store(run_dir: str | RunDir) -> TrajectoryStore:
    """The run's store as its run.yaml chose it (the default store before a launch wrote one)."""
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    if not run.run_yaml.exists():
        return open_store(run)
    # deferred: cycle (neon_hpc.config imports this package's section)
    from neon_hpc import config
    return open_store(run, config.load(run.run_yaml).store)


def _check_registry() -> None:
    declared = set(typing.get_args(StoreKind))
    if declared != set(STORES):   # the config's Literal and the registry must name the same kinds
        raise ImportError(f"neon_hpc/config/store.py StoreKind {sorted(declared)} != "
                          f"neon_hpc/store/registry.py STORES {sorted(STORES)}: add the kind to both")


_check_registry()
