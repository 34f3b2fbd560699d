"""Process entry points of a run, one per role; the same under Slurm and the local launcher.

    python -m neon_hpc.launch.roles trainer        --config RUN/run.yaml --run-dir RUN
    python -m neon_hpc.launch.roles rollout-node   --config RUN/run.yaml --run-dir RUN
    python -m neon_hpc.launch.roles rollout-worker --config RUN/run.yaml --run-dir RUN --rank N --engine-url URL

Under ``srun`` the rank comes from SLURM_PROCID; torch.distributed variables for the trainer
are derived from Slurm's when absent (``neon_hpc.util.rankenv``; MASTER_ADDR is set by the sbatch
script).

Around every trainer and rollout node:

* the launch's lease (``NEON_LEASE_TOKEN``, ``launch.lease``) is renewed from a thread; a
  process that finds the lease taken by another launch stops itself (SIGTERM);
* under the local launcher (``NEON_LAUNCHER_PID``) a thread watches the parent: when the
  launcher is gone (re-parented: SIGKILLed, crashed), the process stops itself with SIGTERM
  (the trainer checkpoints first, the node stops its workers and engines), so nothing of a
  run outlives its launcher for long;
* the trainer's rank 0 writes the finished marker when it has done all its steps (not
  when preempted), so the rollout side stops by itself even without a launcher to tell it;
* a dead megatron checkpoint helper (``train.writers.CheckpointWriterError``), or a full or
  read-only filesystem (``rundir.StorageError``), ends the trainer with exit 2 and one line
  naming the helper or the path, not a traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from neon_hpc import config
from neon_hpc.launch.lease import join_launch
from neon_hpc.protocol import RunDir, mark_finished as mark
from neon_hpc.protocol.rundir import StorageError, storage_error
from neon_hpc.rollout.node import RolloutNode
from neon_hpc.rollout.sections import NodeSections, WorkerSections
from neon_hpc.rollout.worker import run_worker
from neon_hpc.train.sections import TrainerSections
from neon_hpc.train.writers import CheckpointWriterError
from neon_hpc.util import logsinks
from neon_hpc.util.procutil import forked_children_die_with_me
from neon_hpc.util.rankenv import node_rank, trainer_rank_from_slurm

LAUNCHER_POLL_S = 1.0    # how often a role checks its launcher is still its parent


def watch_launcher(role: str) -> threading.Thread | None:
    """Under the local launcher: SIGTERM this process once its launcher (the parent) is gone."""
    want = os.environ.get("NEON_LAUNCHER_PID")
    if not want or os.getppid() != int(want):
        return None

    def loop() -> None:
        while os.getppid() == int(want):
            time.sleep(LAUNCHER_POLL_S)
        print(f"neon-hpc {role}: the launcher (pid {want}) is gone; stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=loop, daemon=True, name="neon-launcher-watch")
    t.start()
    return t


def mark_finished(run_dir: str) -> None:
    """The finished marker: every trainer step is done; the rollout side stops on it."""
    mark(RunDir(run_dir), by="trainer")


def _trainer(cfg, run_dir: str) -> int:
    # the trainer (torch, megatron) is imported where used: the rollout roles never load it
    from neon_hpc.train.loop import run_trainer  # deferred: heavy (neon_hpc.train.loop: torch, tqdm)
    try:
        rc = run_trainer(TrainerSections.of(cfg), run_dir)     # the trainer's view of the config
    except (CheckpointWriterError, StorageError) as e:
        print(f"trainer: {e}. Rerun to resume from the newest checkpoint", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        full = storage_error(e, getattr(e, "filename", None) or run_dir, "writing into")
        if full is None:
            raise
        print(f"trainer: {full}", file=sys.stderr, flush=True)
        return 2
    if rc == 0 and int(os.environ.get("RANK", "0")) == 0:
        mark_finished(run_dir)
    return rc


def _trainer_env() -> None:
    trainer_rank_from_slurm()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m neon_hpc.launch.roles")
    p.add_argument("role", choices=["trainer", "rollout-node", "rollout-worker"])
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--engine-url", default=None)
    a = p.parse_args(argv)
    cfg = config.load(a.config)
    logsinks.configure(cfg.logging)   # TensorBoard / W&B beside metrics.jsonl, when enabled
    if a.role in ("trainer", "rollout-node"):
        rank = os.environ.get("RANK", str(node_rank()))
        join_launch(a.run_dir, f"{a.role}.{rank}")
        watch_launcher(a.role)
    if a.role == "trainer":
        _trainer_env()
        forked_children_die_with_me()   # megatron's forked checkpoint writers
        return _trainer(cfg, a.run_dir)
    # each rollout role is given its own view of the config (rollout/sections.py), built once here
    if a.role == "rollout-node":
        return RolloutNode(NodeSections.of(cfg), a.run_dir).run_forever()
    rank = a.rank if a.rank is not None else int(os.environ.get("SLURM_PROCID", 0))
    return run_worker(WorkerSections.of(cfg), a.run_dir, rank, a.engine_url)


if __name__ == "__main__":
    sys.exit(main())
