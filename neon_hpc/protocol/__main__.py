"""``python -m neon_hpc.protocol COMMAND RUN_DIR``: the run-directory protocol for shell scripts.

The sbatch body asks this helper instead of spelling file names itself:

    finish RUN_DIR           write the finished marker (unless the trainer was preempted)
    preempted RUN_DIR        exit 0 if the trainer left a preemption marker, else 1
    clear-preempted RUN_DIR  remove the preemption marker (a failure is not a preemption)
    path NAME RUN_DIR        print a path: run-yaml, finished, preempted, job, lease
"""

from __future__ import annotations

import argparse
import sys

from neon_hpc.protocol.records import Preempted, mark_finished
from neon_hpc.protocol.rundir import RunDir

PATHS = {"run-yaml": "run_yaml", "finished": "finished_file", "preempted": "preempted_file",
         "job": "job_file", "lease": "lease_file"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m neon_hpc.protocol", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("finish", "preempted", "clear-preempted"):
        sub.add_parser(name).add_argument("run_dir")
    pp = sub.add_parser("path")
    pp.add_argument("name", choices=sorted(PATHS))
    pp.add_argument("run_dir")
    a = p.parse_args(argv)
    run = RunDir(a.run_dir)
    if a.cmd == "finish":
        if not mark_finished(run, by="launcher"):
            print(f"neon-hpc: {Preempted.path(run)} exists: the run was preempted, not finished", file=sys.stderr)
        return 0
    if a.cmd == "preempted":
        return 0 if Preempted.present(run) else 1
    if a.cmd == "clear-preempted":
        Preempted.clear(run)
        return 0
    print(getattr(run, PATHS[a.name]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
