"""Child processes that cannot outlive the process that started them.

Slurm's ``proctrack/linuxproc`` (and the local launcher) find a job's processes through
their parents: a child whose parent is SIGKILLed is re-parented to init and escapes both.
:func:`child_setup` returns a ``preexec_fn`` that asks the kernel to send the child a signal
when its parent dies (Linux ``PR_SET_PDEATHSIG``), so engines and rollout workers end with
the rollout node that started them however it ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def child_setup(death_signal: int = signal.SIGTERM, ignore_usr1: bool = False):
    """A ``preexec_fn`` for ``subprocess.Popen`` (runs in the child between fork and exec)."""
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

    def setup() -> None:
        if ignore_usr1:
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
            if os.getppid() != parent:      # the parent died before prctl took effect
                os.kill(os.getpid(), death_signal)

    return setup
