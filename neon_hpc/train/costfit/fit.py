"""Fit the cost model to measured micro-batch times on this machine.

Measures single-sequence micro-batches over a grid of lengths and a few packed micro-batches
of short documents, fits ``t = c0 + d*documents + a*tokens + b*sum(n**2)`` by non-negative
least squares on *relative* errors (so short sequences count as much as long ones), then
checks the fit on micro-batches it was not fitted on.  ``c0`` becomes the cost model's
``mb_overhead``, ``d`` its ``piece_overhead``.

What is timed is a *runner*: ``runner.best_of(pieces, repeats) -> seconds`` (and optionally
``describe() -> dict``, ``can_split``, ``step_overheads``).  ``neon-hpc costfit``
hands in the trainer's own step (``neon_hpc.train.costfit.step.TrainerStepRunner``: megatron-core
model, the trainer's attention, DDP and optimizer, on CUDA when available); without one, the
plain-torch stand-in of :mod:`neon_hpc.train.costfit.standin` (the benchmark's measured compute).
A runner that cannot run a late chunk of a sequence alone (``can_split = False``: one trainer
rank holds no other rank's prefix) is checked on packed mixes and an unfitted length instead.
"""

from __future__ import annotations

import platform
from typing import Callable, Sequence

import numpy as np

from neon_hpc.balance.cost import CostModel, flops_breakdown
from neon_hpc.train.costfit.standin import Runner
from neon_hpc.util.progress import bar

DEFAULT_LENGTHS = (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)
# packed micro-batches of short documents, fitted with the single sequences so that the
# per-micro-batch and per-document overheads separate
PACKED = ((32, 16), (64, 8), (128, 4))


def _features(pieces) -> list[float]:
    """[1, pieces, tokens, sum(e^2 - s^2)]: what c0, piece_overhead, a and b multiply."""
    return [1.0, float(len(pieces)), float(sum(e - s for s, e in pieces)),
            float(sum(e * e - s * s for s, e in pieces))]


def fit_microbatches(mbs: Sequence[Sequence[tuple[int, int]]], times: Sequence[float],
                     per_piece: bool = True) -> dict:
    """Non-negative least squares of ``t = c0 + d*pieces + a*tokens + b*sum(e^2 - s^2)`` over
    measured micro-batches, rows scaled by ``1/t`` (relative error).  ``per_piece=False``
    drops ``d`` (single-sequence data cannot tell it from ``c0``)."""
    # scipy is imported where used: importing this module does not load it
    from scipy.optimize import nnls  # deferred: heavy (scipy)
    t = np.asarray(times, dtype=np.float64)
    X = np.array([_features(mb) for mb in mbs], dtype=np.float64)
    if not per_piece:
        X[:, 1] = 0.0
    if len(t) < 3:
        raise ValueError(f"calibrate: need at least 3 measured micro-batches to fit; got {len(t)}")
    if (t <= 0).any():
        raise ValueError("calibrate: a measured time is <= 0; the timer or the run is broken")
    w = 1.0 / t
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(X / scale * w[:, None], t * w)
    c0, d, a, b = coef / scale
    pred = X @ np.array([c0, d, a, b])
    rel = (pred - t) / t
    return {"c0": float(c0), "piece": float(d), "a": float(a), "b": float(b),
            "rel_rms": float(np.sqrt(np.mean(rel ** 2))), "rel_max": float(np.abs(rel).max()),
            "points": [{"pieces": len(mb), "tokens": int(sum(e - s for s, e in mb)),
                        "measured_s": float(y), "predicted_s": float(z)}
                       for mb, y, z in zip(mbs, t, pred)]}


def fit(lengths: Sequence[int], times: Sequence[float]) -> dict:
    """``t = c0 + a*n + b*n^2`` from single sequences."""
    return fit_microbatches([[(0, int(n))] for n in lengths], times, per_piece=False)


def calibrate(model_cfg, lengths: Sequence[int] = DEFAULT_LENGTHS, repeats: int = 3,
              threads: int = 1, clock: str = "cpu", progress: Callable[[str], None] | None = None,
              runner=None) -> dict:
    """Measure, fit, validate.  Returns a JSON-able report whose ``cost_model`` entry loads
    with ``CostModel.from_dict``; ``machine`` says what ran where (the runner's ``describe()``)."""
    say = progress or (lambda s: None)
    if runner is None:
        runner = Runner(model_cfg, threads=threads, clock=clock)
    runner.best_of([(0, min(lengths))], 1)                # warm-up: allocator, kernels, optimizer state
    mbs = [[(0, int(n))] for n in lengths] + [[(0, n)] * k for n, k in PACKED]
    times = []
    for i, mb in enumerate(bar(mbs, desc="calibrate", unit="mb")):
        t = runner.best_of(mb, repeats)
        times.append(t)
        say(f"[{i + 1}/{len(mbs)}] {len(mb)} x {mb[0][1]} tokens: {t * 1e3:.2f} ms")
    f = fit_microbatches(mbs, times)
    cm = CostModel(a=f["a"], b=f["b"], mb_overhead=f["c0"], piece_overhead=f["piece"],
                   source="calibration")
    checks = _validate(runner, cm, lengths, repeats, say, getattr(runner, "can_split", True))
    flops = flops_breakdown(model_cfg)
    if hasattr(runner, "describe"):
        machine = runner.describe()
    else:
        machine = {"runner": "plain-torch stand-in of the model's shape (neon_hpc.train.costfit.standin)",
                   "device": "cpu", "device_type": "cpu", "platform": platform.platform(),
                   "processor": platform.processor(), "torch_threads": threads, "clock": clock}
    rep = {
        "cost_model": {k: v for k, v in cm.to_dict().items() if k != "detail"},
        "fit": f, "checks": checks,
        "config_flops": {"a_flops": flops["a_flops"], "b_flops": flops["b_flops"]},
        "effective_gflops": {"linear": flops["a_flops"] / f["a"] / 1e9 if f["a"] else None,
                             "attention": flops["b_flops"] / f["b"] / 1e9 if f["b"] else None},
        "crossover_tokens": cm.crossover_tokens(),
        "machine": machine,
        "model": {k: getattr(model_cfg, k) for k in ("arch", "hidden_size", "num_layers",
                                                      "num_attention_heads", "num_query_groups",
                                                      "head_dim", "moe_ffn_hidden_size",
                                                      "moe_router_topk", "vocab_size")},
    }
    overheads = getattr(runner, "step_overheads", None)
    if overheads:
        # per step, not per micro-batch: grad finalize + optimizer (not a cost-model term)
        rep["step_overhead_s"] = float(np.median(overheads))
    return rep


def _validate(runner, cm: CostModel, lengths, repeats, say, can_split: bool = True) -> list[dict]:
    """Micro-batches unlike the fitted ones: packed documents, and a late chunk and a zigzag
    pair (``can_split``) or a long document packed with short ones and an unfitted length."""
    short, long_ = int(min(lengths)), int(max(lengths))
    half = long_ // 2
    q = long_ // 4
    mid = max(short + 1, (3 * short) // 2)
    cases = {f"6 x {mid} packed": [(0, mid)] * 6}
    if can_split:
        cases.update({f"chunk [{half}, {long_})": [(half, long_)],
                      f"zigzag pair of {long_}": [(0, q), (3 * q, long_)]})
    else:
        grid = sorted(set(int(n) for n in lengths))
        between = (grid[-2] + grid[-1]) // 2 if len(grid) > 1 else long_ // 2
        cases.update({f"mixed {half} + 4 x {short} packed": [(0, half)] + [(0, short)] * 4,
                      f"single {between} (not fitted)": [(0, between)]})
    out = []
    for name, pieces in cases.items():
        m = runner.best_of(pieces, repeats)
        p = sum(cm.chunk_cost(s, e) for s, e in pieces) + cm.mb_overhead
        out.append({"case": name, "measured_s": m, "predicted_s": p, "rel_err": (p - m) / m})
        say(f"check {name}: measured {m * 1e3:.2f} ms, predicted {p * 1e3:.2f} ms ({(p - m) / m:+.1%})")
    return out
