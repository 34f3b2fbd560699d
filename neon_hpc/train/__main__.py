"""``python -m neon_hpc.train --config RUN/run.yaml --run-dir RUN [--mode rl|sft] [--set key=value ...]``:
one trainer rank."""

from __future__ import annotations

import argparse
import sys

from neon_hpc.util.procutil import forked_children_die_with_me


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m neon_hpc.train",
                                 description="Run one trainer rank (torch.distributed env vars or Slurm's).")
    ap.add_argument("--config", required=True, help="experiment YAML (normally RUN/run.yaml)")
    ap.add_argument("--run-dir", required=True, help="the run directory (shared filesystem)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set train.steps=4")
    ap.add_argument("--mode", choices=("rl", "sft"), default=None,
                    help="train.mode: rl (the async RL loop) or sft (cross-entropy on train.sft_data's "
                         "loss-masked tokens; neon_hpc/train/sft.py)")
    args = ap.parse_args(argv)
    if args.mode:
        args.overrides.append(f"train.mode={args.mode}")
    from neon_hpc.config import ConfigError, load  # deferred: heavy (neon_hpc.config: h5py, numpy)
    try:
        cfg = load(args.config, args.overrides)
    except ConfigError as e:
        print(f"trainer: {e}", file=sys.stderr)
        return 2
    from neon_hpc.util import logsinks  # deferred: heavy (neon_hpc.util.logsinks: pydantic)
    logsinks.configure(cfg.logging)   # TensorBoard / W&B beside metrics.jsonl, when enabled
    from neon_hpc.train.loop import run_trainer  # deferred: heavy (neon_hpc.train.loop: torch, h5py)
    from neon_hpc.train.sections import TrainerSections  # deferred: heavy (neon_hpc.train.sections: h5py, numpy)
    forked_children_die_with_me()   # megatron's forked checkpoint writers
    return run_trainer(TrainerSections.of(cfg), args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
