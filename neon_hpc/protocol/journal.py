"""The episode journal's record: one file per unfinished episode, replaced at every turn boundary.

A record is what a resumed episode needs to go on exactly (what that is, and how an episode is
rebuilt from it, is :mod:`neon_hpc.rollout.journal`'s): a JSON header (JSON-able fields only)
and named raw arrays (a whitelist of numeric dtypes, never objects, never pickle). On disk::

    MAGIC (8 bytes) | version u32 | header bytes u32 | blob bytes u64 | sha256 (32 bytes)
    | header (UTF-8 JSON: fields + the arrays' dtype/shape/offset) | blob (the arrays, C order)

The digest covers header and blob, and the lengths must add up to the file's size exactly, so a
truncated, torn or altered record is refused (:class:`JournalCorrupt`, naming the file and what
is wrong), never half-read. Records are published by :func:`neon_hpc.protocol.rundir.atomic_file`
(temporary + fsync + rename): a reader sees the previous record or the new one. The layout
(``journal/<owner>/<group>/e<i>.jrec``) is :class:`~neon_hpc.protocol.rundir.RunDir`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from neon_hpc.protocol.rundir import JOURNAL_SUFFIX, atomic_file

MAGIC = b"NEONJRN\x00"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sIIQ32s")        # magic, version, header bytes, blob bytes, sha256
DTYPES = ("int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64", "bool")


class JournalCorrupt(ValueError):
    """A journal record that cannot be read back as written; the message names the file."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"journal record {path}: {reason}")


@dataclass
class JournalRecord:
    """``meta``: JSON-able fields; ``arrays``: named numeric arrays (dtypes in :data:`DTYPES`)."""

    meta: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def encode(self) -> bytes:
        specs, parts, offset = {}, [], 0
        for name, a in self.arrays.items():
            a = np.ascontiguousarray(a)
            if a.dtype.name not in DTYPES:
                raise TypeError(f"journal array {name!r} has dtype {a.dtype}; one of {', '.join(DTYPES)}")
            raw = a.tobytes()
            specs[name] = {"dtype": a.dtype.name, "shape": list(a.shape), "offset": offset}
            parts.append(raw)
            offset += len(raw)
        header = json.dumps({"meta": self.meta, "arrays": specs}, separators=(",", ":")).encode()
        blob = b"".join(parts)
        digest = hashlib.sha256(header + blob).digest()
        return _FIXED.pack(MAGIC, FORMAT_VERSION, len(header), len(blob), digest) + header + blob

    @classmethod
    def decode(cls, data: bytes, path: str | os.PathLike = "<bytes>") -> "JournalRecord":
        header, blob = _split(data, path)
        if hashlib.sha256(header + blob).digest() != _FIXED.unpack_from(data)[4]:
            raise JournalCorrupt(path, "digest mismatch (the record was altered or torn)")
        try:
            head = json.loads(header)
            arrays = {}
            for name, spec in head["arrays"].items():
                if spec["dtype"] not in DTYPES:
                    raise JournalCorrupt(path, f"array {name!r} has dtype {spec['dtype']!r}")
                dt = np.dtype(spec["dtype"])
                n = int(np.prod(spec["shape"], dtype=np.int64)) * dt.itemsize
                start = int(spec["offset"])
                if start < 0 or start + n > len(blob):
                    raise JournalCorrupt(path, f"array {name!r} runs past the blob")
                arrays[name] = np.frombuffer(blob, dt, n // dt.itemsize, start).reshape(spec["shape"]).copy()
            return cls(meta=head["meta"], arrays=arrays)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, JournalCorrupt):
                raise
            raise JournalCorrupt(path, f"malformed header ({e})") from e


def _split(data: bytes, path) -> tuple[bytes, bytes]:
    if len(data) < _FIXED.size:
        raise JournalCorrupt(path, f"truncated: {len(data)} bytes, shorter than the {_FIXED.size}-byte preamble")
    magic, version, nh, nb, _ = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise JournalCorrupt(path, "not a journal record (bad magic)")
    if version != FORMAT_VERSION:
        raise JournalCorrupt(path, f"format version {version}; this neon-hpc reads version {FORMAT_VERSION}")
    if _FIXED.size + nh + nb != len(data):
        raise JournalCorrupt(path, f"truncated or padded: {len(data)} bytes, the preamble says "
                                   f"{_FIXED.size + nh + nb}")
    return data[_FIXED.size:_FIXED.size + nh], data[_FIXED.size + nh:]


def write_record(path: str | os.PathLike, record: JournalRecord, fsync: bool = True) -> int:
    """Publish ``record`` at ``path`` atomically (replacing the previous one); returns its bytes.

    ``fsync=False`` skips the data and directory fsyncs (the rename stays atomic against a crash
    of this process, not of the node): the rollout config's ``journal_fsync``."""
    return write_encoded(path, record.encode(), fsync)


def write_encoded(path: str | os.PathLike, data: bytes, fsync: bool = True) -> int:
    """:func:`write_record` of a record already encoded (:meth:`JournalRecord.encode`)."""
    if fsync:
        with atomic_file(path, "wb") as f:
            f.write(data)
    else:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return len(data)


def read_record(path: str | os.PathLike) -> JournalRecord:
    """The record at ``path``, checked (:class:`JournalCorrupt` when it is not what was written)."""
    return JournalRecord.decode(Path(path).read_bytes(), path)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The record's fields only, unchecked by the digest (cheap: ``neon-hpc status``)."""
    with open(path, "rb") as f:
        pre = f.read(_FIXED.size)
        if len(pre) < _FIXED.size or pre[:8] != MAGIC:
            raise JournalCorrupt(path, "truncated or not a journal record")
        nh = _FIXED.unpack(pre)[2]
        head = f.read(nh)
    try:
        return json.loads(head)["meta"]
    except (ValueError, KeyError) as e:
        raise JournalCorrupt(path, f"malformed header ({e})") from e


def is_record(path: Path) -> bool:
    """A published record's name (temporaries are hidden and end otherwise)."""
    return path.name.endswith(JOURNAL_SUFFIX) and not path.name.startswith(".")


def journal_summary(run) -> dict[str, Any]:
    """What the run's journal holds (``neon-hpc status``): episodes, groups, turns, tokens, the
    oldest generated token's version, records quarantined. Headers only; a record that cannot be
    read is counted as ``unreadable``."""
    out = {"episodes": 0, "groups": 0, "done": 0, "turns": 0, "tokens": 0, "gen_tokens": 0,
           "oldest_version": None, "unreadable": 0, "quarantined": 0}
    root = Path(run.journal)
    if not root.is_dir():
        return out
    q = Path(run.journal_quarantine)
    out["quarantined"] = sum(1 for p in q.iterdir() if is_record(p)) if q.is_dir() else 0
    for owner in (d for d in root.iterdir() if d.is_dir() and d != q):
        for group in (g for g in owner.iterdir() if g.is_dir()):
            out["groups"] += 1
            for p in (p for p in group.iterdir() if is_record(p)):
                try:
                    m = read_meta(p)
                except (OSError, JournalCorrupt):
                    out["unreadable"] += 1
                    continue
                out["episodes"] += 1
                out["done"] += bool(m.get("done"))
                for k in ("turns", "tokens", "gen_tokens"):
                    out[k] += int(m.get("turn" if k == "turns" else k) or 0)
                v = m.get("version_min")
                if v is not None and (out["oldest_version"] is None or v < out["oldest_version"]):
                    out["oldest_version"] = v
    return out
