"""The shard format, written down once: names, dtypes, file naming, and the payload checksum.

A shard is one HDF5 file holding N trajectories, concatenated (CSR: flat arrays plus offset
arrays), so a shard is a handful of datasets whatever N is. The component README carries
the full table; the constants below are what the writer writes and the reader checks.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

FORMAT = "neon-hpc trajectory shard"
SCHEMA_VERSION = 1

# Per-token datasets (length T = total tokens) and their exact dtypes.
PER_TOKEN = {
    "tokens": np.dtype("<i4"),
    "loss_mask": np.dtype("u1"),
    "logprobs": np.dtype("<f4"),
    "versions": np.dtype("<i4"),
}
# Per-trajectory numeric datasets (length N).
PER_TRAJ = {
    "reward": np.dtype("<f8"),
    "advantage": np.dtype("<f8"),
    "version_min": np.dtype("<i4"),   # oldest weight version among generated tokens (-1: none)
    "version_max": np.dtype("<i4"),   # newest
}
# Per-trajectory strings (variable-length UTF-8; serial HDF5 only, which is all we use).
PER_TRAJ_STR = ("task_id", "group_id", "extra_json")  # extra_json: {"rewards","metadata","timings"}
OFFSETS = "offsets"                  # int64[N+1]: token range of trajectory i is [o[i], o[i+1])
TURN_PTR = "turn_ptr"                # int64[N+1]: turn_offsets of i are turn_offsets[p[i]:p[i+1]]
TURN_OFFSETS = "turn_offsets"        # int64[sum(turns+1)], token positions within the trajectory
ROUTES = "routed_experts"            # uint8/uint16[R, moe_layers, top_k] (optional)
ROUTE_OFFSETS = "route_offsets"      # int64[N+1]: rows of i; length 0 (no routes) or its token count
HAS_ROUTES = "has_routes"            # uint8[N]: 1 if trajectory i carries routes (tells None from empty)
INDEX_DTYPE = np.dtype("<i8")
ROUTE_DTYPES = (np.dtype("u1"), np.dtype("<u2"), np.dtype("<u4"))

# Checksum: CRC-32 over segments of at most BLOCK bytes. Per-token datasets are segmented
# per trajectory (so the writer can checksum each trajectory while it writes it and the
# reader while it reads), the others as one byte range. Segments are independent, so both
# sides compute them on a thread pool (zlib releases the GIL) overlapped with the I/O.
CHECKSUM_ALGO = "crc32-seg16M"
BLOCK = 16 << 20
_POOL_MIN_BYTES = 1 << 20            # below this a thread hop costs more than the CRC

_NAME_RE = re.compile(r"^(?P<ms>\d{13})\.(?P<writer>[A-Za-z0-9_-]+)\.(?P<session>[0-9a-f]{8})"
                      r"\.(?P<seq>\d{6,})\.n(?P<n>\d+)\.h5$")
_WRITER_BAD = re.compile(r"[^A-Za-z0-9_-]+")


@dataclass(frozen=True)
class ShardName:
    created_ms: int
    writer: str
    session: str
    seq: int
    num_trajectories: int

    def __str__(self) -> str:
        return (f"{self.created_ms:013d}.{self.writer}.{self.session}.{self.seq:06d}"
                f".n{self.num_trajectories}.h5")


def safe_writer(writer_id: str) -> str:
    """The writer id as it appears in file names: only [A-Za-z0-9_-] (others become '-')."""
    s = _WRITER_BAD.sub("-", writer_id).strip("-")
    return s or "writer"


def parse_shard_name(name: str) -> ShardName | None:
    """Parse a published shard's file name; None if it is not one.

    Names sort by creation time first, so a lexical sort of ready/ is (roughly) FIFO.
    """
    m = _NAME_RE.match(name)
    if not m:
        return None
    return ShardName(int(m["ms"]), m["writer"], m["session"], int(m["seq"]), int(m["n"]))


# --- checksum -------------------------------------------------------------------------

_pool: ThreadPoolExecutor | None = None


def crc_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                   thread_name_prefix="neon-store-crc")
    return _pool


def split_range(start: int, end: int, block: int = BLOCK) -> list[tuple[int, int]]:
    return [(a, min(a + block, end)) for a in range(start, end, block)]


def token_segments(offsets: np.ndarray, row_bytes: int) -> list[tuple[int, int]]:
    """Byte segments of a per-token (or per-route-row) dataset: per trajectory, split at BLOCK."""
    segs: list[tuple[int, int]] = []
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        segs.extend(split_range(a * row_bytes, b * row_bytes))
    return segs


class SegmentCrc:
    """Collects the CRC-32 of byte segments of one dataset, in segment order.

    ``add(buf)`` takes a bytes-like view of exactly one segment; large ones go to the pool.
    """

    def __init__(self) -> None:
        self._parts: list[int | Future] = []

    def add(self, buf) -> None:
        mv = memoryview(buf).cast("B")
        if mv.nbytes >= _POOL_MIN_BYTES:
            self._parts.append(crc_pool().submit(zlib.crc32, mv))
        else:
            self._parts.append(zlib.crc32(mv))

    def add_segments(self, flat: memoryview, segments: list[tuple[int, int]], base: int = 0) -> None:
        """Add each segment ``(a, b)`` of ``flat``, whose byte 0 is dataset byte ``base``."""
        for a, b in segments:
            self.add(flat[a - base:b - base])

    def result(self) -> np.ndarray:
        return np.array([p.result() if isinstance(p, Future) else p for p in self._parts], dtype="<u4")


def byte_view(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


def strings_crc(values: list[str]) -> np.ndarray:
    """Checksum of a string dataset: CRC-32 of its JSON list encoding."""
    return np.array([zlib.crc32(json.dumps(values, ensure_ascii=False).encode())], dtype="<u4")


def file_checksum(per_dataset: dict[str, np.ndarray]) -> str:
    """The file-level checksum: CRC-32 over (name, segment CRCs) of every dataset, sorted."""
    crc = 0
    for name in sorted(per_dataset):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(np.asarray(per_dataset[name], dtype="<u4").tobytes(), crc)
    return f"{CHECKSUM_ALGO}:{crc:08x}"


def route_storage_dtype(max_id: int) -> np.dtype:
    """Smallest unsigned dtype holding expert ids up to ``max_id`` (uint8 up to 255 experts...)."""
    for dt in ROUTE_DTYPES:
        if max_id <= np.iinfo(dt).max:
            return dt
    raise ValueError(f"expert id {max_id} does not fit in uint32")
