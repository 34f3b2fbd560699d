"""``neon-hpc run CONFIG [--run-dir DIR] [--set k=v ...]``: the whole async loop as local
processes (a laptop, CI, or one node), with the same role processes a Slurm job runs.

Processes: trainer rank(s) and one rollout node (engines + supervised rollout workers).
The launcher shows progress per trainer step, and when the trainer has done its steps it
stops the rollout side and prints a summary; :func:`run` returns how it ended, and
``neon-hpc run`` (``neon_hpc.ops.run``, the operator tools a layer above) then draws the plot. Ctrl-C (or
SIGTERM) makes the trainer checkpoint and every process stop, within :data:`STOP_GRACE_S`
(then they are killed; a second Ctrl-C kills at once); running the same command again resumes.

One launch per run directory: the launcher takes the lease (``launch.lease``) before anything
else and refuses (exit 3) while another launch of the same directory lives. Its processes
renew it, and stop by themselves when the launcher is gone (``roles``: the trainer
checkpoints first) or when the trainer has finished (the finished marker, ``neon_hpc.protocol``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from neon_hpc import config
from neon_hpc.config.launch import parse_cpus, thread_env, trainer_threads
from neon_hpc.config.train import world_size
from neon_hpc.launch import lease, warm as W
from neon_hpc.launch.common import prepare_run, resolve_run_dir
from neon_hpc.launch.summary import render_summary, summarize, trainer_steps
from neon_hpc.protocol.records import Finished, mark_finished
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.util.logs import MetricsTail, RoleLogger
from neon_hpc.util.netutil import free_port
from neon_hpc.util.procutil import StopFlag, stop_tree

STOP_GRACE_S = 120.0   # after Ctrl-C/SIGTERM: how long the trainer gets to checkpoint and everyone to stop
TERM_GRACE_S = 90.0    # at the end of a run: how long the roles get to stop after SIGTERM


def trainer_world_size(cfg: config.ExperimentConfig) -> int:
    return world_size(cfg)      # the train section's rule


class LocalRun:
    def __init__(self, cfg: config.ExperimentConfig, run: RunDir, quiet: bool = False,
                 lease_token: str | None = None):
        self.cfg, self.run, self.quiet, self.lease_token = cfg, run, quiet, lease_token
        self.log = RoleLogger.open(run.root, "launcher", 0, echo=False)
        self.trainers: list[subprocess.Popen] = []
        self.node: subprocess.Popen | None = None
        # Ctrl-C / SIGTERM: the first asks everyone to stop, a second one kills at once
        self.stop_flag = StopFlag((signal.SIGINT, signal.SIGTERM), on_signal=self._on_signal,
                                  on_again=self._on_signal_again)
        self.interrupted_at: float | None = None
        self.metrics = MetricsTail(run.root, "trainer")   # read incrementally, once a second

    def say(self, msg: str) -> None:
        self.log.info("%s", msg)
        if not self.quiet:
            print(msg, flush=True)

    def _popen(self, role: str, rank: int, extra_env: dict[str, str]) -> subprocess.Popen:
        d = self.run.log_dir(role)
        d.mkdir(parents=True, exist_ok=True)
        out = open(d / f"{rank}.stderr", "ab")
        cmd = [sys.executable, "-m", "neon_hpc.launch.roles", role, "--config", str(self.run.run_yaml),
               "--run-dir", str(self.run.root)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", NEON_LAUNCHER_PID=str(os.getpid()), **extra_env)
        if self.lease_token:
            env["NEON_LEASE_TOKEN"] = self.lease_token
        cpus = self._cpus(role)
        # the affinity is set in the child before it execs, so every thread and process it starts
        # (torch's, the engine's, the workers') inherits it; a plain syscall, safe before exec
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        return subprocess.Popen(cmd, stdout=out, stderr=out, env=env, start_new_session=True, preexec_fn=pin)

    def _cpus(self, role: str) -> set[int]:
        """``launch.<group>.local_cpus`` of the role's group, checked against this machine's CPUs."""
        group = "train" if role == "trainer" else "rollout"
        text = getattr(self.cfg.launch, group).local_cpus
        cpus = parse_cpus(text)
        have = os.sched_getaffinity(0)
        if cpus and not cpus <= have:
            raise SystemExit(f"launch.{group}.local_cpus: {text!r} names CPUs this launcher cannot use "
                             f"(it may run on {sorted(have)}); pick a list within them, or '' for any")
        return cpus

    def _trainer_threads(self, world: int) -> int:
        """:func:`~neon_hpc.config.launch.trainer_threads` for the trainer's CPUs: its own list, or
        the machine's, shared with the rollout node unless that has a disjoint list."""
        mine, theirs = self._cpus("trainer"), self._cpus("rollout-node")
        cpus = mine or os.sched_getaffinity(0)
        return trainer_threads(len(cpus), world, beside_rollout=not theirs or bool(cpus & theirs))

    def start(self) -> None:
        for role in ("trainer", "rollout-node"):
            self._cpus(role)                 # refuse an unusable CPU list before starting anything
        world = trainer_world_size(self.cfg)
        port = str(free_port())
        threads = self._trainer_threads(world)
        for r in range(world):
            self.trainers.append(self._popen("trainer", r, {
                "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **thread_env(threads)}))
        self.node = self._popen("rollout-node", 0, {"NEON_NODE_RANK": "0", "NEON_NODE_COUNT": "1"})
        self.say(f"run dir {self.run.root}: {world} trainer rank(s), 1 rollout node with "
                 f"{self.cfg.rollout.num_workers} workers; logs: neon-hpc tail {self.run.root} --role trainer")

    @property
    def interrupted(self) -> bool:
        return self.stop_flag.requested

    def _on_signal_again(self, signum: int) -> None:
        self.say(f"{signal.Signals(signum).name} again: killing every process of the run now")

    def _on_signal(self, signum: int) -> None:
        self.interrupted_at = time.monotonic()
        self.say(f"{signal.Signals(signum).name}: asking the trainer to checkpoint and everyone to stop "
                 f"(run the same command again to resume)")
        for p in self.trainers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def lost_lease(self, msg: str) -> None:
        """Another launch took the run directory (only after this one looked dead): stop."""
        self.say(f"{msg}; stopping this launch")
        os.kill(os.getpid(), signal.SIGTERM)

    def progress(self) -> None:
        for r in self.metrics.read():   # new records in file order; a re-trained step is shown again
            self.say(f"step {r.get('step')}/{self.cfg.train.steps}  reward {r.get('reward_mean', float('nan')):.3f}  "
                     f"trajectories {r.get('trajectories', '-')}  staleness mean {r.get('staleness_mean', 0):.2f} "
                     f"max {r.get('staleness_max', '-')}  wait {r.get('wait_s', 0):.1f}s  "
                     f"step {r.get('step_time_s', 0):.1f}s  -> weights v_{r.get('version', '-')}")

    def wait(self) -> int:
        before = self.metrics.read()   # a resumed run: only new steps are shown
        if before:
            self.say(f"resuming: {len(trainer_steps(before))} step(s) already done in {self.run.root}")
        rc = None
        while True:
            self.progress()
            codes = [p.poll() for p in self.trainers]
            if any(c not in (None, 0) for c in codes):
                bad = next(i for i, c in enumerate(codes) if c not in (None, 0))
                rc = codes[bad]
                self.say(f"trainer rank {bad} failed (exit {rc}); stopping the run. Its log: "
                         f"neon-hpc tail {self.run.root} --role trainer --rank {bad} "
                         f"(and {self.run.log_dir('trainer') / f'{bad}.stderr'})")
                break
            if all(c == 0 for c in codes):
                rc = 0
                break
            if self.stop_flag.escalated:    # a second signal (said so in the handler): stop() kills at once
                rc = 1
                break
            if self.interrupted and time.monotonic() - self.interrupted_at > STOP_GRACE_S:
                self.say(f"the trainer did not stop within {STOP_GRACE_S:.0f}s of the signal; killing it "
                         f"(its log: neon-hpc tail {self.run.root} --role trainer)")
                rc = 1
                break
            finished = Finished.present(self.run)   # the trainer's: the node stops on it
            if self.node is not None and self.node.poll() is not None and not self.interrupted and not finished:
                self.say(f"the rollout node exited (code {self.node.returncode}); stopping the run. Its log: "
                         f"{self.run.log_dir('rollout-node') / '0.stderr'}")
                rc = 1
                break
            time.sleep(1.0)
        self.progress()
        if rc == 0 and not self.interrupted:
            mark_finished(self.run, by="launcher")   # not when the trainer was preempted
        self.stop()
        return rc if not self.interrupted else 130

    def stop_grace(self) -> float:
        """How long the roles get after SIGTERM: none after a second signal or once the first
        one's :data:`STOP_GRACE_S` has passed, else :data:`TERM_GRACE_S`."""
        if self.stop_flag.escalated or (self.interrupted and time.monotonic() - self.interrupted_at > STOP_GRACE_S):
            return 0.0
        return TERM_GRACE_S

    def stop(self) -> None:
        procs = [p for p in self.trainers + [self.node] if p is not None]
        grace = self.stop_grace()
        # SIGTERM to the roles only (each stops its own children in order); nothing of the run
        # may outlive the launcher: what is left is SIGKILLed, and each role's session with it
        done = stop_tree(procs, grace, signal_children=False, process_groups=True)
        for pid in done.stuck:      # SIGKILL: only a process stuck in the kernel takes longer
            self.say(f"pid {pid} did not end 10s after SIGKILL (stuck in the kernel?)")


@dataclass(frozen=True)
class Ended:
    """How a local run ended: its exit code, the run directory to plot (None: no plot is due:
    ``--no-plot``, no step done, or the run never started) and the launcher's ``say``."""
    rc: int
    plot: Path | None = None
    say: Callable[[str], None] = print


def run(argv: list[str]) -> Ended:
    """``neon-hpc run``'s arguments: the whole loop to its end, the summary printed."""
    p = argparse.ArgumentParser(prog="neon-hpc run", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default=None,
                   help="experiment YAML (default: the embedded defaults of configs/tiny_cpu.yaml)")
    p.add_argument("--run-dir", default=None, help="run directory (default: the config's run_dir)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    cfg_path = a.config or str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")
    cfg = config.load(cfg_path, a.set)
    W.apply_warm_start(cfg, resolve_run_dir(cfg, a.run_dir))   # RL starts from the SFT checkpoint
    token = lease.new_token()
    try:
        run, cfg = prepare_run(cfg, a.run_dir, backend="local", lease_token=token)
    except lease.LeaseHeld as e:
        print(f"neon-hpc run: {e}", file=sys.stderr)
        return Ended(3)
    lr = LocalRun(cfg, run, quiet=a.quiet, lease_token=token)
    lr.stop_flag.install()
    renewer = lease.Renewer(run, token, "launcher", on_lost=lr.lost_lease)
    renewer.start()
    t0 = time.monotonic()
    warm = None
    try:
        if cfg.warm_start.enabled and not W.has_warm_start(cfg):
            lr.say(W.no_warm_start_note(cfg))
        elif cfg.warm_start.enabled:
            try:
                warm = W.run_warm_start(cfg, run.root, lr.say)
            except W.WarmStartError as e:
                lr.say(f"warm start failed: {e}")
                return Ended(2, say=lr.say)
        lr.start()
        rc = lr.wait()
    finally:
        renewer.stop()
        lease.release(run, token)
    s = summarize(run.root)
    ev = W.evaluate_run(cfg, run, lr.say) if rc == 0 else {}
    s = W.write_summary(run, s, ev, warm, W.cpu_seconds())
    lr.say(f"--- summary ({time.monotonic() - t0:.0f}s) ---\n" + render_summary(s))
    return Ended(rc, None if a.no_plot or not s["steps"] else run.root, lr.say)
