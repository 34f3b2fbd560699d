"""megatron-core's checkpoint helper processes, with waits that end when a helper dies.

A synchronous ``dist_checkpointing.save`` (torch_dist) runs megatron's
``FileSystemWriterAsync.write_preloaded_data_multiproc`` in the trainer: it forks one writer
per write bucket (children with the trainer's own command line) and then blocks in
``JoinableQueue.join()`` until each writer marks its task done. A writer that is SIGKILLed
(or OOM-killed) never does, and the trainer blocks for ever. The results then go through a
``spawn``-ed multiprocessing Manager (``train.checkpoint.shield_writer_processes``); when that
Manager is gone, the next save dies with a raw ``BrokenPipeError``.

:func:`install` replaces the multiproc writer with :func:`write_buckets_bounded`, which
forks the same writers (megatron's own ``write_preloaded_data``), but waits for their results
in slices of :data:`POLL_S` and checks between slices whether a writer without a result has
exited: then it kills the other writers, reaps them, and reports a
:class:`CheckpointWriterError` naming the writer and its exit status. :func:`guarded_save`
turns the Manager's connection errors into the same error, naming the Manager's pid, and
:func:`manager_alive` lets the next save start a new Manager instead of failing.

A writer that is alive but stuck (stopped, blocked on a hung filesystem) is bounded by a
deadline, ``train.checkpoint_write_timeout_s`` (:func:`configure`; the trainer sets it at
start): a save whose writers have not all reported by then kills them all, reaps them, and
raises a :class:`CheckpointWriterError` naming each late writer's pid and state (``stopped``,
``disk-sleep``, ...) and the key to raise if saves are legitimately that slow. Every round
trip to the results Manager is bounded too (:data:`MANAGER_S`, or the deadline if shorter):
a Manager that does not answer is killed, the save fails naming its pid and state, and the
next save starts a new one. Nothing of the
failed save is published (the staging directory is removed), so a rerun resumes from the
previous checkpoint.

What it does not do: tell a stuck writer from a slow one before the deadline, or kill a
writer stuck in the kernel (uninterruptible sleep on a dead filesystem ignores SIGKILL until
the I/O returns; the error then says so).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import queue
import threading
import time
from functools import partial
from typing import Any

log = logging.getLogger(__name__)

POLL_S = 0.5          # how often a waiting save checks its writers are still alive
REAP_S = 10.0         # how long a writer gets to exit after its result (or after a kill)
_LAST_FAILURE: str | None = None   # why the current save's writers failed (set in the trainer process)
_DEADLINE_S: float | None = None   # train.checkpoint_write_timeout_s, set by configure(); None: the config default


class CheckpointWriterError(RuntimeError):
    """A checkpoint helper process died or became unreachable; the checkpoint was not written."""


def configure(write_timeout_s: float) -> None:
    """Set the deadline of one save's writers (``train.checkpoint_write_timeout_s``)."""
    global _DEADLINE_S
    _DEADLINE_S = float(write_timeout_s)


def deadline_s() -> float:
    if _DEADLINE_S is not None:
        return _DEADLINE_S
    from neon_hpc.config.train import TrainConfig  # deferred: heavy (neon_hpc.config.train: pydantic)
    return float(TrainConfig.checkpoint_write_timeout_s)


def _proc_state(pid: int | None) -> str:
    """The kernel's word for a live process (``stopped``, ``disk-sleep``, ``sleeping``, ...)."""
    import psutil  # deferred: heavy (psutil)
    try:
        return psutil.Process(pid).status()
    except (psutil.Error, TypeError, ValueError):
        return "gone"


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def write_buckets_bounded(transform_list: list, use_msc: bool, rank: int, write_buckets: list,
                          global_results_queue: Any) -> None:
    """Same contract as megatron's ``write_preloaded_data_multiproc``: fork one writer per bucket,
    put ``{idx: results}`` (or an exception) on ``global_results_queue``; never waits on a dead writer."""
    # deferred: heavy (megatron)
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    count = ctx.JoinableQueue()   # megatron's writer marks its task done here; we wait on results instead
    procs = []
    out: dict | Exception = CheckpointWriterError("the checkpoint writers were not started")
    was_enabled = gc.isenabled()
    gc.disable()   # as megatron does: a collection in the forking process may free tensors children use
    try:
        for i, bucket in enumerate(write_buckets):
            count.put(i)
            kwargs = {"local_proc_idx": i, "write_bucket": bucket, "results_queue": results,
                      "count_queue": count, "use_fsync": True}
            if use_msc:
                kwargs["use_msc"] = use_msc
            procs.append(ctx.Process(target=partial(FileSystemWriterAsync.write_preloaded_data, transform_list),
                                     kwargs=kwargs, name=f"neon-ckpt-writer-{rank}.{i}"))
        for p in procs:
            p.start()
        out = _collect(procs, results, time.monotonic() + deadline_s())
    finally:
        _reap(procs, kill_first=isinstance(out, Exception))
        if was_enabled:
            gc.enable()
    global _LAST_FAILURE
    if isinstance(out, CheckpointWriterError):
        _LAST_FAILURE = str(out)
    stuck = _call_bounded(global_results_queue.put, out)
    if stuck is not None:      # megatron's get then fails on the killed Manager: guarded_save names it
        _LAST_FAILURE = stuck


MANAGER_S = 60.0      # the most a round trip to the results Manager may take (capped by the save deadline)


def _manager_process(q: Any) -> Any:
    return getattr(getattr(q, "_manager", None), "_process", None)


def _call_bounded(fn, *args) -> str | None:
    """Call ``fn`` (a round trip to megatron's results Manager) with a deadline. A Manager that
    does not answer in time (stopped, or blocked) is killed, which ends the call with an
    error; returns what happened then, else None. Other errors are raised as they are."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa  # deferred: heavy (megatron)
    err: list[BaseException] = []
    done = threading.Event()

    def call() -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            err.append(e)
        finally:
            done.set()

    threading.Thread(target=call, daemon=True, name="neon-ckpt-manager-call").start()
    limit = min(MANAGER_S, deadline_s())
    if not done.wait(limit):
        proc = _manager_process(getattr(fa, "_results_queue", None))
        pid = getattr(proc, "pid", None)
        state = _proc_state(pid)
        if proc is not None:
            proc.kill()
            proc.join(REAP_S)
        done.wait(REAP_S)
        fa._results_queue = None   # the next save starts a new Manager
        return (f"megatron's checkpoint results Manager (pid {pid}, {state}) did not answer within {limit:.0f}s; "
                f"it was killed and the checkpoint was not written (the next save starts a new one; "
                f"the deadline follows train.checkpoint_write_timeout_s, at most {MANAGER_S:.0f}s)")
    if err:
        raise err[0]
    return None


def _reap(procs: list, kill_first: bool) -> None:
    """No writer outlives the save: after a failure the others are killed, then all are joined."""
    for p in procs:
        if p.pid is not None and kill_first and p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is None:
            continue
        p.join(REAP_S)
        if p.is_alive():
            p.kill()
            p.join(REAP_S)
        if p.is_alive():     # SIGKILL pending: stuck in the kernel (a dead filesystem); say so
            log.error("megatron checkpoint writer pid %d did not end %.0fs after SIGKILL (state %s: stuck in "
                      "the kernel, e.g. on a hung filesystem); it ends when its I/O returns",
                      p.pid, REAP_S, _proc_state(p.pid))


def _collect(procs: list, results: Any, deadline: float) -> dict | Exception:
    got: dict[int, Any] = {}
    while len(got) < len(procs):
        try:
            idx, res = results.get(timeout=POLL_S)
        except queue.Empty:
            dead = [(i, p) for i, p in enumerate(procs) if i not in got and p.exitcode is not None]
            if not dead:
                if time.monotonic() > deadline:
                    late = ", ".join(f"writer {i} (pid {p.pid}, {_proc_state(p.pid)})"
                                     for i, p in enumerate(procs) if i not in got)
                    return CheckpointWriterError(
                        f"megatron checkpoint writers still running {deadline_s():.0f}s after the save began, "
                        f"without a result: {late}; they were killed and the checkpoint was not written. "
                        f"A writer stopped or blocked on a hung filesystem looks like this: check the "
                        f"filesystem; if saves are legitimately this slow, raise train.checkpoint_write_timeout_s")
                continue
            try:   # a writer that put its result and exited: the result may still be in the pipe
                idx, res = results.get(timeout=POLL_S)
            except queue.Empty:
                i, p = dead[0]
                return CheckpointWriterError(
                    f"megatron checkpoint writer {i} (pid {p.pid}) ended without a result "
                    f"({_exit_text(p.exitcode)}); the checkpoint was not written")
        if isinstance(res, Exception):
            return res
        got[idx] = res
    return got


def install() -> None:
    """Make megatron's synchronous torch_dist save use :func:`write_buckets_bounded`. Idempotent."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa  # deferred: heavy (megatron)
    cls = fa.FileSystemWriterAsync
    if cls.__dict__.get("write_preloaded_data_multiproc") is not _BOUNDED:
        cls.write_preloaded_data_multiproc = _BOUNDED


_BOUNDED = staticmethod(write_buckets_bounded)


def manager_alive() -> bool | None:
    """Whether megatron's results-queue Manager answers (None: none started yet)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa  # deferred: heavy (megatron)
    q = getattr(fa, "_results_queue", None)
    if q is None:
        return None
    proc = _manager_process(q)
    if proc is not None and not proc.is_alive():
        return False
    try:   # one round trip: a Manager that is gone, unreachable, or does not answer (killed then) fails it
        stuck = _call_bounded(q.qsize)
    except (OSError, EOFError):
        return False
    if stuck is not None:
        log.warning("%s", stuck)
        return None        # killed and forgotten: the save starts a new one
    return True


def drop_dead_manager() -> str | None:
    """Forget a dead results Manager so the next save starts a new one; returns which (or None)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa  # deferred: heavy (megatron)
    if manager_alive() is not False:
        return None
    proc = _manager_process(fa._results_queue)
    fa._results_queue = None
    return f"pid {proc.pid}" if proc is not None else "no pid known"


@contextlib.contextmanager
def guarded_save(where: str) -> Any:
    """Around ``dist_checkpointing.save``: a dead writer, or a lost connection to megatron's
    results Manager, comes out as one :class:`CheckpointWriterError` naming the process."""
    global _LAST_FAILURE
    install()
    dead = drop_dead_manager()
    if dead is not None:
        log.warning("megatron's checkpoint results Manager (%s) had died; a new one is started", dead)
    _LAST_FAILURE = None
    try:
        yield
    except (BrokenPipeError, EOFError, ConnectionError) as e:
        if _LAST_FAILURE is not None:     # a Manager killed for not answering: say why
            raise CheckpointWriterError(f"saving {where}: {_LAST_FAILURE}") from e
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa  # deferred: heavy (megatron)
        proc = _manager_process(getattr(fa, "_results_queue", None))
        who = f"pid {proc.pid}, {_exit_text(proc.exitcode)}" if proc is not None else "not started"
        raise CheckpointWriterError(
            f"saving {where}: megatron's checkpoint results Manager is unreachable ({who}): "
            f"{type(e).__name__}: {e}; the checkpoint was not written") from e
    except BaseException as e:   # torch's CheckpointException is a BaseException
        if _LAST_FAILURE is None or isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointWriterError(f"saving {where}: {_LAST_FAILURE}") from e
    finally:
        _LAST_FAILURE = None
