"""What every launcher does the same way: prepare (or resume) the run directory (the run
summary is in :mod:`neon_hpc.launch.summary`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from neon_hpc import config
from neon_hpc.config import ConfigError, ExperimentConfig
from neon_hpc.launch import lease
from neon_hpc.launch.lease import LeaseHeld
from neon_hpc.protocol.records import Finished, JobRecord, Preempted
from neon_hpc.protocol.rundir import RunDir, atomic_write_text, remove_stale_tmp
from neon_hpc.store import open_store


def resolve_run_dir(cfg: ExperimentConfig, run_dir: str | None) -> Path:
    return Path(run_dir or cfg.run_dir).absolute()


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def write_run_yaml(cfg: ExperimentConfig, run_dir: str | None) -> tuple[RunDir, ExperimentConfig, list[str]]:
    """Create the run directory and write run.yaml once; return the config that governs the run.

    run.yaml is the run's resolved config, written at its first launch: a resumed or
    requeued run reads it back, so ``--set`` overrides given at launch survive a requeue.
    A config that differs from it is reported (the keys), never silently mixed in.
    """
    root = resolve_run_dir(cfg, run_dir)
    cfg.run_dir = str(root)
    run = RunDir(root)
    if run.run_yaml.exists():
        kept = config.load(run.run_yaml)
        kept.run_dir = str(root)
        return run.create(), kept, _diff(config.to_dict(kept), config.to_dict(cfg))
    run.create()
    atomic_write_text(run.run_yaml, config.dump(cfg))
    return run, cfg, []


def prepare_run(cfg: ExperimentConfig, run_dir: str | None, backend: str,
                job_id: str = "local", lease_token: str | None = None,
                restart: int = 0) -> tuple[RunDir, ExperimentConfig]:
    """Take the run directory's lease (``launch.lease``; raises ``LeaseHeld`` while another launch
    lives), create (or resume) it; returns it and the config in force (run.yaml)."""
    lease.acquire(RunDir(resolve_run_dir(cfg, run_dir)), backend, job_id, restart, lease_token)
    run, cfg, diffs = write_run_yaml(cfg, run_dir)
    if diffs:
        print(f"neon-hpc: resuming {run.root} with its run.yaml; the given config differs in "
              f"{', '.join(diffs)} and is not used for those keys (start a new --run-dir to change them)",
              file=sys.stderr)
    sweep_staging(run, cfg)
    Finished.clear(run)
    Preempted.clear(run)
    JobRecord.start(run, job_id, backend)
    return run, cfg


def sweep_staging(run: RunDir, cfg: ExperimentConfig) -> int:
    """Remove what writers killed mid-write left: the trajectory store's staging (the filesystem
    store: hidden ``.*.tmp.*`` siblings of shards), checkpoints (``checkpoints/.step_N.tmp.*``)
    and weights (``weights/.v_N.tmp.*``). Only under the lease: no writer of this run directory
    is alive then."""
    return (open_store(run, cfg.store).sweep_staging()
            + sum(remove_stale_tmp(d) for d in (run.checkpoints, run.weights)))


def main(argv: list[str] | None = None) -> int:
    """``python -m neon_hpc.launch.common``: prepare the run directory (used by the sbatch script)."""
    p = argparse.ArgumentParser(prog="python -m neon_hpc.launch.common")
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--backend", default="slurm")
    p.add_argument("--job-id", default="local")
    a = p.parse_args(argv)
    try:
        run, _cfg = prepare_run(config.load(a.config), a.run_dir, a.backend, a.job_id,
                                lease_token=os.environ.get("NEON_LEASE_TOKEN") or None,
                                restart=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
    except ConfigError as e:
        print(f"neon-hpc: config error: {e}", file=sys.stderr)
        return 2
    except LeaseHeld as e:
        print(f"neon-hpc: {e}", file=sys.stderr)
        return 3
    print(f"[neon-rl] run directory ready: {run.root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
