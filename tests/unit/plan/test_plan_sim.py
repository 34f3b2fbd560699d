"""Closed-form checks of the capacity-planning simulation (neon_hpc.plan.sim)."""
import dataclasses
import math

import pytest

from neon_hpc.plan.params import SimParams
from neon_hpc.plan.sim import simulate


def constant(**kw) -> SimParams:
    """Every episode one turn of 100 tokens at 10 tok/s = 10 s; no tools, exports or publish."""
    base = dict(max_turns=1, turns_median=1.0, turns_sigma=1e-9, gen_tokens_median=100.0,
                gen_tokens_sigma=1e-9, max_new_tokens=100, prompt_tokens=0, tool_tokens_per_turn=0,
                tail_fraction=0.0, decode_tokens_per_s=10.0, replay_mode="off", model_bytes=0.0,
                rollout_slots=8, group_size=1, trajectories_per_step=4, fixed_step_s=2.0,
                max_staleness=1000, backpressure_steps=1000, steps=400, slot_mode="episode")
    base.update(kw)
    return SimParams(**base)


@pytest.mark.parametrize("step_s,slot_mode,group", [(2.0, "episode", 1), (20.0, "episode", 1),
                                                      (2.0, "worker", 2), (20.0, "worker", 4)])
def test_async_throughput_equals_the_analytic_bottleneck(step_s, slot_mode, group):
    p = constant(fixed_step_s=step_s, slot_mode=slot_mode, group_size=group, backpressure_steps=3)
    r = simulate(p)
    analytic = min(p.rollout_slots / 10.0, p.trajectories_per_step / step_s)   # trajectories per second
    assert r.samples_per_hour / 3600 == pytest.approx(analytic, rel=0.02)
    assert r.consumed == p.steps * p.trajectories_per_step


def test_sync_trainer_idle_equals_rollout_time():
    p = constant(policy="sync", rollout_slots=3, trajectories_per_step=7, steps=50)
    r = simulate(p)
    assert r.wait_s == pytest.approx(r.rollout_phase_s, rel=1e-9)
    # 7 episodes on 3 slots take ceil(7/3) waves of 10 s, then a 2 s step
    assert r.time_per_step_s == pytest.approx(10.0 * math.ceil(7 / 3) + 2.0, rel=1e-9)
    assert r.staleness_max == 0


def test_sync_idle_with_heavy_tail_and_publish_still_matches():
    p = dataclasses.replace(SimParams(), policy="sync", tail_fraction=0.1, steps=40, group_size=4,
                            rollout_slots=16, trajectories_per_step=16, model_bytes=4e9,
                            publish_bytes_per_s=1e9, replay_mode="full", route_bytes_per_token=100.0,
                            cost_a=1e9, cost_b=1e4, train_gpus=8, dp=2)
    r = simulate(p)
    assert r.wait_s == pytest.approx(r.rollout_phase_s, rel=1e-9)
    assert r.publish_s == pytest.approx(40 * 4.0)


def test_one_step_off_staleness_is_exactly_one_after_the_first_step():
    r = simulate(constant(policy="one_step_off", steps=60, tail_fraction=0.0))
    assert r.staleness[0] == 4                       # step 0 trains on batch 0 of v_0
    assert r.staleness[1] == 59 * 4
    assert set(r.staleness) == {0, 1}


@pytest.mark.parametrize("admission", ["steps_ahead", "oldest"])
@pytest.mark.parametrize("slot_mode", ["worker", "episode"])
@pytest.mark.parametrize("bound", [0, 1, 3])
def test_async_never_trains_beyond_the_staleness_bound(admission, slot_mode, bound):
    p = SimParams(policy="async", admission=admission, slot_mode=slot_mode, max_staleness=bound,
                  tail_fraction=0.2, max_turns=16, turns_median=3, rollout_slots=32, group_size=4,
                  trajectories_per_step=16, fixed_step_s=30.0, steps=120, backpressure_steps=2, seed=bound)
    r = simulate(p)
    assert r.staleness_max <= bound
    assert r.consumed == p.steps * p.trajectories_per_step
    if bound >= 1:
        assert r.versions_spanned_mean > 1.0        # in-flight updates: trajectories span versions


def test_full_replay_stalls_engines_more_than_delta():
    base = SimParams(policy="async", slot_mode="episode", rollout_slots=256, num_engines=1,
                     route_bytes_per_token=2560.0, export_bytes_per_s=5e8, max_turns=16,
                     turns_median=8, tail_fraction=0.0, trajectories_per_step=64, fixed_step_s=5.0,
                     steps=60, max_staleness=4)
    full = simulate(dataclasses.replace(base, replay_mode="full"))
    delta = simulate(dataclasses.replace(base, replay_mode="delta"))
    off = simulate(dataclasses.replace(base, replay_mode="off"))
    assert off.engine_stall_mean == 0.0
    assert delta.engine_stall_mean < full.engine_stall_mean
    assert delta.time_per_step_s < full.time_per_step_s


def test_same_seed_same_result():
    p = SimParams(tail_fraction=0.1, steps=30, fixed_step_s=10.0)
    a, b = simulate(p), simulate(p)
    assert a.summary() == b.summary()


def test_aborting_stale_groups_keeps_the_bound_and_frees_workers_early():
    base = SimParams(policy="async", slot_mode="worker", max_staleness=1, tail_fraction=0.2, max_turns=16,
                     stale_policy="drop",   # abort_stale stops groups the drop policy would discard
                     turns_median=3, rollout_slots=32, group_size=4, trajectories_per_step=16,
                     fixed_step_s=30.0, steps=150, backpressure_steps=2)
    plain = simulate(base)
    aborted = simulate(dataclasses.replace(base, abort_stale=True))
    assert aborted.aborted > 0 and plain.aborted == 0
    assert aborted.staleness_max <= 1
    assert aborted.consumed == base.steps * base.trajectories_per_step
    assert 0.0 <= aborted.rollout_idle_frac <= 1.0
    # a straggler no longer holds its worker (and the admission budget) until it ends
    assert aborted.time_per_step_s < plain.time_per_step_s


def test_abort_stale_in_episode_mode_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="slot_mode 'worker' only"):
        simulate(SimParams(abort_stale=True, slot_mode="episode", steps=2))


from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bound=st.integers(0, 4), tail=st.floats(0.0, 0.5), workers=st.integers(1, 12), group=st.integers(1, 4),
       step_s=st.floats(1.0, 120.0), admission=st.sampled_from(["steps_ahead", "oldest"]),
       abort=st.booleans(), seed=st.integers(0, 1000))
def test_property_bound_holds_and_every_step_gets_its_batch(bound, tail, workers, group, step_s, admission,
                                                            abort, seed):
    p = SimParams(policy="async", slot_mode="worker", admission=admission, abort_stale=abort, max_staleness=bound,
                  tail_fraction=tail, max_turns=12, rollout_slots=workers * group, group_size=group,
                  trajectories_per_step=2 * group, fixed_step_s=step_s, steps=25, backpressure_steps=2, seed=seed)
    r = simulate(p)
    assert r.staleness_max <= bound
    assert r.consumed == p.steps * p.trajectories_per_step
    assert 0.0 <= r.trainer_idle_frac <= 1.0 and 0.0 <= r.rollout_idle_frac <= 1.0
    assert r.wall_s >= p.steps * step_s - 1e-6


# ---- the real processes' buffering and latencies (worker mode) ----------------------------

def test_buffered_shards_make_the_trainer_take_whole_shards():
    """One fast worker (groups of 1 s), a slow trainer (10 s steps, 1 group each): once ready/
    holds a step, the worker buffers 3 groups per shard, and the claim takes whole shards."""
    base = constant(slot_mode="worker", rollout_slots=1, group_size=1, trajectories_per_step=1,
                    decode_tokens_per_s=100.0, fixed_step_s=10.0, steps=60, max_staleness=1000, backpressure_steps=1000)
    plain = simulate(base)
    buffered = simulate(dataclasses.replace(base, flush_trajectories=3))
    assert plain.consumed == 60                        # a shard per group: exactly one per step
    assert buffered.consumed / buffered.steps == pytest.approx(3.0, abs=0.1)


def test_a_short_claim_waits_whole_polls():
    p = constant(slot_mode="worker", rollout_slots=2, group_size=1, trajectories_per_step=2, fixed_step_s=1.0,
                 steps=50, claim_poll_s=0.3, backpressure_steps=2, max_staleness=2)
    r = simulate(p)
    assert r.wait_s > 0
    assert all(abs(w / 0.3 - round(w / 0.3)) < 1e-6 for w in r.step_wait_s)


def test_engines_load_weights_only_at_the_nodes_checks():
    """Groups start on the engines' version: a check every 10 s plus a 0.5 s load against 1 s
    steps, the engines lag the trainer by 0.5 s (the load) plus on average half the 10.5 s
    cycle: the data is about 0.5 + 10.5 / 2 versions staler than with instant pickup."""
    from neon_hpc.plan.sim import Sim
    base = constant(slot_mode="worker", rollout_slots=8, group_size=2, trajectories_per_step=4, fixed_step_s=1.0,
                    decode_tokens_per_s=1000.0, steps=200, max_staleness=1000, backpressure_steps=4)
    instant = simulate(base)
    sim = Sim(dataclasses.replace(base, weight_poll_s=10.0, weight_load_s=0.5))
    lagged = sim.run()
    assert lagged.staleness_mean - instant.staleness_mean == pytest.approx(0.5 + 10.5 / 2, abs=0.5)
    assert lagged.consumed == instant.consumed == 200 * 4
    gaps = [b - a for a, b in zip(sim.load_times, sim.load_times[1:])]
    assert gaps and all(g == pytest.approx(10.5) for g in gaps)   # check every 10 s after a 0.5 s load
    assert sim.load_versions == sorted(sim.load_versions) and sim.load_versions[-1] >= 190


@pytest.mark.parametrize("slot_mode", ["worker", "episode"])
def test_admission_counts_the_engines_version_gap(slot_mode):
    """neon_hpc.rollout.worker.version_gap: engines that load each version 3 s after a 0.5 s
    check, against 1 s steps, serve weights several versions behind the trainer's next claim.
    Counting only steps of data ahead, workers keep starting groups that are already too stale
    and the claim drops almost all of them; with the gap they wait for the engines instead:
    (almost) nothing dropped, a group started per group trained. The trainer is held back by
    the engines either way (same wall time), and the bound holds."""
    base = constant(slot_mode=slot_mode, rollout_slots=8, group_size=2, trajectories_per_step=4, fixed_step_s=1.0,
                    decode_tokens_per_s=1000.0, steps=200, max_staleness=2, backpressure_steps=4,
                    weight_poll_s=0.5, weight_load_s=3.0)
    gap = simulate(base)
    steps_only = simulate(dataclasses.replace(base, version_gap=False))
    for r in (gap, steps_only):
        assert r.consumed == 200 * 4 and r.staleness_max <= 2
    assert steps_only.dropped_frac > 0.9
    assert gap.dropped_frac < 0.01
    assert gap.started < 1.02 * gap.consumed < steps_only.started / 10
    assert gap.wall_s == pytest.approx(steps_only.wall_s, rel=0.02)
    # instant weight pickup: the gap is the step in progress (trains v_N, engines serve v_{N-1})
    instant = dataclasses.replace(base, weight_poll_s=0.0, weight_load_s=0.0)
    assert simulate(instant).dropped == 0
    assert simulate(dataclasses.replace(instant, version_gap=False)).dropped_frac > 0.2


@pytest.mark.parametrize("slot_mode", ["worker", "episode"])
def test_in_place_loads_pause_the_running_episodes(slot_mode):
    """One slot, 10 s episodes (all decode), a 1 s step per episode, loads of 0.5 s right after
    each publish: in place, every episode is running during one load and ends 0.5 s later, so a
    step takes 10.5 s; between requests (or without the pause) 10 s, and the versions the
    trajectories see are the same either way."""
    base = constant(slot_mode=slot_mode, rollout_slots=1, trajectories_per_step=1, fixed_step_s=1.0, steps=50,
                    weight_load_s=0.5, pause_on_load=True)
    paused = simulate(base)
    between = simulate(dataclasses.replace(base, weight_update="between_requests"))
    off = simulate(dataclasses.replace(base, pause_on_load=False))
    assert paused.time_per_step_s == pytest.approx(10.5, rel=0.01)
    assert between.time_per_step_s == pytest.approx(10.0, rel=0.01)
    assert off.time_per_step_s == pytest.approx(10.0, rel=0.01)
    assert paused.consumed == between.consumed == 50


def test_a_pause_delays_only_the_decode_share_of_an_episode():
    """Two-turn episodes with a tool call between (exponential, mean 10 s), one slot, one
    episode per 1 s step: the load after each publish (4 s) falls inside the next episode and
    pauses its decoding, not its tool call, so episode i ends 4 s x decode_i / (decode_i +
    tool_i) later. Over 40 steps the wall grows by exactly that sum (episodes 1..39; episode 0
    runs before the first publish)."""
    import numpy as np

    from neon_hpc.plan.workload import sample_episodes
    base = constant(slot_mode="episode", rollout_slots=1, trajectories_per_step=1, fixed_step_s=1.0, steps=40,
                    max_turns=2, turns_median=2.0, tool_latency_s=10.0, weight_load_s=4.0, pause_on_load=True)
    paused = simulate(base)
    off = simulate(dataclasses.replace(base, pause_on_load=False))
    ep = sample_episodes(base, 8192, np.random.default_rng(base.seed))   # the simulation's own draws
    share = ep.decode_s / (ep.decode_s + ep.fixed_s)
    assert 0.2 < share[1:40].mean() < 0.9                               # tools do take part of the time
    assert paused.wall_s - off.wall_s == pytest.approx(4.0 * share[1:40].sum(), rel=1e-6)
