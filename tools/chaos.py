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

Ends with ``RESULT chaos_trials=N chaos_invariant_failures=F chaos_faults_injected=K``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from neon_hpc.protocol.records import ClaimRecord, Finished, Phase, TrainerBeat  # noqa: E402
from neon_hpc.protocol.rundir import RunDir, RunDirError  # noqa: E402

MOMENTS = ("claim", "checkpoint", "publish", "flush", "helper", "launcher", "trainer", "node", "worker",
           "engine", "all")
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
                    "--run-dir", str(root), "--quiet", "--no-plot", "--set", f"train.steps={steps}", *sum(
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
            return by_role(self.root, "trainer") if ph and ph.phase is Phase.CLAIMING and (ph.step or 0) >= 2 else None
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
                names = []
                for p in v:
                    try:
                        names.append(f"{role_of(p)}:{p.pid}")
                        p.send_signal(signal.SIGKILL)
                    except psutil.Error:
                        pass
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
    ap.add_argument("--moment", default="random", choices=("random",) + MOMENTS)
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

    results = []
    order: list[str] = []
    for i in range(a.trials):
        if a.moment == "random":   # every moment once per round, in a random order, at random times
            if not order:
                order = rng.sample(MOMENTS, len(MOMENTS))
            moment = order.pop()
        else:
            moment = a.moment
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
