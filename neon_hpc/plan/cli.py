"""``neon-hpc plan CONFIG [--sweep] [--calibrate RESULTS_FILE...] [--png OUT]``.

Simulates the experiment's layout under sync, one-step-off and async policies (plus async
with the other replay mode and the other balancer), prints every parameter with its source
and a table of idle fractions, throughput, staleness and time per step; ``--sweep`` also
tries other splits of the same nodes and recommends one.  See neon_hpc/plan/README.md.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from neon_hpc import config
from neon_hpc.plan import measured, report
from neon_hpc.plan.params import from_experiment

SWEEP_MAX_STALENESS = 8    # the sweep searches staleness bounds up to this by default


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="neon-hpc plan", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="experiment YAML (e.g. configs/kimi_k2_1300xh200.yaml)")
    p.add_argument("--sweep", action="store_true", help="also sweep the rollout/trainer node split and recommend one")
    p.add_argument("--calibrate", nargs="+", metavar="RESULTS_FILE", default=[],
                   help="benchmark outputs with RESULT lines ('-' = stdin) to set parameters from")
    p.add_argument("--png", metavar="OUT", default="", help="write the plots to this PNG file")
    p.add_argument("--steps", type=int, default=0,
                   help="simulated trainer steps per policy (default plan.simulated_steps)")
    p.add_argument("--sweep-steps", type=int, default=0, help="steps per sweep point (default plan.sweep_steps)")
    p.add_argument("--target-staleness", type=int, default=-1,
                   help="the largest staleness bound the sweep searches (default max(offpolicy.max_staleness, 8))")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, e.g. plan.mfu=0.4")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    for n in ("steps", "sweep_steps"):
        if getattr(a, n) < 0:
            print(f"neon-hpc plan: --{n.replace('_', '-')} must be >= 0", file=sys.stderr)
            return 2
    if a.png and not Path(a.png).resolve().parent.is_dir():
        print(f"neon-hpc plan: --png {a.png}: its folder does not exist; create it or pick another path",
              file=sys.stderr)
        return 2
    cfg = config.load(a.config, a.set)
    try:
        sourced = from_experiment(cfg, a.config)
    except ValueError as e:              # e.g. plan.activation_file unreadable or measured otherwise
        print(f"neon-hpc plan: {e}", file=sys.stderr)
        return 2
    progress = None if a.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    cal = None
    if a.calibrate:
        try:
            cal = measured.apply(sourced, measured.read_results(a.calibrate))
        except (OSError, ValueError) as e:
            print(f"neon-hpc plan: {e}", file=sys.stderr)
            return 2
    p = sourced.params
    target = a.target_staleness if a.target_staleness >= 0 else max(p.max_staleness, SWEEP_MAX_STALENESS)
    _print_inputs(a.config, cfg, sourced, cal)
    t0 = time.perf_counter()
    variants = report.compare_policies(sourced, a.steps or p.steps, progress)
    _print_policies(variants, a.steps or p.steps)
    points, chosen = None, None
    if a.sweep:
        sweep_steps = a.sweep_steps or cfg.plan.sweep_steps
        t_sweep = time.perf_counter()
        points = report.sweep(sourced, cfg.plan.sweep_points, sweep_steps, target, progress,
                              cfg.plan.sweep_staleness, cfg.plan.sweep_trajectories_per_step,
                              cfg.plan.sweep_in_flight_pct)
        t_sweep = time.perf_counter() - t_sweep
        Ss, Ts = report.search_space(p, target, cfg.plan.sweep_staleness, cfg.plan.sweep_trajectories_per_step)
        Cs = report.concurrency_space(p, cfg.plan.sweep_in_flight_pct)
        print(f"\nsweep (async, {p.stale_policy} stale tokens, {p.weight_update} weight updates, {sweep_steps} steps "
              f"each) of the node split, staleness bound {Ss}, trajectories per step {Ts} and episodes in flight "
              f"per engine request slot {[c or 'config' for c in Cs]} (W = rollout.num_workers):")
        print(report.table([(s.label, s.result) for s in points if s.result is not None],
                           first="rollout / train nodes, bound, traj/step, workers"))
        for line in report.not_fitting(points):
            print(f"  does not fit: {line}")
        try:
            chosen, why = report.recommend(points, target)
        except ValueError as e:
            print(f"neon-hpc plan: {e}", file=sys.stderr)
            return 1
        r = chosen.result
        print(f"  best layout: {chosen.rollout_nodes} rollout nodes / {chosen.train_nodes} trainer nodes, "
              f"offpolicy.max_staleness={chosen.max_staleness}, "
              f"train.trajectories_per_step={chosen.trajectories_per_step}, "
              f"rollout.num_workers={chosen.num_workers}: {r.samples_per_hour:,.0f} samples/h, "
              f"trainer idle {r.trainer_idle_frac:.1%}, rollout idle "
              f"{r.rollout_idle_frac:.1%}, wasted rollout tokens {r.wasted_tokens_frac:.1%}, token staleness "
              f"mean {r.token_staleness_mean:.2f} / p95 {r.token_staleness_quantile(0.95)}")
        print(f"  recommended: {why}")
        print(f"  sweep: {len(points)} points in {t_sweep:.1f} s")
    if a.png:
        report.write_png(a.png, variants, points, chosen, title=f"neon-hpc plan: {cfg.name}")
        print(f"\nwrote {a.png}")
    print(f"simulated in {time.perf_counter() - t0:.1f} s")
    return 0


def _print_inputs(path: str, cfg, sourced, cal) -> None:
    p = sourced.params
    print(f"neon-hpc plan: {path} ({cfg.name})")
    print(f"  rollout group {report.nodes_of(p.rollout_gpus, p.gpus_per_node)} nodes / {p.rollout_gpus} GPUs, "
          f"trainer group {report.nodes_of(p.train_gpus, p.gpus_per_node)} nodes / {p.train_gpus} GPUs; "
          f"{p.rollout_slots} concurrent episodes ({p.slot_mode} slots), {p.trajectories_per_step} trajectories/step")
    for warning in _warnings(p):
        print(f"  note: {warning}")
    if cal is not None:
        print("\ncalibration (RESULT lines):")
        print("\n".join(cal.lines()) or "  nothing applicable")
    print("\nparameters (value, source):")
    print(report.params_table(sourced))


def _print_policies(variants, steps: int) -> None:
    print(f"\npolicies, {steps} simulated trainer steps each (step time: {variants[0].result.step_time_source}):")
    print(report.table([(v.label, v.result) for v in variants]))
    sync, async_, other_replay, other_method = (variants[i].result for i in (0, 2, 3, 4))
    print(f"  async over sync throughput: {async_.samples_per_hour / max(sync.samples_per_hour, 1e-9):.2f}x; "
          f"{variants[3].label.split()[2]} over {variants[2].label.split()[2]} time/step: "
          f"{other_replay.time_per_step_s / max(async_.time_per_step_s, 1e-9):.3f}x; "
          f"{variants[4].label.split()[-1]} over {variants[2].label.split()[-1]} compute/step: "
          f"{_ratio(other_method, async_):.3f}x")


def _ratio(a, b) -> float:
    ma, mb = report._mean(a.step_compute_s), report._mean(b.step_compute_s)
    return ma / mb if mb > 0 else 1.0


def _warnings(p) -> list[str]:
    out = []
    if p.slot_mode == "worker" and p.engine_slots and p.rollout_slots < p.engine_slots:
        out.append(f"the rollout workers keep at most {p.rollout_slots} episodes in flight; the engines could "
                   f"batch {p.engine_slots} (engine.num_engines x max_batch_size): more workers or larger groups "
                   f"would use them")
    if p.queued:
        out.append(f"the rollout workers keep {p.rollout_slots} episodes in flight, "
                   f"the engines run {p.engine_slots} at "
                   f"once (engine.num_engines x max_batch_size): the rest wait in the engines' queue")
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
