"""The shard format, written down once: names, dtypes, file naming, and the payload checksum.

A shard is one HDF5 file holding N trajectories, concatenated (CSR: flat arrays plus offset
arrays), so a shard is a handful of datasets whatever N is. The component README carries
the full table; the constants below are what the writer writes and the reader checks.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np
import xxhash

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

# Checksum: XXH3-64 of each dataset's bytes (streamed in order, so the writer hashes each
# trajectory's rows as it writes them without concatenating them), all stored in one
# file attribute ``digests`` (JSON {dataset: hex}; one attribute, not one per dataset,
# because each HDF5 attribute costs about a millisecond to write or read); the file
# attribute ``checksum`` hashes the sorted (name, digest) pairs, covering ``digests`` itself.
# XXH3 runs at memory speed (measured ~12 GB/s per core here, against ~1.5 GB/s for zlib's
# CRC-32), so validation stays close to the cost of the read itself.
CHECKSUM_ALGO = "xxh3_64"
DIGESTS_ATTR = "digests"

SHARD_SUFFIX = ".h5"                # a published shard's file name ends so (ShardName below)
_NAME_RE = re.compile(r"^(?P<ms>\d{13})\.(?P<writer>[A-Za-z0-9_-]+)\.(?P<session>[0-9a-f]{8})"
                      r"\.(?P<seq>\d{6,})\.n(?P<n>\d+)(?:\.x(?P<x>[0-9a-f]{16}))?\.h5$")
_WRITER_BAD = re.compile(r"[^A-Za-z0-9_-]+")


@dataclass(frozen=True)
class ShardName:
    created_ms: int
    writer: str
    session: str
    seq: int
    num_trajectories: int
    # XXH3-64 of the whole file's bytes (16 hex digits, ``.x<digest>`` before the suffix): the
    # reader checks it before HDF5 parses a byte, so a corrupt header is refused, never parsed
    # (libhdf5 can crash the process on one); shards named without it are read unchecked
    file_digest: str | None = None

    def __str__(self) -> str:
        x = f".x{self.file_digest}" if self.file_digest else ""
        return (f"{self.created_ms:013d}.{self.writer}.{self.session}.{self.seq:06d}"
                f".n{self.num_trajectories}{x}{SHARD_SUFFIX}")


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
    return ShardName(int(m["ms"]), m["writer"], m["session"], int(m["seq"]), int(m["n"]), m["x"])


def file_digest(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    """XXH3-64 of a file's bytes as 16 hex digits (:attr:`ShardName.file_digest`)."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return f"{h.intdigest():016x}"


# --- checksum -------------------------------------------------------------------------

class DatasetHash:
    """Streaming XXH3-64 over a dataset's bytes, fed in dataset order."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, a) -> "DatasetHash":
        self._h.update(byte_view(a) if isinstance(a, np.ndarray) else a)
        return self

    def digest(self) -> int:
        return self._h.intdigest()


def byte_view(a: np.ndarray) -> memoryview:
    if a.size == 0:  # memoryview cannot cast a view with a zero in its shape
        return memoryview(b"")
    return memoryview(np.ascontiguousarray(a)).cast("B")


def array_digest(a: np.ndarray) -> int:
    return DatasetHash().update(a).digest()


def strings_digest(values: list[str]) -> int:
    """Digest of a string dataset: XXH3-64 of its JSON list encoding."""
    return xxhash.xxh3_64_intdigest(json.dumps(values, ensure_ascii=False).encode())


def encode_digests(per_dataset: dict[str, int]) -> str:
    return json.dumps({k: f"{v:016x}" for k, v in sorted(per_dataset.items())})


def decode_digests(text: str) -> dict[str, int]:
    """Inverse of :func:`encode_digests`; ValueError if malformed."""
    obj = json.loads(text)
    if not isinstance(obj, dict):
        raise ValueError("digests attribute is not a JSON object")
    return {str(k): int(v, 16) for k, v in obj.items()}


def file_checksum(per_dataset: dict[str, int]) -> str:
    """The file-level checksum over (name, digest) of every dataset, sorted by name."""
    h = xxhash.xxh3_64()
    for name in sorted(per_dataset):
        h.update(name.encode() + b"\0" + int(per_dataset[name]).to_bytes(8, "little"))
    return f"{CHECKSUM_ALGO}:{h.hexdigest()}"


def route_storage_dtype(max_id: int) -> np.dtype:
    """Smallest unsigned dtype holding expert ids up to ``max_id`` (uint8 up to 255 experts...)."""
    for dt in ROUTE_DTYPES:
        if max_id <= np.iinfo(dt).max:
            return dt
    raise ValueError(f"expert id {max_id} does not fit in uint32")
