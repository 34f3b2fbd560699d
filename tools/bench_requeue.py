"""What a requeue loses: the long-episode run interrupted mid-episode, resumed, and compared (issue 41).

Runs ``neon-hpc run configs/tiny_long_cpu.yaml`` (digits, up to 40 turns an episode) as local
processes and interrupts it while episodes are in flight:

1. **signal**: SIGUSR1 to the rollout node and its workers (what Slurm's ``--signal`` sends before
   the time limit) and SIGTERM to the launcher (the trainer checkpoints); ``stop_s`` is from the
   signal to the last worker's exit. The journal as the workers left it is read back, then the
   same command runs again, which resumes.
2. **SIGKILL** of rollout worker 1 in the rerun, mid-turn: the journal is read just before and
   just after; the node restarts the worker, which resumes its episodes.
3. **requeue** (``--slurm``; ``NEON_CLUSTER_DIR``: the local cluster of ``env/cluster.sh``):
   ``scontrol requeue`` of the heterogeneous job (``neon-hpc launch``) while episodes are mid-way;
   the journal is read while the job waits to start again, then the job is released and resumes.

When the rerun has finished, every episode journalled at an interruption is looked up in the
shards (claimed or ready) and in the claims' uid lists: it must be published once, under the
uid it started with, with the journalled prefix (tokens, loss mask, logprobs, per-token
versions, routes) unchanged, and consumed (trained, or masked by the stale policy) once.

Last line: ``RESULT in_flight_tokens=... kept_fraction=... lost_tokens=... duplicated_tokens=...
resumed_episodes=... stop_s=... journal_overhead=...`` (``kept_fraction``: tokens of episodes in
flight at the interruptions that were later consumed with their prefix intact, over all of them;
``journal_overhead``: the episodes' time in the journal over the workers' time running groups).

    python tools/bench_requeue.py                    # ~5 min on 2 CPU cores
    NEON_CLUSTER_DIR=/path/.cluster python tools/bench_requeue.py --slurm
    python tools/bench_requeue.py --steps 10 --keep  # keep the run directory
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny_long_cpu.yaml"


# --- driving the run ---------------------------------------------------------------------------
def launch(root: Path, steps: int, out: Path, *sets: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "neon_hpc.cli", "run", str(CONFIG), "--run-dir", str(root),
           "--set", f"train.steps={steps}", *[x for s in sets for x in ("--set", s)]]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(cmd, stdout=open(out, "a"), stderr=subprocess.STDOUT, cwd=REPO, env=env,
                            start_new_session=True)


def beats(root: Path, role: str) -> dict[int, dict]:
    from neon_hpc.protocol.rundir import RunDir, read_json
    out = {}
    for p in RunDir(root).heartbeats_dir.glob(f"{role}.*.json"):
        hb = read_json(p) or {}
        if hb.get("pid") and not hb.get("stopped"):
            out[int(hb["rank"])] = hb
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie (exited, not yet reaped by its parent) is gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def trainer_steps(root: Path) -> int:
    from neon_hpc.util.logs import read_metrics
    return len({r.get("step") for r in read_metrics(root, "trainer") if "step" in r})


def journal(root: Path, owner: str | None = None) -> dict[str, object]:
    """uid -> record of every readable record (of one worker's directory, or all)."""
    from neon_hpc.protocol.journal import JournalCorrupt, is_record, read_record
    from neon_hpc.protocol.rundir import RunDir
    run = RunDir(root)
    out = {}
    owners = [run.journal_owner(owner)] if owner else [d for d in run.journal.glob("w*") if d.is_dir()]
    for d in owners:
        for p in d.glob("*/*"):
            if is_record(p):
                try:
                    rec = read_record(p)
                except (OSError, JournalCorrupt):
                    continue
                out[rec.meta["uid"]] = rec
    return out


def in_flight(root: Path, min_turn: int = 2) -> dict[str, int]:
    """owner -> how many of its journalled episodes are unfinished and past ``min_turn`` turns."""
    from neon_hpc.protocol.journal import JournalCorrupt, is_record, read_meta
    from neon_hpc.protocol.rundir import RunDir
    out: Counter = Counter()
    for p in RunDir(root).journal.glob("w*/*/*"):
        if is_record(p):
            try:
                m = read_meta(p)
            except (OSError, JournalCorrupt):
                continue
            if not m["done"] and m["turn"] >= min_turn:
                out[p.parent.parent.name] += 1
    return dict(out)


def wait_until(cond, timeout_s: float, what: str, proc: subprocess.Popen | None = None, poll_s: float = 0.25):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the run exited ({proc.returncode}) before {what}")
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def interrupt(proc: subprocess.Popen, root: Path, timeout_s: float = 240) -> float:
    """SIGUSR1 to the rollout node and workers, SIGTERM to the launcher; the seconds until the
    last worker exited. Waits for the launcher to end."""
    workers = [int(hb["pid"]) for hb in beats(root, "rollout").values()]
    nodes = [int(hb["pid"]) for hb in beats(root, "rollout-node").values()]
    t0 = time.monotonic()
    for pid in nodes + workers:
        os.kill(pid, signal.SIGUSR1)
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: not any(alive(p) for p in workers), 60, "the workers to exit", poll_s=0.02)
    stop_s = time.monotonic() - t0
    proc.wait(timeout_s)
    return stop_s


def kill_worker(root: Path, worker: int) -> tuple[dict, dict]:
    """SIGKILL rollout worker ``worker``: its journal just before and just after."""
    pid = int(beats(root, "rollout")[worker]["pid"])
    owner = f"w{worker}"
    before = journal(root, owner)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), 10, "the killed worker to be gone", poll_s=0.01)
    return before, journal(root, owner)


# --- what came back ----------------------------------------------------------------------------
def published(root: Path) -> tuple[dict[str, list], Counter]:
    """uid -> trajectories published under it (claimed or ready shards); uid -> claims consuming it."""
    from neon_hpc.protocol.rundir import RunDir, read_json
    from neon_hpc.store import read_shard
    run = RunDir(root)
    trajs: dict[str, list] = {}
    for p in sorted(run.traj_claimed.glob("step_*/*.h5")) + sorted(run.traj_ready.glob("*.h5")):
        for t in read_shard(p):
            trajs.setdefault(t.metadata.get("uid"), []).append(t)
    claims: Counter = Counter()
    for step, _d in run.claim_dirs():
        for u in (read_json(run.claim_file(step)) or {}).get("uids", []):
            claims[u] += 1
    return trajs, claims


def prefix_kept(rec, tr) -> bool:
    """The trajectory starts with the record's books: tokens, mask, logprobs, versions, routes."""
    a = rec.arrays
    n = len(a["tokens"]) if not rec.meta["done"] else min(len(a["tokens"]), len(tr.tokens))
    if len(tr.tokens) < n:
        return False
    same = (np.array_equal(tr.tokens[:n], a["tokens"][:n]) and np.array_equal(tr.loss_mask[:n], a["loss_mask"][:n])
            and np.array_equal(tr.logprobs[:n], a["logprobs"][:n])
            and np.array_equal(tr.versions[:n], a["versions"][:n]))
    if "routed_experts" in a and tr.routed_experts is not None:
        pinned = min(len(a["cache_tokens"]) - 1, n)
        same = same and np.array_equal(tr.routed_experts[:pinned], a["routed_experts"][:pinned])
    return bool(same)


def account(snapshot: dict, trajs: dict, claims: Counter) -> dict:
    """What came back of the episodes journalled at an interruption."""
    out = {"episodes": len(snapshot), "in_flight_tokens": 0, "kept_tokens": 0, "duplicated_tokens": 0,
           "missing": [], "changed": [], "twice": [], "resumed_episodes": 0}
    for uid, rec in snapshot.items():
        n = len(rec.arrays["tokens"])
        out["in_flight_tokens"] += n
        got = trajs.get(uid, [])
        if len(got) > 1 or claims[uid] > 1:
            out["twice"].append(uid)
            out["duplicated_tokens"] += n * (max(len(got), claims[uid]) - 1)
        if not got:
            out["missing"].append(uid)
            continue
        if not prefix_kept(rec, got[0]):
            out["changed"].append(uid)
            continue
        out["resumed_episodes"] += int(got[0].metadata.get("resumes", 0) >= 1)
        if claims[uid] >= 1:
            out["kept_tokens"] += n
    out["kept_fraction"] = out["kept_tokens"] / out["in_flight_tokens"] if out["in_flight_tokens"] else float("nan")
    out["lost_tokens"] = out["in_flight_tokens"] - out["kept_tokens"]
    return out


def overhead(root: Path) -> float:
    from neon_hpc.launch.summary import journal_counts
    from neon_hpc.util.logs import read_metrics
    v = journal_counts(read_metrics(root, "rollout"))["journal_overhead"]
    return float("nan") if v is None else v


# --- the benchmark -------------------------------------------------------------------------------
def run_bench(root: Path, steps: int, log=print) -> dict:
    out = root.parent / "launcher.out"
    proc = launch(root, steps, out)
    try:
        wait_until(lambda: trainer_steps(root) >= 1 and len(in_flight(root)) >= 2, 600,
                   "both workers mid-episode after the first step", proc)
        stop_s = interrupt(proc, root)
        signalled = journal(root)
        log(f"signal: workers out in {stop_s:.2f}s; {len(signalled)} episodes journalled")
        first = trainer_steps(root)
        proc = launch(root, steps, out)
        wait_until(lambda: trainer_steps(root) >= first + 1 and in_flight(root).get("w1"), 600,
                   "worker 1 mid-episode in the rerun", proc)
        before, after = kill_worker(root, 1)
        log(f"SIGKILL: worker 1 had {len(before)} episodes journalled; after the kill {len(after)}")
        rc = proc.wait(900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    trajs, claims = published(root)
    sig, kill = account(signalled, trajs, claims), account(after, trajs, claims)
    behind = [u for u, r in after.items() if u in before and r.meta["turn"] < before[u].meta["turn"]]
    total = {k: sig[k] + kill[k] for k in ("in_flight_tokens", "kept_tokens", "duplicated_tokens", "lost_tokens",
                                          "resumed_episodes")}
    return {"rc": rc, "stop_s": stop_s, "signal": sig, "sigkill": kill, "sigkill_records_behind": behind,
            "all_claims_once": max(claims.values(), default=0) <= 1, **total,
            "kept_fraction": (total["kept_tokens"] / total["in_flight_tokens"] if total["in_flight_tokens"]
                              else float("nan")),
            "journal_overhead": overhead(root)}


def job_state(env: dict[str, str], job: str) -> str:
    """The job's state: squeue/sacct (``slurmjob.query``), else ``scontrol show job`` (a cluster whose
    accounting database is down answers UNKNOWN for a job no longer queued)."""
    from neon_hpc.launch.slurmjob import query
    st = query(job, env=env).state
    if st != "UNKNOWN":
        return st
    r = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True, timeout=60)
    states = {w.split("=", 1)[1] for w in r.stdout.split() if w.startswith("JobState=")}
    return states.pop() if len(states) == 1 else st


def run_requeue(root: Path, steps: int, cluster_dir: Path, log=print) -> dict:
    """The long-episode run as the heterogeneous Slurm job of the local cluster (``env/cluster.sh``,
    through ``tools/chaos.py``'s harness): ``scontrol requeue`` while episodes are mid-way, the
    journal read while the job waits to start again, then released; accounted when it completes."""
    import random

    import chaos
    from neon_hpc.launch.slurmjob import FINAL
    env = dict(chaos.slurm_env(cluster_dir), PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    root.parent.mkdir(parents=True, exist_ok=True)
    trial = chaos.SlurmTrial(root, steps, [], random.Random(0), log, env)
    trial.state = lambda j: job_state(env, j)
    trial.cmd = [sys.executable, "-m", "neon_hpc.cli", "launch", str(CONFIG), "--run-dir", str(root),
                 "--set", f"train.steps={steps}"]
    problems: list[str] = []
    job = trial.submit()
    if job is None:
        raise RuntimeError(f"neon-hpc launch of {root} was refused (lease held)")
    try:
        wait_until(lambda: trial.state(job) in FINAL or (trainer_steps(root) >= 1 and in_flight(root)), 900,
                   "episodes mid-way in the Slurm job")
        if trial.state(job) in FINAL:
            raise RuntimeError(f"job {job} ended ({trial.state(job)}) before episodes were mid-way")
        workers = [int(hb["pid"]) for hb in beats(root, "rollout").values()]
        t0 = time.monotonic()
        r = trial.slurm("scontrol", "requeue", job)
        if r.returncode:
            raise RuntimeError(f"scontrol requeue {job} failed: {r.stderr.strip()}")
        wait_until(lambda: not any(alive(p) for p in workers), 120, "the workers to exit", poll_s=0.02)
        stop_s = time.monotonic() - t0
        # the journal as the workers left it: the requeued job's workers start tens of seconds later
        # (the job's prologue, the engines, the first weights)
        requeued = journal(root)
        log(f"requeue: workers out in {stop_s:.2f}s; {len(requeued)} episodes journalled")
        st, pending_since, end = trial.state(job), None, time.monotonic() + 1200
        while st not in FINAL and time.monotonic() < end:
            if st in ("PENDING", "REQUEUED"):     # held until its BeginTime: let it start
                pending_since = pending_since or time.monotonic()
                if time.monotonic() - pending_since > 20:
                    trial.release_requeued(job, problems)
                    pending_since = None
            time.sleep(1.0)
            st = trial.state(job)
        if st not in FINAL:
            problems.append(f"job {job} did not end within 1200 s of the requeue (state {st})")
    finally:
        if trial.state(job) not in FINAL:
            trial.slurm("scancel", job)
    trajs, claims = published(root)
    acc = account(requeued, trajs, claims)
    return {"state": st, "problems": problems, "stop_s": stop_s, "requeue": acc, **{k: acc[k] for k in (
        "in_flight_tokens", "kept_tokens", "duplicated_tokens", "lost_tokens", "resumed_episodes", "kept_fraction")},
            "all_claims_once": max(claims.values(), default=0) <= 1, "journal_overhead": overhead(root)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--keep", action="store_true", help="keep the run directory (its path is printed)")
    p.add_argument("--slurm", action="store_true",
                   help="the scontrol requeue of the Slurm job instead (NEON_CLUSTER_DIR: the local cluster)")
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_requeue."))
    try:
        if a.slurm:
            r = run_requeue(tmp / "run", a.steps, Path(os.environ.get("NEON_CLUSTER_DIR", REPO / ".cluster")))
            r["rc"] = 0 if r["state"] == "COMPLETED" and not r["problems"] else 1
        else:
            r = run_bench(tmp / "run", a.steps)
        print(json.dumps({k: v for k, v in r.items()}, indent=1, default=str))
        print(f"RESULT in_flight_tokens={r['in_flight_tokens']} kept_fraction={r['kept_fraction']:.4f} "
              f"lost_tokens={r['lost_tokens']} duplicated_tokens={r['duplicated_tokens']} "
              f"resumed_episodes={r['resumed_episodes']} stop_s={r['stop_s']:.2f} "
              f"journal_overhead={r['journal_overhead']:.4f}")
        return 0 if r["rc"] == 0 else 1
    finally:
        if a.keep:
            print(f"run directory: {tmp / 'run'}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
