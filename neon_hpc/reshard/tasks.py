"""The conversion's tasks: which byte ranges each HF tensor needs, which rank does it, and
where in which output file its bytes go.  Pure: built from metadata only, identical on
every rank (so ranks never exchange them), printable with ``--dry-run``.

Steps:

1. :func:`neon_hpc.reshard.slabs.list_slabs` lists slabs (one source tensor at fixed layer /
   expert indices) and the HF tensors each yields.
2. Slabs that share a saved chunk join one *task* (:class:`ChunkTask`; a chunk is read once); usually a task is
   one slab and its handful of chunks (one expert's gate+up chunks, one layer's QKV chunks).
3. Tasks go to ranks largest first, each to the least-loaded rank (LPT, by bytes read+written).
4. Each rank's outputs are packed, in its task order, into its own safetensors files of at
   most ``shard_cap`` bytes; header and per-tensor byte offsets are fixed here, so the
   executor can write every tensor with one ``pwrite`` as soon as its task is done.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from math import prod

from neon_hpc.checkpoint.metadata import DTYPE_BYTES, Checkpoint, CheckpointError, Chunk, check_chunks_present
from neon_hpc.reshard.slabs import ModelSpec, OutTensor, Slab, list_slabs

ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
             "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
DEFAULT_SHARD_CAP = 5 * 1000**3


def out_nbytes(o: OutTensor) -> int:
    return o.numel * DTYPE_BYTES[o.dtype]


@dataclass
class ChunkTask:
    id: int
    slabs: list[Slab]
    chunks: list[tuple[str, Chunk]]       # (key, chunk), each read once
    rank: int = 0

    @property
    def read_bytes(self) -> int:
        return sum(c.length for _, c in self.chunks)

    @property
    def write_bytes(self) -> int:
        return sum(out_nbytes(o) for s in self.slabs for o in s.outputs)

    @property
    def streamable(self) -> bool:
        """Each chunk is a band of whole rows of its slab and every output a row range of it
        (copy, [gate; up] halves, vocab trim): then each chunk maps to contiguous byte ranges of
        the outputs and is written as soon as it is read, one chunk in memory at a time."""
        for s in self.slabs:
            n = len(s.index)
            if any(o.op.kind not in ("copy", "rows") for o in s.outputs):
                return False
            if any(c.sizes[n + 1:] != s.shape[1:] for k, c in self.chunks if k == s.key and intersects(s, c)):
                return False
        return True

    @property
    def memory_bytes(self) -> int:
        """Tensor bytes held at once: one chunk when streamed, else all chunks plus the slab."""
        dtype = {s.key: s.dtype for s in self.slabs}
        chunk_bytes = [c.numel * DTYPE_BYTES[dtype[k]] for k, c in self.chunks]
        if self.streamable:
            return max(chunk_bytes)
        return sum(chunk_bytes) + max(prod(s.shape) * DTYPE_BYTES[s.dtype] for s in self.slabs)


def intersects(slab: Slab, c: Chunk) -> bool:
    """Whether chunk ``c`` of ``slab.key`` holds part of the slab (same leading indices)."""
    return all(o <= i < o + n for i, o, n in zip(slab.index, c.offsets, c.sizes))


@dataclass
class ShardFile:
    name: str
    rank: int
    entries: list[tuple[OutTensor, int, int]] = field(default_factory=list)  # (tensor, begin, end) in data
    header: bytes = b""

    @property
    def data_bytes(self) -> int:
        return self.entries[-1][2] if self.entries else 0

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes


@dataclass
class ConversionTasks:
    ckpt: Checkpoint
    spec: ModelSpec
    ranks: int
    tasks: list[ChunkTask]
    shards: list[ShardFile]
    location: dict[str, tuple[str, int]]   # HF name -> (shard file, absolute byte offset)

    def tasks_of(self, rank: int) -> list[ChunkTask]:
        return [t for t in self.tasks if t.rank == rank]

    def shards_of(self, rank: int) -> list[ShardFile]:
        return [s for s in self.shards if s.rank == rank]

    @property
    def read_bytes(self) -> int:
        return sum(t.read_bytes for t in self.tasks)

    @property
    def write_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def index_json(self) -> dict:
        total = sum(s.data_bytes for s in self.shards)
        weight_map = {o.name: s.name for s in self.shards for o, _, _ in s.entries}
        return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}

    def summary(self) -> str:
        lines = [f"checkpoint {self.ckpt.path}: {len(self.ckpt.tensors)} tensor keys, arch {self.spec.arch}",
                 f"  {len(self.tasks)} tasks over {self.ranks} rank(s); read {_gb(self.read_bytes)}, "
                 f"write {_gb(self.write_bytes)} in {len(self.shards)} file(s); tensor memory per rank at most "
                 f"{_gb(max((t.memory_bytes for t in self.tasks), default=0))}"]
        for r in range(self.ranks):
            ts = self.tasks_of(r)
            lines.append(f"  rank {r}: {len(ts)} tasks, read {_gb(sum(t.read_bytes for t in ts))}, write "
                         f"{_gb(sum(t.write_bytes for t in ts))}, files "
                         f"{', '.join(s.name for s in self.shards_of(r)) or '-'}")
        return "\n".join(lines)

    def describe(self, max_tasks: int | None = None) -> str:
        """Dry-run listing: the summary, then tasks with their byte ranges and HF tensors."""
        lines = [self.summary()]
        tasks = sorted(self.tasks, key=lambda t: (t.rank, t.id))
        if max_tasks is not None and len(tasks) > max_tasks:
            lines.append(f"  (first {max_tasks} of {len(tasks)} tasks; --tasks -1 lists all)")
            tasks = tasks[:max_tasks]
        for t in tasks:
            lines.append(f"task {t.id} rank {t.rank}: read {t.read_bytes} B from {len(t.chunks)} chunk(s)")
            for key, c in t.chunks:
                lines.append(f"    {c.file}[{c.offset}:{c.offset + c.length}]  {key}@{list(c.offsets)}+{list(c.sizes)}")
            for s in t.slabs:
                for o in s.outputs:
                    f, off = self.location[o.name]
                    lines.append(f"    -> {o.name} {list(o.shape)} {o.dtype} {o.op.kind}{list(o.op.args)}  {f}@{off}")
        return "\n".join(lines)


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e7 else f"{n / 1e3:.1f} kB"


# ---------------------------------------------------------------------------------------


def group_tasks(ckpt: Checkpoint, slabs: list[Slab]) -> list[ChunkTask]:
    """Join slabs that share a chunk (union-find); each group becomes one task."""
    parent = list(range(len(slabs)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    slab_ids = {(s.key, s.index): i for i, s in enumerate(slabs)}
    chunk_slabs: dict[tuple[str, tuple], list[int]] = {}
    chunk_obj: dict[tuple[str, tuple], Chunk] = {}
    for key in sorted({s.key for s in slabs}):
        tm = ckpt.tensors[key]
        n_lead = len(tm.shape) - len(next(s.shape for s in slabs if s.key == key))
        for c in tm.chunks:
            covered = _cover(c, n_lead)
            ids = [slab_ids[(key, idx)] for idx in covered if (key, idx) in slab_ids]
            if not ids:
                continue
            chunk_slabs[(key, c.offsets)] = ids
            chunk_obj[(key, c.offsets)] = c
            for i in ids[1:]:
                parent[find(i)] = find(ids[0])
    groups: dict[int, list[int]] = {}
    for i in range(len(slabs)):
        groups.setdefault(find(i), []).append(i)
    chunks_of_root: dict[int, list[tuple[str, Chunk]]] = {}
    for ck, ids in chunk_slabs.items():
        chunks_of_root.setdefault(find(ids[0]), []).append((ck[0], chunk_obj[ck]))
    tasks = []
    for root, ids in groups.items():
        chunks = sorted(chunks_of_root.get(root, []), key=lambda kc: (kc[0], kc[1].offsets))
        tasks.append(ChunkTask(0, [slabs[i] for i in ids], chunks))
    _check_coverage(ckpt, tasks)
    return tasks


def _cover(c: Chunk, n_lead: int) -> list[tuple[int, ...]]:
    out = [()]
    for o, s in zip(c.offsets[:n_lead], c.sizes[:n_lead]):
        out = [i + (j,) for i in out for j in range(o, o + s)]
    return out


def _check_coverage(ckpt: Checkpoint, tasks: list[ChunkTask]) -> None:
    """Every slab must be fully covered by its chunks (else the metadata is incomplete)."""
    for t in tasks:
        for s in t.slabs:
            n_lead = len(s.index)
            need = prod(s.shape)
            have = 0
            for key, c in t.chunks:
                if key != s.key:
                    continue
                if intersects(s, c):
                    have += prod(c.sizes[n_lead:])
            if have != need:
                raise CheckpointError(f"{ckpt.path}: chunks of {s.key} at index {list(s.index)} cover {have} of "
                                      f"{need} elements; the checkpoint metadata is incomplete or overlapping")


def assign_ranks(tasks: list[ChunkTask], ranks: int) -> list[ChunkTask]:
    """Largest task first onto the least-loaded rank; ties by rank number (deterministic)."""
    order = sorted(tasks, key=lambda t: (-(t.read_bytes + t.write_bytes), t.slabs[0].outputs[0].name))
    load = [0] * ranks
    for i, t in enumerate(order):
        r = min(range(ranks), key=lambda k: (load[k], k))
        t.id, t.rank = i, r
        load[r] += t.read_bytes + t.write_bytes
    return order


def pack_shards(tasks: list[ChunkTask], ranks: int, shard_cap: int) -> list[ShardFile]:
    """Pack each rank's outputs (in task order) into files of at most ``shard_cap`` bytes."""
    per_rank: list[list[ShardFile]] = [[] for _ in range(ranks)]
    for r in range(ranks):
        cur: ShardFile | None = None
        for t in (t for t in tasks if t.rank == r):
            for s in t.slabs:
                for o in s.outputs:
                    n = out_nbytes(o)
                    if cur is None or (cur.entries and cur.data_bytes + n > shard_cap):
                        cur = ShardFile("", r)
                        per_rank[r].append(cur)
                    begin = cur.data_bytes
                    cur.entries.append((o, begin, begin + n))
    shards = [s for lst in per_rank for s in lst]
    total = len(shards)
    for i, s in enumerate(shards):
        s.name = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        s.header = safetensors_header(s.entries)
    return shards


def safetensors_header(entries: list[tuple[OutTensor, int, int]]) -> bytes:
    """The 8-byte length + JSON header of a safetensors file, padded to 8 bytes with spaces."""
    meta = {"__metadata__": {"format": "pt"}}
    for o, b, e in entries:
        meta[o.name] = {"dtype": ST_DTYPES[o.dtype], "shape": list(o.shape), "data_offsets": [b, e]}
    body = json.dumps(meta, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def make_tasks(ckpt: Checkpoint, spec: ModelSpec, ranks: int = 1,
               shard_cap: int = DEFAULT_SHARD_CAP) -> ConversionTasks:
    """Build all tasks and output files from metadata; raises before anything is written on any problem
    (unknown key, shape mismatch, missing or truncated ``.distcp``)."""
    if ranks < 1:
        raise ValueError("ranks must be >= 1")
    slabs = list_slabs(ckpt, spec)
    check_chunks_present(ckpt, sorted({s.key for s in slabs}))
    tasks = assign_ranks(group_tasks(ckpt, slabs), ranks)
    shards = pack_shards(tasks, ranks, shard_cap)
    location = {o.name: (s.name, len(s.header) + b) for s in shards for o, b, _ in s.entries}
    return ConversionTasks(ckpt, spec, ranks, tasks, shards, location)
