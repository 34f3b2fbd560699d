"""The tiny config as a real heterogeneous Slurm job on the local cluster, preempted with
SIGUSR1 (what `--signal=USR1@<s>` sends before the time limit), requeued by its own script,
and resumed from the run directory alone at the same step and data cursor."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from neon_hpc.protocol.rundir import RunDir, read_json
from neon_hpc.util.logs import read_metrics
from repo_paths import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
NEON = [sys.executable, "-m", "neon_hpc.cli"]
STEPS = 4


def _wait(pred, timeout: float, what: str, poll: float = 1.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")


def _diagnose(cluster, job: str, root: Path, out: str) -> str:
    """What an operator would look at when a job ended in the wrong state."""
    acct = cluster.run("sacct", "-D", "-j", job, "-o", "JobID,State,ExitCode,Start,End", "-P", check=False).stdout
    tails = []
    for role in ("trainer", "rollout-node", "launcher"):
        for f in sorted((root / "logs" / role).glob("*.log")) + sorted((root / "logs" / role).glob("*.stderr")):
            tails.append(f"--- {f.relative_to(root)}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
    return f"sacct:\n{acct}\nbatch output:\n{out[-3000:]}\n" + "\n".join(tails)


def test_het_job_preempted_requeued_and_resumed(slurm_cluster, tmp_path):
    root = tmp_path / "run"
    # offpolicy.max_staleness=1: steps 3-4 keep no token of v_0, so the engines must load published
    # weights (weights_loaded below follows from the rule, not from slow synchronous checkpoints)
    r = subprocess.run(NEON + ["launch", str(REPO / "configs" / "tiny_cpu.yaml"), "--run-dir", str(root),
                               "--set", f"train.steps={STEPS}", "--set", "train.checkpoint_every=2",
                               "--set", "warm_start.enabled=false", "--set", "offpolicy.max_staleness=1"],
                       capture_output=True, text=True, env=slurm_cluster.env, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    job = re.search(r"submitted heterogeneous job (\d+)", r.stdout).group(1)
    run = RunDir(root)
    try:
        _wait(lambda: slurm_cluster.state(job) == "RUNNING", 120, "job start")
        _wait(lambda: len(read_metrics(root, "trainer")) >= 1, 600, "first trainer step")
        # what Slurm sends before the time limit: SIGUSR1 to every step of the job
        slurm_cluster.run("scancel", "--signal=USR1", job)
        _wait(lambda: (read_json(run.state / "job.json") or {}).get("starts", 0) >= 2 or
              "PENDING" in slurm_cluster.state(job), 300, "requeue")
        # A requeued job waits for its BeginTime (~2 min); let it go sooner, but only once its
        # last incarnation has finished completing on every node: a restart that races the old
        # one's clean-up fails to launch (seen here as FAILED 1:0 with a CANCELLED batch step),
        # which the BeginTime delay exists to prevent on a real cluster.
        _wait(lambda: slurm_cluster.run("squeue", "-h", "-t", "CG", "-o", "%i", check=False).stdout.strip() == ""
              and "comp" not in slurm_cluster.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout,
              120, "the requeued job's nodes to finish completing")
        time.sleep(2)
        slurm_cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
        _wait(lambda: slurm_cluster.state(job) in ("COMPLETED", "FAILED", "CANCELLED"), 900, "job end", poll=2)
    finally:
        slurm_cluster.run("scancel", job, check=False)
    out = "".join(p.read_text() for p in (root / "launch").glob("neon-rl-*.out"))
    assert slurm_cluster.state(job) == "COMPLETED", _diagnose(slurm_cluster, job, root, out)
    assert read_json(run.state / "job.json")["starts"] >= 2
    assert "requeueing job" in out

    steps = [r["step"] for r in read_metrics(root, "trainer")]
    assert steps == list(range(1, STEPS + 1)), f"steps repeated or skipped across the requeue: {steps}"
    pre = [l for l in (run.log_dir("trainer") / "0.log").read_text().splitlines() if "preempted" in l]
    assert pre, "the trainer never saw the SIGUSR1"
    # data cursor: each step consumed its own claim exactly once
    claimed = sorted(int(p.name.split("_")[1]) for p in run.traj_claimed.glob("step_*"))
    assert claimed == list(range(1, STEPS + 1))
    names = [p.name for p in run.traj_claimed.glob("step_*/*.h5")]
    assert len(names) == len(set(names))
    # the engine loaded published weights; at least one trajectory records a newer version
    assert any(e.get("event") == "weights_loaded" for e in read_metrics(root, "rollout-node"))
    # nothing of the job is left
    assert slurm_cluster.run("squeue", "-h", "-j", job, check=False).stdout.strip() == ""
    left = [p for p in psutil.process_iter(["cmdline"]) if str(root) in " ".join(p.info["cmdline"] or [])]
    assert left == []


def test_dead_trainer_fails_the_job_fast_and_the_run_resumes(slurm_cluster, tmp_path):
    """SIGKILL the trainer rank: the job fails (no hang), nothing is left, and launching the
    same run again resumes from its newest checkpoint and finishes."""
    root = tmp_path / "run"
    launch = NEON + ["launch", str(REPO / "configs" / "tiny_cpu.yaml"), "--run-dir", str(root),
                     "--set", f"train.steps={STEPS}", "--set", "train.checkpoint_every=1",
                     "--set", "warm_start.enabled=false"]
    r = subprocess.run(launch, capture_output=True, text=True, env=slurm_cluster.env, cwd=REPO, timeout=120)
    job = re.search(r"submitted heterogeneous job (\d+)", r.stdout).group(1)
    run = RunDir(root)
    try:
        _wait(lambda: run.latest_checkpoint() is not None, 600, "first checkpoint")
        hb = read_json(run.heartbeat_file("trainer", 0))
        trainer = psutil.Process(int(hb["pid"]))
        # megatron's helpers (a spawned Manager, forked writers) do not carry the run dir in
        # their command line: check them by ancestry
        helpers = trainer.children(recursive=True)
        trainer.kill()
        _wait(lambda: slurm_cluster.state(job) in ("FAILED", "COMPLETED", "CANCELLED"), 120, "job end after the kill")
    finally:
        slurm_cluster.run("scancel", job, check=False)
    assert slurm_cluster.state(job) == "FAILED"
    time.sleep(1.0)
    left = [(p.pid, " ".join(p.info["cmdline"] or [])) for p in psutil.process_iter(["cmdline"])
            if str(root) in " ".join(p.info["cmdline"] or [])]
    assert left == [], _diagnose(slurm_cluster, job, root, "")
    alive = [(h.pid, " ".join(h.cmdline())) for h in helpers if h.is_running() and h.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"the killed trainer's helpers outlived the job: {alive}"
    done_before = run.latest_checkpoint()

    # the same launch again, this time waiting for the job like a user would (a job left by a
    # timeout here is cancelled by the session fixture)
    r = subprocess.run(launch + ["--wait"], capture_output=True, text=True, env=slurm_cluster.env,
                       cwd=REPO, timeout=900)
    job2 = re.search(r"submitted heterogeneous job (\d+)", r.stdout).group(1)
    assert r.returncode == 0 and f"job {job2}: COMPLETED" in r.stdout, r.stdout + r.stderr
    assert slurm_cluster.state(job2) == "COMPLETED"
    log = (run.log_dir("trainer") / "0.log").read_text()
    assert f"resumed from {run.checkpoint(done_before)}" in log
    steps = [r["step"] for r in read_metrics(root, "trainer")]
    assert steps[-1] == STEPS and sorted(set(steps)) == list(range(1, STEPS + 1))
