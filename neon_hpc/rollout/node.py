"""The rollout node: engines, weight pickup, and a supervised set of rollout workers.

One per node of the rollout group (one Slurm task per node; ``neon-hpc run`` starts one).
It starts the inference engine(s) of the node once ``weights/LATEST`` exists, health-checks
them, starts ``rollout.num_workers`` worker processes (split over the nodes of the group),
and then, until told to stop:

* polls ``weights/LATEST`` and tells each engine to load a newer version
  (``/update_weights_from_disk``). Engines swap weights between forward passes, so an
  episode in flight continues on the new weights: its tokens record both versions;
* restarts a worker that died (``rollout.restart_dead_workers``), logging the exit code;
  the worker's flushed shards are already published, its unflushed group is lost (never a
  partial shard: the store publishes by rename);
* beats a heartbeat with the loaded version and worker states.

SIGTERM/SIGUSR1 are forwarded to the workers (they flush and exit); then the engines stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from neon_hpc.config import ExperimentConfig
from neon_hpc.logs import RoleLogger
from neon_hpc.rundir import RunDir, atomic_write_json


def _node_rank() -> int:
    return int(os.environ.get("NEON_NODE_RANK", os.environ.get("SLURM_PROCID", "0")))


def _node_count() -> int:
    return int(os.environ.get("NEON_NODE_COUNT", os.environ.get("SLURM_NTASKS", "1")))


def wait_for_weights(run: RunDir, log: RoleLogger, timeout_s: float, stop) -> tuple[int, Path] | None:
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
        time.sleep(0.5)
    return None


CRASH_WINDOW_S = 60.0   # a worker that dies sooner than this after its start "crashed fast"
MAX_FAST_DEATHS = 5      # ... this many times in a row: a bug, not bad luck; fail the node


class RolloutNode:
    def __init__(self, cfg: ExperimentConfig, run_dir: str):
        self.cfg = cfg
        self.run = RunDir(run_dir)
        self.rank = _node_rank()
        self.log = RoleLogger.open(self.run.root, "rollout-node", self.rank, echo=False)
        self.stopping = False
        self.engines = []     # ServerHandle
        self.clients = []
        self.loaded_version = -1
        self.workers: dict[int, subprocess.Popen] = {}
        self.started_at: dict[int, float] = {}
        self.fast_deaths: dict[int, int] = {}     # consecutive deaths within CRASH_WINDOW_S of start
        self.respawn_at: dict[int, float] = {}
        self.restarts = 0
        self.failed: str | None = None

    def _stop(self, signum, _frame) -> None:
        self.log.info("received %s: stopping workers, then engines", signal.Signals(signum).name)
        self.stopping = True

    def my_workers(self) -> list[int]:
        n, k = self.cfg.rollout.num_workers, _node_count()
        return [w for w in range(n) if w % k == self.rank]

    def start_engines(self, version: int, path: Path) -> None:
        from neon_hpc.rollout.engines.client import EngineClient
        if self.cfg.engine.kind != "embedded":
            raise NotImplementedError("engine.kind=sglang: start SGLang with the command lines of "
                                      "`neon-hpc engine sglang-cmd CONFIG` in the sbatch script and set "
                                      "NEON_ENGINE_URLS; the embedded engine is the only one this node starts itself")
        from neon_hpc.rollout.engines.embedded import start_server
        for i in range(self.cfg.engine.num_engines):
            h = start_server(str(path), host=self.cfg.engine.host,
                             port=self.cfg.engine.port + i if self.cfg.engine.port else 0,
                             max_batch_size=self.cfg.engine.max_batch_size, weight_version=str(version),
                             allowed_root=str(self.run.weights))  # weight loads stay inside the run
            self.engines.append(h)
            self.clients.append(EngineClient(h.url))
        self.loaded_version = version
        atomic_write_json(self.run.state / "engines" / f"node{self.rank}.json",
                          {"urls": [h.url for h in self.engines], "version": version, "pid": os.getpid()})
        self.log.info("engines up at %s with weights v_%d", ", ".join(h.url for h in self.engines), version)

    def engine_urls(self) -> list[str]:
        ext = os.environ.get("NEON_ENGINE_URLS")
        return ext.split(",") if ext else [h.url for h in self.engines]

    def sync_weights(self) -> None:
        latest = self.run.latest_weights()
        if not latest or latest[0] <= self.loaded_version:
            return
        version, path = latest
        t0 = time.monotonic()
        for i, c in enumerate(self.clients):
            try:
                c.update_weights_from_disk(str(path), str(version))
            except (OSError, RuntimeError) as e:  # EngineError, ConnectionError, TimeoutError
                if self.stopping:
                    return
                proc = getattr(self.engines[i], "process", None) if i < len(self.engines) else None
                dead = proc is not None and proc.poll() is not None
                return self._fail(f"engine {c.base_url} "
                                  f"{'died (exit code %s)' % proc.returncode if dead else 'refused'} loading "
                                  f"weights v_{version} from {path}: {e}. Check the weights folder and the "
                                  f"engine log; rerun to resume")
        dt = time.monotonic() - t0
        self.log.info("engines loaded weights v_%d in %.2fs", version, dt)
        self.log.metrics(event="weights_loaded", version=version, seconds=dt)
        self.loaded_version = version

    def spawn(self, w: int) -> None:
        urls = self.engine_urls()
        url = urls[w % len(urls)]
        cmd = [sys.executable, "-m", "neon_hpc.launch.roles", "rollout-worker", "--config", str(self.run.run_yaml),
               "--run-dir", str(self.run.root), "--rank", str(w), "--engine-url", url]
        err = open(self.run.log_dir("rollout") / f"{w}.stderr", "ab")
        self.workers[w] = subprocess.Popen(cmd, stdout=err, stderr=err)
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
            if self.stopping or (self.run.state / "finished.json").exists():
                continue
            how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
            stderr = self.run.log_dir("rollout") / f"{w}.stderr"
            if not self.cfg.rollout.restart_dead_workers:
                self.log.error("rollout worker %d died (%s); not restarting (rollout.restart_dead_workers=false)", w, how)
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
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGUSR1, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        self.run.log_dir("rollout").mkdir(parents=True, exist_ok=True)
        try:
            latest = wait_for_weights(self.run, self.log, self.cfg.train.wait_for_data_s, lambda: self.stopping)
            if latest is None:
                return 0
            if not os.environ.get("NEON_ENGINE_URLS"):
                self.start_engines(*latest)
            for w in self.my_workers():
                self.spawn(w)
            while not self.stopping and not (self.run.state / "finished.json").exists():
                self.sync_weights()
                if not self.failed:
                    self.check_workers()
                if self.failed:
                    return 1
                self.run.beat("rollout-node", self.rank, version=self.loaded_version,
                              workers=len([p for p in self.workers.values() if p.poll() is None]),
                              restarts=self.restarts)
                time.sleep(0.5)
        finally:
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        for p in self.workers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for w, p in self.workers.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log.warning("rollout worker %d did not stop within 60s; killing it", w)
                p.kill()
                p.wait()
        for h in self.engines:
            h.stop()
        self.log.info("rollout node %d stopped", self.rank)
