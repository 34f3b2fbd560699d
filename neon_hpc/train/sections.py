"""What the trainer is given: one frozen, typed view of the experiment config, built once at its start.

``launch/roles.py`` (and ``python -m neon_hpc.train``) build ``TrainerSections.of(cfg)`` and
hand the trainer that, never the whole :class:`~neon_hpc.config.ExperimentConfig`. It holds the
trainer's sections whole (its layout rules, the balancer and the model builders read
them by the same names, so they take the view as they take the config), ``offpolicy`` among them. The rollout
roles' views are ``neon_hpc/rollout/sections.py``; ``tests/structure/test_role_sections.py`` fails if a module of
``neon_hpc/train`` reads a section the view does not hold. The config file is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from neon_hpc.config.balance import BalanceConfig
from neon_hpc.config.launch import LaunchConfig
from neon_hpc.config.model import ModelConfig
from neon_hpc.config.offpolicy import OffpolicyConfig
from neon_hpc.config.protocol import ProtocolConfig
from neon_hpc.config.store import StoreConfig
from neon_hpc.config.train import TrainConfig

if TYPE_CHECKING:
    from neon_hpc.config import ExperimentConfig


@dataclass(frozen=True)
class TrainerSections:
    """A trainer rank's inputs: its sections."""

    schedule: str                       # async / sync (the off-policy correction check)
    model: ModelConfig                  # the model it builds and publishes
    train: TrainConfig                  # steps, optimiser, parallel layout, claim wait
    balance: BalanceConfig              # the step's sequence packing
    store: StoreConfig                  # the claim's quarantine of invalid shards
    protocol: ProtocolConfig            # the claim's poll of ready/
    launch: LaunchConfig                # the layout rules read launch.train (nodes, GPUs per node)
    offpolicy: OffpolicyConfig          # the stale policy, the correction, router replay

    @classmethod
    def of(cls, cfg: "ExperimentConfig") -> "TrainerSections":
        return cls(schedule=cfg.schedule, model=cfg.model, train=cfg.train, balance=cfg.balance, store=cfg.store,
                   protocol=cfg.protocol, launch=cfg.launch, offpolicy=cfg.offpolicy)
