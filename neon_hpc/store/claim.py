"""Claiming shards for a trainer step: exactly once, by rename, resumable after a crash.

Protocol for step N (the README has the full argument)::

    claimed/step_N/               created by renaming a staging dir that already holds OWNER.json
    claimed/step_N/OWNER.json     who is claiming (consumer name, pid, host, time)
    claimed/step_N/<shard>.h5     each moved from ready/ by one rename: whoever's rename
                                  succeeds owns the shard; a losing consumer gets ENOENT
    claimed/step_N/dropped_stale.json   trajectories the consumer's admission dropped (written before ...)
    claimed/step_N/CLAIM.json     ... the commit record, written last, atomically

* CLAIM.json present: the claim is complete; a second call returns exactly the recorded
  trajectories (a restarted trainer re-reads the same data), never touching ready/.
* Directory present without CLAIM.json: a claim crashed half-way. The same consumer rolls
  it forward: the shards already moved in belong to this step and to no other, nothing
  from them was handed out (handing out happens only after the commit), so it validates
  them, claims more from ready/ if needed, and commits.
* No file locks anywhere: rename and mkdir are atomic on POSIX filesystems, NFS, Lustre, GPFS.

The claim is a pipe: it hands trajectories out as written, exactly once.  What a consumer keeps
is its own rule (``admit``: the trainer's stale policy, ``neon_hpc/train/offpolicy.py``), asked
for a :class:`Verdict` on each trajectory read: the claim keeps claiming until ``want`` are kept,
and records the verdicts (dropped ones in ``dropped_stale.json``; ``generated_tokens``,
``masked_stale_tokens``, ``dropped_stale_tokens`` in CLAIM.json) with the rule's own parameters
(``admit.record()``: ``trainer_version``, ``max_staleness``, ``stale_policy``), which a resumed
claim returns as ``ClaimResult.admission``, so the consumer applies the same rule again.

Exactly once by trajectory uid (``metadata["uid"]``, a string): names make shards unique,
not their content, so a valid shard published again under a new name (a copy put back into
ready/, a writer retrying a publish) would train twice.  Every committed claim records the
uids it consumed (``CLAIM.json`` ``uids``); a claim skips a trajectory whose uid a committed
claim of the last ``uid_window_steps`` steps (or this claim itself) already consumed, and
records it (``CLAIM.json`` ``duplicates``, ``ClaimResult.duplicates``).  The window is read
back from those records, so it survives a restart with nothing else to persist.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from neon_hpc.config.protocol import ProtocolConfig
from neon_hpc.config.store import StoreConfig
from neon_hpc.protocol.records import CLAIM_RECORD_NAMES, ClaimOwner, ClaimRecord, DroppedRecord
from neon_hpc.protocol.rundir import (
    CLAIM as CLAIM_FILE,  # noqa: F401
    DROPPED as DROPPED_FILE,  # noqa: F401
    OWNER as OWNER_FILE,
    REASON_SUFFIX,
    RunDir,
    atomic_write_text,
    fsync_dir,
    remove_stale_tmp,
    staging_dir_for,
)
from neon_hpc.store import schema as S
from neon_hpc.store.reader import ShardError, read_shard
from neon_hpc.store.trajectory import Trajectory

log = logging.getLogger("neon_hpc.store")

# CLAIM_FILE, OWNER_FILE, DROPPED_FILE, REASON_SUFFIX: the record names, re-exported from neon_hpc.protocol
# how often a waiting claim looks at ready/ (the trainer passes its config's)
DEFAULT_POLL_S = ProtocolConfig.claim_poll_s
DEFAULT_UID_WINDOW_STEPS = StoreConfig.uid_window_steps
# what a claim records of its admission rule when it has none (CLAIM.json, dropped_stale.json)
NO_ADMISSION = {"trainer_version": None, "max_staleness": None, "stale_policy": "drop"}


@dataclass(frozen=True)
class Verdict:
    """What a consumer's admission rule says of one claimed trajectory."""

    keep: bool
    masked_tokens: int = 0                            # kept: generated tokens it gives loss weight 0
    why: dict = field(default_factory=dict)           # dropped: recorded beside it in dropped_stale.json


class Admission(Protocol):
    """A consumer's rule over the trajectories it claims (the trainer's: ``train/offpolicy.StalePolicy``)."""

    def verdict(self, t: Trajectory) -> Verdict: ...
    def record(self) -> dict: ...                     # its parameters, recorded with the claim (NO_ADMISSION's keys)


class ClaimTimeout(TimeoutError):
    """Not enough trajectories arrived in ready/ before the timeout."""


class ClaimConflict(RuntimeError):
    """Another consumer owns an incomplete claim of this step."""


@dataclass
class ClaimResult:
    step: int
    trajectories: list[Trajectory]
    shards: list[Path]                   # the claimed files, now under claimed/step_N/
    dropped_stale: int                   # trajectories dropped by the staleness filter
    quarantined: list[Path]              # files moved to quarantine/ during this claim
    waited_s: float                      # time spent sleeping for shards to arrive
    claim_s: float = 0.0                 # whole call: waiting, renaming, reading, validating
    resumed: bool = False                # True: read back from a claim committed earlier
    generated_tokens: int = 0            # generated tokens of every trajectory read (kept or dropped)
    masked_stale_tokens: int = 0         # generated tokens of kept trajectories given loss weight 0
    dropped_stale_tokens: int = 0        # generated tokens of the dropped trajectories
    duplicates: int = 0                  # trajectories skipped: their uid was consumed already
    admission: dict = field(default_factory=lambda: dict(NO_ADMISSION))   # the rule the claim recorded

    @property
    def wasted_rollout_tokens(self) -> float:
        """(dropped + masked) generated tokens over all generated tokens read (0 when none)."""
        n = self.generated_tokens
        return (self.masked_stale_tokens + self.dropped_stale_tokens) / n if n else 0.0

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.trajectories)


def _rundir(run_dir) -> RunDir:
    return run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)


def _visible(names: list[str]) -> list[str]:
    return sorted(n for n in names if not n.startswith("."))


def ready_shards(run_dir) -> list[str]:
    """Names in ready/, oldest first (names start with the creation time)."""
    try:
        return _visible(os.listdir(_rundir(run_dir).traj_ready))
    except FileNotFoundError:
        return []


def ready_count(run_dir) -> tuple[int, int]:
    """(shards, trajectories) waiting in ready/, from file names alone (no file is opened)."""
    names = ready_shards(run_dir)
    n = sum(sn.num_trajectories for sn in map(S.parse_shard_name, names) if sn is not None)
    return len(names), n


def claimed_steps(run_dir) -> list[int]:
    """Steps whose claim is committed (CLAIM.json present), ascending."""
    return [s for s, d in _rundir(run_dir).claim_dirs() if ClaimRecord.committed(d)]


def quarantine(run_dir, path: Path, reason: str) -> Path:
    """Move ``path`` into quarantine/ beside ``<name>.reason.txt``; returns the new path.

    The reason is written first: a crash in between leaves a reason file and the shard still
    where it was (so the next claim validates it again and moves it), never a silent shard.
    """
    q = _rundir(run_dir).traj_quarantine
    q.mkdir(parents=True, exist_ok=True)
    dest = q / path.name
    k = 1
    while dest.exists():
        dest, k = q / f"{path.name}.{k}", k + 1
    atomic_write_text(q / f"{dest.name}{REASON_SUFFIX}",
                      f"{reason}\nfrom: {path}\ntime: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
    os.rename(path, dest)
    fsync_dir(q)
    log.warning("quarantined %s: %s", dest, reason)
    return dest


def staleness_stats(trajs: list[Trajectory], trainer_version: int) -> dict:
    """staleness_mean / staleness_max / staleness_hist for the trainer's metrics record."""
    s = [t.staleness(trainer_version) for t in trajs]
    hist: dict[str, int] = {}
    for v in s:
        hist[str(v)] = hist.get(str(v), 0) + 1
    return {"staleness_mean": (sum(s) / len(s)) if s else 0.0, "staleness_max": max(s, default=0),
            "staleness_hist": hist}


def trajectory_uid(t: Trajectory) -> str | None:
    """The run-wide id a producer gave ``t`` (``metadata["uid"]``), or None (not deduplicated)."""
    uid = t.metadata.get("uid") if isinstance(t.metadata, dict) else None
    return uid if isinstance(uid, str) and uid else None


class ConsumedUids:
    """The uids consumed by a run's committed claims, read from their ``CLAIM.json`` once per
    process (a committed record never changes) and kept as one ``uid -> step`` map; a lookup
    applies the window.  A step directory moved aside is forgotten at the next refresh."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps: set[int] = set()
        self.step_of: dict[str, int] = {}
        self._uids: dict[int, list[str]] = {}

    def refresh(self, rd: RunDir, lowest: int) -> None:
        """Load the committed claims of steps >= ``lowest`` not loaded yet; drop the others."""
        try:
            names = os.listdir(rd.traj_claimed)
        except FileNotFoundError:
            names = []
        present = {int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit() and int(n[5:]) >= lowest}
        with self._lock:
            for gone in self.steps - present:
                for u in self._uids.pop(gone, []):
                    if self.step_of.get(u) == gone:
                        del self.step_of[u]
                self.steps.discard(gone)
            for s in sorted(present - self.steps):
                record = ClaimRecord.read_in(rd.claimed_step(s))
                if record is None:
                    continue                          # not committed (yet): looked at again next time
                uids = [u for u in record.uids if isinstance(u, str)]
                for u in uids:
                    self.step_of.setdefault(u, s)
                self._uids[s] = uids
                self.steps.add(s)

    def consumed_by(self, uid: str, step: int, window_steps: int) -> int | None:
        """The step whose committed claim consumed ``uid`` within the window of ``step``, or None."""
        s = self.step_of.get(uid)
        return s if s is not None and s != step and s >= step - window_steps else None


_CONSUMED: dict[str, ConsumedUids] = {}   # per run directory, for this process


def consumed_uids(run_dir, step: int, window_steps: int = DEFAULT_UID_WINDOW_STEPS) -> ConsumedUids:
    """The run's consumed uids, refreshed for a claim of ``step`` (window: steps from
    ``step - window_steps`` on, and any later committed step, e.g. another consumer's)."""
    rd = _rundir(run_dir)
    index = _CONSUMED.setdefault(str(rd.root.absolute()), ConsumedUids())
    index.refresh(rd, step - window_steps)
    return index


@dataclass
class _Claim:
    rd: RunDir
    step: int
    consumer: str
    quarantine_invalid: bool
    admit: Admission | None = None
    shards: list[Path] = field(default_factory=list)
    kept_index: dict[str, list[int]] = field(default_factory=dict)
    trajectories: list[Trajectory] = field(default_factory=list)
    dropped: list[dict] = field(default_factory=list)
    quarantined: list[Path] = field(default_factory=list)
    generated: int = 0
    masked: int = 0
    seen: ConsumedUids | None = None                      # uids consumed by committed claims
    uid_window_steps: int = DEFAULT_UID_WINDOW_STEPS
    uids: list[str] = field(default_factory=list)         # uids this claim consumed (kept or stale-dropped)
    duplicates: list[dict] = field(default_factory=list)  # skipped: uid consumed before
    read: Callable[[Path], list[Trajectory]] = read_shard   # a shard's trajectories (store/readahead.py)

    @property
    def dir(self) -> Path:
        return self.rd.claimed_step(self.step)

    # --- ownership ----------------------------------------------------------------------
    def open(self) -> None:
        """Create claimed/step_N/ owned by us in one rename, or take over our own half-claim."""
        owner = ClaimOwner.mine(self.consumer, self.step)
        staging = staging_dir_for(self.dir)
        owner.write_in(staging)
        try:
            os.rename(staging, self.dir)
            fsync_dir(self.dir.parent)
            return
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not self.dir.is_dir():
                raise
        prev = ClaimOwner.read_in(self.dir) or ClaimOwner()
        if prev.consumer not in (None, self.consumer):
            raise ClaimConflict(
                f"{self.dir}: step {self.step} is being claimed by consumer {prev.consumer!r} "
                f"(pid {prev.pid} on {prev.host}); a step has one consumer. If that "
                f"process is dead, delete {self.dir / OWNER_FILE} and this consumer completes the claim")
        log.warning("%s: completing a claim left unfinished by pid %s on %s", self.dir, prev.pid, prev.host)
        owner.write_in(self.dir)

    def abandon_if_empty(self) -> None:
        """Remove our claim dir when it holds no shard (only our records and hidden temp files)."""
        if not self.shards and not [n for n in _visible(os.listdir(self.dir)) if n not in CLAIM_RECORD_NAMES]:
            shutil.rmtree(self.dir, ignore_errors=True)

    # --- taking shards ------------------------------------------------------------------
    def absorb_existing(self) -> None:
        """Roll forward: shards a crashed attempt already moved in are this step's."""
        for name in _visible(os.listdir(self.dir)):
            if name not in CLAIM_RECORD_NAMES:
                self.absorb(self.dir / name)

    def take_from_ready(self, want: int) -> int:
        """Move shards from ready/ (oldest first) until ``want`` trajectories are kept."""
        taken = 0
        for name in ready_shards(self.rd):
            if len(self.trajectories) >= want:
                break
            dst = self.dir / name
            try:
                os.rename(self.rd.traj_ready / name, dst)
            except FileNotFoundError:
                # Another consumer won it, or (NFS) our own rename was retried after it
                # succeeded: the destination tells the two apart.
                if not dst.exists():
                    continue
            taken += 1
            self.absorb(dst)
        return taken

    def absorb(self, path: Path) -> None:
        try:
            trajs = self.read(path)
        except ShardError as e:
            if not self.quarantine_invalid:
                raise
            self.quarantined.append(quarantine(self.rd, path, e.reason))
            return
        keep = []
        mine = set(self.uids)
        for i, t in enumerate(trajs):
            uid = trajectory_uid(t)
            if uid is not None:
                before = self.seen.consumed_by(uid, self.step, self.uid_window_steps) if self.seen else None
                if before is not None or uid in mine:   # trained (or dropped) already: never twice
                    self.duplicates.append({"shard": path.name, "index": i, "uid": uid,
                                            "step": self.step if before is None else before})
                    continue
                mine.add(uid)
                self.uids.append(uid)
            gen = t.num_generated
            self.generated += gen
            v = self.admit.verdict(t) if self.admit is not None else Verdict(True)
            if not v.keep:
                self.dropped.append({"shard": path.name, "index": i, "task_id": t.task_id,
                                     "group_id": t.group_id, **v.why, "tokens": gen})
            else:
                self.masked += v.masked_tokens
                keep.append(i)
        self.shards.append(path)
        self.kept_index[path.name] = keep
        self.trajectories.extend(trajs[i] for i in keep)

    @property
    def admission(self) -> dict:
        return {**NO_ADMISSION, **(self.admit.record() if self.admit is not None else {})}

    # --- commit -------------------------------------------------------------------------
    def commit(self, want: int, waited_s: float, claim_s: float) -> ClaimResult:
        a = self.admission
        dropped_file = DroppedRecord(step=self.step, **a, dropped=self.dropped).write_in(self.dir)
        dropped_tokens = sum(int(d.get("tokens", 0)) for d in self.dropped)
        ClaimRecord(
            step=self.step, consumer=self.consumer, time=time.time(), want=want,
            trainer_version=a["trainer_version"], max_staleness=a["max_staleness"],
            shards=[{"name": p.name, "kept": self.kept_index[p.name]} for p in self.shards],
            trajectories=len(self.trajectories),
            tokens=sum(t.num_tokens for t in self.trajectories),
            dropped_stale=len(self.dropped), quarantined=[p.name for p in self.quarantined],
            waited_s=waited_s, claim_s=claim_s, stale_policy=a["stale_policy"],
            generated_tokens=self.generated, masked_stale_tokens=self.masked,
            dropped_stale_tokens=dropped_tokens, uids=self.uids, duplicates=self.duplicates,
        ).write_in(self.dir)
        if self.duplicates:
            log.warning("step %d: skipped %d trajectories whose uid was consumed before (e.g. %s in %s, first "
                        "consumed by step %d): a shard published twice; listed in %s", self.step,
                        len(self.duplicates), self.duplicates[0]["uid"], self.duplicates[0]["shard"],
                        self.duplicates[0]["step"], self.dir / CLAIM_FILE)
        if self.dropped:
            log.warning("step %d: dropped %d trajectories older than %s versions behind v%s (see %s)",
                        self.step, len(self.dropped), a["max_staleness"], a["trainer_version"], dropped_file)
        return ClaimResult(self.step, self.trajectories, self.shards, len(self.dropped),
                           self.quarantined, waited_s, claim_s, generated_tokens=self.generated,
                           masked_stale_tokens=self.masked, dropped_stale_tokens=dropped_tokens,
                           duplicates=len(self.duplicates), admission=a)


def _load_committed(rd: RunDir, step: int, read: Callable[[Path], list[Trajectory]] = read_shard
                    ) -> ClaimResult | None:
    d = rd.claimed_step(step)
    record = ClaimRecord.read_in(d)
    if record is None:
        return None
    trajs, shards = [], []
    for entry in record.shards:
        path = d / entry["name"]
        if not path.is_file():
            raise ShardError(path, f"listed in {d / CLAIM_FILE} but missing; the claim of step {step} "
                                   f"cannot be replayed. Restore the file, or move {d} aside to claim afresh")
        got = read(path)
        trajs.extend(got[i] for i in entry["kept"])
        shards.append(path)
    q = [rd.traj_quarantine / n for n in record.quarantined]
    return ClaimResult(step, trajs, shards, record.dropped_stale, q, 0.0, 0.0, resumed=True,
                       generated_tokens=record.generated_tokens, masked_stale_tokens=record.masked_stale_tokens,
                       dropped_stale_tokens=record.dropped_stale_tokens, duplicates=len(record.duplicates),
                       admission={"trainer_version": record.trainer_version, "max_staleness": record.max_staleness,
                                  "stale_policy": record.stale_policy})


def claim_step(run_dir, step: int, want: int, consumer: str, admit: Admission | None = None,
               timeout_s: float = 600.0, poll_s: float = DEFAULT_POLL_S, allow_partial: bool = False,
               quarantine_invalid: bool = True, uid_window_steps: int = DEFAULT_UID_WINDOW_STEPS,
               read: Callable[[Path], list[Trajectory]] = read_shard) -> ClaimResult:
    """Claim whole shards from ready/ for ``step`` until at least ``want`` trajectories are kept.

    Blocks, polling ready/ every ``poll_s``, up to ``timeout_s``; then raises
    :class:`ClaimTimeout` (or, with ``allow_partial`` and something claimed, commits what it
    has). A step already committed returns the same trajectories again (``resumed=True``).
    Invalid shards go to quarantine/ with a reason file; with ``admit``, a trajectory its
    :class:`Verdict` drops is not kept (listed in ``dropped_stale.json``), and the rule's
    parameters come back as ``ClaimResult.admission`` (module docstring).  A trajectory whose uid a
    committed claim of the last ``uid_window_steps`` steps consumed is skipped and counted
    (``duplicates``).  ``read`` reads a shard (``read_shard``; the store's read-ahead serves the
    ones it already holds, ``store/readahead.py``).
    """
    rd = _rundir(run_dir)
    if step < 0 or want < 0:
        raise ValueError(f"claim_step: step ({step}) and want ({want}) must be >= 0")
    done = _load_committed(rd, step, read)
    if done is not None:
        return done
    for d in (rd.traj_ready, rd.traj_claimed, rd.traj_quarantine):
        d.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(rd.traj_claimed, older_than_s=3600.0)  # staging dirs of consumers that crashed
    if uid_window_steps < 1:
        raise ValueError(f"claim_step: uid_window_steps ({uid_window_steps}) must be >= 1")
    claim = _Claim(rd, step, consumer, quarantine_invalid, admit,
                   seen=consumed_uids(rd, step, uid_window_steps), uid_window_steps=uid_window_steps, read=read)
    claim.open()
    claim.absorb_existing()
    t0, waited = time.monotonic(), 0.0
    while len(claim.trajectories) < want:
        taken = claim.take_from_ready(want)
        if len(claim.trajectories) >= want:
            break
        if time.monotonic() - t0 >= timeout_s:
            if allow_partial and claim.trajectories:
                break
            claim.abandon_if_empty()
            raise ClaimTimeout(
                f"{rd.traj_ready}: only {len(claim.trajectories)} of {want} trajectories for step {step} "
                f"arrived within {timeout_s:.0f}s ({len(claim.shards)} shards claimed into "
                f"{claim.dir}); are the rollout workers running? (`neon-hpc status {rd.root}`)")
        if not taken:
            time.sleep(poll_s)
            waited += poll_s
    result = claim.commit(want, waited, time.monotonic() - t0)
    log.info("step %d: claimed %d shards, %d trajectories (%d stale dropped, %d stale tokens masked, "
             "%d quarantined, %d duplicates skipped) in %.2fs (%.2fs waiting)", step, len(result.shards),
             len(result.trajectories), result.dropped_stale, result.masked_stale_tokens, len(result.quarantined),
             result.duplicates, result.claim_s, result.waited_s)
    return result
