"""Audit a run's behaviour logprobs: recompute every generated token as the embedded engine did.

For each generation of a trajectory (one request: a run of ``loss_mask == 1`` tokens), the
engine prefilled the prompt on one weight version and then forwarded each sampled token on
the version that sampled the next one; after an in-place swap the new weights decode on the
KV cache the old ones built (``scheduler.py``). :func:`engine_chunks` rebuilds that schedule
from the trajectory's per-token ``versions`` alone, and :func:`audit_trajectory` runs it as a
teacher-forced forward on the run's published ``weights/v_N`` (one cache, carried from one
version's chunk to the next), so its logprobs must equal the recorded ones to float rounding,
whether the request joined a running batch or not, and whether a swap landed inside it.
A token whose recorded version is wrong, or whose logprob came from other weights, shows up
as a gap far above rounding.

``python -m neon_hpc.rollout.engines.embedded.audit RUN [--steps N] [--tol T]`` audits the
trajectories the trainer claimed (``trajectories/claimed/step_*``), prints the largest gap by
kind of token (``single``: its response has one version; ``pre_swap`` / ``post_swap``: before
or after a swap inside its response) and exits 1 when one is over ``--tol``. Sampling at
temperature 1 without top-p/top-k only (the tiny configs'); the weights must be kept
(every published version is, in a run directory).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from neon_hpc.rollout.engines.embedded.model import cache_kwarg

TOL = 1e-4   # float32: a padded, batched KV-cache decode against one unpadded forward
KINDS = ("single", "pre_swap", "post_swap")


def generation_runs(loss_mask) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of generated tokens (one engine request each)."""
    m = np.asarray(loss_mask).astype(bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[False], m, [False]]).astype(np.int8)))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def engine_chunks(versions, start: int, end: int) -> list[tuple[int, int, int]]:
    """``(version, first, last + 1)`` over the input positions ``[0, end - 1)`` of the request
    that generated tokens ``[start, end)``: its prefill (positions ``< start``) on the version of
    its first token, then input position ``i`` on the version of token ``i + 1`` (the decode
    step that forwarded token ``i`` sampled token ``i + 1``)."""
    v = np.asarray(versions)
    chunks: list[list[int]] = []
    for i in range(end - 1):
        ver = int(v[start]) if i < start else int(v[i + 1])
        if chunks and chunks[-1][0] == ver:
            chunks[-1][2] = i + 1
        else:
            chunks.append([ver, i, i + 1])
    return [tuple(c) for c in chunks]


@torch.no_grad()
def _logprobs(model_of: Callable[[int], torch.nn.Module], tokens: list[int], chunks) -> torch.Tensor:
    """Log-softmax over the vocabulary at input positions ``[0, chunks[-1][2])``, each chunk's
    forward on its version, one KV cache carried through."""
    from transformers import DynamicCache  # deferred: heavy (transformers)

    first = model_of(chunks[0][0])
    cache = DynamicCache(config=first.config)
    out = []
    for ver, a, b in chunks:
        model = model_of(ver)
        res = model(input_ids=torch.tensor([tokens[a:b]]), position_ids=torch.arange(a, b)[None],
                    use_cache=True, **{cache_kwarg(model): cache})
        out.append(res.logits[0].float())
    return torch.log_softmax(torch.cat(out), dim=-1)


def audit_trajectory(t, model_of: Callable[[int], torch.nn.Module]) -> dict[str, np.ndarray]:
    """Per kind of token (:data:`KINDS`), ``|recorded - recomputed|`` of each generated token."""
    tokens = [int(x) for x in t.tokens]
    versions, recorded = np.asarray(t.versions), np.asarray(t.logprobs, dtype=np.float64)
    gaps: dict[str, list[float]] = defaultdict(list)
    for a, b in generation_runs(t.loss_mask):
        lp = _logprobs(model_of, tokens, engine_chunks(versions, a, b))
        swapped = len(set(versions[a:b].tolist())) > 1
        for p in range(a, b):
            kind = "single" if not swapped else ("pre_swap" if versions[p] == versions[a] else "post_swap")
            gaps[kind].append(abs(recorded[p] - float(lp[p - 1, tokens[p]])))
    return {k: np.asarray(v) for k, v in gaps.items()}


class _Weights:
    """``weights/v_N`` loaded once each, on first use."""

    def __init__(self, weights_dir: str | Path):
        self.dir, self.models = Path(weights_dir), {}

    def __call__(self, version: int) -> torch.nn.Module:
        if version not in self.models:
            from neon_hpc.models.hf import load_hf  # deferred: heavy (neon_hpc.models.hf: pydantic)
            self.models[version] = load_hf(self.dir / f"v_{version}")
        return self.models[version]


def audit_run(run_dir: str | Path, steps: int | None = None) -> dict[str, dict[str, float]]:
    """Gaps by kind over the trajectories of the first ``steps`` claimed steps (all: None):
    ``{kind: {"tokens", "mean", "max"}}``."""
    from neon_hpc.protocol.rundir import RunDir  # deferred: heavy (neon_hpc.protocol.rundir: pydantic)
    from neon_hpc.store import run_store  # deferred: heavy (neon_hpc.store: h5py, pydantic)

    weights = _Weights(RunDir(run_dir).weights)
    gaps: dict[str, list[np.ndarray]] = defaultdict(list)
    for _step, t in run_store(RunDir(run_dir)).iter_trained(steps):
        for kind, g in audit_trajectory(t, weights).items():
            gaps[kind].append(g)
    out = {}
    for kind in KINDS:
        g = np.concatenate(gaps[kind]) if gaps[kind] else np.zeros(0)
        out[kind] = {"tokens": int(g.size), "mean": float(g.mean()) if g.size else 0.0,
                     "max": float(g.max()) if g.size else 0.0}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m neon_hpc.rollout.engines.embedded.audit",
                                 description="recompute a run's behaviour logprobs as the embedded engine did")
    ap.add_argument("run_dir")
    ap.add_argument("--steps", type=int, default=None, help="audit the first N claimed steps (default: all)")
    ap.add_argument("--tol", type=float, default=TOL)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = audit_run(a.run_dir, a.steps)
    for kind, r in res.items():
        print(f"{kind:10s} tokens {r['tokens']:7d}  mean gap {r['mean']:.3g}  max gap {r['max']:.3g}")
    worst = max(r["max"] for r in res.values())
    print(f"RESULT audit_tokens={sum(r['tokens'] for r in res.values())} audit_max_gap={worst:.3g} "
          f"audit_post_swap_tokens={res['post_swap']['tokens']}")
    return 0 if worst <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
