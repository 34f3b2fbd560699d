"""``neon-hpc balance dry-run``: lengths in, one step's assignment out (the cost file it reads,
``--cost-file``, is written by ``neon-hpc costfit``: neon_hpc/train/costfit/).

    neon-hpc balance dry-run [CONFIG] [--set k=v] (--lengths 900,12000,... | --lengths-file F |
                             --synthetic mixture:512) [--dp N --pp N --cp N --token-cap N]
                             [--method cost] [--cost-file cost.json] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from neon_hpc.balance.configured import assignment_for_config, load_cost_file


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="neon-hpc balance", description="balancing dry runs (the --cost-file they read is "
                                "fitted by `neon-hpc costfit`)")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("dry-run", help="assign one step from lengths and print every method's prediction")
    config_args(d)
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="comma-separated sequence lengths")
    src.add_argument("--lengths-file", help="JSON list or whitespace-separated integers")
    src.add_argument("--synthetic", help="KIND:N, KIND in mixture (issue 7's long tail), lognormal")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dp", type=int)
    d.add_argument("--pp", type=int, help="pipeline stages (and fewest micro-batches per rank)")
    d.add_argument("--cp", type=int)
    d.add_argument("--token-cap", type=int)
    d.add_argument("--method", choices=["cost", "tokenkk", "flopkk", "sequential"])
    d.add_argument("--cost-file", help="calibration JSON from `neon-hpc costfit --out`")
    d.add_argument("--json", action="store_true", help="print the whole assignment as JSON")

    a = p.parse_args(argv)
    try:
        return _dry_run(a)
    except ValueError as e:
        print(f"neon-hpc balance {a.cmd}: {e}", file=sys.stderr)
        return 2


def config_args(p):
    p.add_argument("config", nargs="?", default=None, help="experiment YAML (default: the embedded defaults)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")


def load_config(a):
    from neon_hpc import config  # deferred: heavy (neon_hpc.config: h5py, pydantic)
    return config.load(a.config, a.set)


def int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"{what}: expected integers separated by commas or spaces") from None
    if not vals:
        raise ValueError(f"{what}: no lengths given")
    return vals


def _read_lengths_file(path: str) -> list[int]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--lengths-file {path}: cannot read it ({e.strerror})") from None
    if text.lstrip().startswith("["):
        try:
            vals = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lengths-file {path}: not valid JSON ({e})") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            raise ValueError(f"--lengths-file {path}: expected a JSON list of integers")
        return vals
    return int_list(text, f"--lengths-file {path}")


def synthetic_lengths(spec: str, seed: int = 0) -> np.ndarray:
    """``mixture:N``: 94% in 2k-16k, 6% in 32k-128k (issue 7); ``lognormal:N``: median 4k, sigma 1,
    clipped to 128..131072."""
    kind, _, n = spec.partition(":")
    try:
        count = int(n)
    except ValueError:
        raise ValueError(f"--synthetic {spec!r}: expected KIND:N, e.g. mixture:512") from None
    rng = np.random.default_rng(seed)
    if kind == "mixture":
        L = rng.integers(2048, 16385, count)
        tail = rng.random(count) < 0.06
        L[tail] = rng.integers(32768, 131073, int(tail.sum()))
        return L
    if kind == "lognormal":
        return np.clip(rng.lognormal(np.log(4096), 1.0, count), 128, 131072).astype(np.int64)
    raise ValueError(f"--synthetic {spec!r}: unknown kind {kind!r}; use mixture or lognormal")


def _dry_run(a) -> int:
    cfg = load_config(a)
    if a.lengths:
        lengths = int_list(a.lengths, "--lengths")
    elif a.lengths_file:
        lengths = _read_lengths_file(a.lengths_file)
    else:
        lengths = synthetic_lengths(a.synthetic, a.seed)
    over = {k: v for k, v in (("dp", a.dp), ("cp", a.cp), ("token_cap", a.token_cap),
                              ("method", a.method)) if v is not None}
    if a.pp is not None:
        over.update(pp_stages=a.pp, pp_microbatches=a.pp)
    cost = load_cost_file(a.cost_file) if a.cost_file else None
    assignment = assignment_for_config(lengths, cfg, cost=cost, shadow=True, **over)
    if a.json:
        print(json.dumps(assignment.to_dict()))
        return 0
    _print_assignment(assignment)
    return 0


def _print_assignment(asg) -> None:
    print(f"{len(asg.lengths)} sequences, {sum(asg.lengths)} tokens; dp={asg.dp} pp_stages={asg.pp_stages} "
          f"cp={asg.cp} token_cap={asg.token_cap}; {asg.num_microbatches} micro-batches per rank; "
          f"cost source: {asg.cost.source}")
    print(f"{'method':<12}{'makespan':>14}{'vs ' + asg.method:>12}")
    rows = {asg.method: asg.makespan, **asg.shadow}
    for name, ms in rows.items():
        print(f"{name:<12}{ms:>14.4g}{ms / asg.makespan:>11.3f}x")
    print(f"chosen: {asg.method} (from {asg.chosen_from}); imbalance max/mean {asg.imbalance:.4f}; "
          f"split sequences {len(asg.split_sequences())}; oversize {asg.oversize}; "
          f"planned in {asg.method_s * 1e3:.1f} ms")
    worst = int(np.argmax(asg.rank_time))
    print(f"slowest rank {worst}: " + "; ".join(
        f"mb{j}: {asg.microbatch_tokens(worst, j)} tok" for j in range(asg.num_microbatches)))
