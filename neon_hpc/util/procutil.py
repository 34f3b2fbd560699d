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

Stopping: :func:`stop_tree` is the one terminate -> wait -> kill sequence (the launcher's
roles, the rollout node's workers, the engines), over each process and its descendants.
:class:`StopFlag` is the one signal handler of a role: the signal sets a flag (and may call
back); the role's loop polls it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

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


# --------------------------------------------------------------------------------------
# stopping

@dataclass
class Stopped:
    """What :func:`stop_tree` had to do: pids it SIGKILLed, and those still there after that."""

    killed: list[int] = field(default_factory=list)
    stuck: list[int] = field(default_factory=list)


def _descendants(pids: Sequence[int]) -> list:
    import psutil  # deferred: heavy (psutil)
    out = []
    for pid in pids:
        try:
            out += psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            pass
    return out


def _gone(proc) -> bool:
    import psutil  # deferred: heavy (psutil)
    try:
        return proc.status() == psutil.STATUS_ZOMBIE    # exited; its parent (or init) reaps it
    except psutil.Error:
        return True


def _wait_gone(procs: list, timeout: float) -> list:
    """Wait up to ``timeout`` for processes that are not our children; returns those left."""
    end = time.monotonic() + timeout
    left = [c for c in procs if not _gone(c)]
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = [c for c in left if not _gone(c)]
    return left


def stop_tree(procs: Sequence[subprocess.Popen], grace_s: float, *, signal_children: bool = True,
              kill_wait_s: float = 10.0, process_groups: bool = False,
              on_kill: Callable[[int], None] | None = None) -> Stopped:
    """Stop ``procs`` (our children) and every descendant: SIGTERM, wait, SIGKILL, reap.

    ``signal_children``: SIGTERM the descendants too and wait for them (SGLang's forked
    schedulers); False: only the roots get SIGTERM (a role stops its own children in order,
    e.g. the trainer's checkpoint writers), and descendants still alive once the roots are
    done are SIGKILLed.  Each root gets at least 0.1 s, so ``grace_s=0`` still reaps one that
    is already exiting.  ``on_kill(pid)`` is called before a process that outlived the grace
    is SIGKILLed.  ``process_groups``: finally SIGKILL each root's process group (roots
    started with ``start_new_session``), which also catches descendants re-parented before
    they could be seen.  Popen objects are reaped through Popen, so their ``returncode`` is
    the real one."""
    import psutil  # deferred: heavy (psutil)
    roots = [p for p in procs if p.poll() is None]
    tree = _descendants([p.pid for p in roots])
    for p in roots:
        try:
            p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    if signal_children:
        for c in tree:
            try:
                c.terminate()
            except psutil.Error:
                pass
    deadline = time.monotonic() + grace_s
    late = []
    for p in roots:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            late.append(p)
    tree += _descendants([p.pid for p in late])     # what the late ones started meanwhile
    tree = list({c.pid: c for c in tree}.values())
    alive = _wait_gone(tree, max(0.0, deadline - time.monotonic()) if signal_children else 0.0)
    done = Stopped()
    for p in late:
        if on_kill is not None:
            on_kill(p.pid)
        p.kill()
        done.killed.append(p.pid)
    for c in alive:
        try:
            if on_kill is not None and signal_children:
                on_kill(c.pid)
            c.kill()
            done.killed.append(c.pid)
        except psutil.Error:
            pass
    end = time.monotonic() + kill_wait_s
    for p in late:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            done.stuck.append(p.pid)      # SIGKILL pending: stuck in the kernel
    done.stuck += [c.pid for c in _wait_gone(alive, max(0.1, end - time.monotonic()))]
    if process_groups:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return done


class StopFlag:
    """A role's stop request: the first of ``signals`` sets it; the role's loop polls it.

    ``signum`` is the latest signal received and ``count`` how many came; ``on_signal(signum)``
    (optional) runs in the handler for each, so it must only set state, log or start a thread.
    ``on_again(signum)`` (optional) runs instead of it from the second signal on: the
    escalation (the local launcher's second Ctrl-C kills at once); ``escalated`` says one came.
    ``install`` replaces the handlers, ``restore`` puts the previous ones back."""

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT),
                 on_signal: Callable[[int], None] | None = None,
                 on_again: Callable[[int], None] | None = None):
        self.signals = tuple(signals)
        self.on_signal = on_signal
        self.on_again = on_again
        self.signum: int | None = None
        self.count = 0
        self._old: dict[int, object] = {}

    def install(self) -> "StopFlag":
        for s in self.signals:
            self._old[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def _handle(self, signum, _frame) -> None:
        self.signum = signum
        self.count += 1
        call = self.on_again if self.count > 1 and self.on_again is not None else self.on_signal
        if call is not None:
            call(signum)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def escalated(self) -> bool:
        """A second signal came after the first (a stop request made twice)."""
        return self.count > 1

    @property
    def name(self) -> str | None:
        """The latest signal's name (``"SIGTERM"``), or None."""
        return signal.Signals(self.signum).name if self.signum is not None else None
