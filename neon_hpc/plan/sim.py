"""The discrete-event simulation of one run (SimPy): rollout slots, GRPO groups, a trainer.

What is an event here, and what is not (so that 10,000 steps of 512 trajectories simulate in
well under a minute): one event per *episode* (its whole multi-turn life, whose duration
comes from ``workload.py``, engine stall included), one process for the *trainer* (wait for
data, compute, publish), and one for the *batch controller* of the synchronous policies.
Turns are not events; their effect (tool latency, export stall, the version the last turn
saw) is summarised per episode.

Policies (``SimParams.policy``):

* ``sync``: generate one step's groups with the current weights, then train, publish, repeat.
* ``one_step_off``: batch k+1 is generated with weights v_k while step k trains on batch k
  (staleness exactly 1 after the first step).
* ``async``: every free rollout slot starts an episode as soon as admission allows; engines
  pick up each new version between turns (in-flight updates), so a trajectory spans
  versions.  Admission: ``steps_ahead`` (the rollout worker's rule: no new group when the
  steps of data ahead of the trainer -- ready plus in flight plus this group -- plus the
  version gap between the trainer's next claim and the engines' loaded weights are more
  than ``S``; ``version_gap=False`` leaves the gap out) or ``oldest`` (no new group while
  the oldest unconsumed group is already ``S`` versions behind the trainer, unless the
  trainer is starved: otherwise the two would wait for each other).  Backpressure: no new
  group while ``ready`` holds more than ``backpressure_steps`` steps of data.  A group whose
  staleness exceeds ``S`` is dropped (counted) when the trainer's claim takes it (what
  ``neon_hpc.store`` does; until then it counts against admission and backpressure), so the
  trainer never consumes data beyond the bound.  With ``abort_stale`` (worker mode) an
  in-flight group is stopped as soon as it is beyond the bound, giving its worker back
  early, and stale data is dropped at once.

Rollout slots (``slot_mode``): ``worker`` = like ``neon_hpc.rollout.worker``, a worker
holds ``G`` slots and starts its next group only when its whole group is done (a long
episode keeps its siblings' slots idle); ``episode`` = each slot starts a new episode as soon
as its own finishes (an engine-level request pool).  When the workers' episodes outnumber the
engines' request slots (``engine_slots``), the rest wait in the engines' queue
(``QueuedWorkerSlots``).  Rollout idle = slot-time not held by any group or episode (request
slots, when queued).

What the real processes add (worker mode; each is a parameter, 0 = ideal):

* the worker's shard writer (``flush_trajectories``, ``flush_seconds``): a finished group
  sits in its worker's buffer, invisible to the trainer and to admission, until the worker
  publishes a shard (``neon_hpc.rollout.worker``'s flush policy, see ``_group_ended``);
* heartbeats: admission counts the ``in_flight`` each worker last *beat* (``G`` + its
  unflushed trajectories, at group start; 0 while refused), not what it holds now;
* the store: stale data is dropped when a claim takes it (it counts against admission and
  backpressure until then); the trainer claims whole shards, in publish order;
* polling: refused workers re-check admission every ``admission_poll_s``, a short claim
  re-looks every ``claim_poll_s`` (its wait is whole polls), the rollout node checks for new
  weights every ``weight_poll_s`` and loads them in ``weight_load_s``: groups start on the
  engines' version, which lags the trainer's.

Staleness of a consumed trajectory = the trainer's step (= the weight version it trains from)
minus the oldest version any of its *trained* tokens came from.

Per-token staleness (``stale_policy``, ``neon_hpc.store.claim``): a group's tokens are taken
as spread evenly over the versions ``vmin..vmax`` it saw.  ``drop``: a group whose oldest
token is over the bound is dropped whole.  ``mask``: the tokens of versions older than
``step - S`` get loss weight 0 (counted as masked tokens) and the rest trains; the group is
dropped only when even its newest version is over the bound.  Waste = (dropped + masked
tokens) / tokens claimed.  ``weight_update``: ``in_place`` engines swap weights inside a
response, so a group's newest version is the one current at its *end*; ``between_requests``
the one current when its last turn started.  The engines' pause while loading is not
modelled (``weight_load_s`` is only the lag before new groups see the version).

The code: this module is the system (admission, the store's ready shards and claims, the
trainer, the rollout node's weight pickup, the batch controller); the slot policies are in
:mod:`neon_hpc.plan.slots`, the books and :class:`SimResult` in :mod:`neon_hpc.plan.accounting`.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections import Counter, deque

import numpy as np
import simpy

from neon_hpc.plan.accounting import Accounts, Occupancy, SimResult
from neon_hpc.plan.params import SimParams
from neon_hpc.plan.slots import EpisodeSlots, Group, QueuedWorkerSlots, WorkerSlots
from neon_hpc.plan.steptime import StepTimeModel
from neon_hpc.plan.workload import EngineStall
from neon_hpc.protocol import admission as rule

__all__ = ["POLICIES", "SimResult", "simulate"]

POLICIES = ("sync", "one_step_off", "async")


class Sim:
    """The system of one simulated run.

    Its interface to the slot policies (:mod:`neon_hpc.plan.slots`), the only methods they
    call: :meth:`admit_new_group`, :meth:`open_group`, :meth:`version_at`,
    :meth:`group_done`, :meth:`publish_shard`, :meth:`is_stale`, :meth:`discard` and
    :meth:`fill`; they also read its state (``p``, ``env``, ``rng``, ``stall``, ``G``,
    ``version``, ``in_place``, ``occ``, ``acc``, ``open``, ``pause_begun`` ...). The rest is
    internal (underscored).
    """

    def __init__(self, p: SimParams, step_model: StepTimeModel | None = None):
        if p.policy not in POLICIES:
            raise ValueError(f"policy {p.policy!r}: expected one of {', '.join(POLICIES)}")
        if p.admission not in ("steps_ahead", "oldest"):
            raise ValueError(f"admission {p.admission!r}: expected 'steps_ahead' or 'oldest'")
        if p.slot_mode not in ("worker", "episode"):
            raise ValueError(f"slot_mode {p.slot_mode!r}: expected 'worker' or 'episode'")
        if p.stale_policy not in ("mask", "drop"):
            raise ValueError(f"stale_policy {p.stale_policy!r}: expected 'mask' or 'drop'")
        if p.weight_update not in ("in_place", "between_requests"):
            raise ValueError(f"weight_update {p.weight_update!r}: expected 'in_place' or 'between_requests'")
        self.mask = p.stale_policy == "mask"
        self.in_place = p.weight_update == "in_place"
        self.p = p
        self.env = simpy.Environment()
        self.rng = np.random.default_rng(p.seed)
        self.stall = EngineStall(p, np.random.default_rng(p.seed + 1))
        self.step_model = step_model or StepTimeModel(p)
        self.G = max(p.group_size, 1)
        self.need = max(1, math.ceil(p.trajectories_per_step / self.G))   # groups per step
        self.batch_mode = p.policy != "async"
        # versions
        self.step = 0                       # completed trainer steps = trainer's weight version
        self.published = 0                  # newest version the trainer has published
        self.version = 0                    # version the engines have loaded (new groups start on it)
        self.trains = 0                     # version the trainer's next claim trains (see admit_new_group)
        self.use_gap = p.version_gap and p.admission == "steps_ahead"
        self.load_times: list[float] = []   # when the engines loaded ...
        self.load_versions: list[int] = []  # ... which version
        # the store
        self.ready: deque[list[Group]] = deque()   # published shards, in publish order
        self.ready_n = 0                    # groups in them
        self.abort_stale = p.abort_stale and p.policy == "async"
        self.eager_drop = self.abort_stale    # else stale data is dropped when claimed (the store)
        self._starved = False               # the trainer is waiting for data
        self._waiter: simpy.Event | None = None
        # the rollout node
        self._node_busy = False             # a weight check or load is scheduled
        self._node_anchor = -float(np.random.default_rng(p.seed + 2).uniform(0.0, p.weight_poll_s)) \
            if p.weight_poll_s > 0 else 0.0
        # in place, a load pauses the engines' running requests for its duration (slots.py)
        self.pause_s = p.weight_load_s if (p.pause_on_load and self.in_place and not self.batch_mode) else 0.0
        self.pause_begun = 0.0              # engine pause seconds begun so far
        # groups
        self.groups_open = 0
        self.open: Group | None = None
        self.open_left = 0                  # episodes of the open group not started yet (episode mode)
        self.groups_started = 0
        self._vmin_heap: list[int] = []
        self.track_oldest = p.admission == "oldest" and not self.batch_mode
        self._vmin_count: Counter = Counter()
        # batch controller (sync, one_step_off)
        self.quota = 0                      # episodes still to launch
        self.batch_index = 0
        self.batch_done = 0
        self._batch_event: simpy.Event | None = None
        self._version_event: simpy.Event | None = None
        # books and slots
        self.acc = Accounts()
        self.occ = Occupancy(p.request_slots)
        self.worker_mode = p.slot_mode == "worker"
        self.slots = (EpisodeSlots(self) if not self.worker_mode else QueuedWorkerSlots(self) if p.queued
                      else WorkerSlots(self))

    # ---- admission and groups ---------------------------------------------------------
    def admit_new_group(self) -> bool:
        """May a new group start now (the admission rule of ``SimParams.admission``)?"""
        p = self.p
        if self.batch_mode:
            return self.quota > 0
        ready = self.ready_n * self.G
        if p.admission == "steps_ahead":     # the rollout worker's rule, the same function
            # in flight: what the workers' heartbeats say (worker mode), else what is running;
            # the version gap: the group starts on the engines' version, behind the one the
            # trainer's next claim trains (a step in progress is one more)
            lag = rule.version_gap(self.trains, self.version, self.published) if self.use_gap else 0
            return rule.admit(ready, self.slots.in_flight_beaten(), self.G, p.trajectories_per_step,
                              p.backpressure_steps, p.max_staleness, lag)[0] == rule.OK
        if rule.backpressured(ready, p.trajectories_per_step, p.backpressure_steps):
            return False
        oldest = self._oldest_unconsumed()
        return oldest is None or self.step - oldest < p.max_staleness or self._starved

    def _oldest_unconsumed(self) -> int | None:
        h = self._vmin_heap
        while h and self._vmin_count[h[0]] == 0:
            heapq.heappop(h)
        return h[0] if h else None

    def fill(self) -> None:
        """Let the slot policy start what admission allows now."""
        self.slots.fill()

    def open_group(self) -> Group:
        """Open a new group on the engines' version (counted for admission and the batch)."""
        v = self.version
        self.open = g = Group(self.G, v, self.batch_index, self.env._now)
        self.open_left = self.G
        self.groups_started += 1
        self.groups_open += 1
        if self.batch_mode:
            self.quota -= self.G
        if self.track_oldest:
            if self._vmin_count[v] == 0:
                heapq.heappush(self._vmin_heap, v)
            self._vmin_count[v] += 1
        return g

    def version_at(self, t: float) -> int:
        """The version the engines had loaded at time ``t``."""
        i = bisect.bisect_right(self.load_times, t)
        return self.load_versions[i - 1] if i else 0

    def group_done(self, g: Group) -> None:
        """A group has ended (its slots are free): count it for the batch controller, drop it
        at once if stale (``abort_stale``), else hand it to its slot policy's writer."""
        if self.batch_mode:
            self.batch_done += 1
            if self.batch_done == self.need and self._batch_event is not None:
                self._batch_event.succeed()
        if self.eager_drop and self.is_stale(g):
            self.discard(g)
            return
        self.slots.group_done(g)

    def publish_shard(self, groups: list[Group]) -> None:
        """A shard of these groups appears in ready/ (visible to the trainer and to admission)."""
        self.ready.append(groups)
        self.ready_n += len(groups)
        if self._waiter is not None:
            self._waiter.succeed()
            self._waiter = None

    def is_stale(self, g: Group) -> bool:
        """Nothing of ``g`` can train: its oldest (drop) or newest (mask) version is over the bound."""
        return not self.batch_mode and self.step - (g.vmax if self.mask else g.vmin) > self.p.max_staleness

    def _release(self, g: Group) -> None:
        if self.track_oldest:
            self._vmin_count[g.vmin] -= 1

    def discard(self, g: Group) -> None:
        """Drop ``g`` (stale): its tokens are counted as discarded."""
        self._release(g)
        self.acc.discard(g.lengths)

    def _purge_stale_ready(self) -> None:
        """``abort_stale`` only: drop stale published data at once (the store drops it when a
        claim takes it, so without this it counts against admission until then)."""
        if self.batch_mode or not self.ready or not self.eager_drop:
            return
        keep: deque[list[Group]] = deque()
        for shard in self.ready:
            live = []
            for g in shard:
                if self.is_stale(g):
                    self.discard(g)
                else:
                    live.append(g)
            if live:
                keep.append(live)
        self.ready = keep
        self.ready_n = sum(len(s) for s in keep)

    # ---- trainer ---------------------------------------------------------------------
    def _need_now(self) -> int:
        """Groups this step consumes: ``need``, or on average ``consume_per_step / G`` (a
        measured run's trainer claims whole shards, so slightly more than one step's worth)."""
        per_step = self.p.consume_per_step / self.G
        if per_step <= 0:
            return self.need
        k = len(self.acc.step_end)
        return max(1, math.floor((k + 1) * per_step + 0.5) - math.floor(k * per_step + 0.5))

    def _take(self, batch: list[Group], need: int) -> None:
        """``neon_hpc.store.claim_step``: whole shards in publish order until ``need`` groups
        are kept; stale ones are dropped as they are taken."""
        while self.ready and len(batch) < need:
            shard = self.ready.popleft()
            self.ready_n -= len(shard)
            for g in shard:
                if self.is_stale(g):
                    self.discard(g)
                else:
                    self._release(g)
                    batch.append(g)

    def _take_batch(self):
        batch: list[Group] = []
        t0 = self.env.now
        need = self._need_now()
        poll = self.p.claim_poll_s
        self._take(batch, need)
        while len(batch) < need:
            self._starved = True
            self.fill()                # a starved trainer lifts the 'oldest' admission rule
            if poll > 0:                # the claim looks at ready/ again after a poll
                yield self.env.timeout(poll)
            else:
                self._waiter = self.env.event()
                yield self._waiter
            self._take(batch, need)
        self._starved = False
        self.acc.wait_s += self.env.now - t0
        self.acc.step_wait.append(self.env.now - t0)
        return batch

    def _trainer(self):
        env, p, acc = self.env, self.p, self.acc
        publish_s = p.publish_s
        for _ in range(p.steps):
            batch = yield from self._take_batch()
            # the trainer has its data (heartbeat phase 'training'): its next claim trains this
            # step's version, one more than the one it trains now
            self.trains = self.step + 1
            self.fill()                # consuming frees backpressure (polling workers see it themselves)
            acc.account(batch, self.step, self.step - p.max_staleness, self.mask and not self.batch_mode)
            k = len(acc.step_end)
            if p.step_seconds:          # a measured run's own step times, in order
                compute = float(p.step_seconds[k % len(p.step_seconds)])
            else:
                lengths = np.array(list(itertools.chain.from_iterable(g.lengths for g in batch)), dtype=np.float64)
                compute = self.step_model.step_seconds(lengths)
            after = float(p.after_publish_seconds[k % len(p.after_publish_seconds)]) if p.after_publish_seconds else 0.0
            acc.step_compute.append(compute + after)
            acc.compute_s += compute + after
            yield env.timeout(compute)
            if p.publish_blocks_trainer:
                yield env.timeout(publish_s)
                acc.publish_s += publish_s
                self.step += 1
                self._published(self.step)
            else:
                self.step += 1
                env.timeout(publish_s, value=self.step).callbacks.append(lambda e: self._published(e.value))
            if after > 0:
                yield env.timeout(after)
            acc.step_end.append(env.now)
            acc.step_busy.append(self.occ.busy_until(env.now))
            self.slots.abort_stale_inflight()
            self._purge_stale_ready()
            self.fill()

    # ---- weight pickup (the rollout node) -------------------------------------------------
    def _published(self, version: int) -> None:
        """The trainer published ``version``: the engines load it at the node's next weight
        check (every ``weight_poll_s``), taking ``weight_load_s``; at once when both are 0."""
        if version <= self.published:
            return
        self.published = version
        p = self.p
        if p.weight_poll_s <= 0 and p.weight_load_s <= 0:
            self._loaded(version)
        elif not self._node_busy:
            self._schedule_check()

    def _schedule_check(self) -> None:
        """The node checks at ``anchor + k * weight_poll_s`` (k >= 1; anchor = the end of its
        last load): it sleeps ``weight_poll_s`` after every check."""
        P, now = self.p.weight_poll_s, self.env._now
        delay = 0.0
        if P > 0:
            k = max(1, math.ceil((now - self._node_anchor) / P - 1e-9))
            delay = self._node_anchor + k * P - now
        self._node_busy = True
        self.env.timeout(delay).callbacks.append(self._node_check)

    def _node_check(self, _e) -> None:
        v = self.published
        self.pause_begun += self.pause_s
        self.env.timeout(self.p.weight_load_s, value=v).callbacks.append(self._node_loaded)

    def _node_loaded(self, e) -> None:
        self._node_anchor = self.env._now
        self._node_busy = False
        self._loaded(e.value)
        if self.published > self.version:
            self._schedule_check()

    def _loaded(self, version: int) -> None:
        if version <= self.version:
            return
        self.version = version
        self.load_times.append(self.env.now)
        self.load_versions.append(version)
        if self._version_event is not None:
            ev, self._version_event = self._version_event, None
            ev.succeed()
        self.fill()

    # ---- batch controller (sync, one_step_off) ----------------------------------------
    def _batches(self):
        env, p = self.env, self.p
        k = 0
        while True:
            needed = k if p.policy == "sync" else max(k - 1, 0)
            while self.version < needed:
                self._version_event = env.event()
                yield self._version_event
            t0 = env.now
            self.batch_index, self.batch_done = k, 0
            self._batch_event = env.event()
            self.quota += self.need * self.G
            self.fill()
            yield self._batch_event
            self.acc.rollout_phase_s += env.now - t0
            k += 1


    # ---- run --------------------------------------------------------------------------
    def run(self) -> SimResult:
        t_start = time.perf_counter()
        env = self.env
        trainer = env.process(self._trainer())
        if self.batch_mode:
            env.process(self._batches())
        else:
            self.slots.start()
        env.run(until=trainer)
        end = env.now
        return self.acc.result(
            policy=self.p.policy, steps=self.p.steps, wall_s=end, rollout_busy_s=self.occ.busy_until(end),
            slots=self.p.request_slots, engine_stall_full=self.stall.at_full,
            aborted=self.slots.aborted_groups * self.G, step_time_source=self.step_model.source,
            sim_seconds=time.perf_counter() - t_start)


def simulate(p: SimParams, step_model: StepTimeModel | None = None) -> SimResult:
    """Simulate ``p.steps`` trainer steps of one configuration and policy."""
    if p.rollout_slots < 1:
        raise ValueError("rollout_slots must be >= 1 (concurrent episodes over all engines)")
    return Sim(p, step_model).run()
