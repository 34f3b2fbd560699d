"""The episode journal: unfinished episodes saved at every turn boundary, resumed where they stopped.

A rollout worker writes one record per episode (``journal/w<worker>/<group>/e<i>.jrec``, the
format :mod:`neon_hpc.protocol.journal`'s) at the start of every turn and once more when the
episode ends, replacing the previous one atomically. A record holds what the episode needs to
go on exactly: the task, its GRPO group and the uid it started with, the token ledger (tokens,
loss mask, behaviour logprobs, per-token weight versions, turn offsets), the routed experts
already received (the delta replay cache), the environment's state, the sampling seed's
position, the turn count, the counters and the model's texts so far. The whole group stays
journalled (its finished episodes too) until the shard holding its trajectories is committed;
then its directory is removed.

A worker that starts resumes its predecessor's groups (the same worker index: its own directory;
a run restarted with fewer workers adopts the missing indices' groups, moved by rename, so two
workers never resume the same episode) before it admits new ones. A resumed episode re-sends its
tokens so far (the engine prefills them under its current weights); the recorded tokens keep
their logprobs, versions and routes (the route cache's rows are pinned; the next request asks
for routes from the resume point on). A record that cannot be read back (truncated, torn,
altered, or its task gone) is moved to ``journal/quarantine/`` with a reason file naming it;
the other episodes resume.

Environments: one with ``snapshot()``/``restore(state)`` (:mod:`neon_hpc.envs.base`) is saved
and restored; any other gets its recorded tool calls replayed in order (said in its registry
line, ``neon-hpc env list``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from neon_hpc.envs.base import can_snapshot
from neon_hpc.protocol.journal import JournalCorrupt, JournalRecord, is_record, read_record, write_encoded
from neon_hpc.protocol.rundir import REASON_SUFFIX, RunDir, atomic_write_text
from neon_hpc.rollout.agent.episode import Episode, EpisodeStopped
from neon_hpc.rollout.agent.parse import ToolCall, parse_action

SCHEMA = 2                     # the record's fields (the file format has its own version)
_OWNER_RE = re.compile(r"^w(\d+)$")


def owner_name(worker: int) -> str:
    """The journal directory of rollout worker ``worker`` (one per worker index, run-wide)."""
    return f"w{worker}"


@dataclass(frozen=True)
class Slot:
    """Where an episode belongs: its uid (given at its start, kept across resumes), group, index."""

    uid: str
    group_id: str
    index: int
    group_size: int
    task_id: str


# --- one episode <-> one record -------------------------------------------------------------
def episode_record(ep: Episode, slot: Slot) -> JournalRecord:
    led, cache = ep.ledger, ep.conv.cache
    env_state = ep.env.snapshot() if can_snapshot(ep.env) else None
    meta = {"schema": SCHEMA, "uid": slot.uid, "group_id": slot.group_id, "index": slot.index,
            "group_size": slot.group_size, "task_id": slot.task_id, "done": ep.done, "turn": ep.turn,
            "started": ep.started, "finish": ep.finish, "answer_text": ep.answer_text, "seed": ep.seed,
            "texts": list(ep.texts), "counts": vars(ep.counts), "timings": dict(ep.timings),
            "env_state": env_state, "resumes": ep.resumes,
            "replay": {"mode": ep.conv.mode, "retries": ep.conv.retries, "last_start": ep.conv.last_start,
                       "stats": cache.stats.as_dict(), "force_full": cache._force_full, "pinned": cache.pinned},
            "tokens": len(led.tokens), "gen_tokens": int(sum(led.loss_mask)),
            "version_min": min((v for v, m in zip(led.versions, led.loss_mask) if m), default=None),
            "written": time.time()}
    arrays = {"tokens": np.asarray(led.tokens, np.int32), "loss_mask": np.asarray(led.loss_mask, np.uint8),
              "logprobs": np.asarray(led.logprobs, np.float32), "versions": np.asarray(led.versions, np.int32),
              "turn_offsets": np.asarray(led.turn_offsets, np.int64),
              "cache_tokens": cache.tokens.astype(np.int64), "row_versions": cache.row_versions.astype(np.int64)}
    if cache.routed_experts is not None:
        arrays["routed_experts"] = cache.routed_experts.astype(np.int32)
    return JournalRecord(meta, arrays)


def restore_episode(ep: Episode, rec: JournalRecord) -> Episode:
    """``ep`` (a fresh Episode of the record's task) set to where the record left it."""
    m, a = rec.meta, rec.arrays
    led = ep.ledger
    led.tokens, led.loss_mask = a["tokens"].tolist(), a["loss_mask"].tolist()
    led.logprobs, led.versions = a["logprobs"].tolist(), a["versions"].tolist()
    led.turn_offsets = a["turn_offsets"].tolist()
    ep.done, ep.turn, ep.started, ep.finish = bool(m["done"]), int(m["turn"]), bool(m["started"]), m["finish"]
    ep.answer_text, ep.seed, ep.texts = m["answer_text"], m["seed"], list(m["texts"])
    ep.timings.update(m["timings"])
    ep.resumes = int(m.get("resumes", 0)) + 1
    for k, v in m["counts"].items():
        setattr(ep.counts, k, int(v))
    rp, cache = m["replay"], ep.conv.cache
    ep.conv.retries, ep.conv.last_start = int(rp["retries"]), int(rp["last_start"])
    st = rp["stats"]
    cache.stats.requests, cache.stats.delta_requests = st["requests"], st["delta_requests"]
    cache.stats.full_requests, cache.stats.rows_received = st["full_requests"], st["rows_received"]
    cache.stats.route_bytes, cache.stats.fallbacks = st["route_bytes"], dict(st["fallbacks"])
    cache.tokens, cache.row_versions = a["cache_tokens"], a["row_versions"]
    cache.routed_experts = a.get("routed_experts")
    cache._force_full = bool(rp["force_full"])
    # every row received so far is the router's record of a forward pass that made the recorded
    # tokens: pinned, never replaced by a recompute (the last row is a placeholder, not received)
    cache.pinned = max(0, len(cache.tokens) - 1) if cache.routed_experts is not None else 0
    _restore_env(ep, m)
    return ep


def _restore_env(ep: Episode, m: dict) -> None:
    if can_snapshot(ep.env):
        if m["env_state"] is None:
            raise ValueError("the record holds no environment state, but the environment takes one")
        ep.env.restore(m["env_state"])
        return
    # no snapshot: replay the recorded tool calls in order (their results were already fed back)
    for text in ep.texts[:ep.turn]:
        action = parse_action(text)
        if isinstance(action, ToolCall):
            ep.env.run_tool(action)


# --- a worker's journal ---------------------------------------------------------------------
@dataclass
class Resumable:
    """One journalled group a worker took over: its records (index -> record), and what was lost."""

    group_id: str
    task_id: str
    records: dict[int, JournalRecord]
    path: Any = None


@dataclass
class JournalStats:
    writes: int = 0           # records written
    coalesced: int = 0        # records replaced by a newer one of the same episode before they were written
    bytes: int = 0
    seconds: float = 0.0      # the episodes' time in the journal (encoding, handing over): what slows rollout
    write_s: float = 0.0      # the writer thread's time writing (and fsyncing) records, beside the episodes


class Journal:
    """The journal of one rollout worker: its records, what it resumed, what it may remove.

    An episode encodes its record at the boundary (a consistent copy of its books, ~0.2 ms) and
    hands it to one writer thread, which publishes it (temporary, fsync, rename, ~2-20 ms): the
    episode does not wait for the disk. A newer record of the same episode replaces one not yet
    written. :meth:`drain` waits until every record handed over is on disk (a stop, a commit)."""

    def __init__(self, run: RunDir, worker: int, fsync: bool = True, enabled: bool = True):
        self.run, self.worker, self.fsync, self.enabled = run, worker, fsync, enabled
        self.owner = owner_name(worker)
        self.stats = JournalStats()
        self.uncommitted: list[str] = []      # group ids whose trajectories the writer holds unpublished
        self._cv = threading.Condition()
        self._pending: dict[Any, bytes] = {}
        self._busy = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def write(self, ep: Episode, slot: Slot) -> None:
        if not self.enabled:
            return
        t = time.perf_counter()
        data = episode_record(ep, slot).encode()
        path = self.run.journal_record(self.owner, slot.group_id, slot.index)
        with self._cv:
            if self._error is not None:
                raise RuntimeError(f"the episode journal stopped writing: {self._error}") from self._error
            if path in self._pending:
                self.stats.coalesced += 1
            self._pending[path] = data
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="journal", daemon=True)
                self._thread.start()
            self._cv.notify_all()
            self.stats.seconds += time.perf_counter() - t

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending:
                    self._cv.wait()
                path = next(iter(self._pending))
                data = self._pending.pop(path)
                self._busy = True
            t = time.perf_counter()
            try:
                write_encoded(path, data, self.fsync)
            except BaseException as e:  # noqa: BLE001 - the episodes raise it at their next boundary
                with self._cv:
                    self._error, self._busy = e, False
                    self._cv.notify_all()
                return
            with self._cv:
                self.stats.writes += 1
                self.stats.bytes += len(data)
                self.stats.write_s += time.perf_counter() - t
                self._busy = False
                self._cv.notify_all()

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every record handed over is written; False if ``timeout_s`` passed first."""
        end = time.monotonic() + timeout_s
        with self._cv:
            while (self._pending or self._busy) and self._error is None:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def added(self, group_id: str) -> None:
        """The group's trajectories are in the writer: remove its records once they are committed."""
        self.uncommitted.append(group_id)

    def committed(self) -> int:
        """Call when the writer holds nothing unpublished: every added group's shard is committed,
        so their records go. Returns how many groups were removed."""
        done, self.uncommitted = self.uncommitted, []
        if done:
            self.drain()          # a finished episode's last record must not land after its removal
        for g in done:
            shutil.rmtree(self.run.journal_group(self.owner, g), ignore_errors=True)
        return len(done)

    # --- resume -------------------------------------------------------------------------
    def take_over(self, num_workers: int, log) -> tuple[list[Resumable], list[dict]]:
        """The groups this worker resumes (its own directory's, and those of worker indices the run
        no longer has that fall to it), and the records quarantined (``{path, reason, tokens}``)."""
        if not self.enabled or not self.run.journal.is_dir():
            return [], []
        mine = self.run.journal_owner(self.owner)
        for d in sorted(self.run.journal.iterdir()):
            m = _OWNER_RE.match(d.name)
            if m and int(m.group(1)) >= num_workers and int(m.group(1)) % num_workers == self.worker:
                for g in sorted(p for p in d.iterdir() if p.is_dir()):
                    mine.mkdir(parents=True, exist_ok=True)
                    with contextlib.suppress(OSError):   # another worker's rename won: not ours
                        os.rename(g, mine / g.name)
        if not mine.is_dir():
            return [], []
        groups, bad = [], []
        for g in sorted(p for p in mine.iterdir() if p.is_dir()):
            for tmp in g.glob(".*"):
                tmp.unlink(missing_ok=True)       # a temporary of a write that a stop or kill cut short
            records = {}
            for p in sorted(p for p in g.iterdir() if is_record(p)):
                try:
                    rec = read_record(p)
                    if rec.meta.get("schema") != SCHEMA:
                        raise JournalCorrupt(p, f"record schema {rec.meta.get('schema')}, "
                                                f"this neon-hpc writes {SCHEMA}")
                    records[int(rec.meta["index"])] = rec
                except JournalCorrupt as e:
                    bad.append(self.quarantine(p, e.reason, log))
            if records:
                first = next(iter(records.values())).meta
                groups.append(Resumable(first["group_id"], first["task_id"], records, g))
            else:
                shutil.rmtree(g, ignore_errors=True)
        return groups, bad

    def quarantine_group(self, r: Resumable, reason: str, log) -> list[dict]:
        """Quarantine every record of a group that cannot resume (its task is gone, it does not restore)."""
        out = [self.quarantine(self.run.journal_record(self.owner, r.path.name, i), reason, log,
                               len(rec.arrays["tokens"])) for i, rec in r.records.items()]
        shutil.rmtree(r.path, ignore_errors=True)
        return out

    def quarantine(self, path, reason: str, log, tokens: int | None = None) -> dict:
        """Move one record aside (``journal/quarantine/``) with a reason file; its episode is lost."""
        q = self.run.journal_quarantine
        q.mkdir(parents=True, exist_ok=True)
        dest = q / f"{self.owner}.{path.parent.name}.{path.name}"
        with contextlib.suppress(FileNotFoundError):
            os.replace(path, dest)
        atomic_write_text(dest.with_name(dest.name + REASON_SUFFIX), f"{reason}\n")
        log.error("journal record %s quarantined (%s): its episode is lost, the others resume; moved to %s",
                  path, reason, dest)
        return {"path": str(path), "reason": reason, "tokens": tokens}


# --- running a journalled group -------------------------------------------------------------
@dataclass
class GroupRun:
    """The episodes of one group, each with its slot; :meth:`run` runs the unfinished ones."""

    episodes: list[tuple[Episode, Slot]] = field(default_factory=list)
    resumed: bool = False
    dropped: int = 0          # episodes stopped mid-turn (that turn is dropped; the record is at the boundary before)

    def run(self, journal: Journal, stop_requested: Callable[[], bool], poll_s: float = 0.05) -> list | None:
        """Run every unfinished episode concurrently (daemon threads: the engine batches them);
        returns the episodes when all are done, or None as soon as ``stop_requested()`` is true:
        each episode's record is current at its last turn boundary, the turn in flight is dropped,
        and nobody waits for it."""
        stop = threading.Event()
        errors: list[BaseException] = []
        threads = []
        for ep, slot in self.episodes:
            if ep.done:
                continue
            ep.stop_event = stop
            ep.on_boundary = lambda e, s=slot: journal.write(e, s)
            t = threading.Thread(target=_run_one, args=(ep, errors), daemon=True, name=f"episode-{slot.uid}")
            t.start()
            threads.append(t)
        while any(t.is_alive() for t in threads):
            if stop_requested():
                stop.set()
                self.dropped = sum(t.is_alive() for t in threads)
                return None
            for t in threads:
                t.join(poll_s / max(len(threads), 1))
        if errors:
            raise errors[0]
        return [ep for ep, _ in self.episodes]


def _run_one(ep: Episode, errors: list) -> None:
    try:
        ep.run()
    except EpisodeStopped:
        pass
    except BaseException as e:  # noqa: BLE001 - the worker's main thread re-raises it
        errors.append(e)


def new_group(make_episode: Callable[[], Episode], task_id: str, size: int, uid_of: Callable[[int], str]) -> GroupRun:
    gid = uuid.uuid4().hex[:16]
    return GroupRun([(make_episode(), Slot(uid_of(i), gid, i, size, task_id)) for i in range(size)])


def resumed_group(r: Resumable, make_episode: Callable[[], Episode]) -> GroupRun:
    out = GroupRun(resumed=True)
    for i, rec in sorted(r.records.items()):
        m = rec.meta
        out.episodes.append((restore_episode(make_episode(), rec),
                             Slot(m["uid"], m["group_id"], i, int(m["group_size"]), m["task_id"])))
    return out


def kept_tokens(r: Resumable) -> tuple[int, int]:
    """(tokens, generated tokens) a resumed group brings back."""
    return (sum(len(rec.arrays["tokens"]) for rec in r.records.values()),
            sum(int(rec.arrays["loss_mask"].sum()) for rec in r.records.values()))
