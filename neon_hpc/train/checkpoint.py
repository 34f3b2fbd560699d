"""Trainer checkpoints: megatron-core dist_checkpointing (torch_dist) behind the run directory's atomic publish.

``checkpoints/step_N/`` holds, once it is visible (it is built in a hidden sibling and
renamed into place by rank 0 after every rank finished writing)::

    .metadata, __R_K.distcp, common.pt, metadata.json   megatron torch_dist: model + optimizer
                                                         (no optimizer tensors before the first step:
                                                         :func:`load` then restores the model only)
    trainer_state.json                                   step, weight version, data cursor, layout
    rng/rank_R.pt                                        each rank's RNG states (tensors only)
    integrity.json                                       xxh3 digest per .distcp file and per blob
                                                         (neon_hpc/checkpoint/integrity.py); checked on resume
    config.json                                          the model's HF config (reshard needs nothing else)

``trainer_state.json``::

    {"step": N,                 # last completed step; a resumed trainer runs N+1 next
     "version": N,              # weights after step N (published as weights/v_N when due)
     "cursor": {"next_step": N+1, "claimed_steps": [..]},   # the store claims per step, so
                                # the data position is the next step number
     "layout": {"tp":..,"ep":..,"pp":..,"cp":..,"dp":..,"vpp":..,"world":..}, "time": ..., ...}

The model and optimizer are loadable into another TP/EP/PP/CP/DP layout (torch_dist reshards:
its keys are global, each rank loads the slices its shards cover); the RNG
states are per rank and restored only when the layout is the same (otherwise reseeded from
``train.seed + step``, logged).  ``rng/*.pt`` hold only tensors and load with
``weights_only=True``; megatron's own ``common.pt``/``.metadata`` are pickles, so every
checkpoint is checked by :func:`refuse_untrusted` (an allowlist unpickler for ``.metadata``,
``weights_only=True`` for ``common.pt``) before megatron loads it.

:func:`save` writes synchronously; :class:`AsyncCheckpointer` (``train.checkpoint_async``)
takes a host snapshot on the step and writes the same directory beside the next steps,
finalized and renamed into place at a later step boundary (visible only when complete).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import math
import multiprocessing as mp
import queue
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from neon_hpc.checkpoint import integrity
from neon_hpc.checkpoint.configsource import CONFIG_FILE as HF_CONFIG_FILE, hf_config_for_model
from neon_hpc.checkpoint.metadata import CheckpointError, load_dcp_metadata, read_json_object
from neon_hpc.protocol.rundir import RunDir, publish_dir, staging_dir_for, storage_error
from neon_hpc.train import writers
from neon_hpc.train.backend import (
    Backend,
    init_checkpoint_kind,
    load_model_state,
    model_sharded_state_dict,
    param_digest,
    parameters,
    tensor_digest,
)
from neon_hpc.util.bounded import REPR_CAP, clip_text
from neon_hpc.util.procutil import die_with_parent

STATE_FILE = "trainer_state.json"


def broadcast_from_rank0(obj: Any, rank: int, world: int) -> Any:
    """Rank 0's ``obj`` on every rank (``world == 1``: ``obj`` itself)."""
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _sharded(be: Backend, is_loading: bool) -> dict:
    """Model chunks under ``model`` (``model0 .. model{V-1}`` with virtual stages) + the optimizer.

    The optimizer's state is keyed by the model's global sharded keys (it finds them in the
    chunks' dicts whatever their nesting), so a checkpoint saved with V chunks loads with
    another V, PP, TP, EP, CP or DP."""
    model_sd = model_sharded_state_dict(be)
    with _factory_repr_without_data():
        optimizer_sd = be.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return {**model_sd, "optimizer": optimizer_sd}


@contextlib.contextmanager
def _factory_repr_without_data():
    """Within: megatron's ``ShardedTensorFactory`` prints as its key, shape, dtype and replica, not
    its tensor's values.

    megatron's ``get_param_id_to_sharded_param_map`` formats each model tensor that one of a
    chained optimizer's parts does not track into a debug message, an f-string built whatever the
    log level.  ``ShardedTensor`` keeps its data out of its repr; a factory's dataclass repr prints
    its tensor: every value formatted on the host, which on CUDA is a device-to-host copy and a
    host sync each (16 per checkpoint of the benchmark's model, ~20 ms of Python on a CPU one)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory  # deferred: heavy (megatron)

    def short(self) -> str:
        d = self.data
        what = f"{tuple(d.shape)} {d.dtype}" if isinstance(d, torch.Tensor) else type(d).__name__
        return f"ShardedTensorFactory(key={self.key!r}, data={what}, replica_id={self.replica_id!r})"

    real = ShardedTensorFactory.__repr__      # the dataclass's own
    ShardedTensorFactory.__repr__ = short
    try:
        yield
    finally:
        ShardedTensorFactory.__repr__ = real


def _rng_state() -> dict[str, torch.Tensor]:
    """This rank's RNG states now (copies: what a later write saves is this moment's)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker  # deferred: heavy (megatron)
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    for name, st in get_cuda_rng_tracker().get_states().items():
        out[f"tracker.{name}"] = st.clone()
    return out


def _set_rng_state(states: dict[str, torch.Tensor]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker  # deferred: heavy (megatron)
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    tracker = {k[len("tracker."):]: v for k, v in states.items() if k.startswith("tracker.")}
    if tracker:
        get_cuda_rng_tracker().set_states(tracker)


_SHIELDED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def shield_writer_processes() -> None:
    """Start megatron's checkpoint-writer helper process with Slurm's signals blocked.

    Slurm delivers ``--signal=USR1@T`` (and a cancel's SIGTERM) to every process of the job
    step. megatron-core's async writer keeps a ``spawn``-ed multiprocessing Manager for its
    results queue; a freshly spawned process has default dispositions, so that signal kills
    it and the very checkpoint the signal asked for fails (EOFError in the queue). A blocked
    signal stays blocked across fork/exec: the helper never sees it, the trainer (which
    unblocks right after) still does. Blocked signals also mean it cannot be stopped
    politely, so it is started with ``procutil.die_with_parent`` as its initializer.
    Idempotent; a no-op if megatron's layout changes.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa  # deferred: heavy (megatron)
    except ImportError:
        return
    if not hasattr(fa, "_get_write_results_queue") or getattr(fa, "_results_queue", None) is not None:
        return

    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SHIELDED)
    try:
        # what megatron's _get_write_results_queue builds (a spawn-context Manager's Queue),
        # plus an initializer: the helper gets SIGKILL when this process dies, however it
        # dies (it cannot see SIGTERM, and a killed trainer never shuts it down)
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=die_with_parent)
        fa._results_queue = manager.Queue()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def save(run: RunDir, be: Backend, step: int, state: dict[str, Any]) -> Path:
    """Collective: write ``checkpoints/step_{step}`` (all ranks call it; rank 0 publishes)."""
    from megatron.core import dist_checkpointing  # deferred: heavy (megatron)

    lay = be.layout
    final, staging = _begin(run, lay, step)
    try:
        with writers.guarded_save(str(final)):   # a dead helper: a clear error, never a hang
            shield_writer_processes()
            dist_checkpointing.save(_sharded(be, is_loading=False), str(staging))
        _save_rng(staging, lay.rank)
        digest = param_digest(be)
        _barrier(lay.world)
        blob_digests = _seal_share(staging, lay.rank, lay.world)   # every rank digests its own .distcp files
        _publish(staging, final, be, step, state, digest, blob_digests)
    except BaseException as e:
        _discard(e, staging, final, lay.rank)
    return final


def _begin(run: RunDir, lay, step: int) -> tuple[Path, Path]:
    """Collective: ``checkpoints/step_{step}`` and the hidden staging sibling rank 0 made for it."""
    final = run.checkpoint(step)
    staging = str(staging_dir_for(final)) if lay.rank == 0 else None
    return final, Path(broadcast_from_rank0(staging, lay.rank, lay.world))


def _save_rng(staging: Path, rank: int, states: dict[str, torch.Tensor] | None = None) -> None:
    """``rng/rank_R.pt``: ``states`` (taken earlier), else this rank's RNG states now."""
    (staging / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state() if states is None else states, staging / "rng" / f"rank_{rank}.pt")


def _publish(staging: Path, final: Path, be: Backend, step: int, state: dict[str, Any], digest: float,
             blob_digests: dict[str, dict]) -> None:
    """Collective, once every rank's files are in ``staging``: rank 0 seals it and renames it into
    place (:func:`_seal`); then a barrier."""
    if be.layout.rank == 0:
        _seal(staging, final, be, step, state, digest, blob_digests)
    _barrier(be.layout.world)


def _seal(staging: Path, final: Path, be: Backend, step: int, state: dict[str, Any], digest: float,
          blob_digests: dict[str, dict]) -> None:
    """Rank 0, no collective: integrity.json (checked against the ``.metadata`` megatron wrote),
    config.json, trainer_state.json, then every file fsynced and the folder renamed into place."""
    integrity.write(staging, blob_digests)
    (staging / HF_CONFIG_FILE).write_text(json.dumps(hf_config_for_model(be.model_cfg), indent=1,
                                                     sort_keys=True) + "\n")
    full_state = {**state, "step": step, "time": time.time(), "param_digest_rank0": digest,
                  "layout": be.layout.as_record(), "precision": be.precision}
    (staging / STATE_FILE).write_text(json.dumps(full_state, indent=1, sort_keys=True) + "\n")
    publish_dir(staging, final)


def _discard(e: BaseException, staging: Path, final: Path, rank: int) -> None:
    """A failed save: rank 0 removes the staging folder (nothing becomes visible); re-raise ``e``,
    a full or read-only filesystem as the StorageError that names the checkpoint."""
    # classified before the clean-up frees what the write took
    full = None if isinstance(e, (KeyboardInterrupt, SystemExit)) else storage_error(e, final, "writing checkpoint")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    if full is not None:   # a full or read-only filesystem: say which checkpoint, not a writer traceback
        raise full from e
    raise e


# --------------------------------------------------------------------------------------
# the asynchronous save (train.checkpoint_async): the step pays for the snapshot only


class CheckpointWriteError(RuntimeError):
    """An asynchronous checkpoint failed beside the steps (raised on the trainer's thread)."""


@dataclass
class CheckpointRecord:
    """What one asynchronous checkpoint cost, in seconds."""

    step: int
    snapshot_s: float = 0.0     # on the step: host copy, megatron's save plan, common.pt, rng
    waited_s: float = 0.0       # on the step: waiting for the previous checkpoint to finish first
    write_s: float = 0.0        # beside the steps: the .distcp files and their digests
    finalize_s: float = 0.0     # on a later step: megatron's finalize (.metadata), the digests gathered
    seal_s: float = 0.0         # beside the steps (rank 0): integrity.json, trainer_state.json, fsyncs, rename
    error: str | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class _Pending:
    step: int
    final: Path
    staging: Path
    request: Any                        # megatron's AsyncRequest (the write, then its finalize_fns)
    state: dict[str, Any]
    digest: float | list            # the figure, or the parameters' host copies it is summed from
    record: CheckpointRecord
    done: threading.Event = field(default_factory=threading.Event)
    digests: dict = field(default_factory=dict)
    error: BaseException | None = None
    thread: threading.Thread | None = None
    started: float = field(default_factory=time.monotonic)
    sealing: bool = False               # finalized on the step; rank 0's seal thread publishes it
    sealed: threading.Event = field(default_factory=threading.Event)
    sealer: threading.Thread | None = None
    save: Any = None                    # megatron's save of the snapshot, on the writer thread (then request)
    rng: dict | None = None             # the RNG states at the snapshot, written with ``save``


def host_snapshot(sharded: dict, copies: dict[int, torch.Tensor] | None = None) -> dict:
    """Every tensor of a sharded state dict replaced, in place, by a host copy the next steps
    cannot change: a clone on CPU; on CUDA a pinned ``non_blocking`` copy, then one sync.
    A tensor reached twice (the same object) is copied once; ``copies`` (if given) is filled
    with ``id(original) -> copy``."""
    # deferred: heavy (megatron)
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    copies = {} if copies is None else copies
    device = []

    def host(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in copies:
            src = t.detach()
            if src.device.type == "cpu":
                copies[id(t)] = src.clone()
            else:
                out = torch.empty_like(src, device="cpu", pin_memory=True)
                out.copy_(src, non_blocking=True)
                device.append(src.device)
                copies[id(t)] = out
        return copies[id(t)]

    def visit(x):
        if isinstance(x, (ShardedTensor, ShardedTensorFactory)) and isinstance(x.data, torch.Tensor):
            x.data = host(x.data)
        elif isinstance(x, ShardedObject):
            x.data = copy.deepcopy(x.data)
        elif isinstance(x, torch.Tensor):
            return host(x)
        return x

    dict_list_map_inplace(visit, sharded)
    if device:
        torch.cuda.synchronize()
    return sharded


def _structure(sharded: dict) -> tuple:
    """What megatron's save plan depends on in a sharded state dict: each sharded tensor's key,
    dtype, shapes, offsets and replica (a factory's: its key and data), each sharded object's key
    and place, sorted."""
    # deferred: heavy (megatron)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out = []
    for x in nested_values(sharded):
        if isinstance(x, ShardedTensorFactory):    # its tensors follow from its key and data's shape
            out.append((x.key, "factory", str(x.data.dtype), tuple(x.data.shape), str(x.replica_id)))
        elif isinstance(x, ShardedTensor):
            out.append((x.key, str(x.dtype), tuple(x.global_shape), tuple(x.global_offset), tuple(x.local_shape),
                        str(x.replica_id), str(x.flattened_range)))
        elif isinstance(x, ShardedObject):
            out.append((x.key, "object", tuple(x.global_shape), tuple(x.global_offset), str(x.replica_id)))
    return tuple(sorted(out))


@contextlib.contextmanager
def _thread_results_queue():
    """Within: megatron's torch_dist writer takes a plain in-process queue for its write results
    instead of its spawned multiprocessing Manager's (the writer thread of this process fills it;
    no helper process to start, to shield from Slurm's signals, or to lose)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa  # deferred: heavy (megatron)
    real = fa._get_write_results_queue
    fa._get_write_results_queue = queue.Queue
    try:
        yield
    finally:
        fa._get_write_results_queue = real


def _write_buckets(request) -> list:
    """On the writer thread: megatron's own per-bucket writer (``write_preloaded_data``, without
    its process-wide GC switch) for each of this rank's write buckets, in this thread (no fork
    from a thread); hands the results to megatron's results queue as its multiproc writer does
    (:func:`_thread_results_queue`) and returns their storage infos (what the digests cover)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa  # deferred: heavy (megatron)

    if request.async_fn is None:          # nothing to write on this rank
        return []
    fn = request.async_fn
    if not isinstance(fn, functools.partial) or len(fn.args) != 2 or len(request.async_fn_args) != 3:
        raise RuntimeError("this megatron-core's async torch_dist request is not "
                           "partial(write_preloaded_data_multiproc, transform_list, use_msc) with "
                           "(rank, write_buckets, results_queue); update neon_hpc/train/checkpoint._write_buckets "
                           "for this version, or set train.checkpoint_async: false")
    transform_list, _use_msc = fn.args
    _rank, buckets, results_queue = request.async_fn_args
    write = inspect.unwrap(fa.FileSystemWriterAsync.write_preloaded_data)
    results: dict[int, list] = {}
    for i, bucket in enumerate(buckets):
        out, count = queue.Queue(), queue.Queue()
        count.put(i)
        write(transform_list, i, bucket, out, count, True)
        idx, res = out.get_nowait()
        if isinstance(res, BaseException):
            raise res
        results[idx] = res
    results_queue.put(results)
    return [r.storage_data for part in results.values() for r in part]


class AsyncCheckpointer:
    """``checkpoints/step_N`` beside the steps (``train.checkpoint_async``).

    :meth:`submit` (collective, on the step): a host snapshot of the model + optimizer sharded
    state (:func:`host_snapshot`) and the RNG states.  megatron's ``dist_checkpointing.save(...,
    async_sharded_save=True)`` on these copies (its preprocessing, ``common.pt``, the save plan;
    it returns the write as an AsyncRequest) runs here while it has collectives in it (the
    first two saves of a structure: validation, planning), and on the writer thread once every
    rank holds megatron's validated cached plan (:meth:`_save_strategy`).  A writer thread per
    checkpoint then writes this rank's
    ``.distcp`` files (:func:`_write_buckets`) into the hidden staging folder, digests them, and
    sums the parameter digest over the snapshot's copies of the parameters (on the step only
    where the snapshot does not hold every parameter as itself).  No collective runs on that
    thread.  :meth:`poll` (collective, at a step boundary) asks every rank whether its writer is
    done; once all are, the trainer's thread finalizes what needs every rank: megatron's finalize
    (gathers the write results, rank 0 writes ``.metadata``) and the digests gathered.  Rank 0's
    sealing (:func:`_seal`: integrity.json, trainer_state.json, the fsyncs and the rename) then
    runs on a thread beside the next step, and a later :meth:`poll` returns the record once it
    ended.  A checkpoint is visible only then, complete.  At most one is in flight: a
    :meth:`submit` while one is still writing or sealing waits for it first (logged).
    :meth:`wait` finishes the one in flight (the loop calls it before exiting, so the final
    checkpoint is complete at exit); a writer's or the seal's error, or a checkpoint still not
    published ``train.checkpoint_write_timeout_s`` after its submit on any rank (a hung mount),
    is raised as :class:`CheckpointWriteError` at the next :meth:`poll` / :meth:`wait` /
    :meth:`submit` on every rank, with nothing published.
    """

    def __init__(self, run: RunDir, be: Backend, log=None, write_timeout_s: float | None = None) -> None:
        self.run, self.be, self.log = run, be, log
        self.write_timeout_s = write_timeout_s if write_timeout_s is not None else writers.deadline_s()
        self._pending: _Pending | None = None
        self._done: list[CheckpointRecord] = []
        self._strategy = None      # megatron's save strategy, kept while the state's structure stays
        self._structure: tuple | None = None

    @property
    def in_flight(self) -> int | None:
        """The step of the checkpoint being written, if any."""
        return None if self._pending is None else self._pending.step

    def submit(self, step: int, state: dict[str, Any]) -> CheckpointRecord:
        """Collective: snapshot ``step`` and start its write; returns its record (``snapshot_s``,
        ``waited_s``: what the step paid)."""
        from megatron.core import dist_checkpointing  # deferred: heavy (megatron)

        rec = CheckpointRecord(step)
        if self._pending is not None:
            t0 = time.perf_counter()
            if self.log is not None and self.be.layout.rank == 0:
                self.log.info("checkpoint step_%d waits for step_%d to finish writing (one in flight at a time)",
                              step, self._pending.step)
            self.wait()
            rec.waited_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        lay = self.be.layout
        final, staging = _begin(self.run, lay, step)
        try:
            copies: dict[int, torch.Tensor] = {}
            snap = host_snapshot(_sharded(self.be, is_loading=False), copies)
            # the parameter digest from the host copies, on the writer thread, when the snapshot
            # holds every parameter as itself (megatron's layers do); else here, on the live ones
            held = [copies.get(id(t)) for t in parameters(self.be)]
            digest = None if any(h is None for h in held) else held
            strategy, validate, beside = self._save_strategy(snap)
            save = functools.partial(dist_checkpointing.save, snap, str(staging), sharded_strategy=strategy,
                                     validate_access_integrity=validate, async_sharded_save=True)
            request, rng = None, _rng_state()
            if not beside:              # megatron's collectives (planning, validation): on the step
                with _thread_results_queue():
                    request = save()
                _save_rng(staging, lay.rank, rng)
            if digest is None:
                digest = param_digest(self.be)
        except BaseException as e:
            _discard(e, staging, final, lay.rank)
        rec.snapshot_s = time.perf_counter() - t0
        p = _Pending(step, final, staging, request, dict(state), digest, rec)
        if beside:
            p.save, p.rng = save, rng
        p.thread = threading.Thread(target=self._write, args=(p,), name=f"neon-ckpt-{step}", daemon=True)
        self._pending = p
        p.thread.start()
        return rec

    def _save_strategy(self, snap: dict):
        """Collective: megatron's torch_dist save strategy for this save, whether to validate the
        sharding, and whether megatron's save may run on the writer thread.  One strategy with
        ``cached_metadata`` is kept while the state's structure (every sharded key, shape, offset,
        dtype, replica) is the same on every rank as at the last save: megatron then plans once
        (reuse from the third save on, after two equal plans, as its
        ``--ckpt-assume-constant-structure``) and the structure validated once is not validated
        again.  A change on any rank starts afresh: a new strategy, validated.  A save that
        neither validates nor plans (every rank holds a validated cached plan) runs no collective:
        megatron's whole save of the snapshot (its preprocessing, ``common.pt``, the local plan,
        the write buckets) then goes to the writer thread; otherwise it runs on the step."""
        from megatron.core.dist_checkpointing.strategies.torch import (  # deferred: heavy (megatron)
            TorchDistSaveShardedStrategy,
        )

        structure = _structure(snap)
        st = self._strategy
        cached = st is not None and bool(st.validated_cache_reuse) and st.cached_central_plan is not None
        changed, uncached = max_over_ranks([int(structure != self._structure), int(not cached)],
                                            self.be.layout.world)
        if changed or st is None:
            self._strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
            self._structure = structure
            return self._strategy, True, False
        return st, False, not uncached

    def poll(self) -> CheckpointRecord | None:
        """Collective (every rank at the same boundaries): finalize the checkpoint in flight if
        every rank's writer is done; its record, or None (none in flight, or still writing)."""
        p = self._pending
        if p is None:
            return None
        event = p.sealed if p.sealing else p.done
        busy = not event.is_set()
        overdue = busy and time.monotonic() - p.started > self.write_timeout_s
        busy, failed, overdue = max_over_ranks([int(busy), int(p.error is not None), int(overdue)],
                                                self.be.layout.world)
        if overdue and not failed:
            raise self._stuck(p)
        if busy and not failed:
            return None
        if p.sealing:
            return self._published(p, failed)
        self._finalize(p, failed)
        return None

    def wait(self) -> CheckpointRecord | None:
        """Collective: block until the checkpoint in flight is complete and visible; its record."""
        p = self._pending
        if p is None:
            return None
        if not p.sealing:
            if not p.done.wait(self._left(p)):
                raise self._stuck(p)
            _busy, failed = max_over_ranks([0, int(p.error is not None)], self.be.layout.world)
            self._finalize(p, failed)
        late = not p.sealed.wait(self._left(p))
        late, failed = max_over_ranks([int(late), int(p.error is not None)], self.be.layout.world)
        if late and not failed:
            raise self._stuck(p)
        return self._published(p, failed)

    def _left(self, p: _Pending) -> float:
        """Seconds left of ``p``'s deadline (``write_timeout_s`` from its submit)."""
        return max(0.0, self.write_timeout_s - (time.monotonic() - p.started))

    def _stuck(self, p: _Pending) -> CheckpointWriteError:
        """The error for a write still running ``write_timeout_s`` after its submit (on this rank or
        another): its staging folder is removed (rank 0), nothing was published; the writer thread
        is left to end on its own (a Python thread cannot be killed) and the trainer exits."""
        self._pending = None
        doing = "sealing" if p.sealing else "writing"
        p.record.error = f"still {doing} after {self.write_timeout_s:.0f}s"
        self._done.append(p.record)
        if self.be.layout.rank == 0 and not p.sealing:    # a seal may be renaming it: left hidden as it is
            shutil.rmtree(p.staging, ignore_errors=True)
        where = f"rank {self.be.layout.rank}" if not (p.sealed if p.sealing else p.done).is_set() else "another rank"
        return CheckpointWriteError(
            f"checkpoint {p.final.name} still {doing} on {where} {self.write_timeout_s:.0f}s after it began "
            f"(train.checkpoint_write_timeout_s); nothing was published (a resume takes the newest complete "
            f"checkpoint). Check the filesystem under {p.final.parent} (a hung mount, a full quota), or raise "
            f"that key if saves are legitimately this slow")

    def completed(self) -> list[CheckpointRecord]:
        """The records finished (published or failed) since the last call."""
        out, self._done = self._done, []
        return out

    def _write(self, p: _Pending) -> None:
        t0 = time.perf_counter()
        try:
            if p.save is not None:      # the plan is megatron's cached one on every rank: no collective
                with _thread_results_queue():
                    p.request = p.save()
                _save_rng(p.staging, self.be.layout.rank, p.rng)
            p.digests = integrity.compute_written(p.staging, _write_buckets(p.request))
            if isinstance(p.digest, list):
                p.digest = tensor_digest(p.digest)
        except BaseException as e:      # handed to the trainer's thread
            p.error = e
        p.record.write_s = time.perf_counter() - t0
        p.done.set()

    def _finalize(self, p: _Pending, failed: int) -> None:
        """Collective, once every rank's writer ended: a writer's failure is raised on every rank;
        else megatron's finalize and the digests gathered, here, and rank 0's seal begins on its
        thread (:meth:`_seal`)."""
        lay = self.be.layout
        if failed:
            self._failed(p, "writer thread")
        t0 = time.perf_counter()
        try:
            for fn in p.request.finalize_fns:   # megatron: gather the write results, .metadata, metadata.json
                fn()
            blob_digests = p.digests
            if lay.world > 1:
                parts: list = [None] * lay.world
                dist.all_gather_object(parts, p.digests)
                blob_digests = {k: v for part in parts for k, v in part.items()}
        except BaseException as e:
            self._pending = None
            self._done.append(p.record)
            p.record.error = f"{type(e).__name__}: {e}"
            _discard(e, p.staging, p.final, lay.rank)
        p.record.finalize_s = time.perf_counter() - t0
        p.sealing = True
        if lay.rank == 0:
            p.sealer = threading.Thread(target=self._seal, args=(p, blob_digests), name=f"neon-ckpt-seal-{p.step}",
                                        daemon=True)
            p.sealer.start()
        else:
            p.sealed.set()

    def _seal(self, p: _Pending, blob_digests: dict[str, dict]) -> None:
        """Rank 0's seal thread: :func:`_seal` beside the step; an error is kept for the trainer's
        thread and the staging folder removed (nothing visible)."""
        t0 = time.perf_counter()
        try:
            _seal(p.staging, p.final, self.be, p.step, p.state, p.digest, blob_digests)
        except BaseException as e:      # handed to the trainer's thread
            p.error = storage_error(e, p.final, "writing checkpoint") or e
            shutil.rmtree(p.staging, ignore_errors=True)
        p.record.seal_s = time.perf_counter() - t0
        p.sealed.set()

    def _published(self, p: _Pending, failed: int) -> CheckpointRecord:
        """Collective, once rank 0's seal ended: its record, or its failure raised on every rank."""
        if failed:
            self._failed(p, "seal thread")
        self._pending = None
        self._done.append(p.record)
        return p.record

    def _failed(self, p: _Pending, where: str) -> None:
        """Raise on every rank the failure of ``p`` beside the steps (on this rank or another)."""
        self._pending = None
        self._done.append(p.record)
        lay = self.be.layout
        why = f"{type(p.error).__name__}: {p.error}" if p.error is not None else "failed on another rank"
        p.record.error = why
        if lay.rank == 0:
            shutil.rmtree(p.staging, ignore_errors=True)
        raise CheckpointWriteError(
            f"checkpoint {p.final} failed on the {where} of rank {lay.rank}: {why}; nothing was "
            f"published (a resume takes the newest complete checkpoint); fix the cause (space, "
            f"permissions or quota under {p.final.parent}) and run the job again") from p.error


def max_over_ranks(values: list[int], world: int) -> list[int]:
    """Each value's maximum over the ranks (``world == 1``: the values)."""
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def read_state(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / STATE_FILE
    st = read_json_object(path, "the trainer's state record")
    if st is None:
        raise CheckpointError(f"{path} missing: not a neon-hpc trainer checkpoint (a published step_N always "
                              f"has one); move the directory aside")
    return st


def refuse_untrusted(ckpt_dir: str | Path) -> None:
    """Refuse a torch_dist checkpoint whose pickles could run code, before megatron opens it.

    megatron-core reads ``.metadata`` with a plain ``pickle.load`` (DCP's reader): a crafted
    file whose ``__reduce__`` names ``os.system`` runs that command inside the trainer.  Every
    checkpoint the trainer loads (a resume's ``checkpoints/step_N``, ``model.init_checkpoint``)
    passes this first: ``.metadata`` through the allowlist unpickler of
    :mod:`neon_hpc.checkpoint.metadata` (only DCP's own classes, as stand-ins), ``common.pt``
    through ``torch.load(weights_only=True)``.  Raises ``CheckpointError`` (one line) naming
    the file, the global it refused, and what to do; returns the (stand-in) DCP metadata.
    """

    ckpt = Path(ckpt_dir)
    meta = load_dcp_metadata(ckpt / ".metadata")
    common = ckpt / "common.pt"
    if common.exists():
        try:
            torch.load(common, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure means: do not let megatron unpickle it
            raise CheckpointError(f"{common}: refused: {_why_not_weights_only(common, e)}; the file is foreign, "
                                  f"tampered with or damaged. Re-save the checkpoint with megatron-core, or "
                                  f"start from an HF folder") from None
    return meta


def _why_not_weights_only(path: Path, error: Exception) -> str:
    """One line on why ``torch.load(weights_only=True)`` refused ``path``: the globals it names
    that are not allowed (read from the pickle, never run), else the error's first line."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - not a readable torch.save archive: say what torch said
        unsafe = []
    if unsafe:
        return (f"it names global(s) {clip_text(', '.join(sorted(unsafe)), REPR_CAP)}, which "
                f"torch.load(weights_only=True) does not allow")
    first = next((ln.strip() for ln in str(error).splitlines() if ln.strip()), "")
    return (f"it does not load with torch.load(weights_only=True) "
            f"({type(error).__name__}: {clip_text(first, REPR_CAP)})")


def check_init_checkpoint(path: str | Path) -> None:
    """Refuse ``model.init_checkpoint`` before the model is built: a folder that is neither an
    HF folder nor a torch_dist checkpoint, or a torch_dist one that :func:`refuse_untrusted`
    refuses.  Raises ``CheckpointError``, one line, prefixed with the config key."""
    try:
        if init_checkpoint_kind(path) == "hf":
            return
        refuse_untrusted(path)
    except FileNotFoundError as e:
        raise CheckpointError(f"{e}; point it at the model's HF folder or a torch_dist checkpoint") from None
    except CheckpointError as e:
        raise CheckpointError(f"model.init_checkpoint={path}: {e}") from None


OPTIMIZER_STATE_KEY = "optimizer.state."   # megatron's sharded keys of per-parameter optimizer tensors


def has_optimizer_moments(meta) -> bool:
    """Whether a checkpoint's DCP metadata (:func:`refuse_untrusted`'s answer) holds optimizer
    tensors (Adam's exp_avg/exp_avg_sq; keys ``[chained_N.]optimizer.state.<name>.<param>``)."""
    return any(f".{OPTIMIZER_STATE_KEY}" in f".{k}" for k in meta.state_dict_metadata)


def optimizer_has_state(be: Backend) -> bool:
    """Whether any of the trainer's torch optimizers holds per-parameter state (after a step)."""
    opts = getattr(be.optimizer, "chained_optimizers", None) or [be.optimizer]
    return any(len(s) for o in opts for s in o.optimizer.state.values())


def load(run: RunDir, be: Backend, step: int) -> dict[str, Any]:
    """Collective: restore model, optimizer and (same layout) RNG from ``checkpoints/step_{step}``."""
    from megatron.core import dist_checkpointing  # deferred: heavy (megatron)

    ckpt = run.checkpoint(step)
    state = read_state(ckpt)
    check_precision(ckpt, state, be.precision)
    meta = refuse_untrusted(ckpt)   # before megatron unpickles anything in it
    lay = be.layout
    # A checkpoint saved before the first optimizer step (publish_via=reshard's step_0) holds no
    # Adam moments: megatron's loading template expects exp_avg/exp_avg_sq (KeyError). The
    # optimizer then starts as it was saved: fresh, with no state.
    moments = has_optimizer_moments(meta)
    with verified_reads(ckpt, lay.rank) as digests:      # every blob checked as DCP reads it
        template = _sharded(be, is_loading=True) if moments else model_sharded_state_dict(be)
        loaded = dist_checkpointing.load(template, str(ckpt))
    state["digests_verified"] = digests is not None
    state["optimizer_restored"] = moments
    load_model_state(be, loaded)
    if moments:
        be.optimizer.load_state_dict(loaded["optimizer"])
    elif optimizer_has_state(be):
        raise RuntimeError(f"{ckpt} holds no optimizer state (saved before the first optimizer step), "
                           f"but this trainer's optimizer already has state: load it into a fresh Backend")
    _check_param_digest(ckpt, state, be)
    saved_layout = {"cp": 1, "vpp": 1, **state.get("layout", {})}   # older records lack cp, vpp
    same_layout = all(saved_layout.get(k) == v for k, v in lay.as_record().items())
    rng_file = ckpt / "rng" / f"rank_{lay.rank}.pt"
    state["rng_restored"] = bool(same_layout and rng_file.exists())
    if state["rng_restored"]:
        _set_rng_state(torch.load(rng_file, weights_only=True))
    _barrier(lay.world)
    return state


def check_precision(ckpt: Path, state: dict[str, Any], precision: str) -> None:
    """A resume continues in the precision the checkpoint was trained in: its optimizer holds fp32
    main parameters beside bf16 ones (bf16) or the parameters themselves (fp32), and megatron
    loads neither into the other.  Checkpoints from before ``precision`` was recorded are fp32."""
    saved = state.get("precision", "fp32")
    if saved != precision:
        raise ValueError(f"{ckpt}: saved with train.precision={saved}, this trainer runs {precision}; resume with "
                         f"train.precision: {saved}, or start a new run from these weights with "
                         f"model.init_checkpoint: {ckpt}")


def _seal_share(staging: Path, rank: int, world: int) -> dict[str, dict]:
    """Digests of this rank's share of the ``.distcp`` files, merged over ranks (all ranks get all)."""
    mine = integrity.compute(staging, rank, world)
    if world == 1:
        return mine
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


@contextlib.contextmanager
def verified_reads(ckpt: Path, rank: int = 0):
    """Within: megatron's torch_dist load checks every storage item it reads against the
    checkpoint's ``integrity.json`` (on the bytes it reads anyway). Yields the digests, or
    None (with a warning) for a checkpoint saved without them."""
    digests = integrity.load(ckpt)
    if digests is None:
        if rank == 0:
            print(f"neon-hpc train: warning: checkpoint {ckpt} {integrity.UNVERIFIED_WARNING}",
                  file=sys.stderr, flush=True)
        yield None
        return
    from megatron.core.dist_checkpointing.strategies import torch as mtorch  # deferred: heavy (megatron)
    real = getattr(mtorch, "_get_filesystem_reader", None)
    if real is None:
        raise RuntimeError(f"{ckpt}: this megatron-core has no strategies.torch._get_filesystem_reader, so the "
                           f"checkpoint's digests cannot be checked while loading; update "
                           f"neon_hpc/train/checkpoint.verified_reads for this megatron-core version")

    def reader(*args, **kwargs):
        return integrity.guard_reader(real(*args, **kwargs), digests)

    mtorch._get_filesystem_reader = reader
    try:
        yield digests
    except BaseException as e:   # DCP wraps a reader's error per rank (CheckpointException): surface ours
        failures = getattr(e, "failures", None) or {}
        found = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        ours = next((f for f in found if isinstance(f, integrity.IntegrityError)), None)
        if ours is not None:
            raise integrity.IntegrityError(str(ours)) from e
        raise
    finally:
        mtorch._get_filesystem_reader = real


def _check_param_digest(ckpt: Path, state: dict[str, Any], be: Backend) -> None:
    """Rank 0's parameters after the load must give the digest recorded at the save, when rank 0
    holds the same shard as then (same TP, EP, PP, virtual stages); a mismatch stops every rank."""
    lay, saved_layout = be.layout, state.get("layout", {})
    saved = state.get("param_digest_rank0")
    same_shard = all(saved_layout.get(k, 1) == getattr(lay, k, 1) for k in ("tp", "ep", "pp", "vpp"))
    error = None
    if lay.rank == 0 and saved is not None and same_shard:
        now = param_digest(be)
        if not math.isclose(now, saved, rel_tol=1e-9, abs_tol=0.0):
            error = (f"{ckpt}: rank 0's parameters after loading give param_digest {now!r}, the save recorded "
                     f"{saved!r} ({STATE_FILE} param_digest_rank0): the loaded weights are not the saved ones. "
                     f"Resume from an older checkpoint or restore this one from another copy.")
    state["param_digest_checked"] = bool(saved is not None and same_shard)
    error = broadcast_from_rank0(error, lay.rank, lay.world)
    if error:
        raise integrity.IntegrityError(error)


def latest_complete(run: RunDir) -> int | None:
    """Newest ``step_N`` that carries its state file (published ones always do)."""
    for step in reversed(run.checkpoint_steps()):
        if (run.checkpoint(step) / STATE_FILE).exists():
            return step
    return None
