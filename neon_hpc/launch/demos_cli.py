"""``neon-hpc demos --out DIR [--config CONFIG] [--n N] [--imperfect F]``: demonstrations as trajectory shards.

The entry point (it loads the whole config); the demonstrations are the environment's (``env.kind``'s
plugin: XRD's are ``neon_hpc/envs/xrd/demos.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from neon_hpc.models.tokenizer import load_tokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="neon-hpc demos", description="write demonstration conversations (the "
                                "baseline solver's actions) of train tasks as trajectory shards")
    p.add_argument("--out", required=True, help="folder for the shards (train.sft_data of an SFT run)")
    p.add_argument("--config", default=None, help="experiment YAML (env, its section, rollout and model; "
                   "default: configs/tiny_cpu.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--n", type=int, default=None, help="tasks (default: warm_start.demos)")
    p.add_argument("--imperfect", type=float, default=None, help="share of imperfect demonstrations "
                   "(default: warm_start.imperfect)")
    a = p.parse_args(argv)
    from neon_hpc import config, envs  # deferred: heavy (neon_hpc.config: h5py, numpy)
    cfg = config.load(a.config or str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"), a.set)
    n = cfg.warm_start.demos if a.n is None else a.n
    imperfect = cfg.warm_start.imperfect if a.imperfect is None else a.imperfect
    if n < 1 or not 0.0 <= imperfect <= 1.0:
        print("neon-hpc demos: --n must be >= 1 and --imperfect within [0, 1]", file=sys.stderr)
        return 2
    env = envs.configured(cfg)
    if env.plugin.write_demos is None:
        print(f"neon-hpc demos: environment {cfg.env.kind!r} provides no demonstrations", file=sys.stderr)
        return 2
    source = env.tasks()
    tasks = source.demo(n)
    tok = load_tokenizer(cfg.model.tokenizer_source)
    s = env.write_demos(a.out, tasks, tok, cfg.rollout, imperfect, source.seed)
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
