"""Process entry points of a run, one per role; the same under Slurm and the local launcher.

    python -m neon_hpc.launch.roles trainer        --config RUN/run.yaml --run-dir RUN
    python -m neon_hpc.launch.roles rollout-node   --config RUN/run.yaml --run-dir RUN
    python -m neon_hpc.launch.roles rollout-worker --config RUN/run.yaml --run-dir RUN --rank N --engine-url URL

Under ``srun`` the rank comes from SLURM_PROCID; torch.distributed variables for the trainer
are derived from Slurm's when absent (MASTER_ADDR is set by the sbatch script).
"""

from __future__ import annotations

import argparse
import os
import sys

from neon_hpc import config
from neon_hpc.procutil import forked_children_die_with_me


def _trainer_env() -> None:
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", "1")
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
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
    from neon_hpc import logsinks
    logsinks.configure(cfg.logging)   # TensorBoard / W&B beside metrics.jsonl, when enabled
    if a.role == "trainer":
        _trainer_env()
        forked_children_die_with_me()   # megatron's forked checkpoint writers
        from neon_hpc.train.loop import run_trainer
        return run_trainer(cfg, a.run_dir)
    if a.role == "rollout-node":
        from neon_hpc.rollout.node import RolloutNode
        return RolloutNode(cfg, a.run_dir).run_forever()
    from neon_hpc.rollout.worker import run_worker
    rank = a.rank if a.rank is not None else int(os.environ.get("SLURM_PROCID", 0))
    return run_worker(cfg, a.run_dir, rank, a.engine_url)


if __name__ == "__main__":
    sys.exit(main())
