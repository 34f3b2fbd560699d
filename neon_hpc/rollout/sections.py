"""What each rollout role is given: one frozen, typed view of the experiment config per role.

A role's process builds its view once at its start (``launch/roles.py``:
``WorkerSections.of(cfg)``, ``NodeSections.of(cfg)``) and hands the role that, never the whole
:class:`~neon_hpc.config.ExperimentConfig`. The view holds the role's own sections whole, and
each value it borrows from a neighbour's section as one field named after where it comes
from (``train_trajectories_per_step`` is ``train.trajectories_per_step``), so what crosses a
section boundary is written here and nowhere else. ``tests/structure/test_role_sections.py`` fails if a
module of ``neon_hpc/rollout`` reads a section of the config it is not given.

The views live here, beside the roles that take them, rather than in ``neon_hpc/config/`` (which
composes and validates the file's sections and knows nothing of the roles) or in each role's
module (the launcher builds them, and the rules for borrowed values, such as which tokenizer
an empty ``model.tokenizer`` means, need one home). The trainer's view is
``neon_hpc/train/sections.py`` (``TrainerSections``), for the same reasons.

The config file's format is unchanged: these are views, not sections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from neon_hpc.config.launch import LaunchConfig
from neon_hpc.config.offpolicy import OffpolicyConfig
from neon_hpc.config.protocol import ProtocolConfig
from neon_hpc.config.rollout import EngineConfig, RolloutConfig
from neon_hpc.config.store import StoreConfig
from neon_hpc.envs.base import EnvSettings

if TYPE_CHECKING:
    from neon_hpc.config import ExperimentConfig


@dataclass(frozen=True)
class WorkerSections:
    """A rollout worker's inputs: its sections, and what it borrows from ``train`` and ``model``."""

    rollout: RolloutConfig              # episodes, groups
    offpolicy: OffpolicyConfig          # the admission bounds, the routes the engines export
    protocol: ProtocolConfig            # heartbeat and admission poll intervals
    store: StoreConfig                  # the shard writer
    # which environment and its settings (env.kind's variant: its plugin gives tasks and episodes from it)
    env: EnvSettings
    # borrowed from train: the admission rule's "trajectories per step" (how fast the trainer
    # consumes), and when a hungry trainer gets a partial shard
    train_trajectories_per_step: int
    # borrowed from model: the tokenizer to load ("" in the file = model.init_checkpoint's),
    # and the route shape the engines do not report (layers, experts per token)
    model_tokenizer: str
    model_num_layers: int
    model_moe_router_topk: int

    @classmethod
    def of(cls, cfg: "ExperimentConfig") -> "WorkerSections":
        return cls(rollout=cfg.rollout, offpolicy=cfg.offpolicy, protocol=cfg.protocol, store=cfg.store,
                   env=cfg.env,
                   train_trajectories_per_step=cfg.train.trajectories_per_step,
                   model_tokenizer=cfg.model.tokenizer_source,
                   model_num_layers=cfg.model.num_layers, model_moe_router_topk=cfg.model.moe_router_topk)


@dataclass(frozen=True)
class NodeSections:
    """A rollout node's inputs. ``engine``, ``launch`` and ``run_dir`` are also what its engine
    group (``rollout/engines/``) places and renders the engine processes from."""

    rollout: RolloutConfig              # how many workers, restarts, the wait for first weights
    engine: EngineConfig                # which engines, how weights reach them
    protocol: ProtocolConfig            # the weight poll
    # borrowed from launch: the rollout group's nodes (gpus_per_node, for the engines' layout)
    launch: LaunchConfig
    # borrowed from the top level: the run directory the SGLang command lines name
    run_dir: str

    @classmethod
    def of(cls, cfg: "ExperimentConfig") -> "NodeSections":
        return cls(rollout=cfg.rollout, engine=cfg.engine, protocol=cfg.protocol, launch=cfg.launch,
                   run_dir=cfg.run_dir)
