"""Synthetic trajectories for tests and benchmarks (shapes and dtypes as rollout makes them)."""

from __future__ import annotations

import numpy as np

from neon_hpc.store.trajectory import Trajectory


def make_trajectory(rng: np.random.Generator, num_tokens: int, *, moe_layers: int = 2, top_k: int = 2,
                    num_experts: int = 4, routes: bool = True, turns: int = 2, version: int = 0,
                    versions_span: int = 1, task_id: str = "task", group_id: str = "group",
                    routes_dtype=np.uint16, vocab: int = 256) -> Trajectory:
    """A plausible trajectory: alternating prompt/generated turns, per-token versions in
    ``[version, version + versions_span)`` on generated tokens, random routes."""
    n = int(num_tokens)
    cuts = np.sort(rng.integers(0, n + 1, size=max(0, 2 * turns - 1))) if n else np.zeros(0, np.int64)
    bounds = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    mask = np.zeros(n, dtype=np.uint8)
    for j in range(1, len(bounds) - 1, 2):  # odd segments are the model's turns
        mask[bounds[j]:bounds[j + 1]] = 1
    gen = mask == 1
    versions = np.full(n, -1, dtype=np.int32)
    versions[gen] = np.sort(rng.integers(version, version + max(1, versions_span), size=int(gen.sum())))
    logprobs = np.zeros(n, dtype=np.float32)
    logprobs[gen] = -rng.exponential(1.0, size=int(gen.sum())).astype(np.float32)
    r = None
    if routes:
        r = rng.integers(0, num_experts, size=(n, moe_layers, top_k)).astype(routes_dtype)
    return Trajectory(
        tokens=rng.integers(0, vocab, size=n).astype(np.int32), loss_mask=mask, logprobs=logprobs,
        versions=versions, routed_experts=r, reward=float(rng.random()),
        rewards={"success": float(rng.integers(0, 2)), "dense": float(rng.random())},
        task_id=task_id, group_id=group_id, turn_offsets=bounds[::2].copy(),
        metadata={"seed": int(rng.integers(1 << 30)), "note": "synthetic ✓"},
        timings={"episode_s": float(rng.random() * 10)})


def replayed_documents(docs: int, tokens: int, *, vocab: int, layers: int, experts: int, top_k: int,
                       seed: int = 0, prompt: int = 4, logprob: float = -8.0) -> list[Trajectory]:
    """``docs`` single-turn trajectories of ``tokens`` tokens (``prompt`` prompt tokens, the rest
    generated at version 0 with log-probability ``logprob``), distinct experts per token in every
    one of ``layers`` layers (the trainer replays them), rewards alternating 0/1, two documents per
    group: the trainer's benchmark and its op census step on these."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(docs):
        mask = np.r_[np.zeros(prompt), np.ones(tokens - prompt)].astype(np.uint8)
        routes = np.argsort(rng.random((tokens, layers, experts)), axis=-1)[..., :top_k]
        out.append(Trajectory(tokens=rng.integers(0, vocab, tokens).astype(np.int32), loss_mask=mask,
                              logprobs=np.where(mask > 0, logprob, 0).astype(np.float32),
                              versions=np.where(mask > 0, 0, -1).astype(np.int32),
                              routed_experts=routes.astype(np.int32), reward=float(i % 2),
                              task_id=f"t{i // 2}", group_id=f"t{i // 2}"))
    return out
