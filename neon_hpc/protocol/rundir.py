"""The run directory's paths and its atomic publish: the only contract between the roles.

Every file name of the run directory is spelled here, once (the names below and the
:class:`RunDir` properties); what each file holds is in :mod:`neon_hpc.protocol.records`,
and the contract, with its layout, writers and readers, is ``neon_hpc/protocol/README.md``.

Rules: nothing is visible under its final name before it is complete; every publish is a
rename inside one filesystem, preceded by an fsync of the data and followed by an fsync of
the directory, so a crash leaves either the old or the new file, never a torn one.  No
file locks (Lustre/GPFS/NFS may lack them) and no inotify: readers poll.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

# ---- the names of the run directory (the only place they are spelled) -------------------
RUN_YAML = "run.yaml"                      # the resolved config, written once at the first launch
LATEST = "LATEST"                          # weights/LATEST: the newest complete version
STATE = "state"
HEARTBEATS = "heartbeats"                  # state/heartbeats/<role>.<rank>.json
ENGINES = "engines"                        # state/engines/node<r>.json
JOB = "job.json"                           # state/job.json
LEASE = "lease.json"                       # state/lease.json: LeaseRecord (neon_hpc.launch.lease)
LEASE_MEMBERS = "lease.d"                  # state/lease.d/<token>/<host>.<pid>.<start>: a launch's processes
LEASE_TAKEOVER = "lease.takeover"          # state/lease.takeover.<gen>: the one taker of generation gen
FINISHED = "finished.json"                 # state/finished.json
PREEMPTED = "trainer_preempted.json"       # state/trainer_preempted.json
CLAIM = "CLAIM.json"                       # trajectories/claimed/step_N/CLAIM.json (the commit record)
OWNER = "OWNER.json"                       # trajectories/claimed/step_N/OWNER.json
DROPPED = "dropped_stale.json"             # trajectories/claimed/step_N/dropped_stale.json
REASON_SUFFIX = ".reason.txt"              # trajectories/quarantine/<name>.reason.txt
JOURNAL = "journal"                        # journal/<owner>/<group>/e<i>.jrec: unfinished episodes
                                           # (protocol/journal.py)
JOURNAL_QUARANTINE = "quarantine"          # journal/quarantine/<owner>.<group>.<file> + REASON_SUFFIX
JOURNAL_SUFFIX = ".jrec"                   # one episode's record, replaced at every turn boundary
# every name above, for the test that no other module spells one
FILE_NAMES = (RUN_YAML, JOB, LEASE, LEASE_MEMBERS, LEASE_TAKEOVER, FINISHED, PREEMPTED, CLAIM, OWNER, DROPPED)

_STEP_RE = re.compile(r"^step_(\d+)$")
_VERSION_RE = re.compile(r"^v_(\d+)$")


class RunDirError(RuntimeError):
    """A run directory is missing, malformed, or a path escapes it."""


# A filesystem that cannot take a write: full, over quota, or read-only.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
_STORAGE_TEXT = ("No space left on device", "Disk quota exceeded", "Read-only file system",
                 "errno = 28", "errno = 30", "errno = 122")


class StorageError(OSError):
    """A write into the run directory failed because its filesystem is full or read-only."""


def storage_error(e: BaseException, path: str | os.PathLike, what: str) -> StorageError | None:
    """A :class:`StorageError` naming ``path`` if ``e`` (or what caused it) is a full or
    read-only filesystem; None for any other failure. Looks through exception chains and
    torch's ``CheckpointException.failures``; h5py and torch report these as text only."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        code = x.errno if isinstance(x, OSError) and x.errno in STORAGE_ERRNOS else None
        text = str(x)
        if code is None:
            hit = next((t for t in _STORAGE_TEXT if t in text), None)
            if hit:
                code = {"errno = 30": errno.EROFS, "Read-only file system": errno.EROFS,
                        "errno = 122": errno.EDQUOT, "Disk quota exceeded": errno.EDQUOT}.get(hit, errno.ENOSPC)
        if code is not None:
            return StorageError(code, f"{what} {path} failed: {os.strerror(code)}. Nothing partial is "
                                      f"visible; free space (or make the filesystem writable) and rerun: "
                                      f"the run resumes from what was published", str(path))
        todo += [x.__cause__, x.__context__]
        for v in (getattr(x, "failures", None) or {}).values():   # torch.distributed.checkpoint
            todo.append(v[0] if isinstance(v, tuple) else v)
    code = _fs_state(Path(path))   # some writers (torch.save: "iostream error") say nothing usable
    if code is not None:
        return storage_error(OSError(code, os.strerror(code)), path, what)
    return None


LOW_SPACE_BYTES = 1 << 20   # after a failed write, less than this free means the write hit a full disk


def _fs_state(path: Path) -> int | None:
    """EROFS / ENOSPC when the filesystem holding ``path`` is read-only / (nearly) full, else None."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if st.f_bavail * st.f_frsize < LOW_SPACE_BYTES:
        return errno.ENOSPC
    return None


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it survives a crash of the machine."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory under ``path`` (bottom-up)."""
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def _tmp_name(final: Path) -> Path:
    # Hidden, unique per writer: a reader that lists the directory never mistakes it for a
    # published file, and two writers never collide.
    return final.with_name(f".{final.name}.tmp.{socket.gethostname()}.{os.getpid()}.{time.monotonic_ns()}")


@contextlib.contextmanager
def atomic_file(final: str | os.PathLike, mode: str = "wb", durable: bool = True) -> Iterator[Any]:
    """Open a temporary file beside ``final``; on clean exit fsync it and rename it into place.

    On an exception the temporary file is removed and ``final`` is untouched.  ``durable=False``
    skips the two fsyncs (file and directory): still atomic for every reader, but a machine crash
    may lose the newest version; only for records a restart rewrites anyway (heartbeats).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(final)
    try:
        f = open(tmp, mode)
    except OSError as e:
        raise (storage_error(e, final, "writing") or e) from e
    try:
        yield f
        f.flush()
        if durable:
            os.fsync(f.fileno())
        f.close()
        os.replace(tmp, final)
        if durable:
            fsync_dir(final.parent)
    except BaseException as e:
        with contextlib.suppress(OSError):   # closing flushes: on a full disk that fails again
            f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        full = storage_error(e, final, "writing") if isinstance(e, OSError) else None
        if full is not None:
            raise full from e
        raise


def atomic_write_bytes(final: str | os.PathLike, data: bytes, durable: bool = True) -> None:
    with atomic_file(final, "wb", durable=durable) as f:
        f.write(data)


def atomic_write_text(final: str | os.PathLike, text: str, durable: bool = True) -> None:
    atomic_write_bytes(final, text.encode(), durable=durable)


def atomic_write_json(final: str | os.PathLike, obj: Any, durable: bool = True) -> None:
    atomic_write_text(final, json.dumps(obj, indent=1, sort_keys=True) + "\n", durable=durable)


def create_json(final: str | os.PathLike, obj: Any) -> bool:
    """Publish ``obj`` at ``final`` only if nothing is there yet; False if something is.

    A fsynced hidden temporary is hard-linked to ``final`` (``link(2)`` fails when the name
    exists, on NFS too, where ``O_EXCL`` and file locks may not hold), then removed: of two
    racing writers exactly one succeeds, and a reader never sees a partial file."""
    final = Path(final)
    tmp = _tmp_name(final)
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, final)
        made = True
    except FileExistsError:
        made = False
    finally:
        os.unlink(tmp)
    fsync_dir(final.parent)
    return made


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """Read a JSON state file written by :func:`atomic_write_json`; ``default`` if absent."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default
    except json.JSONDecodeError as e:  # cannot happen for files we published atomically
        raise RunDirError(f"{path}: not valid JSON ({e}); it was not written by neon-hpc's atomic publish. "
                          f"Move it aside and restart.") from e


def publish_dir(staging: str | os.PathLike, final: str | os.PathLike) -> None:
    """Make a fully written directory visible under its final name in one rename.

    ``staging`` must be on the same filesystem as ``final`` (a sibling, by convention a
    hidden ``.name.tmp...``).  Every file inside is fsynced first.  ``final`` must not
    exist: published directories are immutable.
    """
    staging, final = Path(staging), Path(final)
    if final.exists():
        raise RunDirError(f"{final} already exists; published directories are immutable. "
                          f"Remove it by hand if you really mean to replace it.")
    fsync_tree(staging)
    os.rename(staging, final)
    fsync_dir(final.parent)


def staging_dir_for(final: str | os.PathLike) -> Path:
    """A fresh hidden sibling of ``final`` to build a directory in before :func:`publish_dir`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp.", dir=final.parent))


def inside(base: str | os.PathLike, *parts: str) -> Path:
    """Join ``parts`` under ``base`` and refuse any result that escapes ``base``.

    Paths from configs and tool arguments go through this, so ``../../etc`` stays out.
    """
    base_r = Path(base).resolve()
    p = base_r.joinpath(*parts).resolve()
    if p != base_r and base_r not in p.parents:
        raise RunDirError(f"path {'/'.join(parts)!r} escapes {base_r}; use a path inside it")
    return p


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory. Creating the object touches nothing; :meth:`create` does."""

    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root).absolute())

    # --- layout -----------------------------------------------------------------------
    @property
    def run_yaml(self) -> Path: return self.root / RUN_YAML
    @property
    def traj(self) -> Path: return self.root / "trajectories"
    @property
    def traj_tmp(self) -> Path: return self.traj / "tmp"
    @property
    def traj_ready(self) -> Path: return self.traj / "ready"
    @property
    def traj_claimed(self) -> Path: return self.traj / "claimed"
    @property
    def traj_quarantine(self) -> Path: return self.traj / "quarantine"
    @property
    def checkpoints(self) -> Path: return self.root / "checkpoints"
    @property
    def weights(self) -> Path: return self.root / "weights"
    @property
    def latest_file(self) -> Path: return self.weights / LATEST
    @property
    def state(self) -> Path: return self.root / STATE
    @property
    def heartbeats_dir(self) -> Path: return self.state / HEARTBEATS
    @property
    def engines_dir(self) -> Path: return self.state / ENGINES
    @property
    def job_file(self) -> Path: return self.state / JOB
    @property
    def lease_file(self) -> Path: return self.state / LEASE
    @property
    def lease_members_root(self) -> Path: return self.state / LEASE_MEMBERS
    @property
    def finished_file(self) -> Path: return self.state / FINISHED
    @property
    def preempted_file(self) -> Path: return self.state / PREEMPTED
    @property
    def logs(self) -> Path: return self.root / "logs"
    @property
    def journal(self) -> Path: return self.root / JOURNAL
    @property
    def journal_quarantine(self) -> Path: return self.journal / JOURNAL_QUARANTINE

    def claimed_step(self, step: int) -> Path: return self.traj_claimed / f"step_{step}"
    def checkpoint(self, step: int) -> Path: return self.checkpoints / f"step_{step}"
    def weights_version(self, version: int) -> Path: return self.weights / f"v_{version}"
    def heartbeat_file(self, role: str, rank: int | str) -> Path: return self.heartbeats_dir / f"{role}.{rank}.json"
    def engine_file(self, node: int) -> Path: return self.engines_dir / f"node{node}.json"
    def claim_file(self, step: int) -> Path: return self.claimed_step(step) / CLAIM
    def owner_file(self, step: int) -> Path: return self.claimed_step(step) / OWNER
    def dropped_file(self, step: int) -> Path: return self.claimed_step(step) / DROPPED
    def log_dir(self, role: str) -> Path: return self.logs / role
    def journal_owner(self, owner: str) -> Path: return self.journal / owner
    def journal_group(self, owner: str, group: str) -> Path: return self.journal / owner / group
    def journal_record(self, owner: str, group: str, index: int) -> Path:
        return self.journal / owner / group / f"e{index}{JOURNAL_SUFFIX}"
    def lease_members_dir(self, token: str) -> Path: return self.lease_members_root / token
    def lease_takeover_file(self, gen: int) -> Path: return self.state / f"{LEASE_TAKEOVER}.{gen}"

    def lease_takeover_files(self) -> list[tuple[int, Path]]:
        """``(generation, path)`` of every takeover marker in ``state/``."""
        out = []
        for p in self.state.glob(f"{LEASE_TAKEOVER}.*"):
            gen = p.name.rsplit(".", 1)[-1]
            if gen.isdigit():
                out.append((int(gen), p))
        return sorted(out)

    def dirs(self) -> list[Path]:
        return [self.traj_tmp, self.traj_ready, self.traj_claimed, self.traj_quarantine,
                self.checkpoints, self.weights, self.state, self.heartbeats_dir, self.logs]

    def create(self) -> "RunDir":
        for d in self.dirs():
            d.mkdir(parents=True, exist_ok=True)
        return self

    def check(self) -> None:
        missing = [str(d.relative_to(self.root)) for d in self.dirs() if not d.is_dir()]
        if missing:
            raise RunDirError(f"{self.root} is not a neon-hpc run directory (missing {', '.join(missing)}); "
                              f"start a run with `neon-hpc run CONFIG --run-dir {self.root}`.")

    # --- versions and steps -----------------------------------------------------------
    def checkpoint_steps(self) -> list[int]:
        return sorted(int(m.group(1)) for p in _listdir(self.checkpoints) if (m := _STEP_RE.match(p)))

    def claim_dirs(self) -> list[tuple[int, Path]]:
        """``(N, trajectories/claimed/step_N)`` for every claim directory, committed or being
        filled, ascending."""
        found = ((m, self.traj_claimed / p) for p in _listdir(self.traj_claimed) if (m := _STEP_RE.match(p)))
        return sorted((int(m.group(1)), d) for m, d in found if d.is_dir())

    def latest_checkpoint(self) -> int | None:
        steps = self.checkpoint_steps()
        return steps[-1] if steps else None

    def weight_versions(self) -> list[int]:
        return sorted(int(m.group(1)) for p in _listdir(self.weights) if (m := _VERSION_RE.match(p)))

    def latest_weights(self) -> tuple[int, Path] | None:
        """The version named by ``weights/LATEST`` (written last, so always complete)."""
        obj = read_json(self.latest_file)
        if obj is None:
            return None
        v = int(obj["version"])
        return v, self.weights_version(v)

    def publish_latest(self, version: int, **extra: Any) -> None:
        if not self.weights_version(version).is_dir():
            raise RunDirError(f"cannot point LATEST at v_{version}: {self.weights_version(version)} does not exist")
        atomic_write_json(self.latest_file, {"version": version, "time": time.time(), **extra})

    # --- heartbeats -------------------------------------------------------------------
    def beat(self, role: str, rank: int | str, **fields: Any) -> None:
        atomic_write_json(self.heartbeat_file(role, rank),
                          {"role": role, "rank": rank, "time": time.time(), "pid": os.getpid(),
                           "host": socket.gethostname(), **fields})

    def heartbeats(self, role: str | None = None) -> list[dict[str, Any]]:
        out = []
        for p in sorted(self.heartbeats_dir.glob(f"{role}.*.json" if role else "*.json")):
            obj = read_json(p)
            if obj is not None:
                obj["age_s"] = time.time() - float(obj.get("time", 0))
                out.append(obj)
        return out


def _listdir(d: Path) -> list[str]:
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []


def remove_stale_tmp(directory: str | os.PathLike, older_than_s: float = 0.0) -> int:
    """Delete leftover hidden ``.*.tmp.*`` files/dirs of crashed writers; returns the count."""
    n = 0
    now = time.time()
    for name in _listdir(Path(directory)):
        if name.startswith(".") and ".tmp." in name:
            p = Path(directory) / name
            try:
                if now - p.lstat().st_mtime < older_than_s:
                    continue
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                n += 1
            except FileNotFoundError:
                pass
    return n
