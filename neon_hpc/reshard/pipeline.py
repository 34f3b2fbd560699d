"""Orchestration: build the tasks on every rank, execute each rank's share into one staging folder,
then rank 0 checks, writes ``config.json``, tokenizer files and the index (last) and renames
the folder into place.  The output directory is complete or absent.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import sys
import time
import traceback
from pathlib import Path

from neon_hpc.checkpoint.integrity import DIGEST_FILE, UNVERIFIED_WARNING
from neon_hpc.checkpoint.metadata import CheckpointError, read_checkpoint
from neon_hpc.protocol.rundir import publish_dir, staging_dir_for
from neon_hpc.reshard.comm import get_comm
from neon_hpc.reshard.execute import peak_rss_bytes, proc_io, run_rank
from neon_hpc.reshard.hfconfig import ConfigSource, check_config_shapes, resolve as resolve_config, write_hf_side
from neon_hpc.reshard.serial import convert_all, materialize, reshard_write
from neon_hpc.reshard.slabs import MappingError, ModelSpec, canonical_arch
from neon_hpc.reshard.tasks import DEFAULT_SHARD_CAP, ConversionTasks, make_tasks


class ReshardError(RuntimeError):
    """Conversion failed; no output directory was left behind."""


def build_tasks(src, hf_config_dir=None, arch=None, ranks=1, hf_config=None,
               shard_cap=DEFAULT_SHARD_CAP,
               allow_guessed_config: bool = False) -> tuple[ConversionTasks, dict, list[str]]:
    """Checkpoint metadata + HF config -> (tasks, config.json dict, guessed config fields).

    The config comes from :func:`neon_hpc.reshard.hfconfig.resolve` (``--hf-config-dir``,
    the checkpoint's own config.json, the run's run.yaml; else refused unless
    ``allow_guessed_config``) and must fit the checkpoint's shapes."""
    work, source = tasks_with_source(src, hf_config_dir, arch, ranks, hf_config, shard_cap, allow_guessed_config)
    return work, source.cfg, source.guessed


def tasks_with_source(src, hf_config_dir=None, arch=None, ranks=1, hf_config=None, shard_cap=DEFAULT_SHARD_CAP,
                     allow_guessed_config: bool = False) -> tuple[ConversionTasks, ConfigSource]:
    arch = canonical_arch(arch) if arch else None     # an alias (--arch) is its architecture
    ckpt = read_checkpoint(src)
    source = resolve_config(ckpt, hf_config_dir, hf_config, arch, allow_guessed_config)
    check_config_shapes(source.cfg, ckpt, arch)
    spec = ModelSpec.from_hf_config(source.cfg, arch)
    return make_tasks(ckpt, spec, ranks, shard_cap), source


def convert(src, dst, hf_config_dir=None, arch: str | None = None, ranks: int | None = None, *,
            hf_config: dict | None = None, mode: str = "fast", shard_cap: int = DEFAULT_SHARD_CAP,
            verify: int | None = None, progress: bool = False, use_mpi: bool | None = False,
            allow_guessed_config: bool = False, verify_digests: bool = True,
            allow_unverified: bool = False) -> dict:
    """Convert torch_dist checkpoint ``src`` into HF safetensors directory ``dst``.

    ``ranks``: how many task ranks (default: the MPI world size, 1 without MPI).  A process
    that is alone but asked for more ranks runs them one after another (same output files).
    ``mode``: "fast" (byte ranges per task, streamed) or "serial" (materialize, convert, reshard).
    ``verify``: compare the output with the serial path before publishing: 0 = every tensor,
    N = a sample of N tensors.  ``use_mpi``: False (default, in-process: safe to call from one
    rank of a trainer even under srun), True, or None = detect an MPI launcher (the CLI).
    ``allow_guessed_config``: with no config found, derive one from shapes (``arch`` needed)
    and record the guesses.  ``verify_digests``: check every chunk read against the
    checkpoint's ``integrity.json`` (False only to measure what the check costs).
    ``allow_unverified``: convert a checkpoint that has no ``integrity.json`` (refused
    otherwise: every checkpoint neon-hpc writes carries one, so its absence means it was
    removed or the checkpoint is foreign); the output's index records it.
    Returns stats (on every rank; rank 0's are complete).
    """
    t0 = time.monotonic()
    comm = get_comm(use_mpi)
    check_dst_outside_src(src, dst)
    dst = Path(dst).absolute()
    if mode not in ("fast", "serial"):
        raise ValueError(f"mode must be 'fast' or 'serial', not {mode!r}")
    if mode == "serial" and comm.size > 1:
        raise ReshardError("--mode serial runs on one process; start it without mpiexec/srun")
    work, source = tasks_with_source(src, hf_config_dir, arch, ranks or comm.size, hf_config, shard_cap,
                                    allow_guessed_config)
    if dst.exists():
        raise ReshardError(f"{dst} already exists; the converter never overwrites. Choose another --dst "
                           f"or remove it first.")
    warnings = []
    if work.ckpt.digests is None:
        if not allow_unverified:
            raise ReshardError(f"{work.ckpt.path} {UNVERIFIED_WARNING}. Every checkpoint neon-hpc saves carries "
                               f"one, so it was removed or the checkpoint is foreign; restore it from another copy, "
                               f"or pass --allow-unverified to convert anyway (recorded in the output's "
                               f"model.safetensors.index.json metadata.integrity)")
        warnings.append(f"{work.ckpt.path} {UNVERIFIED_WARNING}; converted anyway (--allow-unverified)")
    elif not verify_digests:
        warnings.append(f"{work.ckpt.path}: digest verification switched off; corrupt bytes would pass")
    if source.guessed:
        warnings.append(f"config {source.origin}: guessed fields {', '.join(source.guessed)} (recorded in "
                        f"{dst}/README.md); do not serve this output before replacing its config.json")
    if comm.rank == 0:
        for w in warnings:
            print(f"reshard: warning: {w}", file=sys.stderr, flush=True)
    staging = comm.bcast(str(_make_staging(dst)) if comm.rank == 0 else None)
    staging = Path(staging)
    mine = [r for r in range(work.ranks) if r % comm.size == comm.rank]
    result = _guarded(lambda: _execute(work, mode, mine, staging, progress and comm.rank == 0, shard_cap,
                                       verify_digests))
    results = comm.allgather(result)
    errors = [r["error"] for r in results if "error" in r]
    final = None
    if comm.rank == 0:
        integrity = ("verified" if work.ckpt.digests is not None and verify_digests else
                     "not verified: --no-verify-digests" if work.ckpt.digests is not None else
                     f"not verified: --allow-unverified (the checkpoint has no {DIGEST_FILE})")
        final = _guarded(lambda: _finish(work, source, staging, dst, errors, verify, mode, integrity))
    final = comm.bcast(final)
    if "error" in final:
        raise ReshardError(final["error"])
    ios = comm.allgather(proc_io())   # after rank 0's finish, so its index/config writes count
    stats = _stats(work, mode, results, final, time.monotonic() - t0)
    stats["proc_io"] = {k: sum(io.get(k, 0) for io in ios) for k in ("read_bytes", "write_bytes", "rchar", "wchar")}
    stats["guessed_config_fields"] = source.guessed
    stats["config_source"] = source.origin
    stats["digests_verified"] = work.ckpt.digests is not None and verify_digests
    stats["warnings"] = warnings
    return stats


def _make_staging(dst: Path) -> Path:
    staging = staging_dir_for(dst)
    staging.chmod(0o755)  # mkdtemp makes it 0700; the published folder is read by engines
    return staging


def _guarded(fn) -> dict:
    try:
        return fn()
    except (CheckpointError, ReshardError) as e:
        return {"error": str(e)}
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # anything else (DCP raises BaseException subclasses) must still clean up
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}


def _execute(work: ConversionTasks, mode: str, my_ranks: list[int], staging: Path, show: bool, shard_cap: int,
             verify_digests: bool) -> dict:
    if mode == "serial":
        return _execute_serial(work, staging, shard_cap, verify_digests)
    per_rank = [run_rank(work, r, staging, show_progress=show, verify_digests=verify_digests).__dict__
                for r in my_ranks]
    return {"ranks": per_rank, "peak_rss_bytes": peak_rss_bytes()}


def _execute_serial(work: ConversionTasks, staging: Path, shard_cap: int, verify_digests: bool) -> dict:
    t = time.monotonic()
    hf = convert_all(work, materialize(work, verify_digests))
    index = reshard_write(hf, staging, shard_cap)
    (staging / ".serial_index.json").write_text(json.dumps(index))
    return {"ranks": [{"rank": 0, "tasks": len(work.tasks), "read_bytes": work.read_bytes,
                       "write_bytes": sum(p.stat().st_size for p in staging.glob("*.safetensors")),
                       "seconds": time.monotonic() - t, "peak_rss_bytes": peak_rss_bytes(), "files": []}],
            "peak_rss_bytes": peak_rss_bytes()}


def _finish(work, source: ConfigSource, staging: Path, dst: Path, errors: list[str], verify, mode,
            integrity: str) -> dict:
    """Rank 0: on any error remove staging; else verify, write the HF side, index last, rename."""
    try:
        if errors:
            raise ReshardError("; ".join(errors))
        if mode == "serial":
            index = json.loads((staging / ".serial_index.json").read_text())
            (staging / ".serial_index.json").unlink()
        else:
            index = work.index_json()
        verified = verify_output(work, staging, index, verify) if verify is not None else None
        write_hf_side(staging, source.cfg, source.tokenizer_dir)
        index["metadata"]["config_source"] = source.origin
        index["metadata"]["integrity"] = integrity   # whether the tensor bytes were checked against digests
        if source.guessed:
            index["metadata"]["guessed_config_fields"] = source.guessed
            _write_guess_readme(staging, work, source)
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        publish_dir(staging, dst)
        return {"verified": verified, "files": len(set(index["weight_map"].values())),
                "tensors": len(index["weight_map"])}
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_guess_readme(staging: Path, work: ConversionTasks, source: ConfigSource) -> None:
    lines = [f"# HF weights converted from {work.ckpt.path}", "",
             f"config.json was {source.origin}. These fields could not be read from the checkpoint and were",
             "guessed: a loader fills those absent from config.json with its own defaults, which are very",
             "likely not this model's values. Replace config.json with the model's real one before serving.", ""]
    lines += [f"- {g}" for g in source.guessed]
    (staging / "README.md").write_text("\n".join(lines) + "\n")


def verify_output(work: ConversionTasks, out_dir: Path, index: dict, sample: int) -> dict:
    """Compare output tensors with the serial path's, byte for byte (all, or a sample)."""
    # safetensors and torch are imported where used: importing this module does not load them
    from safetensors import safe_open  # deferred: heavy (safetensors)
    names = sorted(index["weight_map"])
    if sample:
        names = sorted(random.Random(0).sample(names, min(sample, len(names))))
    keep = set(names)
    sub = _subset(work, keep)
    expected = convert_all(sub, materialize(sub))
    bad = []
    handles = {}
    for n in names:
        f = index["weight_map"][n]
        if f not in handles:
            handles[f] = safe_open(str(out_dir / f), "pt")
        got = handles[f].get_tensor(n)
        exp = expected[n]
        if got.dtype != exp.dtype or got.shape != exp.shape or not _same_bytes(got, exp):
            bad.append(n)
    if bad:
        raise ReshardError(f"--verify: {len(bad)} tensor(s) differ from the serial path: {', '.join(bad[:5])}")
    return {"tensors_compared": len(names), "mismatches": 0}


def _same_bytes(a, b) -> bool:
    import torch  # deferred: heavy (torch)
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _subset(work: ConversionTasks, names: set[str]) -> ConversionTasks:
    """The tasks restricted to those that produce one of ``names`` (for sampled verification)."""
    sub = copy.copy(work)
    sub.tasks = [t for t in work.tasks if any(o.name in names for s in t.slabs for o in s.outputs)]
    return sub


def _stats(work: ConversionTasks, mode: str, results: list[dict], final: dict, seconds: float) -> dict:
    per_rank = [r for res in results for r in res.get("ranks", [])]
    return {
        "mode": mode, "ranks": work.ranks, "processes": len(results), "tasks": len(work.tasks),
        "seconds": seconds,
        "read_bytes": sum(r["read_bytes"] for r in per_rank),
        "write_bytes": sum(r["write_bytes"] for r in per_rank),
        "digest_reread_bytes": sum(r.get("digest_reread_bytes", 0) for r in per_rank),
        "peak_rss_bytes_per_process": [res.get("peak_rss_bytes", 0) for res in results],
        "peak_rss_bytes_sum": sum(res.get("peak_rss_bytes", 0) for res in results),
        "files": final.get("files"), "tensors": final.get("tensors"), "verified": final.get("verified"),
        "per_rank": per_rank,
    }


# ---------------------------------------------------------------------------------------
# --dst must stay out of the source


def check_dst_outside_src(src, dst) -> None:
    """Refuse a ``--dst`` equal to, inside, or containing ``--src`` (symlinks resolved)."""
    s = Path(os.path.realpath(src))
    d = Path(os.path.realpath(dst))
    if d == s or s in d.parents or d in s.parents:
        how = "is" if d == s else ("is inside" if s in d.parents else "contains")
        raise MappingError(f"--dst {dst} ({d}) {how} --src {src} ({s}); the converter never writes into or around "
                           f"the checkpoint it reads. Choose a --dst outside {s}.")
