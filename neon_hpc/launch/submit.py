"""``neon-hpc launch CONFIG [--run-dir DIR] [--set k=v] [--render] [--wait]``: submit the
heterogeneous Slurm job of a run.

The job is submitted by submitit, through this project's executor for the heterogeneous job
(``neon_hpc.launch.hetjob``: the script is ``launch.slurm``'s rendering of CONFIG, so its
``#SBATCH`` lines are CONFIG's launch section); ``--wait`` polls the submitit Job, which reads
every component's state (``launch.slurmjob``). ``--render`` prints the script.
"""

from __future__ import annotations

import argparse
import sys
import time

from neon_hpc import config
from neon_hpc.launch.common import resolve_run_dir
from neon_hpc.launch.hetjob import HetJobExecutor, LaunchRefused
from neon_hpc.launch.lease import LeaseHeld
from neon_hpc.launch.slurm import render_sbatch


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
    executor = HetJobExecutor(run_dir)
    executor.update_parameters(config=a.config, overrides=a.set)
    try:
        job = executor.launch()
    except LeaseHeld as e:
        print(f"neon-hpc launch: {e}", file=sys.stderr)
        return 3
    except LaunchRefused as e:
        print(f"neon-hpc launch: {e}", file=sys.stderr)
        return 2
    print(f"submitted heterogeneous job {job.job_id} ({job.script})")
    print(f"follow it: neon-hpc status {run_dir}   neon-hpc tail {run_dir} --role trainer -f")
    if not a.wait:
        return 0
    last = None
    while True:
        js = job.job_state(force=True)
        if js.state != last:
            print(f"job {job.job_id}: {js.state}", flush=True)
            last = js.state
        if js.final:
            return 0 if js.state == "COMPLETED" else 1
        time.sleep(2)
