"""The planner's token masking, in-place swaps, trainer memory and the split/bound/batch search.

Closed form: with constant 10 s episodes on 4 slots per rollout node and a trainer whose step
time is inversely proportional to its GPUs, throughput is min(rollout rate, trainer rate);
the search must find the balanced split, and each side of it must be bound by its own group.
"""
import dataclasses
import re

import pytest

from neon_hpc.plan import report
from neon_hpc.plan.cli import main
from neon_hpc.plan.memory import layout_for, layout_search, state_bytes_per_gpu
from neon_hpc.plan.params import SimParams, Sourced
from neon_hpc.plan.sim import simulate
from repo_paths import REPO as ROOT

KIMI = str(ROOT / "configs" / "kimi_k2_1300xh200.yaml")


def balanced_case() -> Sourced:
    """10 nodes of 1 GPU. Rollout: 4 slots per node, every episode one 100-token turn at 10
    tok/s = 10 s -> 0.4 trajectories/s per rollout node. Trainer: 720 trajectories of 100
    tokens per step at a = 2.5e7 FLOP/token on 1e9 FLOP/s per GPU = 1,800 GPU-seconds per step
    (720 divides over every DP width here but 7, which packs within 0.2%) -> 0.4 trajectories/s
    per trainer node. Balanced at 5 / 5: 2 trajectories/s."""
    p = SimParams(rollout_gpus=5, train_gpus=5, gpus_per_node=1, rollout_slots=20, engine_slots=20,
                  group_size=1, slot_mode="episode", max_turns=1, turns_median=1.0, turns_sigma=1e-9,
                  gen_tokens_median=100.0, gen_tokens_sigma=1e-9, max_new_tokens=100, prompt_tokens=0,
                  tool_tokens_per_turn=0, tail_fraction=0.0, decode_tokens_per_s=10.0, replay_mode="off",
                  model_bytes=0.0, trajectories_per_step=720, cost_a=2.5e7, cost_b=0.0, gpu_flops=1e9, mfu=1.0,
                  step_overhead_s=0.0, max_staleness=1000, backpressure_steps=2, steps=30,
                  balance_method="sequential")
    return Sourced(p)


def test_split_search_finds_the_balanced_split_and_each_side_is_bound_by_its_group():
    pts = report.sweep(balanced_case(), points=9, steps=30, target_staleness=1000, bounds=[1000], tps=[720])
    by = {s.rollout_nodes: s for s in pts}
    assert set(by) == set(range(1, 10))
    for r, s in by.items():
        analytic = 0.4 * min(r, 10 - r)            # trajectories per second, in steady state
        ends = s.result.step_end_s                 # (the first batch's fill is start-up)
        steady = (len(ends) - 5) * 720 / (ends[-1] - ends[4])
        assert steady == pytest.approx(analytic, rel=0.03), r
        if r < 5:
            assert s.result.trainer_idle_frac > 0.1 and s.result.rollout_idle_frac < 0.05   # rollout-bound
        if r > 5:
            assert s.result.rollout_idle_frac > 0.1 and s.result.trainer_idle_frac < 0.05   # trainer-bound
    best, why = report.recommend(pts, 1000)
    assert (best.rollout_nodes, best.train_nodes) == (5, 5) and "most samples/hour" in why



def test_the_coarse_to_fine_hill_climb_finds_a_balance_between_the_first_scan_s_splits():
    """6 slots per rollout node (0.6 trajectories/s a node) against 0.4 a trainer node: balanced at
    4 / 6 (2.4/s), which a 3-point first scan (1, 5, 9) misses; the climb (stride 2, then 1) must
    reach it without simulating every split."""
    case = balanced_case()
    case = Sourced(dataclasses.replace(case.params, rollout_slots=30, engine_slots=30))
    pts = report.sweep(case, points=3, steps=30, target_staleness=1000, bounds=[1000], tps=[720])
    best, why = report.recommend(pts, 1000)
    assert (best.rollout_nodes, best.train_nodes) == (4, 6) and "most samples/hour" in why
    assert len({s.rollout_nodes for s in pts}) < 9                  # not every split
    by = {s.rollout_nodes: s for s in pts}
    assert by[4].result.samples_per_hour > max(s.result.samples_per_hour for r, s in by.items() if r != 4)

def test_memory_by_hand_and_splits_that_do_not_fit():
    # dense 8e9 over tp2 x pp2 (replicated 2x), experts 16e9 over ep4 x pp2 (not replicated), 8 GPUs:
    # 2e9 * (2 + 4 + 12/2) + 2e9 * (2 + 4 + 12/1) = 24e9 + 36e9
    assert state_bytes_per_gpu(8e9, 16e9, world=8, tp=2, pp=2, ep=4) == pytest.approx(60e9)
    lay = layout_for(8, tp=2, pp=2, cp=1, ep=4, dense_params=8e9, expert_params=16e9,
                     gpu_memory_bytes=80e9, fraction=0.8, num_experts=16)
    assert lay.fits and (lay.dp, lay.ep) == (2, 4)
    small = layout_for(8, tp=2, pp=2, cp=1, ep=4, dense_params=8e9, expert_params=16e9,
                       gpu_memory_bytes=70e9, fraction=0.8, num_experts=16)
    assert not small.fits and "GiB/GPU" in small.problem
    odd = layout_for(6, tp=2, pp=2, cp=1, ep=4, dense_params=8e9, expert_params=16e9,
                     gpu_memory_bytes=80e9, fraction=0.8)
    assert not odd.fits and "model replicas" in odd.problem


def test_a_deeper_pipeline_lays_out_a_trainer_the_configs_does_not():
    # experts 24e9 on 12 GPUs, tp2, ep <= 2: pp2 holds 24e9/(2*2) = 6e9 each x (2 + 4 + 12/3) = 60e9 > 50e9;
    # pp3 holds 4e9 x (2 + 4 + 12/2) = 48e9 (fits); pp4 and pp5 do not divide 12/2 = 6 GPUs per TP group
    kw = dict(cp=1, ep=2, dense_params=0.0, expert_params=24e9, gpu_memory_bytes=62.5e9, fraction=0.8,
              num_experts=6)
    same = layout_search(12, tp=2, pp=2, num_layers=0, **kw)
    assert not same.fits and same.bytes_per_gpu == pytest.approx(60e9)
    deeper = layout_search(12, tp=2, pp=2, num_layers=8, **kw)
    assert deeper.fits and deeper.pp == 3 and deeper.bytes_per_gpu == pytest.approx(48e9)
    assert layout_search(12, tp=2, pp=2, num_layers=4, **kw).pp == 2   # 4 layers: at most 2 stages of 2
    roomy = layout_search(12, tp=2, pp=2, num_layers=8, **dict(kw, gpu_memory_bytes=100e9))
    assert roomy.fits and roomy.pp == 2                                  # the config's when it fits


def _long_tail(**kw) -> SimParams:
    base = dict(policy="async", slot_mode="worker", max_staleness=2, tail_fraction=0.2, max_turns=16,
                turns_median=3, rollout_slots=32, group_size=4, trajectories_per_step=16, fixed_step_s=30.0,
                steps=150, backpressure_steps=2, seed=3)
    base.update(kw)
    return SimParams(**base)


def test_masking_keeps_long_episodes_and_wastes_fewer_tokens_than_dropping():
    drop = simulate(_long_tail(stale_policy="drop"))
    mask = simulate(_long_tail(stale_policy="mask"))
    assert drop.dropped > 0 and drop.dropped_tokens > 0
    assert mask.dropped_frac < drop.dropped_frac
    assert mask.masked_tokens > 0
    assert mask.wasted_tokens_frac < drop.wasted_tokens_frac
    for r in (drop, mask):   # no trained token is beyond the bound, under either policy
        assert max(r.token_staleness) <= 2 and r.staleness_max <= 2
        assert r.claimed_tokens == pytest.approx(sum(r.token_staleness.values()) + r.masked_tokens + r.dropped_tokens)


def test_in_place_updates_make_trajectories_span_more_versions():
    between = simulate(_long_tail(weight_update="between_requests", max_staleness=8))
    in_place = simulate(_long_tail(weight_update="in_place", max_staleness=8))
    assert in_place.versions_spanned_mean > between.versions_spanned_mean > 1.0


@pytest.mark.slow
def test_kimi_sweep_searches_bound_batch_and_split_says_what_does_not_fit_and_draws_it(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    # from the bound the example shipped with (4) up to the default top (8): the example itself now
    # says 8, the search's pick
    rc = main([KIMI, "--steps", "5", "--sweep", "--sweep-steps", "60", "--png", str(png), "--quiet",
               "--set", "offpolicy.max_staleness=4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "does not fit: 147 / 16: needs" in out            # 16 trainer nodes cannot hold the state
    m = re.search(r"best layout: (\d+) rollout nodes / (\d+) trainer nodes, offpolicy.max_staleness=(\d+), "
                  r"train.trajectories_per_step=(\d+), rollout.num_workers=(\d+): ([\d,]+) samples/h, "
                  r"trainer idle [\d.]+%, rollout idle "
                  r"[\d.]+%, wasted rollout tokens ([\d.]+)%, token staleness mean [\d.]+ / p95 \d+", out)
    assert m, out[-2000:]
    assert int(m[1]) + int(m[2]) == 163 and int(m[3]) <= 8
    assert re.search(r"S=4 tps=\d+", out) and re.search(r"S=8 tps=\d+", out)   # bounds were searched
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_search_space_defaults_span_the_config_and_the_target():
    p = dataclasses.replace(SimParams(), max_staleness=4, trajectories_per_step=512, group_size=8)
    assert report.search_space(p, 8) == ([4, 6, 8], [256, 512, 1024, 2048, 4096])
