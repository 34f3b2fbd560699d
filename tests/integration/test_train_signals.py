"""Slurm signals every process of a job step: megatron's checkpoint-writer helper must survive
the SIGUSR1 that asks the trainer for a checkpoint (found by the real het-job test)."""

from __future__ import annotations

import subprocess
import sys

PROG = r"""
import os, signal, sys, time
shield = sys.argv[1] == "shield"
if shield:
    from neon_hpc.train.checkpoint import shield_writer_processes
    shield_writer_processes()
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
q = fa._get_write_results_queue()
pid = q._manager._process.pid if hasattr(q, "_manager") and q._manager else None
import multiprocessing
kids = [p.pid for p in multiprocessing.active_children()]
for k in kids:
    os.kill(k, signal.SIGUSR1)
time.sleep(0.5)
try:
    q.put("x"); print("alive", q.get())
except Exception as e:
    print("dead", type(e).__name__)
for k in kids:   # a shielded helper ignores the SIGTERM multiprocessing ends it with: leave nothing behind
    try:
        os.kill(k, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


def _run(mode: str) -> str:
    r = subprocess.run([sys.executable, "-c", PROG, mode], capture_output=True, text=True, timeout=120)
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-500:]


def test_writer_helper_survives_sigusr1_when_shielded():
    assert _run("shield") == "alive x"


def test_unshielded_helper_dies_so_the_shield_is_needed():
    assert _run("plain").startswith("dead")
