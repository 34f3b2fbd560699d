"""The typed records of the run directory, and the only functions that read and write them.

Each record is a dataclass: ``write(run)`` publishes it atomically at its one path, and
``read(run, ...)`` returns it, or ``None`` when the file is absent.  A reader that meets a
file that is not such a record (torn by a writer that did not publish atomically, edited by
hand, or some other program's file) raises :class:`~neon_hpc.protocol.rundir.RunDirError`
naming the file, the field and what was expected; it never guesses.  Fields a newer writer
adds are kept in ``extra`` and written back unchanged.

Records: :class:`TrainerBeat` (with :class:`TrainerPhase`), :class:`WorkerBeat`, :class:`NodeBeat`,
:class:`EngineRecord`, :class:`JobRecord`, :class:`LeaseRecord`, the markers :class:`Finished` and
:class:`Preempted`, and a claim's :class:`ClaimOwner`, :class:`DroppedRecord` and
:class:`ClaimRecord`.  The contract (who writes what, when) is ``neon_hpc/protocol/README.md``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import socket
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator

from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config
from typing_extensions import NotRequired, Required, TypedDict  # pydantic needs these on Python < 3.12

from neon_hpc.protocol.rundir import (
    CLAIM as CLAIM_NAME,
    DROPPED as DROPPED_NAME,
    OWNER as OWNER_NAME,
    RunDir,
    RunDirError,
    atomic_write_json,
    create_json,
    read_json,
)
from neon_hpc.util import constraints
from neon_hpc.util.bounded import short_repr


class TrainerPhase(str, enum.Enum):
    """Where the trainer's step loop is (its heartbeat's ``phase``)."""

    STARTING = "starting"                  # building the model, before the first step
    CLAIMING = "claiming"                  # step N claims its data (it trains v_{N-1})
    WAITING_FOR_DATA = "waiting_for_data"  # ... and is still waiting for enough of it
    TRAINING = "training"                  # step N has its data and trains v_{N-1} into v_N
    STEPPED = "stepped"                    # step N is done (v_N exists)
    PREEMPTED = "preempted"                # checkpointed and stopped on a signal
    DONE = "done"                          # every step is done

    @property
    def claiming(self) -> bool:
        """Step N's claim is not committed yet: the next claim trains v_{N-1}."""
        return self in (TrainerPhase.CLAIMING, TrainerPhase.WAITING_FOR_DATA)


# --------------------------------------------------------------------------------------
# the generic part: dataclass <-> JSON, every field checked by pydantic (neon_hpc.util.constraints)

@dataclass
class Record:
    """Base of every record: JSON in, JSON out, one path."""

    KIND: ClassVar[str] = "record"
    # False: published atomically without the fsyncs (rundir.atomic_file), for records whose
    # newest version a restart rewrites anyway; a machine crash may lose it, a reader never sees half
    DURABLE: ClassVar[bool] = True
    extra: dict = field(default_factory=dict, repr=False)

    # ---- JSON -------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            if v is None and f.default is None:
                continue          # an unset optional field is absent (the reader's default)
            out[f.name] = v.value if isinstance(v, enum.Enum) else v
        return out

    @classmethod
    def from_json(cls, obj: Any, path: str | os.PathLike = "<record>"):
        if not isinstance(obj, dict):
            raise RunDirError(f"{path}: not a {cls.KIND} record (a JSON {type(obj).__name__}, not an object); "
                              f"it was not written by neon-hpc. Move it aside and restart")
        schema, names = _schema(cls)
        try:
            kw = schema.validate_python({k: v for k, v in obj.items() if k in names})
        except ValidationError as e:
            raise RunDirError(f"{path}: not a {cls.KIND} record ({_what(cls, e, obj)}); it was not written by "
                              f"neon-hpc. Move it aside and restart") from None
        return cls(extra={k: v for k, v in obj.items() if k not in names}, **kw)

    # ---- files ------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike):
        """The record at ``path``; None when the file is absent."""
        obj = read_json(path)
        return None if obj is None else cls.from_json(obj, path)

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_json(), durable=self.DURABLE)


@functools.cache
def _schema(cls: type) -> tuple[TypeAdapter, frozenset[str]]:
    """A record class's fields as one pydantic schema (a TypedDict: only the keys present come
    back, so an absent optional field keeps the dataclass default), built once per class."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.name != "extra"]
    keys = {f.name: constraints.strict(hints[f.name]) if f.default is not dataclasses.MISSING
            or f.default_factory is not dataclasses.MISSING else Required[constraints.strict(hints[f.name])]
            for f in fields}
    td = TypedDict(f"{cls.__name__}Fields", {k: v if typing.get_origin(v) is Required else NotRequired[v]
                                              for k, v in keys.items()})
    return TypeAdapter(td), frozenset(keys) | {"extra"}


def _what(cls: type, exc: ValidationError, obj: dict) -> str:
    """The first wrong field of a record (an item of a list field by its index), as the reader
    reports it."""
    e = exc.errors(include_url=False)[0]
    name, loc = str(e["loc"][0]), e["loc"][1:]
    if e["type"] == "missing" and not loc:
        return f"no {name!r} field"
    tp, key, value = typing.get_type_hints(cls)[name], name, obj.get(name)
    index = next((p for p in loc if isinstance(p, int)), None)
    if index is not None and typing.get_origin(tp) is list and isinstance(value, list):
        tp, key, value = typing.get_args(tp)[0], f"{name}[{index}]", value[index]
    return f"field {key!r} is {short_repr(value)}, expected {constraints.type_name(tp)}"


def _host() -> str:
    return socket.gethostname()


# --------------------------------------------------------------------------------------
# heartbeats: state/heartbeats/<role>.<rank>.json

@dataclass
class _Beat(Record):
    ROLE: ClassVar[str] = ""
    DURABLE: ClassVar[bool] = False   # several a step on the trainer's path; the next beat replaces it
    rank: int | str = 0
    time: float = 0.0
    pid: int | None = None
    host: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"role": self.ROLE, **super().to_json()}

    @classmethod
    def from_json(cls, obj: Any, path: str | os.PathLike = "<record>"):
        if isinstance(obj, dict):
            obj = {k: v for k, v in obj.items() if k not in ("role", "age_s")}
        return super().from_json(obj, path)

    def write(self, run: RunDir) -> None:
        """Publish the beat, stamped now with this process's pid and host."""
        self.time, self.pid, self.host = time.time(), os.getpid(), _host()
        self.save(run.heartbeat_file(self.ROLE, self.rank))

    @classmethod
    def read(cls, run: RunDir, rank: int | str = 0):
        return cls.load(run.heartbeat_file(cls.ROLE, rank))

    @classmethod
    def read_all(cls, run: RunDir) -> list:
        """Every beat of this role, by file name (absent directory: none)."""
        out = []
        for p in sorted(run.heartbeats_dir.glob(f"{cls.ROLE}.*.json")):
            b = cls.load(p)
            if b is not None:
                out.append(b)
        return out

    def age_s(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.time


@dataclass
class TrainerBeat(_Beat):
    """A trainer rank's heartbeat: the step it is on and its :class:`TrainerPhase`."""

    KIND: ClassVar[str] = "trainer heartbeat"
    ROLE: ClassVar[str] = "trainer"
    step: int | None = None
    phase: TrainerPhase = TrainerPhase.STARTING
    version: int | None = None
    waited_s: float | None = None


@dataclass
class WorkerBeat(_Beat):
    """A rollout worker's heartbeat: the trajectories it has in flight (admission counts them)."""

    KIND: ClassVar[str] = "rollout worker heartbeat"
    ROLE: ClassVar[str] = "rollout"
    in_flight: int = 0
    groups: int = 0
    episodes: int | None = None
    tokens: int | None = None
    task: str | None = None
    waiting: str | None = None       # the admission verdict it waits on, while refused
    stopped: bool = False


@dataclass
class NodeBeat(_Beat):
    """A rollout node's heartbeat: its live workers, restarts, and the version its engines hold."""

    KIND: ClassVar[str] = "rollout node heartbeat"
    ROLE: ClassVar[str] = "rollout-node"
    workers: int = 0
    restarts: int = 0
    version: int | None = None


# --------------------------------------------------------------------------------------
# state/engines/node<r>.json

@dataclass
class EngineRecord(Record):
    """Where rollout node ``node``'s engines serve and the weight version they hold."""

    KIND: ClassVar[str] = "engine record"
    urls: list = field(default_factory=list)
    version: int = -1
    kind: str = "embedded"
    workers_url: str | None = None
    pid: int | None = None
    time: float | None = None

    def write(self, run: RunDir, node: int) -> None:
        self.pid, self.time = os.getpid(), time.time()
        self.save(run.engine_file(node))

    @classmethod
    def read(cls, run: RunDir, node: int) -> "EngineRecord | None":
        return cls.load(run.engine_file(node))

    @classmethod
    def read_all(cls, run: RunDir) -> list["EngineRecord"]:
        """Every node's record, in node order."""
        files = sorted(run.engines_dir.glob("node*.json"), key=lambda f: int(f.stem[4:] or 0)
                       if f.stem[4:].isdigit() else -1)
        return [r for r in map(cls.load, files) if r is not None]

    @property
    def serving(self) -> int | None:
        """The version the engines hold, None before they loaded one."""
        return self.version if self.version >= 0 else None


# --------------------------------------------------------------------------------------
# state/job.json

@dataclass
class JobRecord(Record):
    """The launch that owns the run: its job id and backend, and how often the run started."""

    KIND: ClassVar[str] = "job record"
    job_id: str = "local"
    backend: str = "local"
    host: str | None = None
    started: float | None = None
    first_started: float | None = None
    starts: int = 0

    def write(self, run: RunDir) -> None:
        self.save(run.job_file)

    @classmethod
    def read(cls, run: RunDir) -> "JobRecord | None":
        return cls.load(run.job_file)

    @classmethod
    def start(cls, run: RunDir, job_id: str, backend: str) -> "JobRecord":
        """Record one more start of the run by this launch (the first start is kept)."""
        prev = cls.read(run) or cls()
        now = time.time()
        rec = cls(job_id=str(job_id), backend=backend, host=_host(), started=now,
                  first_started=prev.first_started if prev.first_started is not None else now,
                  starts=prev.starts + 1)
        rec.write(run)
        return rec


# --------------------------------------------------------------------------------------
# state/lease.json

@dataclass
class LeaseRecord(Record):
    """The live launch's lease on the run directory (the rules: ``neon_hpc/launch/lease.py``).

    ``token`` names the launch; ``gen`` counts takeovers; ``pid``/``pid_start`` are the
    launcher's (start time in clock ticks, so a reused pid is told apart); ``renewed`` is the
    last renewal by any process of the launch, which holds the lease for ``ttl_s`` seconds;
    ``took_over`` is ``{"token", "why"}`` of the launch it replaced, if any."""

    KIND: ClassVar[str] = "lease record"
    token: str = ""
    gen: int = 0
    host: str | None = None
    pid: int | None = None
    pid_start: str | None = None
    job_id: str = "local"
    backend: str = "local"
    restart: int = 0
    started: float | None = None
    renewed: float = 0.0
    renewed_by: str | None = None
    ttl_s: float = 30.0
    took_over: dict | None = None

    def write(self, run: RunDir) -> None:
        """Publish over whatever lease is there (a renewal, a won takeover)."""
        self.save(run.lease_file)

    def create(self, run: RunDir) -> bool:
        """Publish only if there is no lease (:func:`~neon_hpc.protocol.rundir.create_json`):
        of two racing launches exactly one gets True."""
        return create_json(run.lease_file, self.to_json())

    @classmethod
    def read(cls, run: RunDir) -> "LeaseRecord | None":
        return cls.load(run.lease_file)

    @staticmethod
    def clear(run: RunDir) -> None:
        run.lease_file.unlink(missing_ok=True)

    def age_s(self, now: float | None = None) -> float:
        """Seconds since the last renewal."""
        return (time.time() if now is None else now) - self.renewed


# --------------------------------------------------------------------------------------
# markers: state/finished.json, state/trainer_preempted.json

@dataclass
class _Marker(Record):
    time: float = 0.0

    @staticmethod
    def path(run: RunDir) -> Path:
        raise NotImplementedError

    def write(self, run: RunDir) -> None:
        if not self.time:
            self.time = time.time()
        self.save(self.path(run))

    @classmethod
    def read(cls, run: RunDir):
        return cls.load(cls.path(run))

    @classmethod
    def present(cls, run: RunDir) -> bool:
        """The marker exists (polled by every role: one stat, the file is not opened)."""
        return cls.path(run).exists()

    @classmethod
    def clear(cls, run: RunDir) -> None:
        cls.path(run).unlink(missing_ok=True)


@dataclass
class Finished(_Marker):
    """Every trainer step is done: the rollout side stops its workers and engines."""

    KIND: ClassVar[str] = "finished marker"
    by: str | None = None

    @staticmethod
    def path(run: RunDir) -> Path:
        return run.finished_file


@dataclass
class Preempted(_Marker):
    """The trainer checkpointed ``step`` and stopped on a signal: the job requeues, the run resumes."""

    KIND: ClassVar[str] = "preemption marker"
    step: int | None = None
    signal: int | None = None
    checkpoint: str | None = None

    @staticmethod
    def path(run: RunDir) -> Path:
        return run.preempted_file


def mark_finished(run: RunDir, by: str | None = None) -> bool:
    """Write the finished marker unless the trainer was preempted; True if written."""
    if Preempted.present(run):
        return False
    Finished(by=by).write(run)
    return True


# --------------------------------------------------------------------------------------
# a claim: trajectories/claimed/step_N/{OWNER.json, dropped_stale.json, CLAIM.json}

@with_config(ConfigDict(extra="allow"))      # keys a newer writer adds are kept
class ShardKept(TypedDict):
    """One shard of a claim: its file name and the indices of the trajectories kept from it."""

    name: str
    kept: list[int]

@dataclass
class ClaimOwner(Record):
    """Who is claiming step N (written first: it names the consumer a half-done claim belongs to)."""

    KIND: ClassVar[str] = "claim owner record"
    consumer: str | None = None
    pid: int | None = None
    host: str | None = None
    time: float | None = None
    step: int | None = None

    @classmethod
    def mine(cls, consumer: str, step: int) -> "ClaimOwner":
        return cls(consumer=consumer, pid=os.getpid(), host=_host(), time=time.time(), step=step)

    @classmethod
    def read_in(cls, claim_dir: Path) -> "ClaimOwner | None":
        return cls.load(claim_dir / OWNER_NAME)

    def write_in(self, claim_dir: Path) -> None:
        self.save(claim_dir / OWNER_NAME)


@dataclass
class DroppedRecord(Record):
    """The trajectories step N's claim dropped for staleness (written before the commit)."""

    KIND: ClassVar[str] = "dropped-stale record"
    step: int = 0
    trainer_version: int | None = None
    max_staleness: int | None = None
    stale_policy: str = "drop"
    dropped: list = field(default_factory=list)

    def write_in(self, claim_dir: Path) -> Path:
        self.save(claim_dir / DROPPED_NAME)
        return claim_dir / DROPPED_NAME


@dataclass
class ClaimRecord(Record):
    """Step N's commit record, written last: the claim is complete once it exists."""

    KIND: ClassVar[str] = "claim record"
    step: int = 0
    shards: list[ShardKept] = field(default_factory=list)   # [{"name": shard file, "kept": [index, ...]}]
    consumer: str | None = None
    time: float | None = None
    want: int | None = None
    trainer_version: int | None = None
    max_staleness: int | None = None
    trajectories: int = 0
    tokens: int = 0
    dropped_stale: int = 0
    quarantined: list = field(default_factory=list)
    waited_s: float = 0.0
    claim_s: float = 0.0
    stale_policy: str = "drop"
    generated_tokens: int = 0
    masked_stale_tokens: int = 0
    dropped_stale_tokens: int = 0
    uids: list = field(default_factory=list)          # trajectory uids this claim consumed (kept or stale-dropped)
    duplicates: list = field(default_factory=list)    # [{"shard", "index", "uid", "step"}]: skipped, uid seen before

    @classmethod
    def read_in(cls, claim_dir: Path) -> "ClaimRecord | None":
        return cls.load(claim_dir / CLAIM_NAME)

    @classmethod
    def read(cls, run: RunDir, step: int) -> "ClaimRecord | None":
        return cls.load(run.claim_file(step))

    def write_in(self, claim_dir: Path) -> None:
        self.save(claim_dir / CLAIM_NAME)

    @staticmethod
    def committed(claim_dir: Path) -> bool:
        return (claim_dir / CLAIM_NAME).is_file()


CLAIM_RECORD_NAMES = (OWNER_NAME, CLAIM_NAME, DROPPED_NAME)   # the records in a claim directory (not shards)


def iter_records() -> Iterator[type[Record]]:
    """Every record type (the tests round-trip each)."""
    yield from (TrainerBeat, WorkerBeat, NodeBeat, EngineRecord, JobRecord, LeaseRecord, Finished, Preempted,
                ClaimOwner, DroppedRecord, ClaimRecord)
