"""Read a Megatron ``torch_dist`` checkpoint's metadata without running its pickles.

A torch_dist checkpoint directory holds::

    metadata.json      {"sharded_backend": "torch_dist", ...}   (megatron's marker)
    common.pt          non-sharded state (torch.save; never needed to convert weights)
    .metadata          a pickled DCP ``Metadata``: per key the global shape, dtype and chunks;
                       per chunk ``(relative_path, offset, length)`` of its torch.save blob
    __R_K.distcp       the blobs, concatenated

``.metadata`` is a pickle that names torch (and possibly megatron) classes.  We never import
those classes: :class:`_MetadataUnpickler` maps an allowlist of ``module.name`` globals to
plain stand-ins and refuses everything else, so a foreign pickle cannot run code.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from dataclasses import dataclass, field
from math import prod
from pathlib import Path


class CheckpointError(RuntimeError):
    """The checkpoint is missing, truncated, foreign, or does not match its metadata."""


def read_json_object(path: Path, what: str, error: type[CheckpointError] = CheckpointError) -> dict | None:
    """Every JSON file reshard reads goes through here: ``path`` parsed as a JSON object, or
    None when it does not exist.  Any other problem (unreadable, not UTF-8, not JSON, not an
    object) raises ``error`` naming the file and ``what`` it should be, on one line."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror or e})") from e
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{path}: {what} is damaged: not UTF-8 text (byte {e.start}: {e.reason}); restore the file "
                    f"from another copy of the checkpoint") from None
    except (ValueError, RecursionError) as e:
        raise error(f"{path}: {what} is damaged: not valid JSON ({e}); restore the file from another copy "
                    f"of the checkpoint") from None
    if not isinstance(body, dict):
        raise error(f"{path}: {what} must be a JSON object, got {type(body).__name__}; the file is damaged "
                    f"or not {what}")
    return body


# DCP stores dtypes as torch globals; we keep their names.  Bytes per element for the task sizes.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4,
               "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a global tensor: where it sits in the tensor and in the files."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str            # relative to the checkpoint directory
    offset: int          # byte offset of the torch.save blob in ``file``
    length: int          # blob length in bytes

    @property
    def numel(self) -> int:
        return prod(self.sizes)


@dataclass
class TensorMeta:
    key: str
    shape: tuple[int, ...]
    dtype: str
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_BYTES.get(self.dtype, 4)


@dataclass
class Checkpoint:
    path: Path
    tensors: dict[str, TensorMeta]
    non_tensor_keys: list[str]          # BytesStorageMetadata entries (extra state, rng, ...)
    file_sizes: dict[str, int]
    digests: object = None              # integrity.Digests from integrity.json, or None (no digests)


# ---------------------------------------------------------------------------------------
# restricted unpickler


class _Record:
    """Stand-in for a pickled dataclass / object: keeps whatever state BUILD gives it."""

    _kind = "record"

    def __init__(self, *args):
        self._args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            self.__dict__.update(state[1] or {})
            if isinstance(state[0], dict):
                self.__dict__.update(state[0])
        else:
            self._state = state

    def __repr__(self):
        return f"<{self._kind} {self.__dict__}>"


def _record_class(name: str) -> type:
    return type(name, (_Record,), {"_kind": name})


class _TorchDtype(str):
    """A torch dtype, kept as its name (``torch.bfloat16`` -> ``"bfloat16"``)."""


def _name_of(value):
    return str(value)


def _size(*args):
    return tuple(int(x) for x in args[0]) if args else ()


_DCP = "torch.distributed.checkpoint"
_RECORD_NAMES = {
    f"{_DCP}.metadata": ["Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                         "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta"],
    f"{_DCP}.filesystem": ["_StorageInfo", "_StoragePrefix"],   # the latter: plans kept by cached_metadata saves
    f"{_DCP}.planner": ["SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData",
                        "LoadPlan", "ReadItem"],
    f"{_DCP}._extension": ["ExtensionRegistry"],
}
_RECORDS = {(mod, n): _record_class(n) for mod, names in _RECORD_NAMES.items() for n in names}
_FUNCS = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _name_of,
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"): int,
    (f"{_DCP}.planner", "WriteItemType"): int,
    (f"{_DCP}.planner", "LoadItemType"): int,
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, source: Path):
        super().__init__(f)
        self._source = source

    def find_class(self, module, name):
        if (module, name) in _RECORDS:
            return _RECORDS[(module, name)]
        if (module, name) in _FUNCS:
            return _FUNCS[(module, name)]
        if module == "torch" and name in DTYPE_BYTES:
            return _TorchDtype(name)
        raise CheckpointError(
            f"{self._source}: refuses to unpickle global {module}.{name}; a torch_dist .metadata "
            f"only names torch.distributed.checkpoint classes. The file is foreign or tampered "
            f"with: re-save the checkpoint with megatron-core dist_checkpointing (torch_dist).")


def load_dcp_metadata(path: Path):
    """Unpickle ``.metadata`` with the allowlist; returns the stand-in ``Metadata`` record."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {path.parent} is not a torch_dist checkpoint "
                              f"(expected .metadata, metadata.json and __*.distcp files)") from None
    try:
        return _MetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated or garbage pickle
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")[:200]
        raise CheckpointError(f"{path}: cannot read DCP metadata ({type(e).__name__}: {first}); the file is "
                              f"truncated or not a DCP .metadata pickle: restore it from another copy of the "
                              f"checkpoint, or use an older one") from None


# ---------------------------------------------------------------------------------------
# checkpoint description


def _check_marker(ckpt: Path) -> None:
    marker = ckpt / "metadata.json"
    body = read_json_object(marker, "megatron's checkpoint marker")
    if body is None:
        return  # plain DCP checkpoints (no megatron marker) read the same way
    backend = body.get("sharded_backend")
    if backend not in ("torch_dist", None):
        raise CheckpointError(f"{marker}: sharded_backend is {backend!r}; only torch_dist checkpoints "
                              f"are supported (re-save with --ckpt-format torch_dist)")


def _tensor_meta(key: str, md, storage: dict) -> TensorMeta:
    props = md.properties
    dtype = props._state[0] if hasattr(props, "_state") else getattr(props, "dtype", "float32")
    tm = TensorMeta(key=key, shape=tuple(md.size), dtype=str(dtype))
    for ch in md.chunks:
        offsets, sizes = tuple(ch.offsets), tuple(ch.sizes)
        info = storage.get((key, offsets))
        if info is None:
            raise CheckpointError(f"metadata lists chunk {key}@{list(offsets)} but no storage entry "
                                  f"for it; the .metadata is inconsistent")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{key}@{list(offsets)} is stored with transforms "
                                  f"{info.transform_descriptors}; only plain torch.save chunks are supported")
        chunk = Chunk(tuple(int(x) for x in offsets), tuple(int(x) for x in sizes), str(info.relative_path),
                      int(info.offset), int(info.length))
        if (len(chunk.offsets) != len(tm.shape) or len(chunk.sizes) != len(tm.shape) or chunk.offset < 0
                or chunk.length <= 0 or any(o < 0 or z < 0 or o + z > d
                                            for o, z, d in zip(chunk.offsets, chunk.sizes, tm.shape))):
            raise CheckpointError(f"chunk {key}@{list(offsets)} of size {list(sizes)} at bytes [{chunk.offset}, "
                                  f"+{chunk.length}) does not fit the tensor's global shape {list(tm.shape)}")
        tm.chunks.append(chunk)
    return tm


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Describe a torch_dist checkpoint from its metadata alone (no tensor bytes are read)."""
    ckpt = Path(path)
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint directory {ckpt} does not exist")
    _check_marker(ckpt)
    meta = load_dcp_metadata(ckpt / ".metadata")
    sdm = getattr(meta, "state_dict_metadata", None)
    storage_raw = getattr(meta, "storage_data", None)
    if not isinstance(sdm, dict) or not isinstance(storage_raw, dict):
        raise CheckpointError(f"{ckpt / '.metadata'}: no state_dict_metadata/storage_data; not a DCP checkpoint")
    tensors, others = {}, []
    try:
        storage = {(idx.fqn, tuple(getattr(idx, "offset", None) or ())): info for idx, info in storage_raw.items()}
        for key, md in sdm.items():
            if type(md).__name__ == "TensorStorageMetadata":
                tensors[key] = _tensor_meta(str(key), md, storage)
            else:
                others.append(str(key))
    except CheckpointError as e:
        raise CheckpointError(f"{ckpt / '.metadata'}: {e}") from None
    except (AttributeError, TypeError, ValueError, KeyError, IndexError) as e:
        # a pickle that loads but does not hold what DCP writes (damage that kept it a valid pickle)
        raise CheckpointError(f"{ckpt / '.metadata'}: malformed DCP metadata ({type(e).__name__}: {e}); the file is "
                              f"damaged or foreign: restore it from another copy of the checkpoint") from None
    files = {c.file for t in tensors.values() for c in t.chunks}
    from neon_hpc.checkpoint import integrity  # deferred: heavy (neon_hpc.checkpoint.integrity: xxhash)
    return Checkpoint(ckpt, tensors, sorted(others), _file_sizes(ckpt, files), integrity.load(ckpt))


def _file_sizes(ckpt: Path, files: set[str]) -> dict[str, int]:
    sizes = {}
    for name in sorted(files):
        p = ckpt / name
        if os.sep in name or name.startswith(".."):
            raise CheckpointError(f"{ckpt}/.metadata names file {name!r} outside the checkpoint directory")
        try:
            sizes[name] = p.stat().st_size
        except FileNotFoundError:
            sizes[name] = -1
    return sizes


def check_chunks_present(ckpt: Checkpoint, keys) -> None:
    """Raise if a chunk the conversion needs lies in a missing or truncated ``.distcp``."""
    for key in keys:
        for c in ckpt.tensors[key].chunks:
            size = ckpt.file_sizes.get(c.file, -1)
            if size < 0:
                raise CheckpointError(f"{ckpt.path / c.file} is missing; it holds {key}@{list(c.offsets)}. "
                                      f"Copy the whole checkpoint directory again.")
            if c.offset + c.length > size:
                raise CheckpointError(f"{ckpt.path / c.file} is truncated: {key}@{list(c.offsets)} needs bytes "
                                      f"[{c.offset}, {c.offset + c.length}) but the file has {size}. "
                                      f"Copy the checkpoint again (the save or the copy was cut short).")
