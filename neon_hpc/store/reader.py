"""Reading shards: every check the README lists, at the edge, before anything is trusted.

:func:`read_shard` raises :class:`ShardError` (naming the file and what is wrong) for a file
that is not a complete, uncorrupted shard of a schema version we read; it never returns
partial data. Small datasets are read and checked first, so a corrupted size field cannot
make the reader allocate or read more than the file holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from neon_hpc.store import schema as S
from neon_hpc.store.trajectory import Trajectory


class ShardError(Exception):
    """A shard failed validation. ``path`` and ``reason`` say which file and what is wrong."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}")


def read_shard(path: str | os.PathLike) -> list[Trajectory]:
    """All trajectories of one shard, validated (schema, shapes, offsets, checksums).

    A shard whose name carries its file digest (``schema.ShardName.file_digest``) is checked
    against it before HDF5 parses a byte: libhdf5 can crash the process on a corrupt header."""
    path = Path(path)
    check_file_digest(path)
    try:
        with h5py.File(path, "r") as f:
            return _Reader(path, f).trajectories()
    except ShardError:
        raise
    except FileNotFoundError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError, UnicodeDecodeError) as e:
        # h5py reports a torn or corrupted file as one of these, depending on where it breaks.
        raise ShardError(path, f"unreadable as HDF5 ({type(e).__name__}: {e}); the file is truncated "
                               f"or corrupted") from e


def check_file_digest(path: Path) -> None:
    """Raise :class:`ShardError` when ``path``'s name carries a file digest its bytes do not give
    (before anything opens it as HDF5); a name without one passes unchecked."""
    sn = S.parse_shard_name(path.name)
    if sn is None or sn.file_digest is None:
        return
    try:
        got = S.file_digest(path)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ShardError(path, f"unreadable ({type(e).__name__}: {e})") from e
    if got != sn.file_digest:
        raise ShardError(path, f"file digest mismatch (its name says {sn.file_digest}, the bytes give {got}): "
                               f"the file is corrupted or truncated; it is not opened")


def shard_summary(path: str | os.PathLike) -> dict[str, Any]:
    """File attributes and dataset shapes, without reading or checking the payload (the file
    digest its name carries is checked first, as :func:`read_shard` does)."""
    path = Path(path)
    check_file_digest(path)
    try:
        with h5py.File(path, "r") as f:
            attrs = {k: _plain(v) for k, v in f.attrs.items()}
            dsets = {name: {"shape": list(d.shape),
                            "dtype": "utf-8 string" if h5py.check_string_dtype(d.dtype) else str(d.dtype),
                            "compression": d.compression, "chunks": d.chunks}
                     for name, d in f.items() if isinstance(d, h5py.Dataset)}
    except OSError as e:
        raise ShardError(path, f"unreadable as HDF5 ({e})") from e
    return {"path": str(path), "file_bytes": path.stat().st_size, "attrs": attrs, "datasets": dsets}


def _plain(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return v


class _Reader:
    def __init__(self, path: Path, f: h5py.File):
        self.path, self.f = path, f
        self.file_bytes = path.stat().st_size
        self.digests: dict[str, int] = {}    # computed while reading
        self.recorded: dict[str, int] = {}   # from the digests attribute
        self._opened: dict[str, h5py.h5d.DatasetID | None] = {}

    def fail(self, reason: str) -> ShardError:
        return ShardError(self.path, reason)

    # --- top level ----------------------------------------------------------------------
    def trajectories(self) -> list[Trajectory]:
        n, t = self._check_attrs()
        offsets = self._read_index(S.OFFSETS, n, t, "tokens")
        small = {name: self._read_whole(name, (n,), dt) for name, dt in S.PER_TRAJ.items()}
        strings = {name: self._read_strings(name, n) for name in S.PER_TRAJ_STR}
        turn_ptr = self._read_index(S.TURN_PTR, n, None, "turn offsets")
        turns = self._read_whole(S.TURN_OFFSETS, (int(turn_ptr[-1]),), S.INDEX_DTYPE)
        self._check_turns(offsets, turn_ptr, turns)
        per_token = {name: self._read_per_token(name, offsets, dt, ()) for name, dt in S.PER_TOKEN.items()}
        routes, route_offsets, has_routes, orig = self._read_routes(n, offsets)
        self._check_file_checksum()
        extras = [self._parse_extra(i, s) for i, s in enumerate(strings["extra_json"])]
        return [self._build(i, offsets, per_token, small, strings, extras, turn_ptr, turns,
                            routes, route_offsets, has_routes, orig) for i in range(n)]

    def _build(self, i, offsets, per_token, small, strings, extras, turn_ptr, turns,
               routes, route_offsets, has_routes, orig) -> Trajectory:
        a, b = int(offsets[i]), int(offsets[i + 1])
        r = None
        if routes is not None and has_routes[i]:
            r = routes[int(route_offsets[i]):int(route_offsets[i + 1])]
            r = r if r.dtype == orig else r.astype(orig)
        return Trajectory(
            tokens=per_token["tokens"][a:b], loss_mask=per_token["loss_mask"][a:b],
            logprobs=per_token["logprobs"][a:b], versions=per_token["versions"][a:b],
            routed_experts=r, reward=float(small["reward"][i]), rewards=extras[i]["rewards"],
            task_id=strings["task_id"][i], group_id=strings["group_id"][i],
            turn_offsets=turns[int(turn_ptr[i]):int(turn_ptr[i + 1])],
            advantage=float(small["advantage"][i]), metadata=extras[i]["metadata"],
            timings=extras[i]["timings"])

    # --- attributes ---------------------------------------------------------------------
    def _check_attrs(self) -> tuple[int, int]:
        a = self.f.attrs
        fmt = _plain(a.get("format"))
        if fmt != S.FORMAT:
            raise self.fail(f"not a neon-hpc trajectory shard (format attribute {fmt!r}, "
                            f"expected {S.FORMAT!r})")
        version = _plain(a.get("schema_version"))
        if version != S.SCHEMA_VERSION:
            raise self.fail(f"schema_version {version!r}; this neon-hpc reads version {S.SCHEMA_VERSION}. "
                            f"Read it with the neon-hpc release that wrote it")
        for key in ("num_trajectories", "num_tokens", "checksum", S.DIGESTS_ATTR):
            if key not in a:
                raise self.fail(f"attribute {key!r} is missing")
        try:
            self.recorded = S.decode_digests(str(_plain(a[S.DIGESTS_ATTR])))
        except (ValueError, TypeError, AttributeError) as e:
            raise self.fail(f"attribute {S.DIGESTS_ATTR!r} is malformed ({e})") from e
        n, t = _plain(a["num_trajectories"]), _plain(a["num_tokens"])
        if not isinstance(n, int) or not isinstance(t, int) or n < 1 or t < 0:
            raise self.fail(f"num_trajectories={n!r} / num_tokens={t!r} are not valid counts")
        if t > self.file_bytes or n > self.file_bytes:  # at least a byte per token / trajectory
            raise self.fail(f"num_tokens={t} / num_trajectories={n} exceed the file size "
                            f"({self.file_bytes} bytes)")
        return n, t

    def _check_file_checksum(self) -> None:
        want = _plain(self.f.attrs["checksum"])
        got = S.file_checksum(self.digests)
        if want != got:
            raise self.fail(f"file checksum mismatch (attribute {want}, computed {got})")

    # --- datasets (low-level h5py API: the high-level one costs ~1 ms per dataset here) ---
    def _open(self, name: str) -> h5py.h5d.DatasetID | None:
        if name not in self._opened:
            try:
                self._opened[name] = h5py.h5d.open(self.f.id, name.encode())
            except KeyError:
                self._opened[name] = None
        return self._opened[name]

    def _dataset(self, name: str, shape: tuple[int, ...], dtype: np.dtype | None) -> h5py.h5d.DatasetID:
        d = self._open(name)
        if d is None:
            raise self.fail(f"dataset {name!r} is missing")
        if tuple(d.shape) != tuple(shape):
            raise self.fail(f"dataset {name!r} has shape {tuple(d.shape)}, expected {tuple(shape)}")
        if dtype is not None and d.dtype != dtype:
            raise self.fail(f"dataset {name!r} has dtype {d.dtype}, expected {dtype}")
        if d.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS and int(np.prod(shape)):
            start = d.get_offset()
            end = None if start is None else start + d.get_storage_size()
            if end is None or end > self.file_bytes:
                raise self.fail(f"dataset {name!r} ends at byte {end} beyond the file size "
                                f"{self.file_bytes}: the file is truncated")
        return d

    def _verify(self, name: str, d: h5py.h5d.DatasetID, got: int) -> None:
        want = self.recorded.get(name)
        if want is None:
            raise self.fail(f"dataset {name!r} has no digest in the {S.DIGESTS_ATTR!r} attribute")
        if want != got:
            raise self.fail(f"checksum mismatch in dataset {name!r} (recorded {want:016x}, "
                            f"computed {got:016x}): the payload is corrupted")
        self.digests[name] = got

    def _read_whole(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        d = self._dataset(name, shape, dtype)
        out = np.empty(shape, dtype=dtype)
        if out.size:
            d.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
        self._verify(name, d, S.array_digest(out))
        return out

    def _read_strings(self, name: str, n: int) -> list[str]:
        d = self._dataset(name, (n,), None)
        if h5py.check_string_dtype(d.dtype) is None:
            raise self.fail(f"dataset {name!r} is not a string dataset (dtype {d.dtype})")
        values = [str(s) for s in h5py.Dataset(d).asstr()[()]]
        self._verify(name, d, S.strings_digest(values))
        return values

    def _read_index(self, name: str, n: int, total: int | None, what: str) -> np.ndarray:
        o = self._read_whole(name, (n + 1,), S.INDEX_DTYPE)
        if o[0] != 0 or np.any(np.diff(o) < 0) or (total is not None and o[-1] != total):
            raise self.fail(f"{name} are out of range: must start at 0, never decrease and end at "
                            f"the number of {what} ({total if total is not None else 'any'}); "
                            f"got {o[:4].tolist()}...{o[-2:].tolist()}")
        if o[-1] > self.file_bytes:
            raise self.fail(f"{name} end at {int(o[-1])}, more {what} than the file can hold")
        return o

    def _read_per_token(self, name: str, offsets: np.ndarray, dtype: np.dtype,
                        row_shape: tuple[int, ...]) -> np.ndarray:
        """One read call for the whole dataset (reading in 4-16 MB slabs, to hash while the
        data is in cache, measured no faster cold and slower at times), then one hash pass."""
        total = int(offsets[-1])
        d = self._dataset(name, (total, *row_shape), dtype)
        out = np.empty((total, *row_shape), dtype=dtype)
        if total:
            d.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
        self._verify(name, d, S.array_digest(out))
        return out

    def _read_routes(self, n: int, offsets: np.ndarray):
        if self._open(S.ROUTES) is None and self._open(S.ROUTE_OFFSETS) is None:
            return None, None, None, None
        ro = self._read_index(S.ROUTE_OFFSETS, n, None, "route rows")
        has = self._read_whole(S.HAS_ROUTES, (n,), np.dtype("u1"))
        lengths, route_len = np.diff(offsets), np.diff(ro)
        wrong = np.where(has != 0, route_len != lengths, route_len != 0) | (has > 1)
        if np.any(wrong):
            i = int(np.nonzero(wrong)[0][0])
            raise self.fail(f"route_offsets give trajectory {i} {int(route_len[i])} route rows for "
                            f"{int(lengths[i])} tokens")
        d = self._open(S.ROUTES)
        if d is None or len(d.shape) != 3 or d.dtype not in S.ROUTE_DTYPES:
            raise self.fail(f"dataset {S.ROUTES!r} is missing or not a [rows, layers, top_k] unsigned array")
        orig = self._orig_dtype(h5py.Dataset(d))
        routes = self._read_per_token(S.ROUTES, ro, d.dtype, tuple(d.shape[1:]))
        return routes, ro, has, orig

    def _orig_dtype(self, d: h5py.Dataset) -> np.dtype:
        raw = _plain(d.attrs.get("orig_dtype", d.dtype.str))
        try:
            dt = np.dtype(str(raw))
        except TypeError as e:
            raise self.fail(f"routed_experts orig_dtype {raw!r} is not a dtype") from e
        if dt.kind not in "iu":
            raise self.fail(f"routed_experts orig_dtype {raw!r} is not an integer dtype")
        return dt

    def _check_turns(self, offsets: np.ndarray, turn_ptr: np.ndarray, turns: np.ndarray) -> None:
        lengths = np.diff(offsets)
        for i in range(len(lengths)):
            t = turns[int(turn_ptr[i]):int(turn_ptr[i + 1])]
            if len(t) < 1 or t.min() < 0 or t.max() > lengths[i] or np.any(np.diff(t) < 0):
                raise self.fail(f"turn_offsets of trajectory {i} ({t[:6].tolist()}) are out of range "
                                f"[0, {int(lengths[i])}] or decreasing")

    def _parse_extra(self, i: int, s: str) -> dict[str, Any]:
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            raise self.fail(f"extra_json of trajectory {i} is not JSON ({e})") from e
        if not isinstance(obj, dict) or not all(isinstance(obj.get(k), dict)
                                                for k in ("rewards", "metadata", "timings")):
            raise self.fail(f"extra_json of trajectory {i} lacks rewards/metadata/timings objects")
        return obj
