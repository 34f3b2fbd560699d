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
as its own finishes (an engine-level request pool).  Rollout idle = slot-time not held by
any group or episode.

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
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import simpy

from neon_hpc.plan.params import SimParams
from neon_hpc.plan.trainer import StepTimeModel
from neon_hpc.plan.workload import EngineStall, sample_episodes

POLICIES = ("sync", "one_step_off", "async")


@dataclass
class SimResult:
    policy: str
    steps: int
    wall_s: float
    compute_s: float
    publish_s: float
    wait_s: float
    rollout_busy_s: float          # slot-seconds with an episode running
    slots: int
    consumed: int                  # trajectories trained on
    dropped: int                   # trajectories over the staleness bound
    started: int
    staleness: Counter             # staleness -> trajectories
    step_compute_s: list[float] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)
    step_wait_s: list[float] = field(default_factory=list)
    step_busy_s: list[float] = field(default_factory=list)
    step_staleness: list[tuple[int, float, int]] = field(default_factory=list)
    rollout_phase_s: float = 0.0   # sync/one_step_off: time from batch start to batch complete
    versions_spanned_mean: float = 1.0
    aborted: int = 0               # trajectories stopped early for being beyond the bound (in dropped)
    staleness_token_mean: float = 0.0  # estimate: midpoint of each trajectory's version span
    engine_stall_mean: float = 0.0
    engine_stall_full: float = 0.0
    step_time_source: str = ""
    sim_seconds: float = 0.0
    claimed_tokens: float = 0.0    # tokens of every trajectory a claim took or dropped
    masked_tokens: float = 0.0     # ... of those given loss weight 0 (stale_policy mask)
    dropped_tokens: float = 0.0    # ... of the dropped trajectories
    token_staleness: Counter = field(default_factory=Counter)   # staleness -> trained tokens

    @property
    def wasted_tokens_frac(self) -> float:
        """(dropped + masked) tokens over all tokens claimed: rollout work that trained nothing."""
        return (self.masked_tokens + self.dropped_tokens) / self.claimed_tokens if self.claimed_tokens else 0.0

    @property
    def token_staleness_mean(self) -> float:
        total = sum(self.token_staleness.values())
        return sum(k * v for k, v in self.token_staleness.items()) / total if total else 0.0

    def token_staleness_quantile(self, q: float) -> int:
        total = sum(self.token_staleness.values())
        acc = 0.0
        for k in sorted(self.token_staleness):
            acc += self.token_staleness[k]
            if acc >= q * total - 1e-9:
                return k
        return max(self.token_staleness, default=0)

    @property
    def trainer_idle_frac(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def rollout_idle_frac(self) -> float:
        cap = self.slots * self.wall_s
        return min(1.0, max(0.0, 1.0 - self.rollout_busy_s / cap)) if cap > 0 else 0.0

    @property
    def samples_per_hour(self) -> float:
        return 3600.0 * self.consumed / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def time_per_step_s(self) -> float:
        return self.wall_s / self.steps if self.steps else 0.0

    @property
    def dropped_frac(self) -> float:
        done = self.consumed + self.dropped
        return self.dropped / done if done else 0.0

    def window(self, first_step: int) -> dict[str, float]:
        """Idle fractions and staleness from step ``first_step`` (0-based) on: steady state
        without the start-up, for comparing with a measured run."""
        k = min(max(first_step, 0), max(len(self.step_end_s) - 1, 0))
        t0 = self.step_end_s[k - 1] if k > 0 else 0.0
        b0 = self.step_busy_s[k - 1] if k > 0 else 0.0
        span = self.wall_s - t0
        n = sum(x[0] for x in self.step_staleness[k:])
        return {
            "trainer_idle": sum(self.step_wait_s[k:]) / span if span > 0 else 0.0,
            "rollout_idle": min(1.0, max(0.0, 1.0 - (self.rollout_busy_s - b0) / (self.slots * span)))
            if span > 0 else 0.0,
            "staleness_mean": sum(x[1] for x in self.step_staleness[k:]) / n if n else 0.0,
            "staleness_max": float(max((x[2] for x in self.step_staleness[k:]), default=0)),
        }

    def staleness_quantile(self, q: float) -> int:
        total = sum(self.staleness.values())
        if not total:
            return 0
        acc = 0
        for k in sorted(self.staleness):
            acc += self.staleness[k]
            if acc >= q * total:
                return k
        return max(self.staleness)

    @property
    def staleness_mean(self) -> float:
        total = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / total if total else 0.0

    @property
    def staleness_max(self) -> int:
        return max(self.staleness) if self.staleness else 0

    def summary(self) -> dict:
        return {
            "policy": self.policy, "steps": self.steps, "wall_h": self.wall_s / 3600,
            "time_per_step_s": self.time_per_step_s,
            "step_compute_s": float(np.mean(self.step_compute_s)) if self.step_compute_s else 0.0,
            "trainer_idle": self.trainer_idle_frac, "rollout_idle": self.rollout_idle_frac,
            "samples_per_hour": self.samples_per_hour, "staleness_mean": self.staleness_mean,
            "staleness_p95": self.staleness_quantile(0.95), "staleness_max": self.staleness_max,
            "dropped": self.dropped_frac, "versions_spanned": self.versions_spanned_mean,
            "engine_stall": self.engine_stall_mean, "wasted_tokens": self.wasted_tokens_frac,
            "token_staleness_mean": self.token_staleness_mean,
            "token_staleness_p95": self.token_staleness_quantile(0.95),
        }


class _Group:
    __slots__ = ("remaining", "vmin", "vmax", "lengths", "batch", "t_start", "aborted", "worker")

    def __init__(self, size: int, version: int, batch: int, t_start: float):
        self.t_start = t_start
        self.aborted = False
        self.worker: _Worker | None = None
        self.remaining = size
        self.vmin = version
        self.vmax = version
        self.lengths: list[float] = []
        self.batch = batch


class _Worker:
    """One rollout worker (worker mode): its writer's unpublished groups and its heartbeat."""
    __slots__ = ("buf", "buf_first", "hb")

    def __init__(self) -> None:
        self.buf: list[_Group] = []     # finished groups not yet published as a shard
        self.buf_first = 0.0            # when the oldest of them was added
        self.hb = 0                     # in_flight of its last heartbeat (trajectories)


class _Sim:
    CHUNK = 8192

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
        # state
        self.step = 0                       # completed trainer steps = trainer's weight version
        self.published = 0                  # newest version the trainer has published
        self.version = 0                    # version the engines have loaded (new groups start on it)
        self.trains = 0                     # version the trainer's next claim trains (see _admit_new_group)
        self.use_gap = p.version_gap and p.admission == "steps_ahead"
        self.load_times: list[float] = []   # when the engines loaded ...
        self.load_versions: list[int] = []  # ... which version
        self.ready: deque[list[_Group]] = deque()   # published shards, in publish order
        self.ready_n = 0                    # groups in them
        self.worker_mode = p.slot_mode == "worker"
        self.abort_stale = p.abort_stale and p.policy == "async"
        if self.abort_stale and not self.worker_mode:
            raise ValueError("abort_stale is modelled for slot_mode 'worker' only (one event per group)")
        self.inflight_groups: dict[int, _Group] = {}
        self.aborted_groups = 0
        if self.worker_mode and p.rollout_slots < self.G:
            raise ValueError(f"slot_mode 'worker' needs rollout_slots ({p.rollout_slots}) >= group_size ({self.G})")
        self.idle_slots = p.rollout_slots
        self.eager_drop = self.abort_stale    # else stale data is dropped when claimed (the store)
        self.flush_at = max(p.flush_trajectories, 0)
        self.worker_poll = p.admission_poll_s if (self.worker_mode and not self.batch_mode) else 0.0
        self.workers = [_Worker() for _ in range(p.rollout_slots // self.G)] if self.worker_mode else []
        self.waiting: deque[_Worker] = deque(self.workers)   # idle workers refused by admission
        self.hb_total = 0                   # sum of the workers' heartbeat in_flight
        self._starved = False               # the trainer is waiting for data
        self._node_busy = False             # a weight check or load is scheduled
        self._node_anchor = -float(np.random.default_rng(p.seed + 2).uniform(0.0, p.weight_poll_s)) \
            if p.weight_poll_s > 0 else 0.0
        self.in_flight = 0
        self.occ_start_sum = 0.0
        self.groups_open = 0
        self.open: _Group | None = None
        self.open_left = 0
        self.groups_started = 0
        self.quota = 0                      # batch mode: episodes still to launch
        self.batch_index = 0
        self.batch_done = 0
        self._batch_event: simpy.Event | None = None
        self._version_event: simpy.Event | None = None
        self._waiter: simpy.Event | None = None
        self._vmin_heap: list[int] = []
        self.track_oldest = p.admission == "oldest" and not self.batch_mode
        self._vmin_count: Counter = Counter()
        # accounting
        self.busy_s = 0.0
        self.started = 0
        self.consumed = 0
        self.dropped = 0
        self.staleness: Counter = Counter()
        self.token_staleness: Counter = Counter()
        self.claimed_tokens = self.masked_tokens = self.dropped_tokens = 0.0
        self.spanned_sum = 0.0
        self.token_staleness_sum = 0.0
        self.stall_sum = 0.0
        self.compute_s = self.publish_s = self.wait_s = self.rollout_phase_s = 0.0
        self.step_compute: list[float] = []
        self.step_end: list[float] = []
        self.step_wait: list[float] = []
        self.step_busy: list[float] = []      # rollout slot-seconds held, at each step's end
        self.step_staleness: list[tuple[int, float, int]] = []   # (trajectories, token staleness sum, max)
        self._buf: list = []
        self._buf_i = self.CHUNK
        self._gbuf: list = []
        self._gbuf_i = 0
        self._stall_table = self.stall.table_list
        self._stall_scale = (EngineStall.LEVELS - 1) / p.rollout_slots

    # ---- episodes --------------------------------------------------------------------
    def _admit_new_group(self) -> bool:
        p = self.p
        if self.batch_mode:
            return self.quota > 0
        ready = self.ready_n * self.G
        if ready > p.backpressure_steps * p.trajectories_per_step:
            return False
        if p.admission == "steps_ahead":     # neon_hpc.rollout.worker.admission
            # in flight: what the workers' heartbeats say (worker mode), else what is running
            inflight = self.hb_total if self.worker_mode else self.groups_open * self.G
            pending = ready + inflight + self.G
            estimate = math.ceil(pending / p.trajectories_per_step) - 1
            if self.use_gap and self.trains > self.version:
                # neon_hpc.rollout.worker.version_gap: the group starts on the engines' version,
                # behind the one the trainer's next claim trains (a step in progress is one more)
                estimate += self.trains - self.version
            return estimate <= p.max_staleness
        oldest = self._oldest_unconsumed()
        return oldest is None or self.step - oldest < p.max_staleness or self._starved

    def _oldest_unconsumed(self) -> int | None:
        h = self._vmin_heap
        while h and self._vmin_count[h[0]] == 0:
            heapq.heappop(h)
        return h[0] if h else None

    def _fill(self) -> None:
        if self.worker_mode:           # a worker (G slots) runs one whole group at a time
            if self.worker_poll > 0:   # refused workers re-check on their own polls
                return
            while self.waiting and self._admit_new_group():
                self._start_worker(self.waiting.popleft())
            return
        while self.idle_slots > 0:
            if self.open_left == 0:
                if not self._admit_new_group():
                    return
                self._open_group()
            self._occupy(1)
            self._start_episode()

    # ---- workers (worker mode): admission, heartbeat, shard writer ----------------------
    def _start_worker(self, w: _Worker) -> None:
        """The worker beats ``in_flight = G + its unflushed trajectories`` and starts a group."""
        hb = self.G * (1 + len(w.buf))
        self.hb_total += hb - w.hb
        w.hb = hb
        self._open_group()
        self.open.worker = w
        self._occupy(self.G)
        self._start_group()

    def _worker_check(self, w: _Worker) -> None:
        """The worker's admission check (its loop top, or a poll while refused)."""
        if self._admit_new_group():
            self._start_worker(w)
            return
        self._flush(w)                 # refused: let the trainer have what it holds ...
        self.hb_total -= w.hb          # ... and beat in_flight = 0
        w.hb = 0
        if self.worker_poll > 0:
            self.env.timeout(self.worker_poll).callbacks.append(lambda _e, w=w: self._worker_check(w))
        else:
            self.waiting.append(w)

    def _flush(self, w: _Worker) -> None:
        if not w.buf:
            return
        self.ready.append(w.buf)
        self.ready_n += len(w.buf)
        w.buf = []
        if self._waiter is not None:
            self._waiter.succeed()
            self._waiter = None

    def _group_ended(self, g: _Group) -> None:
        """``neon_hpc.rollout.worker``: add the group to the writer (a shard is published when
        the buffer reaches ``flush_trajectories`` or its oldest is ``flush_seconds`` old), flush
        anyway while ready/ holds less than one step, then go back to the admission check."""
        w = g.worker
        if not w.buf:
            w.buf_first = self.env._now
        w.buf.append(g)
        p = self.p
        if (len(w.buf) * self.G >= self.flush_at
                or (p.flush_seconds > 0 and self.env._now - w.buf_first >= p.flush_seconds)
                or self.ready_n * self.G < p.trajectories_per_step):
            self._flush(w)

    def _occupy(self, n: int) -> None:
        self.idle_slots -= n
        self.occ_start_sum += n * self.env._now

    def _vacate(self, n: int, t_start: float) -> None:
        self.idle_slots += n
        self.occ_start_sum -= n * t_start
        self.busy_s += n * (self.env._now - t_start)

    def _open_group(self) -> None:
        v = self.version
        self.open = _Group(self.G, v, self.batch_index, self.env._now)
        self.open_left = self.G
        self.groups_started += 1
        self.groups_open += 1
        if self.abort_stale:
            self.inflight_groups[id(self.open)] = self.open
        if self.batch_mode:
            self.quota -= self.G
        if self.track_oldest:
            if self._vmin_count[v] == 0:
                heapq.heappush(self._vmin_heap, v)
            self._vmin_count[v] += 1

    def _start_episode(self) -> None:
        # the hot path (one call per simulated episode): locals, no helper calls
        i = self._buf_i
        if i >= self.CHUNK:
            self._refill()
            i = 0
        self._buf_i = i + 1
        decode, fixed, seq, last_frac = self._buf[i]
        f = self._stall_table[int(self.in_flight * self._stall_scale + 0.5)]
        self.stall_sum += f
        dur = decode / (1.0 - f) + fixed
        self.open_left -= 1
        self.in_flight += 1
        self.started += 1
        env = self.env
        now = env._now
        ev = simpy.Event(env)
        ev._ok = True
        ev._value = (self.open, now, dur, seq, last_frac)
        ev.callbacks.append(self._finish)
        env.schedule(ev, delay=dur)

    def _start_group(self) -> None:
        """Worker mode: only the group's end matters (its slots free together), so a group
        is one event lasting as long as its slowest episode."""
        G = self.G
        f = self._stall_table[int(self.in_flight * self._stall_scale + 0.5)]
        self.stall_sum += f * G
        slow = 1.0 / (1.0 - f)
        i = self._gbuf_i
        if i >= len(self._gbuf):
            self._refill_groups()
            i = 0
        self._gbuf_i = i + 1
        d1, f1, d2, f2, last1, seqs = self._gbuf[i]
        # slowest episode under the stall: the upper envelope of d*slow + f over the group,
        # taken from its two candidates (slowest at no stall, most decode-bound)
        longest = max(d1 * slow + f1, d2 * slow + f2)
        g = self.open
        g.lengths = seqs
        self.open_left = 0
        self.in_flight += G
        self.started += G
        env = self.env
        ev = simpy.Event(env)
        ev._ok = True
        ev._value = (g, env._now + last1 * longest / max(d1 + f1, 1e-12))
        ev.callbacks.append(self._finish_group)
        env.schedule(ev, delay=longest)

    def _refill_groups(self) -> None:
        G = self.G
        n = max(1, self.CHUNK // G)
        ep = sample_episodes(self.p, n * G, self.rng)
        d = ep.decode_s.reshape(n, G)
        fx = ep.fixed_s.reshape(n, G)
        rows = np.arange(n)
        j1 = np.argmax(d + fx, axis=1)
        j2 = np.argmax(d, axis=1)
        last = (d + fx) * (1.0 - ep.last_turn_frac.reshape(n, G))
        self._gbuf = list(zip(d[rows, j1].tolist(), fx[rows, j1].tolist(), d[rows, j2].tolist(),
                              fx[rows, j2].tolist(), last.max(axis=1).tolist(), ep.seq_len.reshape(n, G).tolist()))

    def _finish_group(self, ev: simpy.Event) -> None:
        g, t_last_turn = ev._value
        if g.aborted:                 # its slots were freed when it was aborted
            return
        if self.abort_stale:
            del self.inflight_groups[id(g)]
        self.in_flight -= self.G
        if not self.batch_mode and self.load_times:   # in place: the last token saw the newest version
            g.vmax = max(g.vmax, self.version if self.in_place else self._version_at(t_last_turn))
        g.remaining = 0
        self._group_done(g)
        self._worker_check(g.worker)
        self._fill()

    def _version_at(self, t: float) -> int:
        i = bisect.bisect_right(self.load_times, t)
        return self.load_versions[i - 1] if i else 0

    def _refill(self) -> None:
        ep = sample_episodes(self.p, self.CHUNK, self.rng)
        self._buf = list(zip(ep.decode_s.tolist(), ep.fixed_s.tolist(), ep.seq_len.tolist(),
                             ep.last_turn_frac.tolist()))

    def _finish(self, ev: simpy.Event) -> None:
        g, t0, dur, seq, last_frac = ev._value
        self.in_flight -= 1
        if not self.worker_mode:
            self._vacate(1, t0)
        g.lengths.append(seq)
        if not self.batch_mode and self.load_times:   # in-flight updates: the last turn ran on the newest version then
            v_last = self.version if self.in_place else self._version_at(self.env._now - dur * last_frac)
            if v_last > g.vmax:
                g.vmax = v_last
        g.remaining -= 1
        if g.remaining == 0:
            self._group_done(g)
        self._fill()

    def _group_done(self, g: _Group) -> None:
        self.groups_open -= 1
        if self.worker_mode:
            self._vacate(self.G, g.t_start)
        if self.batch_mode:
            self.batch_done += 1
            if self.batch_done == self.need and self._batch_event is not None:
                self._batch_event.succeed()
        if self.eager_drop and self._stale(g):
            self._discard(g)
            return
        if self.worker_mode:
            self._group_ended(g)
            return
        self.ready.append([g])
        self.ready_n += 1
        if self._waiter is not None:
            self._waiter.succeed()
            self._waiter = None

    def _stale(self, g: _Group) -> bool:
        """Nothing of ``g`` can train: its oldest (drop) or newest (mask) version is over the bound."""
        return not self.batch_mode and self.step - (g.vmax if self.mask else g.vmin) > self.p.max_staleness

    def _release(self, g: _Group) -> None:
        if self.track_oldest:
            self._vmin_count[g.vmin] -= 1

    def _discard(self, g: _Group) -> None:
        self._release(g)
        self.dropped += len(g.lengths)
        t = float(sum(g.lengths))
        self.claimed_tokens += t
        self.dropped_tokens += t

    def _abort_stale_inflight(self) -> None:
        """``abort_stale``: a group already beyond the bound can never be trained on; stop it
        now and give its worker back instead of letting it run to the end (worker mode)."""
        if not self.abort_stale or self.mask:   # masked: a running group's next tokens are fresh
            return
        for key, g in list(self.inflight_groups.items()):
            if self._stale(g):
                del self.inflight_groups[key]
                g.aborted = True
                self.in_flight -= self.G
                self.groups_open -= 1
                self._vacate(self.G, g.t_start)
                self._discard(g)
                self.aborted_groups += 1
                self._worker_check(g.worker)

    def _purge_stale_ready(self) -> None:
        """``abort_stale`` only: drop stale published data at once (the store drops it when a
        claim takes it, so without this it counts against admission until then)."""
        if self.batch_mode or not self.ready or not self.eager_drop:
            return
        keep: deque[list[_Group]] = deque()
        for shard in self.ready:
            live = []
            for g in shard:
                if self._stale(g):
                    self._discard(g)
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
        k = len(self.step_end)
        return max(1, math.floor((k + 1) * per_step + 0.5) - math.floor(k * per_step + 0.5))

    def _take(self, batch: list[_Group], need: int) -> None:
        """``neon_hpc.store.claim_step``: whole shards in publish order until ``need`` groups
        are kept; stale ones are dropped as they are taken."""
        while self.ready and len(batch) < need:
            shard = self.ready.popleft()
            self.ready_n -= len(shard)
            for g in shard:
                if self._stale(g):
                    self._discard(g)
                else:
                    self._release(g)
                    batch.append(g)

    def _take_batch(self):
        batch: list[_Group] = []
        t0 = self.env.now
        need = self._need_now()
        poll = self.p.claim_poll_s
        self._take(batch, need)
        while len(batch) < need:
            self._starved = True
            self._fill()                # a starved trainer lifts the 'oldest' admission rule
            if poll > 0:                # the claim looks at ready/ again after a poll
                yield self.env.timeout(poll)
            else:
                self._waiter = self.env.event()
                yield self._waiter
            self._take(batch, need)
        self._starved = False
        self.wait_s += self.env.now - t0
        self.step_wait.append(self.env.now - t0)
        return batch

    def _trainer(self):
        env, p = self.env, self.p
        publish_s = p.publish_s
        for _ in range(p.steps):
            batch = yield from self._take_batch()
            # the trainer has its data (heartbeat phase 'training'): its next claim trains this
            # step's version, one more than the one it trains now
            self.trains = self.step + 1
            self._fill()                # consuming frees backpressure (polling workers see it themselves)
            self._account(batch)
            k = len(self.step_end)
            if p.step_seconds:          # a measured run's own step times, in order
                compute = float(p.step_seconds[k % len(p.step_seconds)])
            else:
                lengths = np.array(list(itertools.chain.from_iterable(g.lengths for g in batch)), dtype=np.float64)
                compute = self.step_model.step_seconds(lengths)
            after = float(p.after_publish_seconds[k % len(p.after_publish_seconds)]) if p.after_publish_seconds else 0.0
            self.step_compute.append(compute + after)
            self.compute_s += compute + after
            yield env.timeout(compute)
            if p.publish_blocks_trainer:
                yield env.timeout(publish_s)
                self.publish_s += publish_s
                self.step += 1
                self._published(self.step)
            else:
                self.step += 1
                env.timeout(publish_s, value=self.step).callbacks.append(lambda e: self._published(e.value))
            if after > 0:
                yield env.timeout(after)
            self.step_end.append(env.now)
            self.step_busy.append(self._busy_until(env.now))
            self._abort_stale_inflight()
            self._purge_stale_ready()
            self._fill()

    def _account(self, batch: list[_Group]) -> None:
        n_step, tok_step, max_step = 0, 0.0, 0
        step, lo_ok = self.step, self.step - self.p.max_staleness
        for g in batch:
            n = len(g.lengths)
            self.consumed += n
            span = g.vmax - g.vmin + 1
            tokens = float(sum(g.lengths))
            self.claimed_tokens += tokens
            lo = g.vmin
            if not self.batch_mode and self.mask and g.vmin < lo_ok:   # masked versions vmin..lo_ok-1
                lo = lo_ok
                self.masked_tokens += tokens * (lo_ok - g.vmin) / span
            per_version = tokens / span
            for v in range(lo, g.vmax + 1):
                self.token_staleness[step - v] += per_version
            self.staleness[step - lo] += n
            tok = n * (step - 0.5 * (lo + g.vmax))
            self.token_staleness_sum += tok
            self.spanned_sum += n * span
            n_step, tok_step, max_step = n_step + n, tok_step + tok, max(max_step, step - lo)
        self.step_staleness.append((n_step, tok_step, max_step))

    def _busy_until(self, t: float) -> float:
        occupied = self.p.rollout_slots - self.idle_slots
        return self.busy_s + occupied * t - self.occ_start_sum

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
        self._fill()

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
            self._fill()
            yield self._batch_event
            self.rollout_phase_s += env.now - t0
            k += 1

    # ---- run --------------------------------------------------------------------------
    def run(self) -> SimResult:
        t_start = time.perf_counter()
        env = self.env
        trainer = env.process(self._trainer())
        if self.batch_mode:
            env.process(self._batches())
        elif self.worker_poll > 0:      # every worker starts with its own admission check
            while self.waiting:
                self._worker_check(self.waiting.popleft())
        else:
            self._fill()
        env.run(until=trainer)
        end = env.now
        busy = self._busy_until(end)
        return SimResult(
            policy=self.p.policy, steps=self.p.steps, wall_s=end, compute_s=self.compute_s,
            publish_s=self.publish_s, wait_s=self.wait_s, rollout_busy_s=busy,
            slots=self.p.rollout_slots, consumed=self.consumed, dropped=self.dropped,
            started=self.started, staleness=self.staleness, step_compute_s=self.step_compute,
            step_end_s=self.step_end, step_wait_s=self.step_wait, step_busy_s=self.step_busy,
            step_staleness=self.step_staleness, rollout_phase_s=self.rollout_phase_s,
            versions_spanned_mean=self.spanned_sum / self.consumed if self.consumed else 1.0,
            staleness_token_mean=self.token_staleness_sum / self.consumed if self.consumed else 0.0,
            engine_stall_mean=self.stall_sum / self.started if self.started else 0.0,
            engine_stall_full=self.stall.at_full, aborted=self.aborted_groups * self.G, step_time_source=self.step_model.source,
            sim_seconds=time.perf_counter() - t_start, claimed_tokens=self.claimed_tokens,
            masked_tokens=self.masked_tokens, dropped_tokens=self.dropped_tokens, token_staleness=self.token_staleness)


def simulate(p: SimParams, step_model: StepTimeModel | None = None) -> SimResult:
    """Simulate ``p.steps`` trainer steps of one configuration and policy."""
    if p.rollout_slots < 1:
        raise ValueError("rollout_slots must be >= 1 (concurrent episodes over all engines)")
    return _Sim(p, step_model).run()
