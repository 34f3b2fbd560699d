"""Writing shards: :func:`write_shard` (one file) and :class:`ShardWriter` (buffer + publish).

Publishing: the file is written under ``trajectories/tmp/``, fsynced, digested (XXH3-64 of its
bytes, into its published name: ``schema.ShardName.file_digest``), renamed into
``trajectories/ready/`` and the directory fsynced. A crash at any point leaves either no
file in ready/ or a complete one; a leftover ``tmp/.<name>.tmp.part`` is removed by the next writer
with the same ``writer_id``, or by any writer once it is ``stale_tmp_s`` old (README).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from neon_hpc.config.store import StoreConfig
from neon_hpc.protocol.rundir import RunDir, fsync_dir, storage_error
from neon_hpc.store import schema as S
from neon_hpc.store.trajectory import Trajectory
from neon_hpc.util.logs import job_id as current_job_id

log = logging.getLogger("neon_hpc.store")

# Hidden, with ".tmp." inside: the run directory's convention for files in progress
# (rundir.remove_stale_tmp and `neon-hpc status` treat them as such).
TMP_SUFFIX = ".tmp.part"


def tmp_name(shard_name: str) -> str:
    return f".{shard_name}{TMP_SUFFIX}"


@dataclass
class ShardInfo:
    path: Path
    num_trajectories: int
    num_tokens: int
    nbytes: int          # payload bytes (all datasets, uncompressed)
    file_bytes: int
    write_s: float


def payload_nbytes(t: Trajectory) -> int:
    n = t.num_tokens
    r = 0 if t.routed_experts is None else t.routed_experts.nbytes
    return n * 13 + r


def _offsets(lengths: list[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=S.INDEX_DTYPE)
    np.cumsum(lengths, out=out[1:])
    return out


def _routes_format(trajs: list[Trajectory]) -> tuple[tuple[int, int], np.dtype, np.dtype] | None:
    """(layers, top_k), original dtype and storage dtype of the shard's routes; None if none."""
    with_routes = [t.routed_experts for t in trajs if t.routed_experts is not None]
    if not with_routes:
        return None
    shapes = {r.shape[1:] for r in with_routes}
    dtypes = {r.dtype for r in with_routes}
    if len(shapes) > 1 or len(dtypes) > 1:
        raise ValueError(f"routed_experts differ within one shard (shapes {sorted(shapes)}, dtypes "
                         f"{sorted(map(str, dtypes))}); one run has one route shape: fix the producer")
    orig = dtypes.pop()
    if orig.kind == "u" and orig.itemsize <= 2:
        return shapes.pop(), orig, orig.newbyteorder("<")   # already compact: no scan, no cast
    # wider ids (e.g. SGLang's int32): one scan finds the narrowest lossless storage dtype
    max_id = max((int(r.max()) for r in with_routes if r.size), default=0)
    return shapes.pop(), orig, S.route_storage_dtype(max_id)


def _check_same_routes(first: Trajectory, t: Trajectory) -> None:
    a, b = first.routed_experts, t.routed_experts
    if a is not None and b is not None and (a.shape[1:] != b.shape[1:] or a.dtype != b.dtype):
        raise ValueError(f"routed_experts differ within one shard ({a.shape[1:]} {a.dtype} vs "
                         f"{b.shape[1:]} {b.dtype} in task {t.task_id!r}); one run has one route shape: "
                         f"fix the producer")


# Datasets are created and written through h5py's low-level API: the high-level one costs
# about half a millisecond per call here, which for a shard of modest size was as much as
# writing its payload.

def _create_contiguous(f: h5py.File, name: str, shape: tuple[int, ...], dtype: np.dtype) -> h5py.h5d.DatasetID:
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    # every element gets written; without this HDF5 first fills the extent with zeros
    # (measured: twice the write time of a raw file)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return h5py.h5d.create(f.id, name.encode(), h5py.h5t.py_create(dtype), h5py.h5s.create_simple(shape),
                           dcpl=dcpl)


def _write_array(f: h5py.File, name: str, arr: np.ndarray) -> int:
    arr = np.ascontiguousarray(arr)
    d = _create_contiguous(f, name, arr.shape, arr.dtype)
    if arr.size:
        d.write(h5py.h5s.ALL, h5py.h5s.ALL, arr)
    return S.array_digest(arr)


def _write_rows(f: h5py.File, name: str, pieces: list[np.ndarray], offsets: np.ndarray, dtype: np.dtype,
                row_shape: tuple[int, ...], compression: str | None, chunk_rows: int) -> int:
    """Write per-trajectory row blocks into one dataset, one hyperslab each (no concatenated
    copy of the large routes array), hashing each block as it goes. Returns the digest."""
    total = int(offsets[-1])
    shape = (total, *row_shape)
    if compression and total:
        d = f.create_dataset(name, shape=shape, dtype=dtype, compression=compression, fill_time="never",
                             chunks=(min(chunk_rows, total), *row_shape)).id
    else:
        d = _create_contiguous(f, name, shape, dtype)
    h = S.DatasetHash()
    fspace = d.get_space()
    for i, piece in enumerate(pieces):
        a, b = int(offsets[i]), int(offsets[i + 1])
        if a == b:
            continue
        arr = np.ascontiguousarray(piece, dtype=dtype)
        h.update(arr)
        fspace.select_hyperslab((a,) + (0,) * len(row_shape), arr.shape)
        d.write(h5py.h5s.create_simple(arr.shape), fspace, arr)
    return h.digest()


def _write_strings(f: h5py.File, name: str, values: list[str]) -> int:
    f.create_dataset(name, data=np.array(values, dtype=object), dtype=h5py.string_dtype("utf-8"))
    return S.strings_digest(values)


def write_shard(path: str | os.PathLike, trajs: list[Trajectory], writer_id: str = "",
                job_id: str | None = None, cfg: StoreConfig | None = None) -> ShardInfo:
    """Write ``trajs`` (already checked) to one HDF5 file at ``path`` (not fsynced, not published)."""
    cfg = cfg or StoreConfig()
    t0 = time.perf_counter()
    if not trajs:
        raise ValueError("write_shard: no trajectories; a shard holds at least one")
    offsets = _offsets([t.num_tokens for t in trajs])
    digests: dict[str, int] = {}
    with h5py.File(path, "w") as f:
        for name, dt in S.PER_TOKEN.items():  # 13 bytes per token in all: concatenating is cheap
            digests[name] = _write_array(f, name,
                                         np.concatenate([getattr(t, name) for t in trajs]).astype(dt, copy=False))
        digests.update(_write_trajectory_fields(f, trajs, offsets))
        digests.update(_write_routes(f, trajs, cfg))
        _write_file_attrs(f, trajs, writer_id, job_id, digests)
    nbytes = sum(payload_nbytes(t) for t in trajs)
    return ShardInfo(Path(path), len(trajs), int(offsets[-1]), nbytes, os.path.getsize(path),
                     time.perf_counter() - t0)


def _write_trajectory_fields(f: h5py.File, trajs: list[Trajectory], offsets: np.ndarray) -> dict[str, int]:
    ranges = [t.version_range() for t in trajs]
    turns = [t.turns() for t in trajs]
    per_traj = {
        S.OFFSETS: offsets,
        "reward": np.array([t.reward for t in trajs], dtype=S.PER_TRAJ["reward"]),
        "advantage": np.array([t.advantage for t in trajs], dtype=S.PER_TRAJ["advantage"]),
        "version_min": np.array([r[0] for r in ranges], dtype=S.PER_TRAJ["version_min"]),
        "version_max": np.array([r[1] for r in ranges], dtype=S.PER_TRAJ["version_max"]),
        S.TURN_PTR: _offsets([len(t) for t in turns]),
        S.TURN_OFFSETS: np.concatenate(turns).astype(S.INDEX_DTYPE),
    }
    digests = {name: _write_array(f, name, arr) for name, arr in per_traj.items()}
    strings = {
        "task_id": [t.task_id for t in trajs],
        "group_id": [t.group_id for t in trajs],
        "extra_json": [json.dumps({"rewards": t.rewards, "metadata": t.metadata, "timings": t.timings},
                                  sort_keys=True) for t in trajs],
    }
    digests.update({name: _write_strings(f, name, vals) for name, vals in strings.items()})
    return digests


def _write_routes(f: h5py.File, trajs: list[Trajectory], cfg: StoreConfig) -> dict[str, int]:
    fmt = _routes_format(trajs)
    if fmt is None:
        return {}
    row_shape, orig_dtype, store_dtype = fmt
    route_offsets = _offsets([0 if t.routed_experts is None else t.num_tokens for t in trajs])
    comp = None if cfg.routed_experts_compression == "none" else cfg.routed_experts_compression
    digest = _write_rows(f, S.ROUTES, [t.routed_experts for t in trajs], route_offsets,
                         store_dtype, row_shape, comp, cfg.compression_chunk_tokens)
    f[S.ROUTES].attrs["orig_dtype"] = orig_dtype.str
    has = np.array([t.routed_experts is not None for t in trajs], dtype=np.uint8)
    return {S.ROUTES: digest, S.ROUTE_OFFSETS: _write_array(f, S.ROUTE_OFFSETS, route_offsets),
            S.HAS_ROUTES: _write_array(f, S.HAS_ROUTES, has)}


def _write_file_attrs(f: h5py.File, trajs: list[Trajectory], writer_id: str, job_id: str | None,
                      digests: dict[str, int]) -> None:
    f.attrs["format"] = S.FORMAT
    f.attrs["schema_version"] = S.SCHEMA_VERSION
    f.attrs["writer_id"] = writer_id
    f.attrs["job_id"] = job_id if job_id is not None else current_job_id()
    f.attrs["created"] = time.time()
    f.attrs["num_trajectories"] = len(trajs)
    f.attrs["num_tokens"] = sum(t.num_tokens for t in trajs)
    f.attrs[S.DIGESTS_ATTR] = S.encode_digests(digests)
    f.attrs["checksum"] = S.file_checksum(digests)


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardWriter:
    """Buffers trajectories and publishes them as shards into ``trajectories/ready/``.

    >>> with ShardWriter(run_dir, "rollout-3") as w:
    ...     w.add(traj)          # may flush (count, bytes or age reached)
    ...     w.flush_if_due()     # call when idle so old trajectories do not wait for company

    ``writer_id`` must be unique among live writers of one run (role + rank, e.g.
    ``rollout-3``); a restarted writer reuses it and cleans up its crashed predecessor's
    temporary files.
    """

    def __init__(self, run_dir, writer_id: str, cfg: StoreConfig = StoreConfig(), job_id: str | None = None):
        self.rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.writer_id, self.cfg = writer_id, cfg
        self.job_id = job_id if job_id is not None else current_job_id()
        self._name_writer = S.safe_writer(writer_id)
        self._session = uuid.uuid4().hex[:8]
        self._seq = 0
        self._buf: list[Trajectory] = []
        self._buf_bytes = 0
        self._first_at: float | None = None
        self.published: list[ShardInfo] = []
        for d in (self.rd.traj_tmp, self.rd.traj_ready):
            d.mkdir(parents=True, exist_ok=True)
        self._remove_predecessor_tmp()

    # --- public -------------------------------------------------------------------------
    def add(self, traj: Trajectory) -> Path | None:
        """Check and buffer one trajectory; returns the shard path if this add flushed."""
        traj.check()
        if self._buf:
            _check_same_routes(self._buf[0], traj)  # refuse a route shape change now, not at flush
        self._buf.append(traj)
        self._buf_bytes += payload_nbytes(traj)
        if self._first_at is None:
            self._first_at = time.monotonic()
        return self.flush_if_due()

    def flush_if_due(self) -> Path | None:
        if not self._buf:
            return None
        due = (len(self._buf) >= self.cfg.flush_trajectories
               or self._buf_bytes >= self.cfg.flush_bytes
               or time.monotonic() - self._first_at >= self.cfg.flush_seconds)
        return self.flush() if due else None

    def flush(self) -> Path | None:
        """Publish everything buffered as one shard; returns its path in ready/ (None if empty)."""
        if not self._buf:
            return None
        sn = S.ShardName(int(time.time() * 1000), self._name_writer, self._session, self._seq, len(self._buf))
        tmp = self.rd.traj_tmp / tmp_name(str(sn))
        final = self.rd.traj_ready / str(sn)
        try:
            info = write_shard(tmp, self._buf, self.writer_id, self.job_id, self.cfg)
            if self.cfg.fsync:
                fsync_file(tmp)
            name = str(dataclasses.replace(sn, file_digest=S.file_digest(tmp)))   # the name carries the bytes' digest
            final = self.rd.traj_ready / name
            os.rename(tmp, final)
            if self.cfg.fsync:
                fsync_dir(final.parent)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            full = storage_error(e, final, "publishing shard") if isinstance(e, Exception) else None
            if full is not None:   # full or read-only: name the shard; the buffer is kept for a retry
                raise full from e
            raise
        info.path = final
        self.published.append(info)
        log.info("published %s: %d trajectories, %d tokens, %.1f MB in %.2fs", name,
                 info.num_trajectories, info.num_tokens, info.file_bytes / 1e6, info.write_s)
        self._seq += 1
        self._buf, self._buf_bytes, self._first_at = [], 0, None
        return final

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Flush on a clean exit and on an exception alike: buffered trajectories are complete.
        self.close()

    @property
    def pending(self) -> int:
        return len(self._buf)

    def stats(self) -> dict[str, float]:
        """Totals for metrics: shards, trajectories, tokens, bytes, write seconds."""
        p = self.published
        return {"shards": len(p), "trajectories": sum(i.num_trajectories for i in p),
                "tokens": sum(i.num_tokens for i in p), "bytes": sum(i.file_bytes for i in p),
                "write_s": sum(i.write_s for i in p), "pending": self.pending}

    # --- internals ----------------------------------------------------------------------
    def _remove_predecessor_tmp(self) -> None:
        """Delete tmp/ files of crashed writers: any of an earlier process with our writer id,
        and anyone's untouched for ``stale_tmp_s`` (a live flush rewrites its file within seconds)."""
        now = time.time()
        for p in self.rd.traj_tmp.glob(tmp_name("*")):
            sn = S.parse_shard_name(p.name[1:-len(TMP_SUFFIX)])
            mine = sn is not None and sn.writer == self._name_writer and sn.session != self._session
            try:
                stale = now - p.stat().st_mtime > self.cfg.stale_tmp_s
            except FileNotFoundError:
                continue
            if mine or stale:
                p.unlink(missing_ok=True)
                log.warning("removed %s left by a crashed writer", p)
