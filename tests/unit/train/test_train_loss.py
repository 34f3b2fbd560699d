"""The off-policy loss on cases small enough to compute by hand (see neon_hpc/train/loss.py)."""

import math

import numpy as np
import pytest
import torch

from neon_hpc.train.corrections import bind
from neon_hpc.train.loss import (
    CORRECTION_PREFIX,
    group_advantages,
    policy_loss,
    staleness_histogram,
    staleness_stats,
    term_means,
)


def test_group_advantages_two_groups():
    # group a: rewards 1, 0 -> mean .5, std .5; group b: 2, 0, 1 -> mean 1, std sqrt(2/3)
    adv = group_advantages([1.0, 2.0, 0.0, 0.0, 1.0], ["a", "b", "a", "b", "b"], eps=0.0)
    s = math.sqrt(2 / 3)
    np.testing.assert_allclose(adv, [1.0, 1 / s, -1.0, -1 / s, 0.0], rtol=1e-12)


def test_group_advantages_degenerate_groups_get_zero():
    adv = group_advantages([3.0, 5.0, 5.0], ["solo", "same", "same"])
    np.testing.assert_array_equal(adv, [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="not finite"):
        group_advantages([float("nan")], ["g"])


def _case():
    # Five generated tokens from two groups and two weight versions, plus one prompt token
    # (mask 0) carrying garbage that must not leak into anything.
    #   token:            t0      t1       t2      t3     t4     prompt
    logp = [math.log(0.5), -1.0, -2.0, -0.5, -0.3, float("nan")]
    prox = [math.log(0.5) - 0.5, -1.0, -1.5, -0.5, -0.3, 0.0]
    behav = [math.log(0.5) - 0.5 - math.log(3.0), -1.2, -1.5, -0.5 + math.log(4.0), -0.3, 99.0]
    adv = [1.0, 1.0, -1.0, -1.0, 0.0, 5.0]
    mask = [1, 1, 1, 1, 1, 0]
    t = lambda xs: torch.tensor(xs, dtype=torch.float64)
    return t(logp), t(prox), t(behav), t(adv), t(mask)


def test_policy_loss_hand_computed():
    logp, prox, behav, adv, mask = _case()
    cfg = dict(clip_eps=0.2, kl_coef=0.1, correction=bind("tis", {"cap": 2.0}))
    loss, terms = policy_loss(logp, prox, behav, adv, mask, denom=5.0, **cfg)
    # t0: w = min(3, 2) = 2 (truncated); rho = e^0.5 = 1.6487 > 1.2, A = +1 -> clipped: pg = -2 * 1.2
    # t1: w = e^0.2 = 1.2214; rho = 1;                      pg = -1.2214
    # t2: w = 1; rho = e^-0.5 = 0.6065 < 0.8, A = -1: min(-0.6065, -0.8) = -0.8 -> pg = 0.8, clipped
    #     (the ratio already fell below 1 - eps for a negative advantage: no gradient)
    # t3: w = e^-log4 = 0.25; rho = 1, A = -1;              pg = 0.25
    # t4: A = 0;                                            pg = 0
    pg = [-2.4, -math.exp(0.2), 0.8, 0.25, 0.0]
    d = [0.5 + math.log(3.0), 0.2, -0.5, -math.log(4.0), 0.0]        # logp - behav
    k3 = [math.exp(x) - x - 1 for x in d]
    expected = sum(p + 0.1 * k for p, k in zip(pg, k3)) / 5.0
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert terms["tokens"].item() == 5
    assert terms["pg_loss"].item() == pytest.approx(sum(pg), rel=1e-12)
    assert terms["kl_k3"].item() == pytest.approx(sum(k3), rel=1e-12)
    # the correction's own per-token metrics, summed (its declared names under the loss's prefix)
    assert terms[CORRECTION_PREFIX + "tis_clip_frac"].item() == 1          # t0 only
    assert terms["ppo_clipped"].item() == 2            # t0 and t2
    assert terms[CORRECTION_PREFIX + "tis_weight_mean"].item() == pytest.approx(2 + math.exp(0.2) + 1 + 0.25 + 1,
                                                                                rel=1e-12)
    assert terms["mismatch_abs"].item() == pytest.approx(sum(abs(x) for x in d), rel=1e-12)
    means = term_means({k: float(v) for k, v in terms.items()})
    assert means["tis_clip_frac"] == pytest.approx(0.2)
    assert means["ppo_clip_frac"] == pytest.approx(0.4)


def test_policy_loss_gradient_is_the_weighted_policy_gradient():
    # With prox = logp.detach() (one update per batch) the gradient per token is -w * A / denom.
    logp, _, behav, adv, mask = _case()
    logp = logp.clone().requires_grad_(True)
    cfg = dict(clip_eps=0.2, kl_coef=0.0, correction=bind("tis", {"cap": 2.0}))
    loss, _ = policy_loss(logp, logp.detach(), behav, adv, mask, denom=5.0, **cfg)
    loss.backward()
    w = torch.clamp(torch.exp(logp.detach() - behav), max=2.0)
    want = (-w * adv * mask / 5.0)
    want[5] = 0.0
    torch.testing.assert_close(logp.grad, want)
    assert torch.isfinite(logp.grad).all()


def test_no_correction_ignores_the_behaviour_policy():
    logp, prox, behav, adv, mask = _case()
    a, _ = policy_loss(logp, prox, behav, adv, mask, 5.0, clip_eps=0.2, kl_coef=0.0, correction=bind("none"))
    b, _ = policy_loss(logp, prox, behav + 7.0, adv, mask, 5.0, clip_eps=0.2, kl_coef=0.0, correction=bind("none"))
    assert a.item() == pytest.approx(b.item())
    c, _ = policy_loss(logp, prox, behav + 7.0, adv, mask, 5.0, clip_eps=0.2, kl_coef=0.0, correction=bind("tis"))
    assert c.item() != pytest.approx(a.item())


def test_loss_is_split_invariant():
    # Summing per-micro-batch losses with the global denom equals the loss of the whole batch.
    logp, prox, behav, adv, mask = _case()
    cfg = dict(clip_eps=0.2, kl_coef=0.05, correction=bind("tis"))
    whole, _ = policy_loss(logp, prox, behav, adv, mask, 5.0, **cfg)
    parts = sum(policy_loss(logp[s], prox[s], behav[s], adv[s], mask[s], 5.0, **cfg)[0]
                for s in (slice(0, 2), slice(2, 6)))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-12)


def test_staleness_histogram_mixed_versions():
    hist = staleness_histogram(5, [np.array([-1, 5, 5, 4]), np.array([-1, 3, 4])])
    assert hist == {"0": 2, "1": 2, "2": 1}
    mean, mx = staleness_stats(hist)
    assert mean == pytest.approx(4 / 5) and mx == 2


def test_async_run_without_off_policy_correction_is_refused(tmp_path, capsys):
    from neon_hpc.config import ExperimentConfig
    from neon_hpc.train.loop import run_trainer
    from neon_hpc.train.sections import TrainerSections
    cfg = ExperimentConfig()
    cfg.offpolicy.correction = "none"      # built in code: the YAML loader refuses it earlier
    assert run_trainer(TrainerSections.of(cfg), str(tmp_path / "run")) == 2
    assert "offpolicy.correction" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
