"""Ranks and the rendezvous port of a run's processes, from the launcher's variables or Slurm's.

One rule each, imported by ``launch.roles`` (every role process), ``launch.slurm`` (the
sbatch script), ``rollout.node`` and ``train.loop``.  It sits below both ``launch`` and
``train`` because both need it (``train`` never imports ``launch``).

- **Trainer rank**: when ``RANK`` is not set, Slurm's ``SLURM_PROCID`` / ``SLURM_NTASKS`` /
  ``SLURM_LOCALID`` give ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (a ``LOCAL_RANK`` already
  set is kept) -- :func:`trainer_rank_from_slurm`.
- **Rollout node rank and count**: ``NEON_NODE_RANK`` / ``NEON_NODE_COUNT`` (the local
  launcher), else ``SLURM_PROCID`` / ``SLURM_NTASKS`` (one rollout-node task per node).
- **Port**: every trainer rank of Slurm job ``J`` meets at ``MASTER_PORT = 20000 + J %
  20000`` (:func:`master_port`); the sbatch script computes the same in bash
  (:data:`MASTER_PORT_BASH`), so a rank that finds ``MASTER_PORT`` unset derives the port
  the script exported.
"""

from __future__ import annotations

import os
from typing import MutableMapping

MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 20000
# the same formula for the sbatch script (bash arithmetic on the job id)
MASTER_PORT_BASH = f"$(({MASTER_PORT_BASE} + SLURM_JOB_ID % {MASTER_PORT_SPAN}))"


def master_port(job_id: int | str) -> int:
    """The torch.distributed port of Slurm job ``job_id``'s trainer."""
    return MASTER_PORT_BASE + int(job_id) % MASTER_PORT_SPAN


def trainer_rank_from_slurm(env: MutableMapping[str, str] | None = None) -> None:
    """Export ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from Slurm's task variables when ``RANK``
    is absent (under ``srun``); otherwise leave the environment as it is."""
    env = os.environ if env is None else env
    if "RANK" not in env and "SLURM_PROCID" in env:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env.get("SLURM_NTASKS", "1")
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))


def node_rank(env: MutableMapping[str, str] | None = None) -> int:
    """This rollout node's rank in the rollout group."""
    env = os.environ if env is None else env
    return int(env.get("NEON_NODE_RANK", env.get("SLURM_PROCID", "0")))


def node_count(env: MutableMapping[str, str] | None = None) -> int:
    """How many rollout nodes the rollout group has."""
    env = os.environ if env is None else env
    return int(env.get("NEON_NODE_COUNT", env.get("SLURM_NTASKS", "1")))
