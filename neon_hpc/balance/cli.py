"""``neon-hpc balance calibrate|dry-run``.

    neon-hpc balance calibrate [CONFIG] [--set k=v] [--lengths 64,128,...] [--out cost.json]
                               [--no-memory] [--stand-in]
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

from neon_hpc.balance.calibrate import DEFAULT_LENGTHS, calibrate
from neon_hpc.balance.configured import load_cost_file, assignment_for_config
from neon_hpc.balance.memory import fit_activation_memory, memory_block


def main(argv: list[str], trainer_step=None) -> int:
    """``trainer_step()`` -> the module that runs the trainer's own step
    (``neon_hpc.train.calibrate``), handed in by ``neon_hpc/cli.py``: a service must not import
    the trainer (tests/structure/test_layers.py)."""
    p = argparse.ArgumentParser(prog="neon-hpc balance", description="cost model calibration and balancing dry runs")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("calibrate", help="fit a and b to measured forward+backward times of the model's shape")
    _config_args(c)
    c.add_argument("--lengths", default="", help="comma-separated sequence lengths to time "
                   "(default 64..4096; cover the lengths you will balance)")
    c.add_argument("--repeats", type=int, default=3, help="best of N timings per length")
    c.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    c.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="cpu: process CPU time (robust on a shared machine); wall: elapsed time")
    c.add_argument("--out", default="", help="write the report (JSON) here; the balance.cost_file format")
    c.add_argument("--no-memory", action="store_true",
                   help="skip the activation-memory measurement (the cost file's memory block, plan.activation_file)")
    c.add_argument("--stand-in", action="store_true",
                   help="time the plain-torch stand-in of the model's shape (balance/measure.py) instead of the "
                        "trainer's step (seconds on CPU; no memory block)")

    d = sub.add_parser("dry-run", help="assign one step from lengths and print every method's prediction")
    _config_args(d)
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
    d.add_argument("--cost-file", help="calibration JSON from `neon-hpc balance calibrate --out`")
    d.add_argument("--json", action="store_true", help="print the whole assignment as JSON")

    a = p.parse_args(argv)
    try:
        return _calibrate(a, trainer_step) if a.cmd == "calibrate" else _dry_run(a)
    except ValueError as e:
        print(f"neon-hpc balance {a.cmd}: {e}", file=sys.stderr)
        return 2


def _config_args(p):
    p.add_argument("config", nargs="?", default=None, help="experiment YAML (default: the embedded defaults)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")


def _load_cfg(a):
    from neon_hpc import config  # deferred: heavy (neon_hpc.config: h5py, pydantic)
    return config.load(a.config, a.set)


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"{what}: expected integers separated by commas or spaces") from None
    if not vals:
        raise ValueError(f"{what}: no lengths given")
    return vals


def _calibrate(a, trainer_step=None) -> int:
    from neon_hpc.protocol.rundir import atomic_write_json  # deferred: heavy (neon_hpc.protocol.rundir: pydantic)
    cfg = _load_cfg(a)
    if a.lengths:
        lengths = _int_list(a.lengths, "--lengths")
    else:   # the defaults, up to what the model's positions reach
        lengths = [n for n in DEFAULT_LENGTHS if n <= cfg.model.max_position_embeddings]
    say = lambda s: print(s, file=sys.stderr, flush=True)    # noqa: E731
    runner, step = None, None
    if not a.stand_in:
        if trainer_step is None:
            raise ValueError("the trainer's step is handed in by the `neon-hpc balance calibrate` entry point "
                             "(neon_hpc/cli.py); run it that way, or pass --stand-in for the plain-torch stand-in")
        step = trainer_step()
        runner = step.TrainerStepRunner(cfg, clock=a.clock, threads=a.threads)
    try:
        rep = calibrate(cfg.model, lengths, repeats=a.repeats, threads=a.threads, clock=a.clock,
                        progress=say, runner=runner)
    finally:
        if runner is not None:
            runner.close()
    if step is not None and not a.no_memory:
        try:
            rep["memory"] = _memory(a, cfg, lengths, step)
        except RuntimeError as e:      # the measurement process failed: its output is above
            raise ValueError(str(e)) from e
    cm, f = rep["cost_model"], rep["fit"]
    print(f"device: {rep['machine'].get('device')} ({rep['machine'].get('runner')}; clock {rep['machine'].get('clock')})")
    print(f"fit: t = {cm['mb_overhead']:.3e} + {cm['piece_overhead']:.3e}*docs + {cm['a']:.3e}*n "
          f"+ {cm['b']:.3e}*n^2 s   "
          f"(relative residual rms {f['rel_rms']:.1%}, max {f['rel_max']:.1%}; "
          f"quadratic = linear at {rep['crossover_tokens']:.0f} tokens)")
    if "step_overhead_s" in rep:
        print(f"per step (grad finalize + optimizer, not in the cost model): {rep['step_overhead_s'] * 1e3:.1f} ms")
    for chk in rep["checks"]:
        print(f"check {chk['case']}: {chk['rel_err']:+.1%}")
    if "memory" in rep:
        m = rep["memory"]
        print(f"memory: {m['bytes_per_token_per_layer']:.0f} B/token/layer (= {m['per_hidden']:.2f} x hidden), "
              f"{m['bytes_per_token_pair_per_layer']:.3g} B/token pair/layer, "
              f"{m['bytes_per_token_outside_layers']:.0f} B/token outside the layers "
              f"(= {m['per_vocab']:.2f} x vocab), fixed {m['bytes_fixed'] / 2**20:.1f} MiB; "
              f"relative residual rms {m['rel_rms']:.1%}, max {m['rel_max']:.1%} ({m['method']})")
    if a.out:
        atomic_write_json(a.out, rep)
        print(f"wrote {a.out}")
    else:
        print(json.dumps(rep["cost_model"]))
    return 0


def _memory(a, cfg, lengths, step) -> dict:
    """The cost file's memory block (balance/memory.py) from the trainer's steps at two depths,
    measured in a fresh process (an allocator this process's timing steps have not shaped)."""
    points, d = step.measure_memory_process(a.config, a.set, step.memory_lengths(lengths))
    return memory_block(fit_activation_memory(points), cfg.model, element_bytes=d["element_bytes"],
                        recompute=d["recompute"], method=d["memory_method"], device=d["device"],
                        precision=d["precision"])


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
    return _int_list(text, f"--lengths-file {path}")


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
    cfg = _load_cfg(a)
    if a.lengths:
        lengths = _int_list(a.lengths, "--lengths")
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
