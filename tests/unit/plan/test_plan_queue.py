"""The engines' request queue (workers whose episodes outnumber the engines' request slots) and
decode speed against the engine's batch (neon_hpc.plan.slots)."""
import dataclasses

import numpy as np
import pytest

from neon_hpc import config
from neon_hpc.plan import report
from neon_hpc.plan.params import SimParams, from_experiment, kv_bytes_per_token_per_gpu
from neon_hpc.plan.sim import simulate
from neon_hpc.plan.slots import decode_speed_table
from repo_paths import REPO as ROOT

KIMI = str(ROOT / "configs" / "kimi_k2_1300xh200.yaml")


def constant(**kw) -> SimParams:
    """Every episode one turn of 100 tokens at 10 tok/s = 10 s; no tools, exports or publish;
    a 0.1 s trainer step, so the rollout side is the bottleneck."""
    base = dict(max_turns=1, turns_median=1.0, turns_sigma=1e-9, gen_tokens_median=100.0,
                gen_tokens_sigma=1e-9, max_new_tokens=100, prompt_tokens=0, tool_tokens_per_turn=0,
                tail_fraction=0.0, decode_tokens_per_s=10.0, replay_mode="off", model_bytes=0.0,
                group_size=4, trajectories_per_step=8, fixed_step_s=0.1, max_staleness=1000,
                backpressure_steps=1000, steps=300, slot_mode="worker", policy="async")
    base.update(kw)
    return SimParams(**base)


def steady_rate(r, per_step: int, skip: int = 20) -> float:
    ends = r.step_end_s
    return (len(ends) - 1 - skip) * per_step / (ends[-1] - ends[skip])


def test_workers_beyond_the_request_slots_queue_and_the_engines_bound_throughput():
    # 4 workers x 4 = 16 episodes in flight, the engines run 8 at once: 8 / 10 s, not 16 / 10 s
    queued = simulate(constant(rollout_slots=16, engine_slots=8))
    assert steady_rate(queued, 8) == pytest.approx(0.8, rel=0.02)
    assert queued.slots == 8 and queued.rollout_idle_frac < 0.02     # idle is measured on the request slots
    free = simulate(constant(rollout_slots=16, engine_slots=16))     # room for every episode: no queue
    assert steady_rate(free, 8) == pytest.approx(1.6, rel=0.02)
    fewer = simulate(constant(rollout_slots=8, engine_slots=16))     # fewer workers than slots: theirs bound it
    assert steady_rate(fewer, 8) == pytest.approx(0.8, rel=0.02) and fewer.slots == 8


def test_a_straggler_holds_one_request_slot_not_its_groups():
    # measured episodes: 7 of 8 take 10 s, 1 takes 80 s (mean 18.75 s); groups of 4
    secs = (10.0,) * 7 + (80.0,)
    base = constant(episode_seconds=secs, episode_tokens=(100.0,) * 8, engine_slots=32, steps=400,
                    trajectories_per_step=16, seed=5)
    workers = simulate(dataclasses.replace(base, rollout_slots=32))    # workers fill the slots: no queue
    queued = simulate(dataclasses.replace(base, rollout_slots=128))    # 4x the slots: the rest queue
    mean = sum(secs) / len(secs)
    g = np.random.default_rng(0).choice(secs, size=(200000, 4))
    slowest = g.max(axis=1).mean()                                     # E[slowest of a group of 4]
    assert steady_rate(workers, 16) == pytest.approx(32 / slowest, rel=0.06)
    # the queue keeps the request slots busy: 32 / E[episode], the engines' bound
    assert steady_rate(queued, 16) == pytest.approx(32 / mean, rel=0.06)
    assert queued.rollout_idle_frac < 0.03 and workers.rollout_idle_frac < 0.03   # held, though not running


def test_decode_speed_against_the_engine_batch_by_hand():
    # k = 1: (1 + k * b/B) / (1 + k): an empty engine decodes 2x faster than a full one
    p = constant(slot_mode="episode", rollout_slots=100, engine_slots=100, decode_kv_ratio=1.0)
    t = decode_speed_table(p)
    assert t[0] == pytest.approx(0.5) and t[50] == pytest.approx(0.75) and t[-1] == pytest.approx(1.0)
    assert decode_speed_table(dataclasses.replace(p, decode_kv_ratio=0.0)) == [1.0] * len(t)
    # worker mode without a queue: held slots x E[episode] / E[slowest of a group] run a request;
    # with constant episodes every held slot runs one
    w = decode_speed_table(constant(rollout_slots=100, engine_slots=100, decode_kv_ratio=1.0))
    assert w[-1] == pytest.approx(1.0) and w[50] == pytest.approx(0.75)
    # a full engine pool decodes at decode_tokens_per_s; a half-full one (fewer slots used) faster
    full = simulate(constant(slot_mode="episode", rollout_slots=16, engine_slots=16, decode_kv_ratio=1.0))
    assert steady_rate(full, 8) == pytest.approx(1.6 / ((1 + 15 / 16) / 2), rel=0.03)   # steady: 15 others run
    half = simulate(constant(slot_mode="worker", group_size=1, rollout_slots=8, engine_slots=16,
                             decode_kv_ratio=1.0))
    assert steady_rate(half, 8) > 1.3 * steady_rate(simulate(constant(slot_mode="worker", group_size=1,
                                                                       rollout_slots=8, engine_slots=16)), 8)


def test_kv_cache_bytes_per_token_by_hand():
    cfg = config.load(KIMI, [])
    # MLA: the compressed latent, 61 layers x (512 + 64) x bf16, on every GPU of the attention TP group
    assert kv_bytes_per_token_per_gpu(cfg.model, 8) == 61 * (512 + 64) * 2
    gqa = dataclasses.replace(cfg.model, kv_lora_rank=0, num_query_groups=8, head_dim=128)
    # K and V of 8 groups x 128, sharded over TP 4
    assert kv_bytes_per_token_per_gpu(gqa, 4) == 2 * 2 * 61 * 8 * 128 / 4
    s = from_experiment(cfg, KIMI)
    p = s.params
    weights = 2 * (p.expert_params / 64 + p.dense_params / 8)
    assert weights == pytest.approx(36.7e9, rel=0.01)
    assert 0.5 < p.decode_kv_ratio < 3 and s.source("decode_kv_ratio").startswith("derived (256/8 requests")
    tiny = from_experiment(config.load(str(ROOT / "configs" / "tiny_cpu.yaml"), []), "tiny")
    assert tiny.params.decode_kv_ratio == 0.0 and "embedded" in tiny.source("decode_kv_ratio")
    set_ = from_experiment(config.load(KIMI, ["plan.decode_kv_ratio=0.25"]), KIMI)
    assert set_.params.decode_kv_ratio == 0.25


# issue 18's example layout: 12 engines (3 prefill) on 99 nodes, 384 workers x 8 = 3,072 episodes in flight
EXAMPLE = ["launch.rollout.nodes=99", "launch.train.nodes=64", "engine.num_engines=12", "rollout.num_workers=384",
           "train.expert_parallel=64", "train.data_parallel=2"]


def test_other_splits_keep_the_configs_workers_per_request_slot():
    s = from_experiment(config.load(KIMI, EXAMPLE), KIMI)   # 3,072 episodes in flight per 2,304 request slots
    assert report.split_changes(s, 99, 64)["rollout_slots"] == 3072
    for r in (19, 99, 131, 142):
        ch = report.split_changes(s, r, 163 - r)
        assert ch["rollout_slots"] == ch["engine_slots"] * 3072 // (2304 * 8) * 8      # whole groups
        c3 = report.split_changes(s, r, 163 - r, 3.0)
        assert c3["rollout_slots"] == int(3 * ch["engine_slots"]) // 8 * 8
    assert report.concurrency_space(s.params) == [0.0, 1.0, 2.0, 3.0, 4.0]
    fill = from_experiment(config.load(KIMI, EXAMPLE + ["rollout.num_workers=288"]), KIMI)   # 2,304: ratio 1
    assert report.concurrency_space(fill.params) == [0.0, 2.0, 3.0, 4.0]   # 0 = the config's, not twice
    assert not fill.params.queued and report.split_changes(fill, 142, 21)["rollout_slots"] <= \
        report.split_changes(fill, 142, 21)["engine_slots"]
    assert report.concurrency_space(s.params, [150, 300]) == [0.0, 1.5, 3.0]
    with pytest.raises(ValueError, match="plan.sweep_in_flight_pct"):
        report.concurrency_space(s.params, [0])


def test_the_queue_refuses_abort_stale():
    with pytest.raises(ValueError, match="abort_stale is not modelled"):
        simulate(constant(rollout_slots=16, engine_slots=8, abort_stale=True))


def test_policy_comparison_leaves_out_abort_stale_when_workers_queue():
    queued = from_experiment(config.load(KIMI, []), KIMI)
    assert queued.params.queued
    assert not any("abort" in v.label for v in report.policy_variants(queued))
    fits = from_experiment(config.load(KIMI, ["rollout.num_workers=384"]), KIMI)   # 1x the 3,072 slots
    assert not fits.params.queued and any("abort-stale" in v.label for v in report.policy_variants(fits))
