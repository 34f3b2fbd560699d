"""A child started with procutil.child_setup() dies with its parent, even a SIGKILLed one."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from repo_paths import REPO

PARENT = r"""
import subprocess, sys, time
from neon_hpc.util.procutil import child_setup
ignore = sys.argv[1] == "ignore"
c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=child_setup(ignore_usr1=ignore))
print(c.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("mode", ["plain", "ignore"])
def test_child_ends_when_its_parent_is_killed(mode):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True,
                              cwd=str(REPO))
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        if mode == "ignore":
            child.send_signal(signal.SIGUSR1)          # Slurm's pre-timeout signal: ignored
            time.sleep(0.3)
            assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        parent.kill()
        parent.wait()
        child.wait(timeout=10)                         # psutil raises TimeoutExpired if it lingers
    finally:
        for p in (child,):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


FORKER = r"""
import os, sys, time
from neon_hpc.util.procutil import forked_children_die_with_me
forked_children_die_with_me()
pid = os.fork()
if pid == 0:
    time.sleep(120)
    os._exit(0)
print(pid, flush=True)
time.sleep(120)
"""

SHIELDED = r"""
import multiprocessing, time
from neon_hpc.train.checkpoint import shield_writer_processes
before = {p.pid for p in multiprocessing.active_children()}
shield_writer_processes()
new = [p.pid for p in multiprocessing.active_children() if p.pid not in before]
print(new[0], flush=True)
time.sleep(120)
"""


def _child_dies_with(cmd, env=None):
    repo = str(REPO)
    parent = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=repo, env=env)
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        time.sleep(0.5)    # the spawned child has imported the parent's module by now
        parent.kill()
        parent.wait()
        child.wait(timeout=10)
    finally:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_forked_children_die_with_a_killed_parent():
    """What megatron's checkpoint writers are: os.fork() children of the trainer."""
    _child_dies_with([sys.executable, "-c", FORKER])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_megatrons_checkpoint_helper_dies_with_a_killed_trainer():
    """The spawned results-queue Manager that shield_writer_processes starts for megatron
    (with SIGTERM blocked, so only the kernel's SIGKILL can end it once its owner is gone)."""
    _child_dies_with([sys.executable, "-c", SHIELDED])
