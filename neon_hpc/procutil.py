"""Child processes that cannot outlive the process that started them.

Slurm's ``proctrack/linuxproc`` (and the local launcher) find a job's processes through
their parents: a child whose parent is SIGKILLed is re-parented to init and escapes both.
:func:`child_setup` returns a ``preexec_fn`` that asks the kernel to send the child a signal
when its parent dies (Linux ``PR_SET_PDEATHSIG``), so engines and rollout workers end with
the rollout node that started them however it ends.

The trainer's own helpers come from megatron-core, not from us: checkpoint writers forked
during a save, and a ``spawn``-ed multiprocessing Manager. :func:`forked_children_die_with_me`
covers the forks (an at-fork hook); the Manager is started by
``train.checkpoint.shield_writer_processes`` with :func:`die_with_parent` as its initializer.
A SIGKILLed trainer then leaves none of them behind (the resource tracker ends when they
do). The signal fires when the parent *thread* ends; megatron forks these from the main
thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
# loaded before any fork: children only call into it
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(death_signal: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask the kernel to send this process ``death_signal`` when its parent dies (Linux).

    ``parent``: the pid the parent had (a child checks it has not been orphaned already,
    before the request took effect); without it, re-parenting to init counts as orphaned.
    """
    if _LIBC is None:
        return
    _LIBC.prctl(_PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
    ppid = os.getppid()
    orphaned = ppid != parent if parent is not None else ppid == 1
    if orphaned:
        os.kill(os.getpid(), death_signal)


def child_setup(death_signal: int = signal.SIGTERM, ignore_usr1: bool = False):
    """A ``preexec_fn`` for ``subprocess.Popen`` (runs in the child between fork and exec)."""
    parent = os.getpid()

    def setup() -> None:
        if ignore_usr1:
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        die_with_parent(death_signal, parent)

    return setup


_FORK_HOOKED = False


def forked_children_die_with_me(death_signal: int = signal.SIGKILL) -> None:
    """Every ``os.fork()`` child of this process (not fork+exec) dies with it. Idempotent."""
    global _FORK_HOOKED
    if not _FORK_HOOKED and _LIBC is not None:
        os.register_at_fork(after_in_child=lambda: die_with_parent(death_signal))
        _FORK_HOOKED = True
