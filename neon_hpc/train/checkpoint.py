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
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing as mp
import shutil
import sys
import signal
import time
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from neon_hpc.util.bounded import REPR_CAP, clip_text
from neon_hpc.util.procutil import die_with_parent
from neon_hpc.checkpoint import integrity
from neon_hpc.checkpoint.configsource import CONFIG_FILE as HF_CONFIG_FILE, hf_config_for_model
from neon_hpc.protocol.rundir import RunDir, publish_dir, staging_dir_for, storage_error
from neon_hpc.checkpoint.metadata import CheckpointError, load_dcp_metadata, read_json_object
from neon_hpc.train.backend import (Backend, init_checkpoint_kind, load_model_state, model_sharded_state_dict,
                                    param_digest)
from neon_hpc.train import writers

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
    return {**model_sd, "optimizer": be.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def _rng_state() -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker  # deferred: heavy (megatron)
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    for name, st in get_cuda_rng_tracker().get_states().items():
        out[f"tracker.{name}"] = st
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
    final = run.checkpoint(step)
    staging = str(staging_dir_for(final)) if lay.rank == 0 else None
    staging = Path(broadcast_from_rank0(staging, lay.rank, lay.world))
    try:
        with writers.guarded_save(str(final)):   # a dead helper: a clear error, never a hang
            shield_writer_processes()
            dist_checkpointing.save(_sharded(be, is_loading=False), str(staging))
        (staging / "rng").mkdir(exist_ok=True)
        torch.save(_rng_state(), staging / "rng" / f"rank_{lay.rank}.pt")
        digest = param_digest(be)
        _barrier(lay.world)
        blob_digests = _seal_share(staging, lay.rank, lay.world)   # every rank digests its own .distcp files
        if lay.rank == 0:
            integrity.write(staging, blob_digests)
            (staging / HF_CONFIG_FILE).write_text(json.dumps(hf_config_for_model(be.model_cfg), indent=1,
                                                             sort_keys=True) + "\n")
            full_state = {**state, "step": step, "time": time.time(), "param_digest_rank0": digest,
                          "layout": lay.as_record(), "precision": be.precision}
            (staging / STATE_FILE).write_text(json.dumps(full_state, indent=1, sort_keys=True) + "\n")
            publish_dir(staging, final)
        _barrier(lay.world)
    except BaseException as e:
        # classified before the clean-up frees what the write took
        full = None if isinstance(e, (KeyboardInterrupt, SystemExit)) else storage_error(e, final, "writing checkpoint")
        if lay.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if full is not None:   # a full or read-only filesystem: say which checkpoint, not a writer traceback
            raise full from e
        raise
    return final


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
