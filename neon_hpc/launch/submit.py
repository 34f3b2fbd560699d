"""``neon-hpc launch CONFIG [--run-dir DIR] [--set k=v] [--render] [--wait]``: submit the
heterogeneous Slurm job of a run.

How it talks to Slurm, and why: submitit 1.5.4 renders one set of ``#SBATCH`` lines and has
no heterogeneous-job support. Rather than subclass its private script renderer, we render
the het job ourselves (``neon_hpc.launch.slurm``, golden-tested) and submit it with
``sbatch``. Its job objects cannot track a het job either (``submitit.SlurmJob`` reads
``JOBID`` from sacct, which lists only ``JOBID+0`` and ``JOBID+1``, and reports UNKNOWN
forever), so ``--wait`` reads every component's state (``launch.slurmjob``). ``--render`` prints the script.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from neon_hpc import config
from neon_hpc.launch.common import resolve_run_dir, write_run_yaml
from neon_hpc.launch.lease import LeaseHeld, check_free
from neon_hpc.launch.slurm import quote, render_sbatch, sbatch_command
from neon_hpc.launch.slurmjob import query
from neon_hpc.protocol.rundir import RunDir, atomic_write_text


def submit(cfg: config.ExperimentConfig, config_path: str, run_dir: Path) -> tuple[str, Path]:
    """Write the rendered script into RUN/launch/ and sbatch it; returns (job id, script)."""
    # run.yaml before sbatch: the job (and every requeue of it) runs with the resolved config,
    # --set overrides included
    run, cfg, diffs = write_run_yaml(cfg, str(run_dir))
    if diffs:
        print(f"neon-hpc launch: {run_dir} already has a run.yaml; it wins over the given config for "
              f"{', '.join(diffs)}", file=sys.stderr)
    config_path = str(run.run_yaml)
    launch_dir = run_dir / "launch"
    launch_dir.mkdir(parents=True, exist_ok=True)
    script = launch_dir / f"neon_rl.{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    atomic_write_text(script, render_sbatch(cfg, config_path))
    cmd = sbatch_command(str(script), str(Path(config_path).absolute()), str(run_dir))
    env = dict(os.environ, NEON_PYTHON=sys.executable)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=launch_dir)
    if r.returncode != 0:
        raise SystemExit(f"neon-hpc launch: sbatch failed ({r.stderr.strip()}); the script is {script}; "
                         f"command: {quote(cmd)}")
    return r.stdout.strip().split(";")[0], script


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="neon-hpc launch", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--render", action="store_true", help="print the sbatch script and exit")
    p.add_argument("--wait", action="store_true", help="poll until the job ends")
    a = p.parse_args(argv)
    cfg = config.load(a.config, a.set)
    if a.render:
        print(render_sbatch(cfg, a.config), end="")
        return 0
    run_dir = resolve_run_dir(cfg, a.run_dir)
    try:
        check_free(RunDir(run_dir))   # the job takes the lease itself when it starts
    except LeaseHeld as e:
        print(f"neon-hpc launch: {e}", file=sys.stderr)
        return 3
    if cfg.warm_start.enabled and not cfg.model.init_checkpoint:
        from neon_hpc.launch.warm import sft_checkpoint  # deferred: heavy (neon_hpc.launch.warm: httpx)
        print(f"neon-hpc launch: warm_start.enabled: the Slurm job does not run the warm start (`neon-hpc run` "
              f"does); run `neon-hpc sft {a.config} --run-dir {run_dir}` first and add --set "
              f"model.init_checkpoint={sft_checkpoint(cfg, run_dir)}, or --set warm_start.enabled=false",
              file=sys.stderr)
        return 2
    job_id, script = submit(cfg, a.config, run_dir)
    print(f"submitted heterogeneous job {job_id} ({script})")
    print(f"follow it: neon-hpc status {run_dir}   neon-hpc tail {run_dir} --role trainer -f")
    if not a.wait:
        return 0
    last = None
    while True:
        job = query(job_id)
        st = job.state
        if st != last:
            print(f"job {job_id}: {st}", flush=True)
            last = st
        if job.final:
            return 0 if st == "COMPLETED" else 1
        time.sleep(2)
