#!/usr/bin/env python
"""Benchmark the capacity planner on a 1,300-GPU layout: policies compared, and simulator speed.

Configuration: configs/kimi_k2_1300xh200.yaml (163 nodes of 8 H200s, a Kimi-K2-class model).
Episodes are heavy-tailed (5% run all 32 turns of long output: about an hour at 25 tok/s).
The *example layout* of issue 18 (99 rollout / 64 trainer nodes, 12 engines, 384 workers, 512
trajectories per step, tp8 pp8 cp4 ep64 dp2: the config's until the planner's recommendation
replaced it) is ``EXAMPLE`` below, applied with ``--example-set``.

Runs, in one invocation: the synchronous baseline, async with delta replay and async with
full replay (``--compare-steps`` each, same seed: common random numbers), then a timed
``--steps`` (10,000) step async run.  Ratios compare like with like (the compare runs).

Then the planner's search (``neon-hpc plan --sweep``: node split x staleness bound x
trajectories per step, trainer memory respected) with ``--sweep-steps`` per point, and the
example layout exactly as configured (same steps and seed) for the ratio.

Last line:
``RESULT plan_async_over_sync_throughput=<r> plan_delta_over_full_step_time=<r> plan_sim_seconds=<s> ...
plan_best_wasted=<f> plan_best_trainer_idle=<f> plan_best_over_config_throughput=<r> plan_best_staleness_p95=<k> ...``
(``plan_sim_seconds`` = wall time of the ``--steps`` async simulation; the ``plan_best_*``
keys describe the sweep's recommended layout: wasted rollout tokens, trainer idle, its
samples/h over the configured layout's (``over_config``) and over the example layout's
(``over_example``, the issue's target), its token staleness p95; ``plan_config_*`` the
configured layout as written).  The policy comparison and the timed run use the example
layout.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from neon_hpc import config  # noqa: E402
from neon_hpc.plan import report  # noqa: E402
from neon_hpc.plan.params import from_experiment  # noqa: E402
from neon_hpc.plan.sim import simulate  # noqa: E402
from neon_hpc.plan.workload import sample_episodes  # noqa: E402

# issue 18's example layout (configs/kimi_k2_1300xh200.yaml before 'plan: Kimi example takes the
# planner's layout'): what the targets compare against
EXAMPLE = ["launch.rollout.nodes=99", "launch.train.nodes=64", "engine.num_engines=12", "rollout.num_workers=384",
           "train.trajectories_per_step=512", "train.pipeline_parallel=8", "train.pipeline_last_stage_layers=5",
           "train.expert_parallel=64", "train.context_parallel=4", "train.data_parallel=2"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "kimi_k2_1300xh200.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--example-set", action="append", default=EXAMPLE, metavar="KEY=VALUE",
                    help="the example layout the targets compare against (default: issue 18's)")
    ap.add_argument("--steps", type=int, default=10000, help="steps of the timed async simulation")
    ap.add_argument("--compare-steps", type=int, default=2000, help="steps of each policy-comparison run")
    ap.add_argument("--balance-every", type=int, default=100,
                    help="run the balancer every N steps (bound x last ratio between)")
    ap.add_argument("--sweep-steps", type=int, default=300, help="steps per point of the layout search")
    ap.add_argument("--target-staleness", type=int, default=8, help="largest staleness bound the search tries")
    args = ap.parse_args(argv)

    import numpy as np
    mine = config.load(args.config, args.set)
    configured = from_experiment(mine, args.config)
    configured.set("balance_every", args.balance_every, "bench_plan --balance-every")
    cfg = config.load(args.config, args.set + args.example_set)
    sourced = from_experiment(cfg, args.config + " (example layout)")
    sourced.set("balance_every", args.balance_every, "bench_plan --balance-every")
    p = sourced.params
    ep = sample_episodes(p, 20000, np.random.default_rng(1))
    dur = ep.decode_s + ep.fixed_s
    print(f"example layout: {p.rollout_gpus} rollout GPUs ({p.rollout_slots} episodes in flight, "
          f"{p.engine_slots} request slots), {p.train_gpus} trainer GPUs, "
          f"{p.trajectories_per_step} trajectories/step, staleness <= {p.max_staleness}")
    print(f"episodes: median {np.median(dur) / 60:.1f} min, p95 {np.quantile(dur, 0.95) / 60:.1f} min, "
          f"p99 {np.quantile(dur, 0.99) / 60:.1f} min, max {dur.max() / 60:.1f} min; "
          f"trajectory length median {np.median(ep.seq_len):,.0f}, max {ep.seq_len.max():,.0f} tokens")

    rows = []
    for label, changes in (("sync delta", dict(policy="sync", replay_mode="delta")),
                           ("async delta", dict(policy="async", replay_mode="delta")),
                           ("async full", dict(policy="async", replay_mode="full"))):
        r = simulate(sourced.replace(steps=args.compare_steps, **changes).params)
        rows.append((label, r))
        print(f"  {label}: {args.compare_steps} steps simulated in {r.sim_seconds:.1f} s", flush=True)
    print(report.table(rows))
    sync, delta, full = (r for _, r in rows)
    step_busy = report._mean(delta.step_compute_s) + (p.publish_s if p.publish_blocks_trainer else 0.0)
    print(f"trainer busy per step (compute + overhead + publish): {step_busy:.0f} s")

    t0 = time.perf_counter()
    big = simulate(sourced.replace(steps=args.steps, policy="async", replay_mode="delta").params)
    sim_s = time.perf_counter() - t0
    print(f"timed: {args.steps} async steps ({big.started:,} episodes, {big.wall_s / 86400:.1f} simulated days) "
          f"in {sim_s:.1f} s")
    print(report.table([(f"async delta x{args.steps}", big)]))

    t1 = time.perf_counter()
    points = report.sweep(configured, mine.plan.sweep_points, args.sweep_steps, args.target_staleness, None,
                          mine.plan.sweep_staleness, mine.plan.sweep_trajectories_per_step,
                          mine.plan.sweep_in_flight_pct)
    best, why = report.recommend(points, args.target_staleness)
    nodes = (p.rollout_gpus // p.gpus_per_node, p.train_gpus // p.gpus_per_node)
    here = report.simulate_point(sourced, *nodes, p.max_staleness, p.trajectories_per_step, args.sweep_steps)
    drop = report.simulate_point(sourced.replace(stale_policy="drop"), *nodes, p.max_staleness,
                                 p.trajectories_per_step, args.sweep_steps)
    c = configured.params
    as_written = report.simulate_point(configured, c.rollout_gpus // c.gpus_per_node, c.train_gpus // c.gpus_per_node,
                                       c.max_staleness, c.trajectories_per_step, args.sweep_steps)
    print(f"\nlayout search: {len(points)} points of {args.sweep_steps} steps in {time.perf_counter() - t1:.1f} s")
    print(report.table([(s.label, s.result) for s in points if s.result is not None], first="rollout / train, S, tps"))
    for line in report.not_fitting(points):
        print(f"  does not fit: {line}")
    rows = [(f"example {here.label} ({p.stale_policy})", here.result), (f"example {drop.label} (drop)", drop.result)]
    if as_written.result is not None:
        rows.append((f"configured {as_written.label}", as_written.result))
    print(report.table(rows + [(f"best {best.label}", best.result)], first="layout"))
    if as_written.layout is not None:
        print(f"configured trainer layout: {as_written.layout.describe()}"
              + ("" if as_written.result is not None else f" -- does not fit: {as_written.layout.problem}"))
    print(f"recommended: {why}")
    b = best.result
    async_over_sync = delta.samples_per_hour / max(sync.samples_per_hour, 1e-12)
    delta_over_full = delta.time_per_step_s / max(full.time_per_step_s, 1e-12)
    print(f"RESULT plan_async_over_sync_throughput={async_over_sync:.3f} "
          f"plan_delta_over_full_step_time={delta_over_full:.4f} plan_sim_seconds={sim_s:.1f} "
          f"plan_steps={args.steps} plan_async_trainer_idle={big.trainer_idle_frac:.3f} "
          f"plan_async_rollout_idle={big.rollout_idle_frac:.3f} plan_async_dropped={big.dropped_frac:.3f} "
          f"plan_async_wasted={big.wasted_tokens_frac:.3f} "
          f"plan_best_wasted={b.wasted_tokens_frac:.3f} plan_best_trainer_idle={b.trainer_idle_frac:.3f} "
          f"plan_best_over_example_throughput={b.samples_per_hour / max(here.result.samples_per_hour, 1e-12):.3f} "
          f"plan_best_over_config_throughput={b.samples_per_hour / max(_sph(as_written), 1e-12):.3f} "
          f"plan_best_over_config_drop_throughput={b.samples_per_hour / max(drop.result.samples_per_hour, 1e-12):.3f} "
          f"plan_best_staleness_p95={b.token_staleness_quantile(0.95)} plan_best_bound={best.max_staleness} "
          f"plan_best_rollout_nodes={best.rollout_nodes} plan_best_train_nodes={best.train_nodes} "
          f"plan_best_trajectories_per_step={best.trajectories_per_step} plan_best_num_workers={best.num_workers} "
          f"plan_best_rollout_idle={b.rollout_idle_frac:.3f} plan_best_samples_per_hour={b.samples_per_hour:.0f} "
          f"plan_config_samples_per_hour={_sph(as_written):.0f} plan_config_fits={int(as_written.result is not None)} "
          f"plan_config_trainer_idle={as_written.result.trainer_idle_frac if as_written.result else float('nan'):.3f} "
          f"plan_config_wasted={as_written.result.wasted_tokens_frac if as_written.result else float('nan'):.3f} "
          f"plan_example_samples_per_hour={here.result.samples_per_hour:.0f}")
    return 0


def _sph(point) -> float:
    return point.result.samples_per_hour if point.result is not None else 0.0


if __name__ == "__main__":
    sys.exit(main())
