"""The balancer's pipeline time model (balance/pipeline.py): 1F1B and megatron's interleaved
schedule, checked against a closed form and an event-by-event play of the schedule's order,
whose order is checked against megatron-core's own schedule table and warm-up counts."""

import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest

from neon_hpc import config
from neon_hpc.balance import CostModel, assign_step
from neon_hpc.balance.configured import assignment_for_config
from neon_hpc.balance.pipeline import microbatch_group_size, pipeline_time, schedule_order, simulate

COST = CostModel(a=1.0, b=1e-3)


def _cases():
    """(pp, vpp, n, group) for small pipelines, every group size megatron accepts."""
    for p, v in itertools.product((2, 3, 4), (1, 2, 3, 4)):
        for n in range(p, 3 * p + 3):
            groups = [None] if v == 1 else [g for g in range(p, n + 1) if n % g == 0 or n % g >= p]
            for g in groups:
                yield p, v, n, g


def test_closed_form_for_equal_microbatches():
    """One pipeline by hand: 4 equal micro-batches of cost 1 on 2 stages take (4 + 1) / 2 with
    1F1B and (4 + 1/2) / 2 with 2 chunks per stage (the bubble is one chunk step, half a stage's
    share); and the closed form is what the schedule's order gives, for every small case."""
    assert pipeline_time([1.0] * 4, 2) == pytest.approx(2.5)
    assert pipeline_time([1.0] * 4, 2, vpp=2) == pytest.approx(2.25)
    assert simulate([1.0] * 4, 2) == pytest.approx(2.5)
    assert simulate([1.0] * 4, 2, vpp=2) == pytest.approx(2.25)
    for p, v, n, g in _cases():
        t = [1.7] * n
        want = (n + (p - 1) / v) * 1.7 / p
        assert simulate(t, p, v, group=g) == pytest.approx(want), (p, v, n, g)
        assert pipeline_time(t, p, v) == pytest.approx(want), (p, v, n, g)


def test_the_order_is_megatrons():
    """Chunk order and warm-up count as megatron-core's own schedules compute them, and each
    stage runs every (micro-batch, chunk) forward once and its backward once, after it."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    for p, v, n, g in _cases():
        for r in range(p):
            ops = schedule_order(n, p, v, r, g)
            fwd = [(j, c) for k, j, c in ops if k == "F"]
            bwd = [(j, c) for k, j, c in ops if k == "B"]
            assert sorted(fwd) == sorted(bwd) == sorted(itertools.product(range(n), range(v)))
            assert all(ops.index(("F", j, c)) < ops.index(("B", j, c)) for j, c in fwd)
            first_b = next(i for i, o in enumerate(ops) if o[0] == "B")
            if v == 1:
                assert fwd == [(j, 0) for j in range(n)] == bwd
                warm = min(p - r - 1, n)             # forward_backward_pipelining_without_interleaving
                assert first_b == (warm + 1 if warm < n else n), (p, n, r)
                continue
            assert fwd == get_schedule_table(n, v, g)
            # megatron reads the pipeline's size and rank from the communicator's group
            comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda p=p: p, rank=lambda r=r: r),
                                   virtual_pipeline_model_parallel_size=v)
            _total, _all, warm, _rest = get_pp_rank_microbatches(n, v, g, p2p_communicator=comm)
            # warm-up forwards, then forward/backward pairs: the first backward follows forward warm
            assert first_b == (warm + 1 if warm < n * v else n * v), (p, v, n, g, r)


def test_interleaving_shortens_the_bubble_and_the_floor_holds():
    """Unequal micro-batches: the closed form never predicts less than one micro-batch's own
    forward + backward (the schedule cannot: its forward crosses every virtual stage before its
    backward starts), nor less than a stage's share of the work; and against the schedule's
    order it stays within the band the README states."""
    rng = random.Random(7)
    ratios = {1: [], 2: []}
    for _ in range(400):
        p, v = rng.choice((2, 3, 4)), rng.choice((1, 2, 3, 4))
        n = rng.randint(p, 3 * p + 2)
        t = [rng.choice((rng.uniform(0.1, 1.0), rng.uniform(1.0, 10.0))) for _ in range(n)]
        sim, model = simulate(t, p, v), pipeline_time(t, p, v)
        assert sim >= max(t) * (1 - 1e-12) and sim >= sum(t) / p * (1 - 1e-12)
        assert model >= max(t) * (1 - 1e-12) and model >= sum(t) / p
        ratios[min(v, 2)].append(sim / model)
    # the README's band (balance/README.md, "Pipeline time model")
    assert 0.8 <= min(ratios[1]) and max(ratios[1]) <= 1.9
    assert 0.9 <= min(ratios[2]) and max(ratios[2]) <= 2.0


def test_assign_step_scores_with_virtual_stages():
    lens = [300, 500, 800, 1200, 2500, 4000, 700, 900, 350, 6000, 450, 1500]
    plain = assign_step(lens, dp=2, pp_microbatches=4, pp_stages=4, cost=COST, token_cap=8192, shadow=True)
    inter = assign_step(lens, dp=2, pp_microbatches=4, pp_stages=4, cost=COST, token_cap=8192, shadow=True, vpp=2)
    assert inter.vpp == 2 and inter.summary()["vpp"] == 2 and plain.vpp == 1
    for asg in (plain, inter):
        for r in range(asg.dp):
            costs = [asg.microbatch_cost(r, j) for j in range(asg.num_microbatches)]
            assert asg.rank_time[r] == pytest.approx(pipeline_time(costs, 4, asg.vpp))
    assert inter.makespan < plain.makespan
    with pytest.raises(ValueError, match="vpp"):
        assign_step(lens, dp=2, pp_microbatches=1, pp_stages=1, cost=COST, vpp=2)
    with pytest.raises(ValueError, match="vpp"):
        assign_step(lens, dp=2, pp_microbatches=4, cost=COST, vpp=0)


def test_assignment_for_config_passes_virtual_stages():
    cfg = config.load(None, ["model.num_layers=4", "train.pipeline_parallel=2", "train.virtual_pipeline_stages=2",
                             "balance.cost_a=1.0", "balance.cost_b=0.001"])
    asg = assignment_for_config(np.array([300, 900, 2000, 500, 700]), cfg)
    assert (asg.pp_stages, asg.vpp) == (2, 2)
    assert asg.num_microbatches >= 2
    times = [[asg.microbatch_cost(r, j) for j in range(asg.num_microbatches)] for r in range(asg.dp)]
    assert asg.makespan == pytest.approx(max(pipeline_time(c, 2, 2) for c in times))
    assert asg.makespan < max(pipeline_time(c, 2, 1) for c in times)


def test_group_size_is_one_rule():
    from neon_hpc.train import backend
    assert backend.microbatch_group_size is microbatch_group_size
