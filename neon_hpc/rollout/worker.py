"""The rollout worker: agent episodes against an engine, written as trajectory shards.

One worker process runs groups of episodes (GRPO groups) one after another and never waits
for the trainer, except where the run asks it to:

* **bounded staleness (admission control)**: before starting a group, the worker estimates
  how many trainer steps will pass before the group is consumed (trajectories ready plus in
  flight across all workers, over trajectories per step), plus how many versions its engines'
  weights are behind the version the trainer's next claim trains (engines load new weights
  between requests, some time after they are published; a step in progress is one more).
  If the group's oldest token would then be more than ``offpolicy.max_staleness`` versions
  behind, it waits. The trainer's claim still drops anything too stale (counted),
  so the bound holds even when the estimate is off.
* **backpressure**: when ``ready/`` holds more than ``offpolicy.backpressure_steps`` steps of
  data, the worker waits: producing more would only make it stale.

The rule is :mod:`neon_hpc.protocol.admission`'s (the simulator calls the same function), and
every record the worker reads or writes is :mod:`neon_hpc.protocol.records`'; its poll
intervals are the config's ``protocol`` section. The worker is given
:class:`~neon_hpc.rollout.sections.WorkerSections`, not the whole config: the admission rule's
``trajectories_per_step`` and the tokenizer come through it, named as borrowed.
Both waits are logged and written to metrics.jsonl as ``event`` records, never silent.

Every episode is journalled at each turn boundary (:mod:`neon_hpc.rollout.journal`), under the
uid it got when it started. SIGTERM/SIGUSR1 make the worker stop at once, not at the group's
end: the turns in flight are dropped (each episode's record is current at its last turn
boundary), finished groups are flushed, and it exits 0 within seconds. A worker that starts
resumes its journalled groups before it admits new ones.
"""

from __future__ import annotations

import os
import random
import threading
import time

from neon_hpc import envs
from neon_hpc.config.protocol import ProtocolConfig
from neon_hpc.models.tokenizer import load_tokenizer
from neon_hpc.protocol import admission as rule
from neon_hpc.protocol.records import EngineRecord, Finished, TrainerBeat, WorkerBeat
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.rollout import journal as jr
from neon_hpc.rollout.agent.episode import Episode
from neon_hpc.rollout.agent.group import as_environment
from neon_hpc.rollout.engines.client import EngineClient
from neon_hpc.rollout.sections import WorkerSections
from neon_hpc.store import StoreConfig, open_store
from neon_hpc.util.logs import RoleLogger, job_id
from neon_hpc.util.procutil import StopFlag

# default of the beater's period; the run's is protocol.worker_heartbeat_s
HEARTBEAT_S = ProtocolConfig.worker_heartbeat_s


def ready_trajectories(run: RunDir, store: StoreConfig = StoreConfig()) -> int:
    """Trajectories published and not yet claimed (the filesystem store: from shard names, no file is opened)."""
    return open_store(run, store).ready_count()[1]


def pending_trajectories(run: RunDir, expiry_s: float = ProtocolConfig.heartbeat_expiry_s,
                         store: StoreConfig = StoreConfig()) -> tuple[int, int]:
    """(trajectories ready in the store, trajectories in flight across live workers)."""
    # the workers' beats only, not the trainer ranks' or nodes' (hundreds at scale)
    return ready_trajectories(run, store), rule.in_flight(WorkerBeat.read_all(run), time.time(), expiry_s)


def _node(node: int | None) -> int:
    return int(os.environ.get("NEON_NODE_RANK", "0")) if node is None else node


def version_gap(run: RunDir, node: int | None = None) -> int:
    """Versions between the weights the trainer's *next* claim trains and what this node's
    engines serve now (:func:`neon_hpc.protocol.admission.gap_from_records`): a group admitted
    now is that stale even if consumed at once. Engines started elsewhere
    (``NEON_ENGINE_URLS``) have no engine record and count as serving the newest published version.
    """
    latest = run.latest_weights()
    return rule.gap_from_records(TrainerBeat.read(run, 0), EngineRecord.read(run, _node(node)),
                                 latest[0] if latest else 0)


def admission(run: RunDir, sec: WorkerSections, group: int, lag: int = 0) -> tuple[str, float]:
    """(verdict, staleness estimate) for starting one more group now: the protocol's rule
    (:func:`neon_hpc.protocol.admission.admit`) over ready/, the workers' beats and ``lag``,
    the :func:`version_gap` between the trainer's next claim and the engines."""
    ready, inflight = pending_trajectories(run, sec.protocol.heartbeat_expiry_s, sec.store)
    return rule.admit(ready, inflight, group, sec.train_trajectories_per_step, sec.offpolicy.backpressure_steps,
                      sec.offpolicy.max_staleness, lag)


def wake_key(run: RunDir, node: int | None = None) -> tuple:
    """What must change before a refused worker can be admitted: the trainer's step/phase
    (its claim empties ready/ and moves the version it trains) and the engines' version.

    Data ahead only shrinks when the trainer claims (other workers finishing groups move
    trajectories from in flight to ready, which leaves the sum alone), so a refused worker
    watches these two small files instead of re-reading every heartbeat and listing ready/
    each poll: at 384 workers that would be ~10^5-10^6 metadata operations a second on the
    shared filesystem.
    """
    hb, st = TrainerBeat.read(run, 0), EngineRecord.read(run, _node(node))
    return (hb.step if hb else None, hb.phase if hb else None, st.version if st else None)


class _Beater:
    """The worker's heartbeat: written at each state change, and every ``every_s`` seconds
    (``protocol.worker_heartbeat_s``) from a thread while a group runs (an hour-long episode
    must not look dead, neither to ``neon-hpc status`` nor to the other workers' admission,
    which drops beats older than ``protocol.heartbeat_expiry_s``)."""

    def __init__(self, run: RunDir, worker: int, every_s: float | None = None):
        self.run, self.worker, self.fields = run, worker, {}
        self.every = HEARTBEAT_S if every_s is None else every_s
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self.thread.start()

    def beat(self, **fields) -> None:
        with self.lock:
            self.fields = fields
            WorkerBeat(rank=self.worker, **fields).write(self.run)

    def _loop(self) -> None:
        while not self.done.wait(self.every):
            with self.lock:
                if self.fields:
                    WorkerBeat(rank=self.worker, **self.fields).write(self.run)

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)


def run_worker(sec: WorkerSections, run_dir: str, worker: int, engine_url: str) -> int:
    log = RoleLogger.open(RunDir(run_dir).root, "rollout", worker, echo=False)
    try:
        return _run_worker(sec, run_dir, worker, engine_url, log)
    except Exception as e:  # the operator reads the role log first: put the failure there too
        log.logger.exception("rollout worker %d failed: %s", worker, e)
        raise
    finally:
        log.close()


def _run_worker(sec: WorkerSections, run_dir: str, worker: int, engine_url: str, log: RoleLogger) -> int:
    run = RunDir(run_dir)
    stop = StopFlag().install()     # SIGTERM, SIGUSR1 (Slurm's pre-timeout), SIGINT: journal, flush, exit

    tokenizer = load_tokenizer(sec.model_tokenizer)
    env = envs.get(sec.env.kind).bind(sec.env)
    source = env.tasks()
    tasks = source.train()
    if not tasks:
        log.error("no tasks for %s %s; check the env section of the config", sec.env.kind, source.describe())
        return 2
    # the route shape is ours to state: SGLang's model info does not report it
    client = EngineClient(engine_url, num_moe_layers=sec.model_num_layers, top_k=sec.model_moe_router_topk)
    # a new writer id per incarnation: a restarted worker never reuses a dead one's file names
    writer_id = f"w{worker}-{job_id()}-{os.getpid()}"
    rng = random.Random(f"{source.seed}-{worker}-{os.getpid()}")
    order = list(range(len(tasks)))
    groups = episodes = tokens = 0
    log.info("rollout worker %d up: engine %s, %d tasks (%s), writer %s", worker, engine_url,
             len(tasks), source.describe(), writer_id)
    poll = sec.protocol
    beater = _Beater(run, worker, poll.worker_heartbeat_s)
    journal = jr.Journal(run, worker, fsync=sec.rollout.journal_fsync, enabled=sec.rollout.journal)
    by_id = {t.id: t for t in tasks}

    def episode_of(task):
        return lambda: Episode(client, as_environment(task, sec.rollout, env), tokenizer, sec.rollout,
                               replay=sec.offpolicy.replay_engine)

    resume = _take_over(journal, by_id, episode_of, sec, log, worker)
    rollout_s = 0.0     # seconds spent running groups (the journal's overhead is a share of it)
    dropped = 0         # episodes whose turn in flight a stop dropped
    with open_store(run, sec.store).writer(writer_id) as writer:
        def committed():
            if writer.pending == 0:
                journal.committed()

        def new_uid(i):
            return f"{writer_id}-{episodes + i}"

        def play(group) -> bool:
            """Run ``group`` to its end and publish it; False when a stop ended it at a turn boundary."""
            nonlocal rollout_s, dropped, groups, tokens
            trajs, dt = _run(group, journal, stop, sec)
            rollout_s += dt
            if trajs is None:
                dropped = group.dropped
                return False
            groups, tokens = _publish(trajs, dt, group, writer, journal, log, worker, groups, tokens)
            committed()
            return True

        while not stop.requested and not Finished.present(run):
            if resume:      # journalled groups first: already in flight, they need no admission
                group = resume.pop(0)
                task = by_id[group.episodes[0][1].task_id]
                beater.beat(in_flight=sum(len(g.episodes) for g in [group] + resume) + writer.pending,
                            groups=groups, episodes=episodes, tokens=tokens, task=task.id)
                if not play(group):
                    break
                continue
            lag = version_gap(run)
            verdict, ahead = admission(run, sec, sec.rollout.group_size, lag)
            if verdict != rule.OK:
                reason, t0 = verdict, time.monotonic()
                writer.flush()  # let the trainer have what we hold
                committed()
                beater.beat(in_flight=0, groups=groups, waiting=verdict)
                key, checked = wake_key(run), time.monotonic()
                while verdict != rule.OK and not stop.requested and not Finished.present(run):
                    time.sleep(poll.admission_poll_s)
                    now_key = wake_key(run)
                    if now_key == key and time.monotonic() - checked < poll.admission_recheck_s:
                        continue
                    key, checked = now_key, time.monotonic()
                    lag = version_gap(run)
                    verdict, ahead = admission(run, sec, sec.rollout.group_size, lag)
                waited = time.monotonic() - t0
                log.info("%s: waited %.1fs (staleness estimate %.1f, of which trainer-engine version gap %d)",
                         reason, waited, ahead, lag)
                log.metrics(event=reason, seconds=waited, worker=worker)
                continue
            if groups % len(order) == 0:
                rng.shuffle(order)
            task = tasks[order[groups % len(order)]]
            # in flight = the group about to run plus what the writer holds unpublished
            beater.beat(in_flight=sec.rollout.group_size + writer.pending, groups=groups,
                        episodes=episodes, tokens=tokens, task=task.id)
            # a run-wide unique id, given at the episode's start and kept across resumes:
            # exactly-once consumption is checkable trajectory by trajectory
            group = jr.new_group(episode_of(task), task.id, sec.rollout.group_size, new_uid)
            episodes += sec.rollout.group_size
            if not play(group):
                break
            # a hungry trainer gets what we hold now rather than at the next full shard:
            # trajectories in a writer's buffer are invisible to the trainer and to admission
            if ready_trajectories(run, sec.store) < sec.train_trajectories_per_step:
                writer.flush()
                committed()
        t_stop = time.monotonic()
        writer.flush()
        committed()
    drained = journal.drain()     # the records handed over before the stop are on disk
    beater.beat(in_flight=0, groups=groups, episodes=episodes, tokens=tokens, stopped=True)
    beater.close()
    js = journal.stats
    log.metrics(event="journal", worker=worker, writes=js.writes, coalesced=js.coalesced, bytes=js.bytes,
                seconds=js.seconds, write_s=js.write_s, rollout_s=rollout_s, stop=stop.name, turns_dropped=dropped,
                exit_s=time.monotonic() - t_stop, drained=drained)
    log.info("rollout worker %d stopping (%s): %d groups, %d tokens; journal: %d records, %.1f MB, episodes "
             "spent %.2fs in it of %.1fs rolling out (%.2fs writing beside them); %d episodes journalled mid-group, "
             "their turns in flight dropped%s", worker, stop.name or "run finished", groups, tokens, js.writes,
             js.bytes / 1e6, js.seconds, rollout_s, js.write_s, dropped,
             "" if drained else "; some records were still being written")
    return 0


def _take_over(journal: jr.Journal, by_id: dict, episode_of, sec: WorkerSections, log, worker: int) -> list:
    """The journalled groups this worker resumes before admitting new ones (quarantined records:
    logged, counted in the ``resume`` event)."""
    found, bad = journal.take_over(sec.rollout.num_workers, log)
    groups, kept, gen = [], 0, 0
    for r in found:
        task = by_id.get(r.task_id)
        if task is None:
            bad += journal.quarantine_group(r, f"task {r.task_id!r} is not in this run's task set (was the "
                                               f"env section changed?)", log)
            continue
        try:
            groups.append(jr.resumed_group(r, episode_of(task)))
        except (KeyError, ValueError, TypeError) as e:
            bad += journal.quarantine_group(r, f"cannot restore it: {e}", log)
            continue
        t, g = jr.kept_tokens(r)
        kept, gen = kept + t, gen + g
    if groups or bad:
        eps = sum(len(g.episodes) for g in groups)
        log.info("resuming %d journalled groups (%d episodes, %d tokens kept, %d generated); %d records "
                 "quarantined", len(groups), eps, kept, gen, len(bad))
        log.metrics(event="resume", worker=worker, groups=len(groups), episodes=eps, tokens_kept=kept,
                    gen_tokens_kept=gen, quarantined=len(bad),
                    tokens_lost=sum(b["tokens"] or 0 for b in bad))
    return groups


def _run(group: jr.GroupRun, journal: jr.Journal, stop: StopFlag, sec: WorkerSections) -> tuple[list | None, float]:
    """The group's trajectories (None: a stop came first) and the seconds it took."""
    t0 = time.monotonic()
    eps = group.run(journal, lambda: stop.requested)
    if eps is None:
        return None, time.monotonic() - t0
    reward = getattr(sec.rollout, "reward", "dense")
    trajs = []
    for ep, slot in group.episodes:
        tr = ep.trajectory(group_id=slot.group_id, reward_key=reward)
        tr.metadata["uid"] = slot.uid
        tr.metadata["resumes"] = ep.resumes
        trajs.append(tr)
    return trajs, time.monotonic() - t0


def _publish(trajs: list, dt: float, group: jr.GroupRun, writer, journal: jr.Journal, log, worker: int,
             groups: int, tokens: int) -> tuple[int, int]:
    for tr in trajs:
        tr.metadata["worker"] = worker
        writer.add(tr)
        gen = int(tr.loss_mask.sum())
        vmin, vmax = _versions(tr)
        tokens += len(tr.tokens)
        log.metrics(worker=worker, task_id=tr.task_id, tokens=int(len(tr.tokens)), gen_tokens=gen,
                    episode_s=float(tr.timings.get("episode_s", dt)), version_min=vmin,
                    version_max=vmax, reward=float(tr.reward), turns=int(len(tr.turn_offsets) - 1),
                    uid=tr.metadata["uid"], resumed=int(tr.metadata["resumes"]))
    journal.added(group.episodes[0][1].group_id)
    groups += 1
    log.set(version=max((_versions(t)[1] for t in trajs), default=None))
    log.info("group %d task %s%s: %d episodes in %.1fs, reward mean %.3f, versions %s", groups, trajs[0].task_id,
             " (resumed)" if group.resumed else "", len(trajs), dt, sum(t.reward for t in trajs) / max(len(trajs), 1),
             sorted({v for t in trajs for v in _versions(t)}))
    return groups, tokens


def _versions(tr) -> tuple[int, int]:
    gen = tr.versions[tr.loss_mask.astype(bool)]
    if len(gen) == 0:
        return -1, -1
    return int(gen.min()), int(gen.max())
