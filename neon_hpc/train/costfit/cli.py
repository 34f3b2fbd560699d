"""``neon-hpc costfit``: fit the balancer's cost model (and the planner's memory block) to the trainer's own step.

    neon-hpc costfit [CONFIG] [--set k=v] [--lengths 64,128,...] [--out cost.json]
                     [--no-memory] [--stand-in]

Times the trainer's step (:mod:`neon_hpc.train.costfit.step`) over a grid of micro-batches, fits
the cost model (:mod:`neon_hpc.train.costfit.fit`) and, unless ``--no-memory``, measures the
activation memory; ``--out`` writes the report that ``balance.cost_file`` and
``plan.activation_file`` read (``neon-hpc balance dry-run --cost-file``).
"""

from __future__ import annotations

import argparse
import json
import sys

from neon_hpc.balance.cli import config_args, int_list, load_config
from neon_hpc.balance.memory import fit_activation_memory, memory_block
from neon_hpc.train.costfit.fit import DEFAULT_LENGTHS, calibrate


def main(argv: list[str]) -> int:
    c = argparse.ArgumentParser(prog="neon-hpc costfit",
                                description="fit a and b to measured forward+backward times of the model's shape")
    config_args(c)
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
                   help="time the plain-torch stand-in of the model's shape (train/costfit/standin.py) instead of the "
                        "trainer's step (seconds on CPU; no memory block)")

    a = c.parse_args(argv)
    try:
        return _costfit(a)
    except ValueError as e:
        print(f"neon-hpc costfit: {e}", file=sys.stderr)
        return 2


def _costfit(a) -> int:
    from neon_hpc.protocol.rundir import atomic_write_json  # deferred: heavy (neon_hpc.protocol.rundir: pydantic)
    cfg = load_config(a)
    if a.lengths:
        lengths = int_list(a.lengths, "--lengths")
    else:   # the defaults, up to what the model's positions reach
        lengths = [n for n in DEFAULT_LENGTHS if n <= cfg.model.max_position_embeddings]
    say = lambda s: print(s, file=sys.stderr, flush=True)    # noqa: E731
    runner, step = None, None
    if not a.stand_in:
        from neon_hpc.train.costfit import step  # deferred: heavy (neon_hpc.train.costfit.step: numpy, torch)
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
    mach = rep["machine"]
    print(f"device: {mach.get('device')} ({mach.get('runner')}; clock {mach.get('clock')})")
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
