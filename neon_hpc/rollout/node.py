"""The rollout node: engines, weight pickup, and a supervised set of rollout workers.

One per node of the rollout group (one Slurm task per node; ``neon-hpc run`` starts one).
It starts the inference engine(s) of the node once ``weights/LATEST`` exists (the embedded
engine, or SGLang servers placed over the group's nodes by ``engines/fleet.py``; or none when
``NEON_ENGINE_URLS`` names engines started elsewhere), health-checks them, starts
``rollout.num_workers`` worker processes (split over the nodes that serve engines), and
then, until told to stop:

* polls ``weights/LATEST`` and tells each engine to load a newer version
  (``engines.fleet.update_weights``, per ``engine.weight_update``). ``in_place`` (default):
  pause in place, load, continue, so a response in flight goes on with the new weights and
  its KV cache, and its tokens record both versions (``meta_info.weight_versions``);
  ``between_requests``: the load waits for running requests. Either way an episode of
  several turns continues on the new weights in its next turn;
* restarts a worker that died (``rollout.restart_dead_workers``), logging the exit code;
  the worker's flushed shards are already published, its unfinished groups resume from the
  episode journal (``neon_hpc/rollout/journal.py``; at most each episode's turn in flight is lost, never a
  partial shard: the store publishes by rename);
* fails (exit 1, which fails the job step) when one of its engine processes dies: the
  engines' state is gone, and the run resumes from the run directory when relaunched;
* beats a heartbeat with the loaded version and worker states.

SIGTERM/SIGUSR1 are forwarded to the workers (they journal, flush finished groups and exit); then the engines stop.
The node is given :class:`~neon_hpc.rollout.sections.NodeSections`, not the whole config.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from neon_hpc.protocol.records import EngineRecord, Finished, NodeBeat
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.rollout.engines.client import EngineClient
from neon_hpc.rollout.engines.fleet import update_weights
from neon_hpc.rollout.engines.groups import EngineStartError, engine_group
from neon_hpc.rollout.sections import NodeSections
from neon_hpc.util.logs import RoleLogger
from neon_hpc.util.procutil import StopFlag, child_setup, stop_tree
from neon_hpc.util.rankenv import node_count, node_rank


def wait_for_weights(run: RunDir, log: RoleLogger, timeout_s: float, stop,
                     poll_s: float = 0.5) -> tuple[int, Path] | None:
    t0 = time.monotonic()
    warned = False
    while not stop():
        latest = run.latest_weights()
        if latest:
            return latest
        if time.monotonic() - t0 > 10 and not warned:
            log.info("waiting for the trainer to publish initial weights (%s)", run.latest_file)
            warned = True
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"no weights in {run.latest_file} after {timeout_s:.0f}s: is the trainer running? "
                               f"see `neon-hpc tail {run.root} --role trainer`")
        time.sleep(poll_s)
    return None


CRASH_WINDOW_S = 60.0   # a worker that dies sooner than this after its start "crashed fast"
MAX_FAST_DEATHS = 5      # ... this many times in a row: a bug, not bad luck; fail the node


class RolloutNode:
    def __init__(self, sec: NodeSections, run_dir: str):
        self.sec = sec
        self.run = RunDir(run_dir)
        self.rank = node_rank()
        self.log = RoleLogger.open(self.run.root, "rollout-node", self.rank, echo=False)
        self.stop_flag = StopFlag(on_signal=self._on_signal)
        self.engines = engine_group(sec, self.run, self.rank, node_count(), self.log)   # chosen once
        self.clients = []     # one per engine whose weights this node updates
        self.loaded_version = -1
        self.workers: dict[int, subprocess.Popen] = {}
        self.started_at: dict[int, float] = {}
        self.fast_deaths: dict[int, int] = {}     # consecutive deaths within CRASH_WINDOW_S of start
        self.respawn_at: dict[int, float] = {}
        self.restarts = 0
        self.failed: str | None = None

    def _on_signal(self, signum: int) -> None:
        self.log.info("received %s: stopping workers, then engines", signal.Signals(signum).name)

    @property
    def stopping(self) -> bool:
        return self.stop_flag.requested

    def my_workers(self) -> list[int]:
        n = self.sec.rollout.num_workers
        nodes = self.engines.worker_nodes()
        return [w for w in range(n) if nodes[w % len(nodes)] == self.rank]

    def start_engines(self, version: int, path: Path) -> bool:
        """Start and health-check this node's engines; False if stopped (or failed) meanwhile."""
        try:
            if not self.engines.start(version, path, lambda: self.stopping):
                return False
        except EngineStartError as e:
            self._fail(str(e))
            return False
        self.clients = [EngineClient(u) for u in self.engines.update_urls()]
        self.loaded_version = self.engines.version
        self._write_engine_state()
        if self.engines.ready_message():
            self.log.info("%s", self.engines.ready_message())
        return True

    def _write_engine_state(self) -> None:
        """``state/engines/node<r>.json``: where this node's engines serve and the version they
        hold (workers add the lag to their staleness estimate; ``neon-hpc status`` shows it)."""
        record = self.engines.record()
        if record is not None:
            EngineRecord(**record, version=self.loaded_version).write(self.run, self.rank)

    def engine_death(self) -> str | None:
        """Why an engine process of this node is gone, or None."""
        return self.engines.dead()

    def sync_weights(self) -> None:
        if not self.clients:
            return   # no engine endpoint on this node (another node of a multi-node engine)
        latest = self.run.latest_weights()
        if not latest or latest[0] <= self.loaded_version:
            return
        version, path = latest
        t0 = time.monotonic()
        for i, c in enumerate(self.clients):
            try:
                update_weights(c, str(path), str(version), self.sec.engine.weight_update)
            except (OSError, RuntimeError) as e:  # EngineError, ConnectionError, TimeoutError
                if self.stopping:
                    return
                dead = self.engine_death()
                return self._fail(f"engine {c.base_url} {'died' if dead else 'refused'} loading weights "
                                  f"v_{version} from {path}: {e}. {dead + '. ' if dead else ''}Check the weights "
                                  f"folder and the engine log; rerun to resume")
        dt = time.monotonic() - t0
        self.log.info("engines loaded weights v_%d in %.2fs", version, dt)
        self.log.metrics(event="weights_loaded", version=version, seconds=dt)
        self.loaded_version = version
        self._write_engine_state()

    def spawn(self, w: int) -> None:
        url = self.engines.worker_url(w)
        cmd = [sys.executable, "-m", "neon_hpc.launch.roles", "rollout-worker", "--config", str(self.run.run_yaml),
               "--run-dir", str(self.run.root), "--rank", str(w), "--engine-url", url]
        err = open(self.run.log_dir("rollout") / f"{w}.stderr", "ab")
        # preexec_fn: SIGTERM (flush, exit) if this node dies
        self.workers[w] = subprocess.Popen(cmd, stdout=err, stderr=err,
                                           env=dict(os.environ, NEON_NODE_RANK=str(self.rank)),
                                           preexec_fn=child_setup())
        self.started_at[w] = time.monotonic()
        self.log.info("started rollout worker %d (pid %d) on %s", w, self.workers[w].pid, url)

    def _fail(self, message: str) -> None:
        """Remember why the node must stop; run_forever exits non-zero, failing the job step."""
        self.failed = message
        self.log.error("%s", message)

    def check_workers(self) -> None:
        now = time.monotonic()
        for w, when in list(self.respawn_at.items()):
            if now >= when:
                del self.respawn_at[w]
                self.spawn(w)
        for w, p in list(self.workers.items()):
            rc = p.poll()
            if rc is None or w in self.respawn_at:
                continue
            if self.stopping or Finished.present(self.run):
                continue
            how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
            stderr = self.run.log_dir("rollout") / f"{w}.stderr"
            if not self.sec.rollout.restart_dead_workers:
                self.log.error("rollout worker %d died (%s); not restarting (rollout.restart_dead_workers=false)",
                               w, how)
                del self.workers[w]
                continue
            fast = now - self.started_at.get(w, 0.0) < CRASH_WINDOW_S
            self.fast_deaths[w] = self.fast_deaths.get(w, 0) + 1 if fast else 0
            if self.fast_deaths[w] >= MAX_FAST_DEATHS:
                return self._fail(f"rollout worker {w} died {MAX_FAST_DEATHS} times in a row within "
                                  f"{CRASH_WINDOW_S:.0f}s of starting ({how}): that is a bug or a bad config, "
                                  f"not bad luck. Read {stderr} (or `neon-hpc tail {self.run.root} --role rollout "
                                  f"--rank {w}`), fix it, and rerun to resume")
            delay = min(30.0, 2.0 ** self.fast_deaths[w]) if fast else 0.0
            self.restarts += 1
            self.log.warning("rollout worker %d died (%s); restarting it in %.0fs (restart #%d); its stderr: %s",
                             w, how, delay, self.restarts, stderr)
            self.log.metrics(event="worker_restart", worker=w, how=how)
            self.respawn_at[w] = now + delay

    def run_forever(self) -> int:
        self.stop_flag.install()
        self.run.log_dir("rollout").mkdir(parents=True, exist_ok=True)
        try:
            latest = wait_for_weights(self.run, self.log, self.sec.rollout.wait_for_weights_s, lambda: self.stopping,
                                      self.sec.protocol.weight_poll_s)
            if latest is None:
                return 0
            if not self.start_engines(*latest):
                return 1 if self.failed else 0
            for w in self.my_workers():
                self.spawn(w)
            while not self.stopping and not Finished.present(self.run):
                dead = self.engine_death()
                if dead:
                    time.sleep(0.5)   # a job-wide SIGTERM reaches the engines and this node together
                    if self.stopping:
                        break
                    self._fail(f"{dead}\nThe job step fails so the run can be relaunched; rerun to resume "
                               f"from the newest checkpoint")
                    return 1
                self.sync_weights()
                if not self.failed:
                    self.check_workers()
                if self.failed:
                    return 1
                beat = {"version": self.loaded_version} if self.clients else {}   # engines whose weights it updates
                NodeBeat(rank=self.rank, workers=len([p for p in self.workers.values() if p.poll() is None]),
                         restarts=self.restarts, **beat).write(self.run)
                time.sleep(self.sec.protocol.weight_poll_s)
        finally:
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        names = {p.pid: w for w, p in self.workers.items()}
        stop_tree(list(self.workers.values()), 60.0,
                  on_kill=lambda pid: self.log.warning("rollout worker %s did not stop within 60s; killing it",
                                                       names.get(pid, f"{pid}'s child process")))
        self.engines.stop()
        self.log.info("rollout node %d stopped", self.rank)
