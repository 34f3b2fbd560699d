"""Chaos harness: run the main job, SIGKILL one role at a chosen or random moment, recover the
way a user would (run the same command again), and check the invariants from the run
directory and the process table alone.

    python tools/chaos.py --trials 20                      # random roles at random moments
    python tools/chaos.py --moment helper --trials 3       # a named moment, every trial

Moments (``--moment``): ``claim`` (the trainer while it claims a step), ``checkpoint`` (the
trainer while ``checkpoints/.step_N.tmp.*`` exists), ``publish`` (the trainer while
``weights/.v_N.tmp.*`` exists), ``flush`` (a rollout worker while a shard is in
``trajectories/tmp``), ``helper`` (one of megatron's checkpoint helpers of the trainer, a forked
writer or the results Manager, during a save), ``launcher`` (``neon-hpc run`` itself after a
step), ``trainer``/``node``/``worker``/``engine`` (that role a random time after the first
step), ``all`` (every process of the run at once), or ``random`` (each of these once per round
of 11 trials, in a random order, the role moments after a random delay).

Recovery: wait for the killed launch to end by itself (bounded), then rerun the same command
until it completes; a rerun refused because the old launch still holds the lease (exit 3) is
retried after a pause, as a user would.

Invariants, checked after each trial:

* exactly once: no shard is claimed by two steps or both claimed and ready, so every
  trajectory (shard, index) is trained at most once; every shard a claim names is in its step;
* no partial shard: every shard in ``ready/`` and ``claimed/`` reads back and passes its checksum;
* step continuity: the trainer's metrics cover steps 1..S, each claimed step has its claim record;
* ``weights/LATEST`` complete: it names ``v_S``, whose safetensors files parse;
* no process left: no process of any launch of the trial is alive afterwards;
* completion: the last command exited 0 and ``state/finished.json`` exists; no staging
  directory of a dead writer is left.

On the real Slurm het job (``--backend slurm``; the local cluster of ``env/cluster.sh``,
``--cluster-dir``), the job is submitted with ``neon-hpc launch`` and the moments are Slurm's
faults, each after the first trainer step and a random delay:

* ``scancel``: ``scancel JOB+C`` of one component (``+0`` the rollout group with the batch
  script, ``+1`` the trainer group), chosen at random (or ``--component``);
* ``kill-node``: SIGKILL of every task process of one group's srun step at once (the rollout
  node with its engines and workers, or the trainer with megatron's helpers), as when a node
  dies under a living slurmstepd;
* ``requeue``: ``scontrol requeue JOB`` of the running job; the job restarts by itself
  (``SLURM_RESTART_COUNT`` + 1) and resumes. The harness then lifts the requeued job's
  BeginTime delay (``scontrol update StartTime=now``) once its nodes have finished completing,
  rather than wait out Slurm's ~2 min.

Recovery: a job that did not complete is launched again (``neon-hpc launch`` with the same
run directory; refused launches, exit 3, are retried), until one completes. The invariants
are the same, plus: no job of the trial is left in ``squeue``, and for ``requeue`` the run
was started at least twice (``state/job.json``).

Ends with ``RESULT chaos_trials=N chaos_invariant_failures=F chaos_faults_injected=K``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from neon_hpc.launch.slurmjob import FINAL  # noqa: E402
from neon_hpc.protocol.records import ClaimRecord, Finished, JobRecord, TrainerBeat, TrainerPhase  # noqa: E402
from neon_hpc.protocol.rundir import RunDir, RunDirError  # noqa: E402

MOMENTS = ("claim", "checkpoint", "publish", "flush", "helper", "launcher", "trainer", "node", "worker",
           "engine", "all")
SLURM_MOMENTS = ("scancel", "kill-node", "requeue")
GROUPS = {0: "rollout", 1: "trainer"}      # het components of the job (sbatch/tiny_cpu.example.sbatch)
POLL_S = 0.02
LAUNCHER_EXIT_S = 900.0     # a launch must end by itself this long after a fault (it may run to the end)
ORPHAN_EXIT_S = 240.0       # processes of a launcher that was killed must stop by themselves
RERUN_WINDOW_S = 600.0      # how long the user keeps rerunning a refused (lease held) command
MAX_RERUNS = 4


def run_processes(root: Path) -> list[psutil.Process]:
    """Every live process whose command line names the run directory (roles, workers, engines)."""
    out = []
    needle = str(root)
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(needle in a for a in (p.info["cmdline"] or [])):
                out.append(p)
        except psutil.Error:
            continue
    return out


def role_of(p: psutil.Process) -> str:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return "?"
    for role in ("rollout-worker", "rollout-node", "trainer"):
        if f"roles {role}" in cmd:
            return {"rollout-worker": "worker", "rollout-node": "node"}.get(role, role)
    if "neon_hpc.cli" in cmd or " run " in f" {cmd} ":
        return "launcher"
    return "engine" if "engine" in cmd or "embedded" in cmd else "other"


def sigkill(procs: list[psutil.Process]) -> list[str]:
    """SIGKILL each process; the ``role:pid`` of each (one that is already gone is skipped)."""
    names = []
    for p in procs:
        try:
            names.append(f"{role_of(p)}:{p.pid}")
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    return names


def by_role(root: Path, role: str) -> list[psutil.Process]:
    return [p for p in run_processes(root) if role_of(p) == role]


def helpers(root: Path) -> list[psutil.Process]:
    """megatron's helpers: the trainer's children (forked writers, the spawned Manager)."""
    out = []
    for t in by_role(root, "trainer"):
        try:
            out += [c for c in t.children() if "resource_tracker" not in " ".join(c.cmdline())]
        except psutil.Error:
            pass
    return out


def staging(d: Path) -> bool:
    try:
        return any(n.startswith(".") and ".tmp." in n for n in os.listdir(d))
    except FileNotFoundError:
        return False


class Trial:
    def __init__(self, root: Path, steps: int, sets: list[str], rng: random.Random, log):
        self.root, self.steps, self.rng, self.log = root, steps, rng, log
        self.run = RunDir(root)
        self.cmd = [sys.executable, "-m", "neon_hpc.cli", "run", str(REPO / "configs" / "tiny_cpu.yaml"),
                    "--run-dir", str(root), "--quiet", "--no-plot", "--set", f"train.steps={steps}",
                    "--set", "warm_start.enabled=false", "--set", "eval.num_tasks=0", *sum(
                        (["--set", s] for s in sets), [])]
        self.seen: set[int] = set()     # every pid of the trial's launches (for "no process left")

    def launch(self) -> subprocess.Popen:
        out = open(self.root.parent / f"{self.root.name}.launcher.txt", "ab")
        return subprocess.Popen(self.cmd, cwd=REPO, stdout=out, stderr=out, start_new_session=True,
                                env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))

    def snapshot(self, launcher: psutil.Process | None) -> None:
        procs = run_processes(self.root)
        if launcher is not None:
            try:
                procs += launcher.children(recursive=True)
            except psutil.Error:
                pass
        for p in procs:
            self.seen.add(p.pid)
            try:
                self.seen.update(c.pid for c in p.children(recursive=True))
            except psutil.Error:
                pass

    def steps_done(self) -> int:
        f = self.run.log_dir("trainer") / "metrics.jsonl"
        try:
            return len({json.loads(line).get("step") for line in f.read_text().splitlines() if line.strip()})
        except (FileNotFoundError, json.JSONDecodeError):
            return 0

    def trainer_phase(self) -> TrainerBeat | None:
        try:
            return TrainerBeat.read(self.run, 0)
        except RunDirError:
            return None

    # --- the fault ------------------------------------------------------------------------
    def victims(self, moment: str, launcher: subprocess.Popen) -> list[psutil.Process] | None:
        """The processes to kill if the moment has come, else None."""
        r = self.run
        if moment == "claim":
            ph = self.trainer_phase()
            return (by_role(self.root, "trainer") if ph and ph.phase is TrainerPhase.CLAIMING and (ph.step or 0) >= 2
                    else None)
        if moment == "checkpoint":
            return by_role(self.root, "trainer") if staging(r.checkpoints) else None
        if moment == "publish":
            return by_role(self.root, "trainer") if r.latest_weights() and staging(r.weights) else None
        if moment == "flush":
            if any(True for _ in r.traj_tmp.glob("*")) if r.traj_tmp.is_dir() else False:
                ws = by_role(self.root, "worker")
                return [self.rng.choice(ws)] if ws else None
            return None
        if moment == "helper":
            hs = helpers(self.root) if staging(r.checkpoints) else []
            return [self.rng.choice(hs)] if hs else None
        if self.steps_done() < 1:
            return None
        if moment == "launcher":
            return [psutil.Process(launcher.pid)]
        if moment == "all":
            return run_processes(self.root) + helpers(self.root)
        ps = by_role(self.root, moment)
        return [self.rng.choice(ps)] if ps else None

    def inject(self, moment: str, launcher: subprocess.Popen, delay_s: float) -> str:
        t0 = time.monotonic()
        armed_at = None
        snap_at = 0.0
        while launcher.poll() is None:
            if time.monotonic() - snap_at > 1.0:   # a process-table scan is slow: keep the poll fast
                self.snapshot(psutil.Process(launcher.pid))
                snap_at = time.monotonic()
            if moment in ("launcher", "trainer", "node", "worker", "engine", "all"):
                if self.steps_done() >= 1 and armed_at is None:
                    armed_at = time.monotonic()
                if armed_at is None or time.monotonic() - armed_at < delay_s:
                    time.sleep(0.2)
                    continue
            v = self.victims(moment, launcher)
            if v:
                names = sigkill(v)
                return f"SIGKILL {', '.join(names)} after {time.monotonic() - t0:.0f}s"
            time.sleep(POLL_S)
        return "none (the run ended before the moment came)"

    # --- recovery -------------------------------------------------------------------------
    def wait_gone(self, launcher: subprocess.Popen, problems: list[str]) -> None:
        try:
            launcher.wait(timeout=LAUNCHER_EXIT_S)
        except subprocess.TimeoutExpired:
            problems.append(f"the launcher did not end within {LAUNCHER_EXIT_S:.0f}s of the fault (hung)")
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        deadline = time.monotonic() + ORPHAN_EXIT_S
        while time.monotonic() < deadline and self.alive():
            self.snapshot(None)
            time.sleep(1.0)

    def alive(self) -> list[str]:
        out = []
        for pid in sorted(self.seen):
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{pid} ({' '.join(p.cmdline())[:120]})")
            except psutil.Error:
                pass
        return out

    def recover(self, problems: list[str]) -> int:
        t0 = time.monotonic()
        reruns = 0
        while True:
            launcher = self.launch()
            while launcher.poll() is None:
                self.snapshot(psutil.Process(launcher.pid) if launcher.poll() is None else None)
                time.sleep(0.5)
            rc = launcher.returncode
            self.log(f"  rerun exited {rc}")
            if rc == 3 and time.monotonic() - t0 < RERUN_WINDOW_S:
                time.sleep(5.0)                  # the old launch still holds the lease: wait, rerun
                continue
            reruns += 1
            if rc == 0 or reruns >= MAX_RERUNS:
                return rc
            self.wait_gone(launcher, problems)

    # --- invariants -----------------------------------------------------------------------
    def check(self, rc: int, problems: list[str]) -> None:
        from neon_hpc.store.reader import ShardError, read_shard
        r = self.run
        if rc != 0:
            problems.append(f"the last rerun exited {rc}, not 0")
        if not Finished.present(r):
            problems.append(f"{r.finished_file} is missing: the run did not complete")
        ready = {p.name for p in r.traj_ready.glob("*.h5")}
        owner: dict[str, int] = {}
        for step_dir in sorted(r.traj_claimed.glob("step_*")):
            step = int(step_dir.name.split("_")[1])
            rec = ClaimRecord.read_in(step_dir)
            if rec is None:
                problems.append(f"{step_dir} has no commit record (a half-done claim left behind)")
                continue
            for s in rec.shards:
                name = s["name"]
                if name in owner:
                    problems.append(f"shard {name} claimed by steps {owner[name]} and {step}: trained twice")
                owner[name] = step
                if name in ready:
                    problems.append(f"shard {name} is both claimed (step {step}) and in ready/")
                if not (step_dir / name).exists():
                    problems.append(f"claim of step {step} names {name}, which is not in {step_dir}")
        for p in list(r.traj_ready.glob("*.h5")) + list(r.traj_claimed.glob("step_*/*.h5")):
            try:
                read_shard(p)
            except (ShardError, OSError) as e:
                problems.append(f"partial or corrupt shard {p}: {e}")
        steps = []
        f = r.log_dir("trainer") / "metrics.jsonl"
        if f.exists():
            steps = sorted({json.loads(line)["step"] for line in f.read_text().splitlines() if line.strip()})
        if steps != list(range(1, self.steps + 1)):
            problems.append(f"trainer steps in metrics are {steps}, not 1..{self.steps}")
        missing = [s for s in range(1, self.steps + 1) if not ClaimRecord.committed(r.claimed_step(s))]
        if missing:
            problems.append(f"steps without a committed claim: {missing}")
        latest = r.latest_weights()
        if latest is None or latest[0] != self.steps:
            problems.append(f"weights/LATEST names {latest and latest[0]}, not v_{self.steps}")
        elif not _weights_complete(latest[1]):
            problems.append(f"{latest[1]} (named by LATEST) is incomplete")
        for d in (r.checkpoints, r.weights):
            if staging(d):
                problems.append(f"staging directories left in {d}: "
                                f"{[n for n in os.listdir(d) if n.startswith('.')]}")
        time.sleep(2.0)
        left = self.alive()
        if left:
            problems.append(f"processes left after the run: {left}")
            for pid in sorted(self.seen):
                try:
                    psutil.Process(pid).kill()
                except psutil.Error:
                    pass


def _weights_complete(d: Path) -> bool:
    from safetensors import safe_open
    files = list(d.glob("*.safetensors"))
    if not files or not (d / "config.json").exists():
        return False
    try:
        for f in files:
            with safe_open(str(f), "pt") as h:
                list(h.keys())
    except Exception:  # noqa: BLE001 - any parse failure means incomplete
        return False
    return True


def slurm_env(cluster_dir: Path) -> dict[str, str]:
    """The environment that talks to the local cluster (``env/cluster.sh``), or SystemExit."""
    conf = cluster_dir / "etc" / "slurm.conf"
    env = dict(os.environ, SLURM_CONF=str(conf), PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"chaos.py --backend slurm: sinfo failed ({e}); is Slurm installed (env/setup.sh)?")
    if not conf.exists() or r.returncode != 0 or not any(t in r.stdout for t in ("idle", "mix", "alloc")):
        raise SystemExit(f"chaos.py --backend slurm: no cluster answers with {conf} ({r.stderr.strip()[:200]}); "
                         f"start it with `bash env/cluster.sh start` (NEON_CLUSTER_DIR={cluster_dir})")
    return env


class SlurmTrial(Trial):
    """One trial on the real heterogeneous job: submit, inject a Slurm fault, relaunch until done."""

    JOB_END_S = 900.0      # a job must end (or be requeued) this long after a fault
    CG_S = 180.0           # a requeued job's nodes must have finished completing within this

    def __init__(self, root: Path, steps: int, sets: list[str], rng: random.Random, log, env: dict[str, str],
                 component: int | None = None):
        super().__init__(root, steps, sets, rng, log)
        self.env, self.component = env, component
        self.cmd = [sys.executable, "-m", "neon_hpc.cli", "launch", str(REPO / "configs" / "tiny_cpu.yaml"),
                    "--run-dir", str(root), "--set", f"train.steps={steps}", "--set", "warm_start.enabled=false",
                    *sum((["--set", x] for x in sets), [])]
        self.jobs: list[str] = []

    def slurm(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=60)

    def state(self, job: str) -> str:
        from neon_hpc.launch.slurmjob import query
        return query(job, env=self.env).state

    def submit(self) -> str | None:
        """``neon-hpc launch``: the job id, or None when the launch was refused (lease held, exit 3)."""
        r = subprocess.run(self.cmd, cwd=REPO, env=dict(self.env, PYTHONWARNINGS="ignore"), capture_output=True,
                           text=True, timeout=300)
        with open(self.root.parent / f"{self.root.name}.launcher.txt", "a") as f:
            f.write(r.stdout + r.stderr)
        if r.returncode == 3:
            return None
        m = re.search(r"submitted heterogeneous job (\d+)", r.stdout)
        if r.returncode != 0 or m is None:
            raise RuntimeError(f"neon-hpc launch failed (exit {r.returncode}): {r.stderr[-500:]}")
        self.jobs.append(m.group(1))
        return m.group(1)

    def wait_state(self, job: str, done, timeout: float, what: str, problems: list[str]) -> str:
        end = time.monotonic() + timeout
        st = self.state(job)
        while time.monotonic() < end:
            self.snapshot(None)
            st = self.state(job)
            if done(st):
                return st
            time.sleep(1.0)
        problems.append(f"job {job}: {what} did not happen within {timeout:.0f}s (state {st})")
        return st

    def victims_of(self, group: str) -> list[psutil.Process]:
        """Every task process of one group's srun step (children of its slurmstepd), with their
        descendants: what runs on that node. Not ``srun`` itself, which runs beside the batch
        script and carries the same command line."""
        roles = ("node", "worker", "engine") if group == "rollout" else ("trainer",)
        top = []
        for p in run_processes(self.root):
            try:
                if role_of(p) in roles and p.parent() is not None and p.parent().name().startswith("slurmstepd"):
                    top.append(p)
            except psutil.Error:
                continue
        out = {p.pid: p for p in top}
        for p in top:
            try:
                out.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.Error:
                pass
        return list(out.values())

    def inject_slurm(self, moment: str, job: str, delay_s: float, problems: list[str]) -> str:
        t0 = time.monotonic()
        st = self.wait_state(job, lambda s: s == "RUNNING" or s in FINAL, 600, "job start", problems)
        while st == "RUNNING" and self.steps_done() < 1:
            self.snapshot(None)
            time.sleep(0.5)
            st = self.state(job)
        end = time.monotonic() + delay_s
        while time.monotonic() < end and self.state(job) == "RUNNING":
            self.snapshot(None)
            time.sleep(0.5)
        if self.state(job) != "RUNNING":
            return "none (the job ended before the moment came)"
        self.snapshot(None)
        if moment == "scancel":
            comp = self.component if self.component is not None else self.rng.choice(sorted(GROUPS))
            r = self.slurm("scancel", f"{job}+{comp}")
            return (f"scancel {job}+{comp} ({GROUPS[comp]} group) after {time.monotonic() - t0:.0f}s"
                    + (f" [scancel: {r.stderr.strip()}]" if r.returncode else ""))
        if moment == "kill-node":
            group = GROUPS[self.component] if self.component is not None else self.rng.choice(sorted(GROUPS.values()))
            v = self.victims_of(group)
            names = sigkill(v)
            return (f"SIGKILL the {group} node's {len(names)} processes ({', '.join(names)}) "
                    f"after {time.monotonic() - t0:.0f}s")
        r = self.slurm("scontrol", "requeue", job)
        if r.returncode:
            problems.append(f"scontrol requeue {job} failed: {r.stderr.strip()}")
        return f"scontrol requeue {job} after {time.monotonic() - t0:.0f}s"

    def release_requeued(self, job: str, problems: list[str]) -> None:
        """A requeued job waits for its BeginTime; let it start once its nodes are done completing."""
        self.wait_state(job, lambda s: s in ("PENDING", "REQUEUED") or s in FINAL, 300,
                        "the requeue", problems)
        end = time.monotonic() + self.CG_S
        while time.monotonic() < end:
            self.snapshot(None)
            cg = self.slurm("squeue", "-h", "-t", "CG", "-j", job, "-o", "%i").stdout.strip()
            if not cg and "comp" not in self.slurm("sinfo", "-h", "-N", "-o", "%t").stdout:
                break
            time.sleep(1.0)
        time.sleep(2.0)
        self.slurm("scontrol", "update", f"JobId={job}", "StartTime=now")

    def run_slurm(self, moment: str, delay_s: float) -> tuple[str, int, list[str]]:
        problems: list[str] = []
        job = self.submit()
        if job is None:
            return "none (the first launch was refused)", 1, [f"the first launch of {self.root} was refused"]
        fault = self.inject_slurm(moment, job, delay_s, problems)
        self.log(f"  {fault}")
        if moment == "requeue" and not fault.startswith("none"):
            self.release_requeued(job, problems)
        st = self.wait_state(job, lambda s: s in FINAL, self.JOB_END_S, "job end", problems)
        self.log(f"  job {job}: {st}")
        rc = 0 if st == "COMPLETED" else 1
        t0, reruns = time.monotonic(), 0
        while rc != 0 and reruns < MAX_RERUNS:       # the user launches the run again
            self.wait_processes_gone()
            job = self.submit()
            if job is None:
                if time.monotonic() - t0 > RERUN_WINDOW_S:
                    problems.append("every relaunch was refused (lease held) for "
                                    f"{RERUN_WINDOW_S:.0f}s after the job ended")
                    break
                time.sleep(5.0)
                continue
            reruns += 1
            st = self.wait_state(job, lambda s: s in FINAL, self.JOB_END_S, "job end", problems)
            self.log(f"  relaunch: job {job}: {st}")
            rc = 0 if st == "COMPLETED" else 1
        if moment == "requeue" and not fault.startswith("none"):
            rec = JobRecord.read(self.run)
            starts = rec.starts if rec is not None else 0
            if starts < 2:
                problems.append(f"the requeued job did not start again ({self.run.job_file} starts={starts})")
        self.wait_jobs_gone(problems)
        return fault, rc, problems

    def wait_processes_gone(self) -> None:
        end = time.monotonic() + ORPHAN_EXIT_S
        while time.monotonic() < end and self.alive():
            time.sleep(1.0)

    def wait_jobs_gone(self, problems: list[str]) -> None:
        """Every job of the trial out of squeue (CG included); then its steps' processes must be gone."""
        end = time.monotonic() + self.CG_S
        left = ""
        while time.monotonic() < end:
            left = self.slurm("squeue", "-h", "-j", ",".join(self.jobs), "-o", "%i %T").stdout.strip()
            if not left:
                break
            time.sleep(1.0)
        if left:
            problems.append(f"jobs still in squeue {self.CG_S:.0f}s after the run: {left}")




def run_slurm_trial(i: int, moment: str, work: Path, steps: int, sets: list[str], rng: random.Random, log,
                    env: dict[str, str], delay_s: float | None = None, component: int | None = None) -> dict:
    root = work / f"trial_{i:03d}"
    t = SlurmTrial(root, steps, sets, rng, log, env, component)
    t0 = time.monotonic()
    fault, rc, problems = t.run_slurm(moment, rng.uniform(0.0, 8.0) if delay_s is None else delay_s)
    log(f"trial {i} moment={moment}: {fault}")
    t.check(rc, problems)
    for p in problems:
        log(f"  INVARIANT FAILED: {p}")
    return {"trial": i, "moment": moment, "fault": fault, "problems": problems, "rc": rc, "jobs": t.jobs,
            "seconds": time.monotonic() - t0, "injected": not fault.startswith("none"), "backend": "slurm"}


def run_trial(i: int, moment: str, work: Path, steps: int, sets: list[str], rng: random.Random, log,
              delay_s: float | None = None) -> dict:
    root = work / f"trial_{i:03d}"
    t = Trial(root, steps, sets, rng, log)
    problems: list[str] = []
    t0 = time.monotonic()
    launcher = t.launch()
    fault = t.inject(moment, launcher, delay_s=rng.uniform(0.0, 8.0) if delay_s is None else delay_s)
    log(f"trial {i} moment={moment}: {fault}")
    if launcher.poll() is None or moment == "launcher":
        t.wait_gone(launcher, problems)
    rc = launcher.returncode
    if rc != 0:                 # a user reruns a run that did not complete
        rc = t.recover(problems)
    t.check(rc, problems)
    for p in problems:
        log(f"  INVARIANT FAILED: {p}")
    return {"trial": i, "moment": moment, "fault": fault, "problems": problems, "rc": rc,
            "seconds": time.monotonic() - t0, "injected": not fault.startswith("none")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--backend", default="local", choices=("local", "slurm"),
                    help="local: neon-hpc run; slurm: the het job on the local cluster (moments "
                         f"{', '.join(SLURM_MOMENTS)})")
    ap.add_argument("--moment", default="random", choices=("random",) + MOMENTS + SLURM_MOMENTS)
    ap.add_argument("--component", type=int, default=None, choices=sorted(GROUPS),
                    help="slurm scancel/kill-node: this het component (0 rollout, 1 trainer; default random)")
    ap.add_argument("--cluster-dir", default=os.environ.get("NEON_CLUSTER_DIR", str(REPO / ".cluster")),
                    help="slurm: the env/cluster.sh cluster (default $NEON_CLUSTER_DIR or .cluster)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delay-s", type=float, default=None,
                    help="role moments: kill this long after the first step (default: random, 0-8 s)")
    ap.add_argument("--work-dir", default=None, help="where the trials' run directories go (kept)")
    ap.add_argument("--report", default=None, help="write every trial as JSON lines here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config overrides for every trial")
    a = ap.parse_args(argv)
    import tempfile
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="neon-chaos."))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    sets = ["train.trajectories_per_step=8", "train.checkpoint_every=2", "train.wait_for_data_s=300", *a.set]

    def log(msg: str) -> None:
        print(msg, flush=True)

    moments = SLURM_MOMENTS if a.backend == "slurm" else MOMENTS
    if a.moment != "random" and a.moment not in moments:
        ap.error(f"--moment {a.moment} is not a {a.backend} moment (one of {', '.join(moments)})")
    env = slurm_env(Path(a.cluster_dir)) if a.backend == "slurm" else None
    results = []
    order: list[str] = []
    for i in range(a.trials):
        if a.moment == "random":   # every moment once per round, in a random order, at random times
            if not order:
                order = rng.sample(moments, len(moments))
            moment = order.pop()
        else:
            moment = a.moment
        if env is not None:
            res = run_slurm_trial(i, moment, work, a.steps, sets, rng, log, env, a.delay_s, a.component)
        else:
            res = run_trial(i, moment, work, a.steps, sets, rng, log, a.delay_s)
        results.append(res)
        if a.report:
            with open(a.report, "a") as f:
                f.write(json.dumps(res) + "\n")
    failures = sum(1 for r in results if r["problems"])
    injected = sum(1 for r in results if r["injected"])
    print(f"work dir {work}")
    print(f"RESULT chaos_trials={len(results)} chaos_invariant_failures={failures} chaos_faults_injected={injected}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
