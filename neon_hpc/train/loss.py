"""The off-policy policy-gradient loss: group-normalised advantages, PPO clip, per-token TIS.

Three policies meet in one step (all as per-token log-probabilities of the sampled token):

- ``logp``:  the policy being trained (has a gradient).
- ``logp_prox``: the proximal policy the PPO ratio is taken against: the trainer's weights at
  the start of this update (detached).  With one optimizer update per claimed batch it equals
  ``logp.detach()``, the ratio is 1 and the clip is inactive; with several updates per batch
  (or in a test) it differs and the clip binds.
- ``behaviour_logprobs``: the behaviour policy: the logprob the inference engine recorded for that
  token, under the weight version that generated *that token* (tokens of one trajectory can
  come from several versions; every token carries its own).

Per generated token (``loss_mask == 1``)::

    w     = correction(exp(logp_prox - behaviour_logprobs))        # detached; offpolicy.correction:
          = min(exp(logp_prox - behaviour_logprobs), cap)          #   "tis": truncated IS
          = 1                                                        #   "none": assumes on-policy data
    rho   = exp(logp - logp_prox)
    pg    = -w * min(rho * A, clip(rho, 1 - eps, 1 + eps) * A)
    k3    = exp(logp - behaviour_logprobs) - (logp - behaviour_logprobs) - 1   # >= 0, unbiased for KL(behav || policy)
    loss  = pg + kl_coef * k3

This is the decoupled PPO objective (behaviour and proximal policies kept apart), with the
behaviour importance weight truncated from above, as in truncated importance sampling for
train/inference mismatch.  The optional KL term pulls the policy toward the policy that
generated the data (no reference model is kept).  The corrections are
``neon_hpc/train/corrections.py``'s registry (a user's one by import path); the settings are the
config's (``train.clip_eps``, ``train.kl_coef``, ``offpolicy.correction``/``correction_params``),
read once by :func:`loss_settings`.

Stale tokens (``offpolicy.stale_policy: mask``, applied after the claim: ``neon_hpc.train.offpolicy``):
a generated token more than ``max_staleness`` versions behind the trainer has ``loss_mask == 0``
here, exactly like a prompt token: it contributes nothing to the loss, the terms or
``denom``, and its gradient is zero; it still conditions the tokens after it (it stays in
the input). The in-bound tokens of the same trajectory train with the per-token TIS above.

Group advantages with part of a group masked: the advantage is a property of the whole
trajectory (its reward against its group's), so :func:`group_advantages` runs over every
trajectory the claim kept, partly masked or not, with its full reward; the masked tokens
simply do not carry it. A trajectory with no trainable token left was dropped by the stale policy
and is not in its group: the group's mean/std are taken over the members present, and a
group left with one member gets advantage 0 (no preference signal), as any group of one.

Normalisation: the per-token losses are *summed* and divided by ``denom``, the number of
generated tokens in the whole global batch (all micro-batches, all data-parallel ranks), so
every token weighs the same however the batch is split; :func:`policy_loss` never averages
per micro-batch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from neon_hpc.train import corrections
from neon_hpc.train.corrections import Bound


def group_advantages(rewards: Sequence[float], group_ids: Sequence[str], norm: str = "std",
                     eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages: reward minus its group's mean, divided by the group's std (``norm="std"``).

    Groups are the trajectories that share a ``group_id`` (one prompt/task sampled several
    times).  The std is the population std (ddof=0).  A group of one, or one whose rewards
    are all equal, gets advantage 0: it carries no preference signal.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"group_advantages: {len(rewards)} rewards but {len(group_ids)} group ids")
    if norm not in ("std", "none"):
        raise ValueError(f"group_advantages: norm must be 'std' or 'none', got {norm!r}")
    r = np.asarray(rewards, dtype=np.float64)
    if not np.all(np.isfinite(r)):
        raise ValueError("group_advantages: a reward is not finite (nan/inf); the trajectory "
                         "should have been quarantined by the store")
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    adv = np.zeros_like(r)
    for idx in members.values():
        x = r[idx]
        centred = x - x.mean()
        if norm == "std":
            centred = centred / (x.std() + eps)
        adv[idx] = centred
    return adv


def loss_settings(cfg: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`policy_loss` from the config (its one source of them)."""
    return {"clip_eps": cfg.train.clip_eps, "kl_coef": cfg.train.kl_coef, "correction": corrections.of(cfg.offpolicy)}


# The correction's metrics travel among the term sums under this prefix (``term_means`` logs
# their per-token means under the declared names).
CORRECTION_PREFIX = "correction:"


def policy_loss(logp: torch.Tensor, logp_prox: torch.Tensor, behaviour_logprobs: torch.Tensor,
                advantages: torch.Tensor, loss_mask: torch.Tensor, denom: float, *, clip_eps: float,
                kl_coef: float, correction: Bound) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch (already divided by ``denom``) and its per-token term sums.

    All tensors have the same shape (any); ``loss_mask`` is 1 for generated tokens, 0 elsewhere.
    Values at masked-out positions never reach the loss or the terms (even if nan/inf).
    ``correction``: :func:`neon_hpc.train.corrections.bind`'s (:func:`loss_settings` gives all three).
    """
    if not (logp.shape == logp_prox.shape == behaviour_logprobs.shape == advantages.shape == loss_mask.shape):
        raise ValueError(f"policy_loss: shapes differ: logp {tuple(logp.shape)}, prox "
                         f"{tuple(logp_prox.shape)}, behav {tuple(behaviour_logprobs.shape)}, adv "
                         f"{tuple(advantages.shape)}, loss_mask {tuple(loss_mask.shape)}")
    if denom <= 0:
        raise ValueError(f"policy_loss: denom must be > 0 generated tokens, got {denom}")
    m = loss_mask.to(logp.dtype)
    on = m > 0
    # Zero the masked positions before any exp: prompt tokens carry placeholder logprobs.
    zero = torch.zeros_like(logp)
    lp = torch.where(on, logp, zero)
    lp_prox = torch.where(on, logp_prox.detach().to(logp.dtype), zero)
    lp_behav = torch.where(on, behaviour_logprobs.detach().to(logp.dtype), zero)
    adv = torch.where(on, advantages.to(logp.dtype), zero)

    w, corr_terms = correction(torch.exp(lp_prox - lp_behav))

    rho = torch.exp(lp - lp_prox)
    surr = rho * adv
    surr_clipped = torch.clamp(rho, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    pg = -w * torch.minimum(surr, surr_clipped)
    clipped = (surr_clipped < surr).to(logp.dtype)

    d = lp - lp_behav
    k3 = torch.exp(d) - d - 1.0
    per_token = pg + kl_coef * k3
    loss = (per_token * m).sum() / denom

    with torch.no_grad():
        terms = {
            "tokens": m.sum(),
            "pg_loss": (pg * m).sum(),
            "kl_k3": (k3 * m).sum(),
            "loss": (per_token * m).sum(),
            **{CORRECTION_PREFIX + k: (v * m).sum() for k, v in corr_terms.items()},
            "ppo_clipped": (clipped * m).sum(),
            "ratio": (rho * m).sum(),
            "mismatch_abs": ((lp - lp_behav).abs() * m).sum(),
        }
    return loss, terms


def add_terms(total: dict[str, float], terms: dict[str, torch.Tensor]) -> None:
    for k, v in terms.items():
        total[k] = total.get(k, 0.0) + float(v)


def term_means(sums: dict[str, float]) -> dict[str, float]:
    """Per-token means of summed terms, with the names the metrics contract logs."""
    n = sums.get("tokens", 0.0)
    if n <= 0:
        return {"loss_tokens": 0}
    return {
        "loss_tokens": int(n),
        "loss": sums["loss"] / n,
        "pg_loss": sums["pg_loss"] / n,
        "kl_k3": sums["kl_k3"] / n,
        **{k[len(CORRECTION_PREFIX):]: v / n for k, v in sums.items() if k.startswith(CORRECTION_PREFIX)},
        "ppo_clip_frac": sums["ppo_clipped"] / n,
        "ratio_mean": sums["ratio"] / n,
        "mismatch_abs_mean": sums["mismatch_abs"] / n,
    }


def staleness_histogram(trainer_version: int, versions: Iterable[np.ndarray]) -> dict[str, int]:
    """Count generated tokens by staleness (trainer version minus the token's version)."""
    hist: dict[int, int] = defaultdict(int)
    for v in versions:
        v = np.asarray(v)
        v = v[v >= 0]
        if v.size:
            ks, counts = np.unique(trainer_version - v, return_counts=True)
            for k, c in zip(ks.tolist(), counts.tolist()):
                hist[int(k)] += int(c)
    return {str(k): hist[k] for k in sorted(hist)}


def staleness_stats(hist: dict[str, int]) -> tuple[float, int]:
    n = sum(hist.values())
    if n == 0:
        return math.nan, 0
    mean = sum(int(k) * c for k, c in hist.items()) / n
    return mean, max(int(k) for k in hist)


def version_span_histogram(versions: Iterable[np.ndarray]) -> dict[str, int]:
    """Count trajectories by how many distinct weight versions their generated tokens span."""
    hist: dict[int, int] = defaultdict(int)
    for v in versions:
        v = np.asarray(v)
        n = int(np.unique(v[v >= 0]).size)
        if n:
            hist[n] += 1
    return {str(k): hist[k] for k in sorted(hist)}


# --------------------------------------------------------------------------------------
# supervised fine-tuning (train.mode: sft): the same books, another loss

SFT_TERMS = ("tokens", "loss")


def sft_loss(logp: torch.Tensor, loss_mask: torch.Tensor, denom: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy on the tokens ``loss_mask`` marks: ``sum(-logp * loss_mask) / denom``.

    ``logp`` is the trainer's log-probability of each label token (megatron's vocab-parallel
    cross-entropy negated, as for :func:`policy_loss`); ``denom`` the marked tokens of the whole
    step (all micro-batches and data ranks), so the loss is a per-token mean over the step
    however it is split.  Masked positions never reach the loss (even if nan/inf).
    """
    if logp.shape != loss_mask.shape:
        raise ValueError(f"sft_loss: shapes differ: logp {tuple(logp.shape)}, loss_mask {tuple(loss_mask.shape)}")
    if denom <= 0:
        raise ValueError(f"sft_loss: denom must be > 0 marked tokens, got {denom}")
    m = loss_mask.to(logp.dtype)
    nll = -torch.where(m > 0, logp, torch.zeros_like(logp))
    total = (nll * m).sum()
    with torch.no_grad():
        terms = {"tokens": m.sum(), "loss": total.detach()}
    return total / denom, terms


def sft_term_means(sums: dict[str, float]) -> dict[str, float]:
    """Per-token mean cross-entropy (``loss``, nats) and its perplexity, as logged by an SFT step."""
    n = sums.get("tokens", 0.0)
    if n <= 0:
        return {"loss_tokens": 0}
    loss = sums["loss"] / n
    return {"loss_tokens": int(n), "loss": loss, "perplexity": math.exp(min(loss, 50.0))}
