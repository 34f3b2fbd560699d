"""A trainer survives, or cleanly fails, the death of any of megatron's checkpoint helpers
(issue 20, fault 1): a SIGKILLed forked writer, and a results Manager SIGKILLed during a save
(the next save then starts a new one). Never a hang, never a raw BrokenPipeError, no helper left behind.
A writer that is alive but stuck (SIGSTOP) is bounded by ``train.checkpoint_write_timeout_s``.

Real megatron-core torch_dist saves of the tiny model over gloo. The only addition is a
pause at the start of each writer child (HOLD_WRITERS), so the test can kill it mid-save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from neon_hpc.util.netutil import free_port
from repo_paths import REPO

PROG = r"""
import json, os, sys, time
from pathlib import Path
import psutil
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.train import backend as B, checkpoint as ckpt, writers
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

root = Path(sys.argv[2])
hold = root / "hold"
real = fa.FileSystemWriterAsync.write_preloaded_data
def held(*a, **k):                 # runs in each forked writer: announce, wait while told to
    (root / f"writer.{os.getpid()}").write_text("")
    while hold.exists():
        time.sleep(0.05)
    return real(*a, **k)
fa.FileSystemWriterAsync.write_preloaded_data = staticmethod(held)

from neon_hpc.config.model import ModelConfig
be = B.setup(ModelConfig(), seed=1)
run = RunDir(root / "run").create()
def report(**kw):
    print(json.dumps(kw), flush=True)
def children():   # live helpers (multiprocessing's resource tracker is not one of megatron's)
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:      # a zombie: dead, not yet reaped
            pass
    return sorted(out)
def save(step):
    t0 = time.monotonic()
    try:
        ckpt.save(run, be, step, {"version": step})
        return {"ok": True, "s": time.monotonic() - t0}
    except writers.CheckpointWriterError as e:
        return {"ok": False, "error": str(e), "type": type(e).__name__, "s": time.monotonic() - t0}
    except BaseException as e:
        return {"ok": False, "error": repr(e)[:300], "type": type(e).__name__}

if sys.argv[1] in ("stuck", "manager_stuck"):   # a short deadline for the save the test stalls
    writers.configure(float(sys.argv[3]))
report(first=save(1))          # writers held: the test kills one (or the Manager), or stops one
writers.configure(1800.0)
def manager():
    q = fa._results_queue
    return q._manager._process.pid if q is not None else None
report(children=children(), manager=manager())
hold.unlink(missing_ok=True)
report(second=save(2))
report(manager2=manager())
report(steps=run.checkpoint_steps(),
       staging=sorted(p.name for p in run.checkpoints.iterdir() if p.name.startswith(".")))
B.teardown()
"""


def _start(tmp_path: Path, mode: str, *extra: str) -> subprocess.Popen:
    (tmp_path / "hold").write_text("")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, "-c", PROG, mode, str(tmp_path), *extra], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _writers(tmp_path: Path, proc: subprocess.Popen, timeout: float = 180) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(p.name.split(".")[1]) for p in tmp_path.glob("writer.*")]
        if pids:
            time.sleep(0.3)       # every writer of the bucket set has started by now
            return [int(p.name.split(".")[1]) for p in tmp_path.glob("writer.*")]
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.1)
    raise AssertionError("no checkpoint writer started")


def _finish(proc: subprocess.Popen, timeout: float = 240) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kids = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        for k in kids:
            k.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the save hung (killed after {timeout}s); stderr tail:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    rec: dict = {}
    for line in out.splitlines():
        if line.startswith("{"):
            rec.update(json.loads(line))
    rec["stderr"] = err
    return rec


def _manager_pid(proc: subprocess.Popen) -> int:
    """The spawned Manager: the trainer's child that is not a held writer."""
    kids = psutil.Process(proc.pid).children()
    return next(k.pid for k in kids if "spawn_main" in " ".join(k.cmdline()))


def _assert_no_leftovers(pids: list[int]) -> None:
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"helper processes outlived the save: {alive}"


@pytest.mark.slow
def test_a_killed_forked_writer_fails_the_save_cleanly_and_the_next_save_works(tmp_path):
    proc = _start(tmp_path, "writer")
    try:
        held = _writers(tmp_path, proc)
        os.kill(held[0], signal.SIGKILL)
        rec = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    first = rec["first"]
    assert first["ok"] is False and first["type"] == "CheckpointWriterError", first
    assert f"pid {held[0]}" in first["error"] and "signal 9" in first["error"], first
    _assert_no_leftovers(held)                     # the other writers were killed and reaped
    assert set(rec["children"]) <= {rec["manager"]}, rec["children"]
    assert rec["second"]["ok"], rec["second"]      # the trainer can still checkpoint
    assert rec["steps"] == [2] and rec["staging"] == [], rec   # nothing partial of step 1
    assert "Traceback" not in rec["stderr"]


@pytest.mark.slow
def test_a_manager_killed_during_a_save_is_a_clear_error_not_a_broken_pipe(tmp_path):
    proc = _start(tmp_path, "manager_during")
    try:
        held = _writers(tmp_path, proc)
        mpid = _manager_pid(proc)
        os.kill(mpid, signal.SIGKILL)
        (tmp_path / "hold").unlink()
        rec = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    first = rec["first"]
    assert first["ok"] is False and first["type"] == "CheckpointWriterError", first
    assert "Manager" in first["error"] and f"pid {mpid}" in first["error"], first
    _assert_no_leftovers(held)
    assert rec["second"]["ok"], rec["second"]      # a new Manager for the next save
    assert rec["steps"] == [2] and rec["staging"] == []
    assert "BrokenPipeError" not in rec["stderr"].replace("BrokenPipeError:", "")


@pytest.mark.slow
def test_a_stuck_writer_is_bounded_by_the_deadline_killed_and_the_next_save_works(tmp_path):
    """SIGSTOP one forked writer (alive, never reporting): the save fails once the deadline
    passes, naming the pid, its state and the key; the stopped writer is killed and reaped;
    nothing of the step is published and the next save works (the run resumes)."""
    proc = _start(tmp_path, "stuck", "6")
    try:
        held = _writers(tmp_path, proc)
        os.kill(held[0], signal.SIGSTOP)
        (tmp_path / "hold").unlink()               # the other writers go on and report
        rec = _finish(proc)
        left = [p for p in held if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in held:                           # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    first = rec["first"]
    assert first["ok"] is False and first["type"] == "CheckpointWriterError", first
    assert f"pid {held[0]}, stopped" in first["error"], first
    assert "train.checkpoint_write_timeout_s" in first["error"], first
    assert left == [], f"writers outlived the failed save (checked before the test's own clean-up): {left}"
    assert set(rec["children"]) <= {rec["manager"]}, rec["children"]
    assert rec["second"]["ok"], rec["second"]
    assert rec["steps"] == [2] and rec["staging"] == [], rec
    assert "Traceback" not in rec["stderr"]


@pytest.mark.slow
def test_a_stopped_results_manager_is_bounded_killed_and_replaced(tmp_path):
    """SIGSTOP megatron's results Manager during a save: the writers finish, but handing their
    results over would block for ever. The save fails at the deadline naming the Manager's pid
    and state, the Manager is killed, and the next save starts a new one and works."""
    proc = _start(tmp_path, "manager_stuck", "6")
    try:
        held = _writers(tmp_path, proc)
        mpid = _manager_pid(proc)
        os.kill(mpid, signal.SIGSTOP)
        (tmp_path / "hold").unlink()
        rec = _finish(proc)
        stopped_left = psutil.pid_exists(mpid) and psutil.Process(mpid).status() != psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in held + [mpid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, UnboundLocalError):
                pass
    first = rec["first"]
    assert first["ok"] is False and first["type"] == "CheckpointWriterError", first
    assert f"pid {mpid}, stopped" in first["error"] and "Manager" in first["error"], first
    assert not stopped_left, f"the stopped Manager {mpid} outlived the failed save"
    assert rec["manager2"] not in (None, mpid)       # a new Manager for the next save
    assert rec["second"]["ok"], rec["second"]
    assert rec["steps"] == [2] and rec["staging"] == [], rec
    assert "Traceback" not in rec["stderr"]
