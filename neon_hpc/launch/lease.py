"""One live launch per run directory: a lease in ``state/lease.json``, without file locks.

Two launches on one run directory (a rerun while the first one's trainer still runs, a
second ``sbatch``) train twice and interleave their metrics. Lustre, GPFS and NFS may lack
``flock``/``fcntl`` locks, so the lease uses only what they do have atomically: a hard link
that fails if its name exists (``link(2)``, the classic NFS lock-file step) and ``rename``.

``state/lease.json`` is a :class:`~neon_hpc.protocol.records.LeaseRecord` (published by
rename or link, read and checked by the record like every state file)::

    {"token": "...", "gen": 3, "host": "n1", "pid": 1234, "job_id": "567", "backend": "slurm",
     "restart": 0, "started": t0, "renewed": t1, "renewed_by": "trainer.0@n3:4321", "ttl_s": 30}

* **acquire** (the launcher, before it touches anything): with no lease, write the record to
  a hidden temporary and ``link`` it to ``lease.json``: only one of two racing launches
  succeeds. With a lease, refuse (:class:`LeaseHeld`, naming its owner and why it counts as
  alive) unless its owner is *provably dead* (:func:`owner_dead`). A takeover of generation
  ``g`` first links ``state/lease.takeover.<g+1>``: of two racing takers one wins, the other
  is refused; the winner then renames its record over ``lease.json``.
* **renew**: every process of the launch (launcher, trainer ranks, rollout nodes) rewrites
  the record with a new ``renewed`` time every :data:`RENEW_S` while its token is still the
  one in the file. A process that finds another token there has lost the run directory and
  stops itself (SIGTERM: the trainer checkpoints first).
* **members**: each such process also creates ``state/lease.d/<token>/<host>.<pid>.<start>``
  once, so a launch on the same host can check the processes themselves.
* **release**: a launch that ends removes the lease (if still its own).

Provably dead, in this order: the same process asking again (a resumed prepare in one
process); every member on this host has exited (pid gone, or reused: the start time
differs) and none is on another host; a Slurm requeue of the same job (same job id, a higher
restart count); or no renewal for ``ttl_s`` seconds. Anything else is alive: refuse.

What it does not do: fence a frozen owner that wakes up after a TTL takeover within one
renewal (it then sees the new token and stops itself, at most :data:`RENEW_S` later).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from neon_hpc.launch.slurmjob import in_queue
from neon_hpc.protocol.records import LeaseRecord
from neon_hpc.protocol.rundir import RunDir, create_json

RENEW_S = 2.0       # how often every process of a launch renews the lease
TTL_S = LeaseRecord.ttl_s   # a lease not renewed for this long belongs to a dead launch


class LeaseHeld(RuntimeError):
    """The run directory belongs to another live launch."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):   # a zombie has exited
        return None
    return fields[19]


def new_token(job_id: str = "local", restart: int = 0) -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{job_id}-{restart}-{time.time_ns()}"


def lease_path(run: RunDir) -> Path:
    return run.lease_file


def read(run: RunDir) -> LeaseRecord | None:
    return LeaseRecord.read(run)


def describe(rec: LeaseRecord) -> str:
    return (f"launch {rec.token} ({rec.backend} job {rec.job_id}, launcher pid "
            f"{rec.pid} on {rec.host}; renewed {rec.age_s():.0f}s ago by {rec.renewed_by})")


def members(run: RunDir, token: str) -> list[tuple[str, int, str]]:
    d = run.lease_members_dir(token)
    out = []
    for p in d.glob("*") if d.is_dir() else []:
        host, pid, start = p.name.rsplit(".", 2)
        out.append((host, int(pid), start))
    return out


def register(run: RunDir, token: str) -> None:
    """Record this process as a member of the launch ``token`` (created once, never rewritten)."""
    d = run.lease_members_dir(token)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{socket.gethostname()}.{os.getpid()}.{_start_time(os.getpid())}").touch()


def owner_dead(run: RunDir, rec: LeaseRecord, job_id: str = "local", restart: int = 0) -> str | None:
    """Why the owner of ``rec`` is provably dead, or None when it may be alive."""
    host = socket.gethostname()
    if rec.host == host and rec.pid == os.getpid():
        return "it is this process"
    age = rec.age_s()
    if age > rec.ttl_s:
        return f"not renewed for {age:.0f}s (ttl {rec.ttl_s:.0f}s)"
    if rec.backend == "slurm" and rec.job_id == str(job_id) and rec.restart < restart:
        return f"this is restart {restart} of the same Slurm job {job_id} (the lease is restart {rec.restart})"
    if rec.backend == "slurm":
        return _slurm_job_gone(rec.job_id)
    mem = members(run, rec.token)
    if rec.host == host and all(h == host for h, _, _ in mem):
        alive = [pid for _, pid, start in mem if _start_time(pid) == start]
        if rec.pid is not None and _start_time(rec.pid) == rec.pid_start:
            alive.append(rec.pid)
        if not alive:
            return f"none of its processes on {host} is running (pids {sorted({p for _, p, _ in mem} | {rec.pid})})"
    return None


def _slurm_job_gone(job_id: str) -> str | None:
    """Slurm's word that the job no longer runs (squeue lists nothing), else None (or no Slurm)."""
    seen = in_queue(job_id)
    if seen == "gone":
        return f"Slurm job {job_id} is no longer in the queue"
    if seen == "unknown":
        return f"Slurm does not know job {job_id} any more"
    return None


def _alive_detail(run: RunDir, rec: LeaseRecord) -> str:
    host = socket.gethostname()
    alive = [f"pid {pid}" for h, pid, start in members(run, rec.token) if h == host and _start_time(pid) == start]
    return f"; still running here: {', '.join(alive)}" if alive else ""


def acquire(run: RunDir, backend: str, job_id: str = "local", restart: int = 0,
            token: str | None = None) -> LeaseRecord:
    """Take the run directory's lease for this launch, or raise :class:`LeaseHeld`."""
    run.state.mkdir(parents=True, exist_ok=True)
    now = time.time()
    rec = LeaseRecord(token=token or new_token(job_id, restart), host=socket.gethostname(), pid=os.getpid(),
                      pid_start=_start_time(os.getpid()), job_id=str(job_id), backend=backend, restart=restart,
                      started=now, renewed=now, renewed_by=f"launcher@{socket.gethostname()}:{os.getpid()}",
                      ttl_s=TTL_S, gen=0)
    for _ in range(3):    # the lease may vanish (released) between our checks: look again
        if rec.create(run):
            register(run, rec.token)
            return rec
        cur = read(run)
        if cur is None:
            continue
        if cur.token == rec.token:
            return cur
        why = owner_dead(run, cur, job_id, restart)
        if why is None:
            raise LeaseHeld(f"{run.root} is in use by {describe(cur)}{_alive_detail(run, cur)}. Wait for that "
                            f"run to end (`neon-hpc status {run.root}`) or stop it; a run directory takes one "
                            f"launch at a time")
        gen = cur.gen + 1
        if not create_json(run.lease_takeover_file(gen), {"token": rec.token, "from": cur.token}):
            raise LeaseHeld(f"{run.root}: another launch is taking over the lease of {describe(cur)} right now")
        rec.gen = gen
        rec.took_over = {"token": cur.token, "why": why}
        rec.write(run)
        register(run, rec.token)
        _sweep(run, cur, gen)
        return rec
    raise LeaseHeld(f"{run.root}: the lease changed hands repeatedly while acquiring it; try again")


def check_free(run: RunDir) -> None:
    """Raise :class:`LeaseHeld` if a live launch holds the run directory (``neon-hpc launch``
    checks before it submits; the job itself acquires when it starts)."""
    cur = read(run)
    if cur is not None and owner_dead(run, cur) is None:
        raise LeaseHeld(f"{run.root} is in use by {describe(cur)}{_alive_detail(run, cur)}. Wait for that run "
                        f"to end (`neon-hpc status {run.root}`) or stop it; a run directory takes one launch "
                        f"at a time")


def _sweep(run: RunDir, dead: LeaseRecord, gen: int) -> None:
    shutil.rmtree(run.lease_members_dir(dead.token), ignore_errors=True)
    for g, p in run.lease_takeover_files():
        if g < gen:
            p.unlink(missing_ok=True)


def renew(run: RunDir, token: str, who: str) -> bool:
    """Renew the lease if it is still ``token``'s; False when another launch holds it now."""
    cur = read(run)
    if cur is None or cur.token != token:
        return False
    cur.renewed, cur.renewed_by = time.time(), who
    cur.write(run)
    return True


def release(run: RunDir, token: str) -> bool:
    cur = read(run)
    if cur is None or cur.token != token:
        return False
    LeaseRecord.clear(run)
    shutil.rmtree(run.lease_members_dir(token), ignore_errors=True)
    return True


class Renewer(threading.Thread):
    """Renews the lease every :data:`RENEW_S` from a daemon thread; on loss calls ``on_lost``."""

    def __init__(self, run: RunDir, token: str, who: str, on_lost=None):
        super().__init__(daemon=True, name="neon-lease")
        self.rundir, self.token, self.who = run, token, f"{who}@{socket.gethostname()}:{os.getpid()}"
        self.on_lost = on_lost or (lambda msg: os.kill(os.getpid(), signal.SIGTERM))
        self._stop_ev = threading.Event()

    def run(self) -> None:  # noqa: D401 - threading API
        while not self._stop_ev.wait(RENEW_S):
            try:
                ok = renew(self.rundir, self.token, self.who)
            except OSError:       # a full or read-only filesystem: the owner stays alive; retry
                continue
            if not ok:
                cur = read(self.rundir)
                self.on_lost(f"lost the lease of {self.rundir.root}: it is now held by "
                             f"{describe(cur) if cur else 'nobody (released)'}")
                return

    def stop(self) -> None:
        self._stop_ev.set()


def join_launch(run_dir: str, who: str) -> Renewer | None:
    """For a role process: register with and renew the launch's lease (``NEON_LEASE_TOKEN``)."""
    token = os.environ.get("NEON_LEASE_TOKEN")
    if not token:
        return None
    run = RunDir(run_dir)
    register(run, token)
    r = Renewer(run, token, who, on_lost=_stop_self)
    r.start()
    return r


def _stop_self(msg: str) -> None:
    print(f"neon-hpc: {msg}; stopping", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """``python -m neon_hpc.launch.lease release RUN_DIR``: the sbatch script's release at the end."""
    p = argparse.ArgumentParser(prog="python -m neon_hpc.launch.lease")
    p.add_argument("action", choices=["release", "show"])
    p.add_argument("run_dir")
    a = p.parse_args(argv)
    run = RunDir(a.run_dir)
    if a.action == "show":
        rec = read(run)
        print(describe(rec) if rec else "no lease")
        return 0
    token = os.environ.get("NEON_LEASE_TOKEN", "")
    release(run, token)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
