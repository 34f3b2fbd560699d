"""The rollout worker: agent episodes against an engine, written as trajectory shards.

One worker process runs groups of episodes (GRPO groups) one after another and never waits
for the trainer, except where the run asks it to:

* **bounded staleness (admission control)**: before starting a group, the worker estimates
  how many trainer steps will pass before the group is consumed (trajectories ready plus in
  flight across all workers, over trajectories per step), plus how many versions its engines'
  weights are behind the version the trainer's next claim trains (engines load new weights
  between requests, some time after they are published; a step in progress is one more).
  If the group's oldest token would then be more than ``rollout.max_staleness`` versions
  behind, it waits. The trainer's claim still drops anything too stale (counted),
  so the bound holds even when the estimate is off.
* **backpressure**: when ``ready/`` holds more than ``rollout.backpressure_steps`` steps of
  data, the worker waits: producing more would only make it stale.

Both waits are logged and written to metrics.jsonl as ``event`` records, never silent.
SIGTERM/SIGUSR1 make the worker finish the current group, flush its shard and exit 0.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time

from neon_hpc.config import ExperimentConfig
from neon_hpc.logs import RoleLogger, job_id
from neon_hpc.rundir import RunDir, read_json


ADMISSION_POLL_S = 0.25   # a refused worker re-checks admission this often (the planner models it)
HEARTBEAT_S = 10.0        # a worker in a long group re-beats this often (admission ignores beats > 60 s old)
FULL_RECHECK_S = 5.0      # a refused worker re-reads everything at least this often (dead workers' beats expire)


class _Stop:
    def __init__(self) -> None:
        self.requested = False
        self.signal = None

    def __call__(self, signum, _frame) -> None:
        self.requested = True
        self.signal = signal.Signals(signum).name


def ready_trajectories(run: RunDir) -> int:
    """Trajectories published in ready/ (from shard names: no file is opened)."""
    from neon_hpc.store import ready_count
    return ready_count(run.root)[1]


def pending_trajectories(run: RunDir) -> tuple[int, int]:
    """(trajectories ready in ready/, trajectories in flight across live workers)."""
    ready = ready_trajectories(run)
    inflight = 0
    for hb in run.heartbeats("rollout"):   # not the trainer ranks' or nodes' (hundreds at scale)
        if hb.get("age_s", 1e9) < 60:
            inflight += int(hb.get("in_flight", 0))
    return ready, inflight


def _trainer_and_engines(run: RunDir, node: int | None) -> tuple[dict, dict]:
    """The trainer's (rank 0) heartbeat and this node's engine record (``{}`` when absent)."""
    node = int(os.environ.get("NEON_NODE_RANK", "0")) if node is None else node
    return (read_json(run.heartbeat_file("trainer", 0)) or {},
            read_json(run.state / "engines" / f"node{node}.json") or {})


def version_gap(run: RunDir, node: int | None = None) -> int:
    """Versions between the weights the trainer's *next* claim trains and what this node's
    engines serve now: a group admitted now is that stale even if consumed at once.

    The trainer's next claim trains ``v_N`` once step ``N`` has claimed its data (heartbeat
    phase ``training``/``stepped``/``done``) and ``v_{N-1}`` while step ``N`` still claims
    (``claiming``/``waiting_for_data``); without a trainer heartbeat, ``weights/LATEST``.
    The rollout node records the version its engines loaded in ``state/engines/node<r>.json``
    (before it starts workers, and after every load); engines started elsewhere
    (``NEON_ENGINE_URLS``) have no record and count as serving ``LATEST``.
    """
    hb, st = _trainer_and_engines(run, node)
    latest = run.latest_weights()
    published = latest[0] if latest else 0
    step = hb.get("step")
    if isinstance(step, int):
        trains = step - 1 if hb.get("phase") in ("claiming", "waiting_for_data") else step
    else:
        trains = published
    serving = st["version"] if isinstance(st.get("version"), int) and st["version"] >= 0 else published
    return max(0, trains - serving)


def admission(run: RunDir, cfg: ExperimentConfig, group: int, lag: int = 0) -> tuple[str, float]:
    """('ok' | 'backpressure' | 'admission_wait', staleness estimate) for starting one more group now.

    The estimate is the trainer steps that pass before the group is consumed plus ``lag``,
    the :func:`version_gap` between the trainer's next claim and the engines.
    """
    ready, inflight = pending_trajectories(run)
    per_step = cfg.train.trajectories_per_step
    if ready > cfg.rollout.backpressure_steps * per_step:
        return "backpressure", ready / per_step
    # the trainer consumes FIFO by publish order: this group lands after everything pending
    steps_ahead = math.ceil((ready + inflight + group) / per_step) - 1
    if steps_ahead + lag > cfg.rollout.max_staleness:
        return "admission_wait", float(steps_ahead + lag)
    return "ok", float(steps_ahead + lag)


def wake_key(run: RunDir, node: int | None = None) -> tuple:
    """What must change before a refused worker can be admitted: the trainer's step/phase
    (its claim empties ready/ and moves the version it trains) and the engines' version.

    Data ahead only shrinks when the trainer claims (other workers finishing groups move
    trajectories from in flight to ready, which leaves the sum alone), so a refused worker
    watches these two small files instead of re-reading every heartbeat and listing ready/
    each poll: at 384 workers that would be ~10^5-10^6 metadata operations a second on the
    shared filesystem.
    """
    hb, st = _trainer_and_engines(run, node)
    return hb.get("step"), hb.get("phase"), st.get("version")


class _Beater:
    """The worker's heartbeat: written at each state change, and every HEARTBEAT_S seconds
    from a thread while a group runs (an hour-long episode must not look dead, neither to
    ``neon-hpc status`` nor to the other workers' admission, which drops beats over 60 s)."""

    def __init__(self, run: RunDir, worker: int):
        import threading
        self.run, self.worker, self.fields = run, worker, {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self.thread.start()

    def beat(self, **fields) -> None:
        with self.lock:
            self.fields = fields
            self.run.beat("rollout", self.worker, **fields)

    def _loop(self) -> None:
        while not self.done.wait(HEARTBEAT_S):
            with self.lock:
                if self.fields:
                    self.run.beat("rollout", self.worker, **self.fields)

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)


def run_worker(cfg: ExperimentConfig, run_dir: str, worker: int, engine_url: str) -> int:
    log = RoleLogger.open(RunDir(run_dir).root, "rollout", worker, echo=False)
    try:
        return _run_worker(cfg, run_dir, worker, engine_url, log)
    except Exception as e:  # the operator reads the role log first: put the failure there too
        log.logger.exception("rollout worker %d failed: %s", worker, e)
        raise
    finally:
        log.close()


def _run_worker(cfg: ExperimentConfig, run_dir: str, worker: int, engine_url: str, log: RoleLogger) -> int:
    from neon_hpc.models.tokenizer import load_tokenizer
    from neon_hpc.rollout.agent import run_group
    from neon_hpc.rollout.engines.client import EngineClient
    from neon_hpc.store import ShardWriter
    from neon_hpc.xrd.tasks import load_tasks

    run = RunDir(run_dir)
    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, stop)
    signal.signal(signal.SIGINT, stop)

    tokenizer = load_tokenizer("xrd-tiny") if cfg.model.vocab_size <= 256 else load_tokenizer(cfg.model.init_checkpoint)
    tasks = load_tasks(cfg.xrd.preset, cfg.xrd.split, seed=cfg.xrd.seed, n=cfg.xrd.num_tasks)
    if not tasks:
        log.error("no tasks for preset=%s split=%s; check the xrd section of the config", cfg.xrd.preset, cfg.xrd.split)
        return 2
    # the route shape is ours to state: SGLang's model info does not report it
    client = EngineClient(engine_url, num_moe_layers=cfg.model.num_layers, top_k=cfg.model.moe_router_topk)
    # a new writer id per incarnation: a restarted worker never reuses a dead one's file names
    writer_id = f"w{worker}-{job_id()}-{os.getpid()}"
    rng = random.Random(f"{cfg.xrd.seed}-{worker}-{os.getpid()}")
    order = list(range(len(tasks)))
    groups = episodes = tokens = 0
    log.info("rollout worker %d up: engine %s, %d tasks (%s/%s), writer %s", worker, engine_url,
             len(tasks), cfg.xrd.preset, cfg.xrd.split, writer_id)
    beater = _Beater(run, worker)
    with ShardWriter(run.root, writer_id, cfg.store) as writer:
        while not stop.requested and not (run.state / "finished.json").exists():
            lag = version_gap(run)
            verdict, ahead = admission(run, cfg, cfg.rollout.group_size, lag)
            if verdict != "ok":
                reason, t0 = verdict, time.monotonic()
                writer.flush()  # let the trainer have what we hold
                beater.beat(in_flight=0, groups=groups, waiting=verdict)
                key, checked = wake_key(run), time.monotonic()
                while verdict != "ok" and not stop.requested and not (run.state / "finished.json").exists():
                    time.sleep(ADMISSION_POLL_S)
                    now_key = wake_key(run)
                    if now_key == key and time.monotonic() - checked < FULL_RECHECK_S:
                        continue
                    key, checked = now_key, time.monotonic()
                    lag = version_gap(run)
                    verdict, ahead = admission(run, cfg, cfg.rollout.group_size, lag)
                waited = time.monotonic() - t0
                log.info("%s: waited %.1fs (staleness estimate %.1f, of which trainer-engine version gap %d)",
                         reason, waited, ahead, lag)
                log.metrics(event=reason, seconds=waited, worker=worker)
                continue
            if groups % len(order) == 0:
                rng.shuffle(order)
            task = tasks[order[groups % len(order)]]
            # in flight = the group about to run plus what the writer holds unpublished
            beater.beat(in_flight=cfg.rollout.group_size + writer.pending, groups=groups,
                        episodes=episodes, tokens=tokens, task=task.id)
            t0 = time.monotonic()
            trajs = run_group(client, task, tokenizer, cfg.rollout, cfg.rollout.group_size)
            dt = time.monotonic() - t0
            for i, tr in enumerate(trajs):
                # a run-wide unique id: exactly-once consumption is checkable trajectory by trajectory
                tr.metadata["uid"] = f"{writer_id}-{episodes + i}"
                tr.metadata["worker"] = worker
                writer.add(tr)
                gen = int(tr.loss_mask.sum())
                vmin, vmax = _versions(tr)
                tokens += len(tr.tokens)
                log.metrics(worker=worker, task_id=tr.task_id, tokens=int(len(tr.tokens)), gen_tokens=gen,
                            episode_s=float(tr.timings.get("episode_s", dt)), version_min=vmin,
                            version_max=vmax, reward=float(tr.reward), turns=int(len(tr.turn_offsets) - 1))
            # a hungry trainer gets what we hold now rather than at the next full shard:
            # trajectories in a writer's buffer are invisible to the trainer and to admission
            if ready_trajectories(run) < cfg.train.trajectories_per_step:
                writer.flush()
            episodes += len(trajs)
            groups += 1
            log.set(version=max((_versions(t)[1] for t in trajs), default=None))
            log.info("group %d task %s: %d episodes in %.1fs, reward mean %.3f, versions %s", groups, task.id,
                     len(trajs), dt, sum(t.reward for t in trajs) / max(len(trajs), 1),
                     sorted({v for t in trajs for v in _versions(t)}))
        writer.flush()
    beater.beat(in_flight=0, groups=groups, episodes=episodes, tokens=tokens, stopped=True)
    beater.close()
    log.info("rollout worker %d stopping (%s): %d groups, %d episodes, %d tokens", worker,
             stop.signal or "run finished", groups, episodes, tokens)
    return 0


def _versions(tr) -> tuple[int, int]:
    gen = tr.versions[tr.loss_mask.astype(bool)]
    if len(gen) == 0:
        return -1, -1
    return int(gen.min()), int(gen.max())
