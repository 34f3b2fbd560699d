"""Digests of a torch_dist checkpoint's blobs: written at save, checked while reading.

Nothing in torch_dist checksums tensor bytes, so a flipped byte inside a ``.distcp`` loads
as a silently different weight.  The trainer (and the test/benchmark fixtures) therefore
write ``integrity.json`` into the checkpoint as part of its atomic save::

    {"format": 1, "algorithm": "xxh3_64",
     "files": {"__0_0.distcp": {"size": N, "digest": "<hex, whole file>",
                                "items": {"<offset>:<length>": "<hex>", ...}}, ...}}

``items`` has one digest per DCP storage item (a tensor chunk's ``torch.save`` blob, or a
bytes item), keyed by its byte range.  Readers check the items they read, on the bytes they
read anyway (reshard's chunk reads, the trainer's resume through DCP's reader): no second
pass.  The whole-file digest is for tools that copy or check a checkpoint as files.

Pure standard library + ``xxhash``; never imports torch (``--dry-run`` stays light).
"""

from __future__ import annotations

import io as _io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import xxhash

from neon_hpc.checkpoint.metadata import CheckpointError, load_dcp_metadata, read_json_object
from neon_hpc.util.bounded import short_repr

DIGEST_FILE = "integrity.json"
ALGORITHM = "xxh3_64"
FORMAT = 1
_BLOCK = 16 << 20


class IntegrityError(CheckpointError):
    """Bytes read from a checkpoint differ from the digest written when it was saved."""


def digest_bytes(data) -> str:
    return xxhash.xxh3_64(data).hexdigest()


def item_key(offset: int, length: int) -> str:
    return f"{int(offset)}:{int(length)}"


def digest_file(path: Path, items: list[tuple[int, int]]) -> dict:
    """One sequential read of ``path``: the whole-file digest and one digest per item range.

    ``items``: the ``(offset, length)`` of every storage item in the file (DCP writes them
    back to back; any bytes between them count only towards the file digest)."""
    whole = xxhash.xxh3_64()
    out: dict[str, str] = {}
    pos = 0
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        for off, length in sorted(set(items)):
            if off + length > size:
                raise IntegrityError(f"{path}: item [{off}, {off + length}) lies past the end ({size} bytes); "
                                     f"the file was cut short while saving")
            while pos < off:                       # a gap: file digest only
                buf = os.pread(f.fileno(), min(_BLOCK, off - pos), pos)
                whole.update(buf)
                pos += len(buf)
            if off < pos:
                raise IntegrityError(f"{path}: storage items overlap at byte {off}; the .metadata is inconsistent")
            h = xxhash.xxh3_64()
            end = off + length
            while pos < end:
                buf = os.pread(f.fileno(), min(_BLOCK, end - pos), pos)
                if not buf:
                    raise IntegrityError(f"{path}: short read at byte {pos}")
                h.update(buf)
                whole.update(buf)
                pos += len(buf)
            out[item_key(off, length)] = h.hexdigest()
        while pos < size:
            buf = os.pread(f.fileno(), min(_BLOCK, size - pos), pos)
            whole.update(buf)
            pos += len(buf)
    return {"size": size, "digest": whole.hexdigest(), "items": out}


def storage_items(ckpt_dir: Path) -> dict[str, list[tuple[int, int]]]:
    """Per ``.distcp`` file, the ``(offset, length)`` of each storage item, from ``.metadata``
    (read with metadata.py's allowlist unpickler, never ``pickle.load``)."""
    meta = load_dcp_metadata(Path(ckpt_dir) / ".metadata")
    storage = getattr(meta, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{ckpt_dir}/.metadata: no storage_data; not a DCP checkpoint")
    return _per_file(storage.values(), f"{ckpt_dir}/.metadata")


def _per_file(infos, where: str) -> dict[str, list[tuple[int, int]]]:
    """DCP storage infos (``relative_path``, ``offset``, ``length``) grouped per file."""
    per_file: dict[str, list[tuple[int, int]]] = {}
    for info in infos:
        name = str(info.relative_path)
        if os.sep in name or name.startswith(".."):
            raise CheckpointError(f"{where} names file {name!r} outside the checkpoint directory")
        per_file.setdefault(name, []).append((int(info.offset), int(info.length)))
    return per_file


def compute_written(ckpt_dir: str | os.PathLike, infos) -> dict[str, dict]:
    """Digests of the files one writer just wrote, from its own write results' storage infos
    (before any ``.metadata`` exists: the asynchronous save digests beside the steps);
    :func:`write` later checks they cover what ``.metadata`` names."""
    ckpt_dir = Path(ckpt_dir)
    per_file = _per_file(infos, f"the write results for {ckpt_dir}")
    return {n: digest_file(ckpt_dir / n, per_file[n]) for n in sorted(per_file)}


def _writer_rank(name: str) -> int | None:
    """``__R_K.distcp`` was written by global rank R (torch DCP's file naming)."""
    m = re.match(r"^__(\d+)_\d+\.distcp$", name)
    return int(m.group(1)) if m else None


def compute(ckpt_dir: str | os.PathLike, rank: int = 0, world: int = 1) -> dict[str, dict]:
    """Digests of this rank's share of the files: those it wrote (``__<rank>_K.distcp``, still in
    its page cache), and of any other names every ``world``-th (sorted) from ``rank``."""
    ckpt_dir = Path(ckpt_dir)
    per_file = storage_items(ckpt_dir)
    others = sorted(n for n in per_file if (_writer_rank(n) or 0) >= world or _writer_rank(n) is None)
    mine = [n for n in sorted(per_file) if n not in others and _writer_rank(n) == rank] + others[rank::world]
    return {n: digest_file(ckpt_dir / n, per_file[n]) for n in mine}


def write(ckpt_dir: str | os.PathLike, files: dict[str, dict]) -> Path:
    """Write ``integrity.json`` (call inside the checkpoint's staging folder, before publish)."""
    ckpt_dir = Path(ckpt_dir)
    expected = set(storage_items(ckpt_dir))
    if set(files) != expected:
        raise IntegrityError(f"{ckpt_dir}: digests cover {sorted(files)} but .metadata names {sorted(expected)}")
    path = ckpt_dir / DIGEST_FILE
    body = {"format": FORMAT, "algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return path


def seal(ckpt_dir: str | os.PathLike) -> Path:
    """One process: compute every file's digests and write ``integrity.json``."""
    return write(ckpt_dir, compute(ckpt_dir))


@dataclass
class Digests:
    """The digests a checkpoint carries; :meth:`check` compares bytes just read."""

    path: Path
    files: dict[str, dict]

    def expected(self, file: str, offset: int, length: int) -> str | None:
        return self.files.get(file, {}).get("items", {}).get(item_key(offset, length))

    def matches_parts(self, file: str, offset: int, length: int, parts) -> bool:
        """Whether bytes held in pieces (in file order) hash to the saved digest (not joined)."""
        want = self.expected(file, offset, length)
        h = xxhash.xxh3_64()
        for p in parts:
            h.update(p)
        return want is not None and h.hexdigest() == want

    def check(self, file: str, offset: int, length: int, data, what) -> None:
        """Raise naming the file, byte range and ``what`` (a string, or a callable giving it:
        only called on a mismatch) when ``data`` is not what was saved there."""
        want = self.expected(file, offset, length)
        if want is not None and digest_bytes(data) == want:
            return
        what = what() if callable(what) else what
        if want is None:
            raise IntegrityError(f"{self.path}: no digest for {file}[{offset}:{offset + length}] ({what}); the "
                                 f"checkpoint's {DIGEST_FILE} does not belong to these .distcp files")
        got = digest_bytes(data)
        raise IntegrityError(f"{self.path.parent / file}[{offset}:{offset + length}] holding {what} is corrupt: "
                             f"{ALGORITHM} {got}, saved as {want}. The bytes changed after the save (disk or "
                             f"copy damage); restore this checkpoint from another copy or use an older one.")


def load(ckpt_dir: str | os.PathLike) -> Digests | None:
    """The checkpoint's digests, or None when it has none (saved before they existed, or foreign).

    The whole file is checked here, before any tensor byte is read: a damaged ``integrity.json``
    (not UTF-8, not JSON, or not the shape written by :func:`write`) raises naming it."""
    path = Path(ckpt_dir) / DIGEST_FILE
    body = read_json_object(path, "the checkpoint's digest file", IntegrityError)
    if body is None:
        return None
    if body.get("format") != FORMAT or body.get("algorithm") != ALGORITHM or not isinstance(body.get("files"), dict):
        raise IntegrityError(f"{path}: format {short_repr(body.get('format'))} "
                             f"/ algorithm {short_repr(body.get('algorithm'))} "
                             f"/ files {type(body.get('files')).__name__} not understood (expected format {FORMAT}, "
                             f"{ALGORITHM}, files an object); the digest file is damaged or from another tool")
    for name, entry in body["files"].items():
        problem = _entry_problem(entry)
        if problem:
            raise IntegrityError(f"{path}: files[{short_repr(name)}] {problem}; the digest file is damaged: restore it "
                                 f"from another copy of the checkpoint")
    return Digests(path, body["files"])


_HEX = re.compile(r"^[0-9a-f]{1,16}$")
_RANGE = re.compile(r"^\d+:\d+$")


def _entry_problem(entry) -> str | None:
    """What is wrong with one file's entry of ``integrity.json`` (None: nothing)."""
    if not isinstance(entry, dict):
        return f"is a {type(entry).__name__}, not an object"
    size, digest, items = entry.get("size"), entry.get("digest"), entry.get("items")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return f"size is {short_repr(size)}, not a byte count"
    if not isinstance(digest, str) or not _HEX.match(digest):
        return f"digest is {short_repr(digest)}, not an {ALGORITHM} hex digest"
    if not isinstance(items, dict):
        return f"items is a {type(items).__name__}, not an object"
    for k, v in items.items():
        if not _RANGE.match(k) or not isinstance(v, str) or not _HEX.match(v):
            return f"items[{short_repr(k)}] = {short_repr(v)} is not '<offset>:<length>': <{ALGORITHM} hex digest>"
    return None


UNVERIFIED_WARNING = (f"has no {DIGEST_FILE}: the integrity of its tensor bytes cannot be verified "
                      f"(saved before digests existed, or not by neon-hpc)")


def guard_reader(reader, digests: Digests):
    """Make a torch DCP ``FileSystemReader`` check every storage item it reads.

    DCP reads each item through ``_slice_file(stream, storage_info)``; this instance's version
    reads the item's bytes once, checks them, and hands DCP a buffer of those same bytes (no
    second read).  A mismatch raises :class:`IntegrityError` naming the file and the tensor."""

    def _fqn(sinfo) -> str:
        for idx, info in getattr(reader, "storage_data", {}).items():
            if info is sinfo or (info.relative_path, info.offset) == (sinfo.relative_path, sinfo.offset):
                off = list(idx.offset) if getattr(idx, "offset", None) is not None else []
                return f"{idx.fqn}@{off}"
        return "an unnamed item"

    def _slice_file(stream, sinfo):
        stream.seek(sinfo.offset)
        data = stream.read(sinfo.length)
        digests.check(str(sinfo.relative_path), sinfo.offset, sinfo.length, data, lambda: _fqn(sinfo))
        return _io.BytesIO(data)

    reader._slice_file = _slice_file
    return reader
