"""Per-token staleness (offpolicy.stale_policy, neon_hpc/train/offpolicy.py): the claim keeps what the
policy keeps and hands trajectories out as written; the policy then masks tokens over the bound and a
trajectory is dropped only when nothing of it is left to train; the loss then trains exactly the
in-bound tokens (checked by hand, gradients of masked tokens are zero); waste is counted in tokens."""

import json
import math

import numpy as np
import torch

from neon_hpc.config.store import StoreConfig
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.store import ShardWriter, claim_step
from neon_hpc.store.claim import CLAIM_FILE
from neon_hpc.store.trajectory import Trajectory
from neon_hpc.train.corrections import bind
from neon_hpc.train.loss import group_advantages, policy_loss, version_span_histogram
from neon_hpc.train.offpolicy import StalePolicy, apply, stale_token_mask

CFG = StoreConfig(fsync=False)


def _traj(task, versions, prompt=3, reward=1.0, group="g"):
    """``prompt`` env tokens, then one generated token per entry of ``versions``."""
    n = prompt + len(versions)
    mask = np.array([0] * prompt + [1] * len(versions), np.uint8)
    vers = np.array([-1] * prompt + list(versions), np.int32)
    lp = np.array([0.0] * prompt + [-0.5 - 0.1 * i for i in range(len(versions))], np.float32)
    return Trajectory(tokens=np.arange(n, dtype=np.int32) % 50, loss_mask=mask, logprobs=lp, versions=vers,
                      reward=reward, task_id=task, group_id=group)


def _publish(run, tag, trajs):
    with ShardWriter(run, f"w-{tag}", CFG) as w:
        for t in trajs:
            w.add(t)


def test_mask_policy_keeps_in_bound_tokens_and_drops_only_fully_stale(tmp_path):
    v = 10   # trainer version; bound 2 -> versions >= 8 train
    _publish(tmp_path, "a", [_traj("mixed", [v - 5, v - 5, v - 1, v - 1, v - 1]),   # 2 masked, 3 train
                             _traj("fresh", [v, v]),
                             _traj("old", [v - 4, v - 3])])                       # nothing in bound
    res = claim_step(tmp_path, 1, want=2, consumer="trainer-0", admit=StalePolicy(v, 2, "mask"), timeout_s=0)
    by = {t.task_id: t for t in res.trajectories}
    assert by["mixed"].loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]   # the store is a pipe: as written
    apply(res)                                                           # the trainer's policy masks
    assert sorted(by) == ["fresh", "mixed"] and res.dropped_stale == 1
    assert by["mixed"].loss_mask.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert len(by["mixed"].tokens) == 8          # masked tokens stay in the context
    assert res.generated_tokens == 9 and res.masked_stale_tokens == 2 and res.dropped_stale_tokens == 2
    assert math.isclose(res.wasted_rollout_tokens, 4 / 9)
    rec = json.loads((RunDir(tmp_path).claimed_step(1) / CLAIM_FILE).read_text())
    assert rec["stale_policy"] == "mask" and rec["masked_stale_tokens"] == 2 and rec["dropped_stale_tokens"] == 2
    # a resumed claim trains the same tokens (the shard keeps the engine's mask; the rule the claim
    # recorded is re-applied, whatever rule the resuming call brings)
    again = apply(claim_step(tmp_path, 1, want=2, consumer="trainer-0", admit=StalePolicy(v + 5, 0, "drop"),
                             timeout_s=0))
    assert again.resumed and again.admission == {"trainer_version": v, "max_staleness": 2, "stale_policy": "mask"}
    assert {t.task_id: t.loss_mask.tolist() for t in again.trajectories} == \
        {k: t.loss_mask.tolist() for k, t in by.items()}
    assert again.masked_stale_tokens == 2 and math.isclose(again.wasted_rollout_tokens, 4 / 9)


def test_drop_policy_drops_the_whole_trajectory_and_counts_its_tokens(tmp_path):
    v = 10
    _publish(tmp_path, "a", [_traj("mixed", [v - 5, v - 1, v - 1]), _traj("fresh", [v, v])])
    res = apply(claim_step(tmp_path, 1, want=1, consumer="trainer-0", admit=StalePolicy(v, 2, "drop"), timeout_s=0))
    assert [t.task_id for t in res.trajectories] == ["fresh"]
    assert res.dropped_stale_tokens == 3 and res.masked_stale_tokens == 0 and res.generated_tokens == 5
    assert math.isclose(res.wasted_rollout_tokens, 3 / 5)


def test_loss_trains_only_in_bound_tokens_by_hand_and_masked_tokens_get_no_gradient():
    # versions [v-5, v-1] under a bound of 2 at trainer version v: the v-5 token is masked
    v = 7
    versions = np.array([-1, v - 5, v - 1])
    gen = np.array([0, 1, 1])
    train = stale_token_mask(gen, versions, v, 2)
    assert train.tolist() == [0, 0, 1]
    logp = torch.tensor([0.0, -1.0, -0.4], dtype=torch.float64, requires_grad=True)
    behav = torch.tensor([0.0, -1.3, -0.4 - math.log(1.5)], dtype=torch.float64)
    adv = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)
    cfg = dict(clip_eps=0.2, kl_coef=0.1, correction=bind("tis", {"cap": 2.0}))
    loss, terms = policy_loss(logp, logp.detach(), behav, adv, torch.tensor(train, dtype=torch.float64),
                              denom=float(train.sum()), **cfg)
    # the one trained token: w = min(exp(prox - behav), 2) = 1.5, rho = 1 -> pg = -1.5 * A;
    # k3 = exp(d) - d - 1 with d = logp - behav = log 1.5
    d = math.log(1.5)
    want = -1.5 * 1.0 + 0.1 * (math.exp(d) - d - 1.0)
    assert math.isclose(float(loss.detach()), want, rel_tol=1e-12)
    assert float(terms["tokens"]) == 1.0
    loss.backward()
    g = logp.grad.tolist()
    assert g[0] == 0.0 and g[1] == 0.0          # prompt and stale token: zero gradient
    # d loss / d logp of the trained token: -w * A * rho + kl * (exp(d) - 1)
    assert math.isclose(g[2], -1.5 + 0.1 * (1.5 - 1.0), rel_tol=1e-12)
    # had the stale token trained, the loss would differ (the mask is what makes the difference)
    loss_all, _ = policy_loss(logp.detach(), logp.detach(), behav, adv, torch.tensor(gen, dtype=torch.float64),
                              denom=1.0, **cfg)
    assert not math.isclose(float(loss_all), want)


def test_group_advantages_of_a_partly_masked_group_use_every_kept_member():
    # a partly masked member keeps its full reward in its group's baseline
    adv = group_advantages([1.0, 0.0, 0.5], ["g", "g", "g"], eps=0.0)
    assert np.all(np.isfinite(adv)) and math.isclose(float(adv.sum()), 0.0, abs_tol=1e-12)
    # a group reduced to one member by drops carries no preference: advantage 0
    assert group_advantages([1.0], ["g"]).tolist() == [0.0]


def test_version_span_histogram_counts_distinct_versions_of_generated_tokens():
    assert version_span_histogram([np.array([-1, 3, 3, 4]), np.array([-1, 5]), np.array([-1, -1])]) == \
        {"1": 1, "2": 1}


def test_summary_and_status_show_version_spans_and_waste():
    from neon_hpc.launch.summary import render_summary, trained_versions_and_waste
    from neon_hpc.ops.status import render
    steps = [{"version_spans": {"1": 10, "2": 6}, "claimed_gen_tokens": 100, "masked_stale_tokens": 3,
              "dropped_stale_tokens": 2},
             {"version_spans": {"1": 12, "3": 4}, "claimed_gen_tokens": 100, "masked_stale_tokens": 0,
              "dropped_stale_tokens": 0}]
    w = trained_versions_and_waste(steps)
    assert w["trained_versions_spanned"] == {1: 22, 2: 6, 3: 4}
    assert math.isclose(w["trained_multi_version_fraction"], 10 / 32)
    assert math.isclose(w["wasted_rollout_tokens"], 5 / 200)
    s = dict(steps=2, wall_s=10.0, trajectories_written=40, trajectories_trained=32, tokens_written=1,
             tokens_trained=1, versions_spanned={1: 40}, reward_first=0.1, reward_last=0.2, staleness_max=2,
             trainer_idle_fraction=0.1, rollout_idle_fraction=0.2, **w)
    text = render_summary(s)
    assert "per trained trajectory (token by token): 1 version: 22, 2 versions: 6, 3 versions: 4" in text
    assert "(>= 2 versions: 0.312)" in text and "wasted rollout tokens 0.025 (stale: 3 masked, 2 dropped)" in text
    info = dict(run="r", job={}, slurm_state="", trainer_step=2, checkpoint=None, weights_latest=2,
                heartbeats=[], shards={"ready": 0, "claimed": 2, "quarantined": 0, "writing": 0},
                trajectories_written=40, staleness_hist={}, trainer_tokens_per_s=None, rollout_tokens_per_s=None,
                reward_last=0.2, finished=None, errors=[], engines=[], **w)
    st = render(info)
    assert "versions  1:22 2:6 3:4" in st and "wasted    0.025 of generated tokens (stale: 3 masked, 2 dropped)" in st
