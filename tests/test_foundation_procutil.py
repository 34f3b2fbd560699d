"""A child started with procutil.child_setup() dies with its parent, even a SIGKILLed one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

PARENT = r"""
import subprocess, sys, time
from neon_hpc.procutil import child_setup
ignore = sys.argv[1] == "ignore"
c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=child_setup(ignore_usr1=ignore))
print(c.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("mode", ["plain", "ignore"])
def test_child_ends_when_its_parent_is_killed(mode):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
