"""Test support: start ``world`` gloo ranks of a script as processes and wait for all of them."""

from __future__ import annotations

import os
import subprocess
import sys

from neon_hpc.util.netutil import free_port
from repo_paths import with_tests_on_pythonpath


def run_ranks(world: int, args_of, timeout: float = 300) -> list[str]:
    """Run ``python *args_of(rank)`` for every rank with RANK / WORLD_SIZE / LOCAL_RANK and one free
    localhost MASTER_PORT (one CPU thread each); returns each rank's output after asserting it
    exited 0.  A rank that outlives ``timeout`` fails the test, and none is left running."""
    port = free_port()
    procs = []
    for r in range(world):
        env = with_tests_on_pythonpath(dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
        procs.append(subprocess.Popen([sys.executable, *args_of(r)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{outs[r][-4000:]}"
    return outs
