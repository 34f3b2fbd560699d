"""Fit the cost model to measured forward + backward times on this machine.

Measures single-sequence micro-batches over a grid of lengths with the real compute of
:mod:`neon_hpc.balance.measure`, fits ``t = c0 + a*n + b*n**2`` by non-negative least
squares on *relative* errors (so short sequences count as much as long ones), then checks
the fit on micro-batches it was not fitted on: packed short documents and a chunk of a
split sequence.  ``c0`` becomes the cost model's ``mb_overhead``.
"""

from __future__ import annotations

import platform
from typing import Callable, Sequence

import numpy as np

from neon_hpc.balance.cost import CostModel, flops_breakdown

DEFAULT_LENGTHS = (64, 128, 256, 512, 768, 1024, 1536, 2048)


def fit(lengths: Sequence[int], times: Sequence[float]) -> dict:
    """Non-negative least squares of ``t = c0 + a n + b n^2``, rows scaled by ``1/t``."""
    from scipy.optimize import nnls
    n = np.asarray(lengths, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if n.size < 3:
        raise ValueError(f"calibrate: need at least 3 measured lengths to fit c0, a, b; got {n.size}")
    if (t <= 0).any():
        raise ValueError("calibrate: a measured time is <= 0; the timer or the run is broken")
    X = np.stack([np.ones_like(n), n, n * n], axis=1)
    w = 1.0 / t
    # scale columns so nnls is well conditioned
    scale = np.abs(X).max(axis=0)
    coef, _ = nnls(X / scale * w[:, None], t * w)
    c0, a, b = coef / scale
    pred = c0 + a * n + b * n * n
    rel = (pred - t) / t
    return {"c0": float(c0), "a": float(a), "b": float(b),
            "rel_rms": float(np.sqrt(np.mean(rel ** 2))), "rel_max": float(np.abs(rel).max()),
            "points": [{"tokens": int(x), "measured_s": float(y), "predicted_s": float(z)}
                       for x, y, z in zip(n, t, pred)]}


def calibrate(model_cfg, lengths: Sequence[int] = DEFAULT_LENGTHS, repeats: int = 3,
              threads: int = 1, clock: str = "cpu", progress: Callable[[str], None] | None = None) -> dict:
    """Measure, fit, validate.  Returns a JSON-able report whose ``cost_model`` entry loads
    with ``CostModel.from_dict``."""
    from neon_hpc.balance.measure import Runner
    say = progress or (lambda s: None)
    runner = Runner(model_cfg, threads=threads, clock=clock)
    runner.run([(0, min(lengths))])                      # warm-up: allocator, kernels
    times = []
    for i, n in enumerate(lengths):
        t = runner.best_of([(0, int(n))], repeats)
        times.append(t)
        say(f"[{i + 1}/{len(lengths)}] {n} tokens: {t * 1e3:.2f} ms")
    f = fit(lengths, times)
    cm = CostModel(a=f["a"], b=f["b"], mb_overhead=f["c0"], source="calibration")
    checks = _validate(runner, cm, lengths, repeats, say)
    flops = flops_breakdown(model_cfg)
    return {
        "cost_model": {k: v for k, v in cm.to_dict().items() if k != "detail"},
        "fit": f, "checks": checks,
        "config_flops": {"a_flops": flops["a_flops"], "b_flops": flops["b_flops"]},
        "effective_gflops": {"linear": flops["a_flops"] / f["a"] / 1e9 if f["a"] else None,
                             "attention": flops["b_flops"] / f["b"] / 1e9 if f["b"] else None},
        "crossover_tokens": cm.crossover_tokens(),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch_threads": threads, "clock": clock},
        "model": {k: getattr(model_cfg, k) for k in ("arch", "hidden_size", "num_layers",
                                                      "num_attention_heads", "num_query_groups",
                                                      "head_dim", "moe_ffn_hidden_size",
                                                      "moe_router_topk", "vocab_size")},
    }


def _validate(runner, cm: CostModel, lengths, repeats, say) -> list[dict]:
    """Micro-batches unlike the fitted ones: packed documents, a late chunk, a zigzag pair."""
    short, long_ = int(min(lengths)), int(max(lengths))
    half = long_ // 2
    q = long_ // 4
    cases = {
        f"8 x {short} packed": [(0, short)] * 8,
        f"chunk [{half}, {long_})": [(half, long_)],
        f"zigzag pair of {long_}": [(0, q), (3 * q, long_)],
    }
    out = []
    for name, pieces in cases.items():
        m = runner.best_of(pieces, repeats)
        p = sum(cm.chunk_cost(s, e) for s, e in pieces) + cm.mb_overhead
        out.append({"case": name, "measured_s": m, "predicted_s": p, "rel_err": (p - m) / m})
        say(f"check {name}: measured {m * 1e3:.2f} ms, predicted {p * 1e3:.2f} ms ({(p - m) / m:+.1%})")
    return out
