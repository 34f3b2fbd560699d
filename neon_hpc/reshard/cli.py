"""``tools/reshard.py`` / ``neon-hpc reshard``: parse arguments, then call the library.

Run on one process, or under MPI (``mpiexec -n N`` / ``srun --mpi=pmi2``) to spread the work.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

from neon_hpc.arch import MODEL_TYPES
from neon_hpc.checkpoint.integrity import UNVERIFIED_WARNING
from neon_hpc.checkpoint.metadata import CheckpointError
from neon_hpc.reshard.comm import get_comm, launched_under_mpi


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="reshard", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--src", required=True, help="Megatron torch_dist checkpoint directory")
    p.add_argument("--dst", help="output HF directory (must not exist; appears only when complete)")
    p.add_argument("--hf-config-dir", help="directory with the model's HF config.json (+ tokenizer files to copy)")
    p.add_argument("--arch", choices=sorted(MODEL_TYPES),
                   help="architecture (with --allow-guessed-config: derive the config's shape fields from the "
                        "checkpoint)")
    p.add_argument("--allow-guessed-config", action="store_true",
                   help="foreign checkpoints only: when no config is found (--hf-config-dir, the checkpoint's "
                        "config.json, the run's run.yaml), write the shape-derived fields and record the guessed "
                        "ones in the output's README.md (never for serving)")
    p.add_argument("--no-verify-digests", dest="verify_digests", action="store_false",
                   help="do not check chunks against the checkpoint's integrity.json (to measure the check's cost)")
    p.add_argument("--allow-unverified", action="store_true",
                   help="convert a checkpoint that has no integrity.json (refused otherwise); recorded in the "
                        "output's model.safetensors.index.json metadata.integrity")
    p.add_argument("--ranks", type=int, help="task ranks (default: MPI world size, else 1)")
    p.add_argument("--mode", choices=["fast", "serial"], default="fast",
                   help="fast: byte-range reads per task; serial: materialize, convert, reshard (baseline)")
    p.add_argument("--shard-size-gb", type=float, default=5.0, help="cap per output safetensors file")
    p.add_argument("--verify", type=int, nargs="?", const=0, default=None, metavar="N",
                   help="compare with the serial path before publishing: every tensor, or a sample of N")
    p.add_argument("--dry-run", action="store_true", help="print the tasks (metadata only) and write nothing")
    p.add_argument("--tasks", type=int, default=20, metavar="N",
                   help="with --dry-run: list the first N tasks' byte ranges and outputs (-1: all)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--json", action="store_true", help="print stats as one JSON line")
    args = p.parse_args(argv)
    if not args.dry_run and not args.dst:
        p.error("--dst is required (or --dry-run)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # deferred: heavy (neon_hpc.reshard.pipeline: pydantic, torch when converting; --help stays light)
    from neon_hpc.reshard.pipeline import ReshardError, check_dst_outside_src, convert, tasks_with_source
    cap = int(args.shard_size_gb * 1e9)
    try:
        if args.dry_run:
            if args.dst:
                check_dst_outside_src(args.src, args.dst)
            work, source = tasks_with_source(args.src, args.hf_config_dir, args.arch, args.ranks or 1, None, cap,
                                            args.allow_guessed_config)
            print(work.describe(max_tasks=None if args.tasks < 0 else args.tasks))
            print(f"config: {source.origin}")
            if source.guessed:
                print("config fields guessed: " + ", ".join(source.guessed))
            if work.ckpt.digests is None:
                print(f"warning: {work.ckpt.path} {UNVERIFIED_WARNING}; converting it needs --allow-unverified")
            return 0
        stats = convert(args.src, args.dst, args.hf_config_dir, args.arch, args.ranks, mode=args.mode,
                        shard_cap=cap, verify=args.verify, progress=not args.quiet, use_mpi=None,
                        allow_guessed_config=args.allow_guessed_config, verify_digests=args.verify_digests,
                        allow_unverified=args.allow_unverified)
    except (CheckpointError, ReshardError) as e:
        # one line whatever the message (a quoted parser error may span several)
        print("reshard: error: " + " | ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()),
              file=sys.stderr)
        return 1
    except BaseException:
        _abort_world_if_mpi()
        raise
    if get_comm().rank == 0:
        _report(stats, args)
    return 0


def _abort_world_if_mpi() -> None:
    """An unexpected error on one rank must not leave the others waiting in a collective."""
    if launched_under_mpi():
        traceback.print_exc()
        from mpi4py import MPI  # deferred: optional (mpi4py: only under an MPI launcher)
        MPI.COMM_WORLD.Abort(1)


def _report(stats: dict, args) -> None:
    if args.json:
        print(json.dumps({k: v for k, v in stats.items() if k != "per_rank"}))
        return
    s = stats
    print(f"reshard {s['mode']}: {s['tensors']} tensors in {s['files']} file(s) -> {args.dst} in {s['seconds']:.2f}s "
          f"({s['ranks']} rank(s)); read {s['read_bytes'] / 1e9:.3f} GB, wrote {s['write_bytes'] / 1e9:.3f} GB, "
          f"peak RSS {s['peak_rss_bytes_sum'] / 1e6:.0f} MB summed")
    if s.get("verified"):
        print(f"verify: {s['verified']['tensors_compared']} tensors equal to the serial path, byte for byte")
    print(f"config: {s['config_source']}; tensor digests {'verified' if s['digests_verified'] else 'NOT verified'}")
    if s.get("guessed_config_fields"):
        print("config fields guessed: " + ", ".join(s["guessed_config_fields"]))
