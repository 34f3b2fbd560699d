"""Rollout slot policies of the simulation (``SimParams.slot_mode``): who starts work, and when.

* :class:`WorkerSlots` (``worker``, like ``neon_hpc.rollout.worker``): a worker holds ``G``
  slots and starts its next group only when its whole group is done (a long episode keeps its
  siblings' slots idle). A group is one event lasting as long as its slowest episode. It also
  models the worker's process: its admission check (at its loop top, then every
  ``admission_poll_s`` while refused), its heartbeat (``in_flight`` = ``G`` + its unpublished
  trajectories, beaten at group start; 0 while refused), its shard writer (``_group_ended``)
  and ``abort_stale``.
* :class:`QueuedWorkerSlots` (``worker`` with more episodes in flight than the engines'
  request slots, ``rollout_slots > engine_slots``): the workers as above, but a group's ``G``
  episodes are requests that wait in the engines' queue (FIFO, as SGLang's beyond
  ``--max-running-requests`` and the embedded scheduler's) until a request slot is free; one
  event per episode, a slot held from its start to its end (tool calls included). A straggler
  then holds one request slot, not its whole group's.
* :class:`EpisodeSlots` (``episode``, an engine-level request pool): each slot starts a new
  episode as soon as its own finishes; one event per episode.

Decode speed and the engine's batch (``decode_kv_ratio`` k): an episode's decode time is
scaled, at its start (mean field, like the stall), by ``(1 + k * b/B) / (1 + k)`` with
``b/B`` the share of the engines' request slots running: measured in queue and episode modes;
in worker mode without a queue, the slots held times ``E[episode] / E[slowest of a group]``
(the share of a held group's slots with a request still running, from the workload).

Engine pauses (``pause_on_load`` with ``in_place`` updates): every weight load pauses the
engines for ``weight_load_s`` (SGLang's ``pause_generation(in_place)`` around the load). An
event's end is not known in advance, so it is lazy: when a group (episode) is due, the pause
seconds begun since its start, times its decode share (a tool call runs through a pause),
push its end back, until no new pause began meanwhile.

Both ask the simulation (:class:`neon_hpc.plan.sim.Sim`) whether a new group may start
(admission), open groups there, and hand finished groups back to it; the books are kept in
:mod:`neon_hpc.plan.accounting`.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import simpy

from neon_hpc.plan.workload import EngineStall, sample_episodes

if TYPE_CHECKING:
    from neon_hpc.plan.sim import Sim

CHUNK = 8192        # episodes sampled at a time


class Group:
    """One task's group of ``size`` episodes, from its start to its shard (the unit the
    simulator and the slot models hand each other)."""

    __slots__ = ("remaining", "vmin", "vmax", "lengths", "batch", "t_start", "aborted", "worker", "mark", "share",
                 "unstarted")

    def __init__(self, size: int, version: int, batch: int, t_start: float):
        self.t_start = t_start
        self.aborted = False
        self.worker: _Worker | None = None
        self.remaining = size
        self.vmin = version
        self.vmax = version
        self.lengths: list[float] = []
        self.batch = batch
        self.mark = 0.0                 # engine pause seconds begun when it (last) got its end time
        self.share = 1.0                # the share of its slowest episode spent decoding (paused by a load)
        self.unstarted = 0              # queue mode: episodes still waiting for an engine slot


class _Worker:
    """One rollout worker (worker mode): its writer's unpublished groups and its heartbeat."""
    __slots__ = ("buf", "buf_first", "hb")

    def __init__(self) -> None:
        self.buf: list[Group] = []     # finished groups not yet published as a shard
        self.buf_first = 0.0            # when the oldest of them was added
        self.hb = 0                     # in_flight of its last heartbeat (trajectories)


class _Slots:
    def __init__(self, sim: "Sim"):
        self.sim = sim
        self.in_flight = 0              # episodes running
        self._stall_table = sim.stall.table_list
        self._stall_scale = (EngineStall.LEVELS - 1) / sim.p.request_slots
        self._speed = decode_speed_table(sim.p)

    def start(self) -> None:            # the run begins
        self.fill()

    def abort_stale_inflight(self) -> None:   # only workers abort
        pass

    def _episode_rows(self) -> list[tuple[float, float, float, float]]:
        """The next :data:`CHUNK` episodes (one event each): decode s, fixed s, length, last turn's share."""
        ep = sample_episodes(self.sim.p, CHUNK, self.sim.rng)
        return list(zip(ep.decode_s.tolist(), ep.fixed_s.tolist(), ep.seq_len.tolist(), ep.last_turn_frac.tolist()))

    def _episode_ended(self, ev: simpy.Event) -> "Group | None":
        """One episode's end event (value, a list: group, start, duration, length, last turn's
        share, pause mark, decode share). Pushed back by the in-place pauses begun while it ran
        (None: an event with the same value, its duration and mark updated, is due later), else it leaves
        its request slot and its group takes its length and, with in-flight updates, its newest
        version (the last turn ran on it); returns the group."""
        v = ev._value
        sim = self.sim
        if sim.pause_begun > v[5] and sim.pause_s > 0:   # paused by in-place weight loads meanwhile
            owed = (sim.pause_begun - v[5]) * v[6]
            v[2] += owed
            v[5] = sim.pause_begun
            ev2 = simpy.Event(sim.env)
            ev2._ok = True
            ev2._value = v
            ev2.callbacks.append(self._finish)
            sim.env.schedule(ev2, delay=owed)
            return None
        g, t0, dur, seq, last_frac = v[0], v[1], v[2], v[3], v[4]
        self.in_flight -= 1
        sim.occ.vacate(1, t0, sim.env._now)
        g.lengths.append(seq)
        if not sim.batch_mode and sim.load_times:
            v_last = sim.version if sim.in_place else sim.version_at(sim.env._now - dur * last_frac)
            if v_last > g.vmax:
                g.vmax = v_last
        g.remaining -= 1
        return g


def decode_speed_table(p) -> list[float]:
    """Decode-time factor per occupancy level of :class:`EngineStall`'s table (0..1 of
    ``p.request_slots``): ``(1 + k * b/B) / (1 + k)``, ``b/B`` the engines' batch fill."""
    k = p.decode_kv_ratio
    levels = np.linspace(0.0, 1.0, EngineStall.LEVELS)
    if k <= 0:
        return [1.0] * len(levels)
    cap = p.request_slots
    running = 1.0
    if p.slot_mode == "worker" and not p.queued:   # a held group's slots: how many still run a request
        G = max(p.group_size, 1)
        ep = sample_episodes(p, max(G, 8192 // G * G), np.random.default_rng(p.seed + 3))
        d = (ep.decode_s + ep.fixed_s).reshape(-1, G)
        running = float(d.mean() / max(d.max(axis=1).mean(), 1e-12))
    fill = np.minimum(1.0, levels * cap * running / max(p.engine_slots or cap, 1))
    return ((1.0 + k * fill) / (1.0 + k)).tolist()


class WorkerSlots(_Slots):
    def __init__(self, sim: "Sim"):
        super().__init__(sim)
        p, G = sim.p, sim.G
        if p.rollout_slots < G:
            raise ValueError(f"slot_mode 'worker' needs rollout_slots ({p.rollout_slots}) >= group_size ({G})")
        self.flush_at = max(p.flush_trajectories, 0)
        self.poll = p.admission_poll_s if not sim.batch_mode else 0.0
        self.workers = [_Worker() for _ in range(p.rollout_slots // G)]
        self.waiting: deque[_Worker] = deque(self.workers)   # idle workers refused by admission
        self.hb_total = 0                   # sum of the workers' heartbeat in_flight
        self.inflight_groups: dict[int, Group] = {}   # abort_stale: groups running
        self.aborted_groups = 0
        self._gbuf: list = []
        self._gbuf_i = 0

    def in_flight_beaten(self) -> int:
        """In flight as admission reads it: what the workers' heartbeats say."""
        return self.hb_total

    def start(self) -> None:
        if self.poll > 0:      # every worker starts with its own admission check
            while self.waiting:
                self._worker_check(self.waiting.popleft())
        else:
            self.fill()

    def fill(self) -> None:
        """A worker (G slots) runs one whole group at a time."""
        if self.poll > 0:   # refused workers re-check on their own polls
            return
        sim = self.sim
        while self.waiting and sim.admit_new_group():
            self._start_worker(self.waiting.popleft())

    def _start_worker(self, w: _Worker) -> None:
        """The worker beats ``in_flight = G + its unflushed trajectories`` and starts a group."""
        sim = self.sim
        hb = sim.G * (1 + len(w.buf))
        self.hb_total += hb - w.hb
        w.hb = hb
        g = sim.open_group()
        if sim.abort_stale:
            self.inflight_groups[id(g)] = g
        g.worker = w
        self._start_group(g)

    def _worker_check(self, w: _Worker) -> None:
        """The worker's admission check (its loop top, or a poll while refused)."""
        sim = self.sim
        if sim.admit_new_group():
            self._start_worker(w)
            return
        self._flush(w)                 # refused: let the trainer have what it holds ...
        self.hb_total -= w.hb          # ... and beat in_flight = 0
        w.hb = 0
        if self.poll > 0:
            sim.env.timeout(self.poll).callbacks.append(lambda _e, w=w: self._worker_check(w))
        else:
            self.waiting.append(w)

    def _flush(self, w: _Worker) -> None:
        if not w.buf:
            return
        self.sim.publish_shard(w.buf)
        w.buf = []

    def group_done(self, g: Group) -> None:
        """``neon_hpc.rollout.worker``: add the group to the writer (a shard is published when
        the buffer reaches ``flush_trajectories`` or its oldest is ``flush_seconds`` old), flush
        anyway while ready/ holds less than one step, then go back to the admission check."""
        sim = self.sim
        w = g.worker
        if not w.buf:
            w.buf_first = sim.env._now
        w.buf.append(g)
        p = sim.p
        if (len(w.buf) * sim.G >= self.flush_at
                or (p.flush_seconds > 0 and sim.env._now - w.buf_first >= p.flush_seconds)
                or sim.ready_n * sim.G < p.trajectories_per_step):
            self._flush(w)

    def _start_group(self, g: Group) -> None:
        """Only the group's end matters (its slots free together), so a group is one event
        lasting as long as its slowest episode."""
        sim = self.sim
        G = sim.G
        sim.occ.occupy(G, sim.env._now)
        level = int(self.in_flight * self._stall_scale + 0.5)
        f = self._stall_table[level]
        sim.acc.stall_sum += f * G
        slow = self._speed[level] / (1.0 - f)
        i = self._gbuf_i
        if i >= len(self._gbuf):
            self._refill_groups()
            i = 0
        self._gbuf_i = i + 1
        d1, f1, d2, f2, last1, seqs = self._gbuf[i]
        # slowest episode under the stall: the upper envelope of d*slow + f over the group,
        # taken from its two candidates (slowest at no stall, most decode-bound)
        longest = max(d1 * slow + f1, d2 * slow + f2)
        if sim.pause_s > 0:             # a load pauses its decoding, not its tool calls
            d = d1 * slow if d1 * slow + f1 >= d2 * slow + f2 else d2 * slow
            g.share, g.mark = d / max(longest, 1e-12), sim.pause_begun
        g.lengths = seqs
        sim.open_left = 0
        self.in_flight += G
        sim.acc.started += G
        env = sim.env
        ev = simpy.Event(env)
        ev._ok = True
        ev._value = (g, env._now + last1 * longest / max(d1 + f1, 1e-12))
        ev.callbacks.append(self._finish_group)
        env.schedule(ev, delay=longest)

    def _refill_groups(self) -> None:
        sim = self.sim
        G = sim.G
        n = max(1, CHUNK // G)
        ep = sample_episodes(sim.p, n * G, sim.rng)
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
        sim = self.sim
        if sim.pause_s > 0 and sim.pause_begun > g.mark:
            # the engines paused (in-place weight loads) while it ran: it ends that much later
            owed = (sim.pause_begun - g.mark) * g.share
            g.mark = sim.pause_begun
            ev2 = simpy.Event(sim.env)
            ev2._ok = True
            ev2._value = (g, t_last_turn + owed)
            ev2.callbacks.append(self._finish_group)
            sim.env.schedule(ev2, delay=owed)
            return
        if sim.abort_stale:
            del self.inflight_groups[id(g)]
        self.in_flight -= sim.G
        if not sim.batch_mode and sim.load_times:   # in place: the last token saw the newest version
            g.vmax = max(g.vmax, sim.version if sim.in_place else sim.version_at(t_last_turn))
        g.remaining = 0
        sim.occ.vacate(sim.G, g.t_start, sim.env._now)
        self._group_end(g)

    def _group_end(self, g: Group) -> None:
        sim = self.sim
        sim.groups_open -= 1
        sim.group_done(g)
        self._worker_check(g.worker)
        sim.fill()

    def abort_stale_inflight(self) -> None:
        """``abort_stale``: a group already beyond the bound can never be trained on; stop it
        now and give its worker back instead of letting it run to the end."""
        sim = self.sim
        if not sim.abort_stale or sim.mask:   # masked: a running group's next tokens are fresh
            return
        for key, g in list(self.inflight_groups.items()):
            if sim.is_stale(g):
                del self.inflight_groups[key]
                g.aborted = True
                self.in_flight -= sim.G
                sim.groups_open -= 1
                sim.occ.vacate(sim.G, g.t_start, sim.env._now)
                sim.discard(g)
                self.aborted_groups += 1
                self._worker_check(g.worker)


class QueuedWorkerSlots(WorkerSlots):
    """Workers whose episodes outnumber the engines' request slots: the rest wait in the
    engines' FIFO queue. Workers, heartbeats, admission and the shard writer as in
    :class:`WorkerSlots`; a request slot is held per episode."""

    def __init__(self, sim: "Sim"):
        super().__init__(sim)
        if sim.abort_stale:
            raise ValueError("abort_stale is not modelled when the workers' episodes (rollout_slots) exceed the "
                             "engines' request slots (engine_slots): lower rollout.num_workers or turn it off")
        self.queue: deque[Group] = deque()     # groups with episodes waiting for a request slot
        self._ebuf: list = []
        self._ebuf_i = CHUNK

    def _start_group(self, g: Group) -> None:
        sim = self.sim
        g.unstarted = sim.G
        sim.open_left = 0
        sim.acc.started += sim.G
        self.queue.append(g)
        self._dispatch()

    def _dispatch(self) -> None:
        """Free request slots take the queue's next episodes, oldest group first."""
        sim, occ, q = self.sim, self.sim.occ, self.queue
        while occ.idle > 0 and q:
            g = q[0]
            if g.unstarted == sim.G and not sim.track_oldest:
                g.vmin = g.vmax = sim.version    # its first token: the engines' version when it starts
            g.unstarted -= 1
            if g.unstarted == 0:
                q.popleft()
            occ.occupy(1, sim.env._now)
            self._start_episode(g)

    def _start_episode(self, g: Group) -> None:
        """One episode starts: its duration under the engines' stall and batch at this occupancy."""
        sim = self.sim
        i = self._ebuf_i
        if i >= CHUNK:
            self._ebuf = self._episode_rows()
            i = 0
        self._ebuf_i = i + 1
        decode, fixed, seq, last_frac = self._ebuf[i]
        level = int(self.in_flight * self._stall_scale + 0.5)
        f = self._stall_table[level]
        sim.acc.stall_sum += f
        d = decode * self._speed[level] / (1.0 - f)
        dur = d + fixed
        self.in_flight += 1
        env = sim.env
        ev = simpy.Event(env)
        ev._ok = True
        ev._value = [g, env._now, dur, seq, last_frac, sim.pause_begun, d / dur if dur > 0 else 1.0]
        ev.callbacks.append(self._finish)
        env.schedule(ev, delay=dur)

    def _finish(self, ev: simpy.Event) -> None:
        g = self._episode_ended(ev)
        if g is None:
            return
        if g.remaining == 0:
            self._group_end(g)
        self._dispatch()


class EpisodeSlots(_Slots):
    def __init__(self, sim: "Sim"):
        super().__init__(sim)
        if sim.abort_stale:
            raise ValueError("abort_stale is modelled for slot_mode 'worker' only (one event per group)")
        self._buf: list = []
        self._buf_i = CHUNK
        self.aborted_groups = 0

    def in_flight_beaten(self) -> int:
        """In flight as admission reads it: the groups running (no heartbeats here)."""
        return self.sim.groups_open * self.sim.G

    def fill(self) -> None:
        sim, occ = self.sim, self.sim.occ
        while occ.idle > 0:
            if sim.open_left == 0:
                if not sim.admit_new_group():
                    return
                sim.open_group()
            occ.occupy(1, sim.env._now)
            self._start_episode()

    def group_done(self, g: Group) -> None:
        self.sim.publish_shard([g])

    def _start_episode(self) -> None:
        # the hot path (one call per simulated episode): locals, no helper calls
        sim = self.sim
        i = self._buf_i
        if i >= CHUNK:
            self._refill()
            i = 0
        self._buf_i = i + 1
        decode, fixed, seq, last_frac = self._buf[i]
        level = int(self.in_flight * self._stall_scale + 0.5)
        f = self._stall_table[level]
        acc = sim.acc
        acc.stall_sum += f
        decode = decode * self._speed[level] / (1.0 - f)
        dur = decode + fixed
        sim.open_left -= 1
        self.in_flight += 1
        acc.started += 1
        env = sim.env
        now = env._now
        ev = simpy.Event(env)
        ev._ok = True
        ev._value = [sim.open, now, dur, seq, last_frac, sim.pause_begun, decode / dur if dur > 0 else 1.0]
        ev.callbacks.append(self._finish)
        env.schedule(ev, delay=dur)

    def _refill(self) -> None:
        self._buf = self._episode_rows()

    def _finish(self, ev: simpy.Event) -> None:
        g = self._episode_ended(ev)
        if g is None:
            return
        if g.remaining == 0:
            self.sim.groups_open -= 1
            self.sim.group_done(g)
        self.sim.fill()
