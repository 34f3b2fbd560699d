"""The cost file's ``memory`` block: activation bytes per token, measured on the trainer's own step.

``neon-hpc costfit`` runs the real trainer step (``neon_hpc.train.costfit.step``) and,
beside the times it fits the cost model to, records each step's **peak memory above what the
model held before the step** (weights, gradient buffers, optimizer state are already there
after a warm-up step; what the step adds is activations, the backward's working set and the
loss).  Steps of single sequences of several lengths at two model depths are fitted by
non-negative least squares on relative errors to::

    peak(n tokens, l layers) = c + e*n + l*(k*n + q*n^2)

* ``k`` bytes per token per decoder layer (what a layer keeps for its backward);
* ``q`` bytes per (query, key) pair per layer: attention scores a kernel materialises (0 for
  attention whose memory grows linearly with length);
* ``e`` bytes per token outside the layers (embedding output, logits, loss);
* ``c`` a fixed part (allocator, the optimizer step's temporaries).

So that the figure carries over to another model shape (the capacity planner's), each coefficient is
also written per unit of what it scales with: ``k / hidden_size``, ``q / num_attention_heads``,
``e / vocab_size``.  That scaling is an approximation: a layer's activations also grow with
its experts' width x top-k and its attention projection widths, which the measured model's
ratios to ``hidden_size`` fix; measure a model of the target's proportions when they differ.

Block format (JSON, key ``memory`` of the cost file; :func:`memory_from_dict` checks it)::

    {"bytes_per_token_per_layer": k, "bytes_per_token_pair_per_layer": q,
     "bytes_per_token_outside_layers": e, "bytes_fixed": c,
     "per_hidden": k / hidden, "per_head": q / heads, "per_vocab": e / vocab,
     "element_bytes": 4 | 2,            # bytes of one activation element (the precision measured)
     "recompute": "none" | "selective" | "full",   # the trainer's recomputation while measured
     "method": "...", "device": "...", "precision": "...",
     "model": {"hidden_size", "num_attention_heads", "vocab_size", ...},
     "points": [{"layers", "tokens", "peak_bytes", "predicted_bytes"}], "rel_rms", "rel_max"}

Pure arithmetic: no torch (the measurement is the trainer's, :mod:`neon_hpc.train.costfit.step`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class MeasuredActivations:
    """The capacity planner's view of a ``memory`` block: bytes per token per layer per hidden unit, ..."""

    per_hidden: float            # bytes per token per layer per hidden unit
    per_head: float              # bytes per (query, key) pair per layer per attention head
    per_vocab: float             # bytes per token per vocabulary entry (outside the layers)
    element_bytes: int           # bytes of one activation element in the measured run
    recompute: str               # the trainer's recomputation while measured
    source: str                  # where it was read from

    def __post_init__(self):
        for name in ("per_hidden", "per_head", "per_vocab"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{self.source}: memory.{name} must be a finite number >= 0, got {v!r}")
        if self.per_hidden <= 0:
            raise ValueError(f"{self.source}: memory.per_hidden is 0: a layer that keeps nothing for its "
                             f"backward; the measurement is broken (re-run `neon-hpc costfit`)")
        if self.element_bytes not in (2, 4):
            raise ValueError(f"{self.source}: memory.element_bytes must be 2 (bf16) or 4 (fp32), "
                             f"got {self.element_bytes!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"{self.source}: memory.recompute must be one of {RECOMPUTE}, got {self.recompute!r}")


def features(layers: int, tokens: int) -> list[float]:
    """``[1, n, l*n, l*n^2]``: what ``c``, ``e``, ``k`` and ``q`` multiply."""
    n = float(tokens)
    return [1.0, n, layers * n, layers * n * n]


def fit_activation_memory(points: Sequence[tuple[int, int, float]]) -> dict:
    """``(layers, tokens, peak_bytes)`` per measured step -> ``c, e, k, q`` (non-negative least
    squares, rows scaled by ``1/peak``) and the residuals.  Needs two depths and at least
    two lengths at one of them, else ``k`` and ``e`` (or ``k`` and ``q``) cannot be told apart."""
    from scipy.optimize import nnls  # deferred: heavy (scipy)
    if len({p[0] for p in points}) < 2:
        raise ValueError("memory fit: needs steps at two model depths (bytes per layer vs outside the layers)")
    if len({p[1] for p in points}) < 3:
        raise ValueError("memory fit: needs at least 3 sequence lengths (linear vs quadratic bytes); give "
                         "calibrate more --lengths, or --no-memory")
    y = np.asarray([p[2] for p in points], dtype=np.float64)
    if (y <= 0).any():
        raise ValueError("memory fit: a measured peak is <= 0 bytes: the step allocated nothing above "
                         "its baseline, so the measurement (or the lengths: too short) is broken")
    X = np.array([features(l, n) for l, n, _ in points], dtype=np.float64)
    w = 1.0 / y
    scale = np.abs(X).max(axis=0)
    coef, _ = nnls(X / scale * w[:, None], y * w)
    c, e, k, q = coef / scale
    pred = X @ np.array([c, e, k, q])
    rel = (pred - y) / y
    return {"bytes_fixed": float(c), "bytes_per_token_outside_layers": float(e),
            "bytes_per_token_per_layer": float(k), "bytes_per_token_pair_per_layer": float(q),
            "rel_rms": float(np.sqrt(np.mean(rel ** 2))), "rel_max": float(np.abs(rel).max()),
            "points": [{"layers": int(l), "tokens": int(n), "peak_bytes": float(m), "predicted_bytes": float(z)}
                       for (l, n, _), m, z in zip(points, y, pred)]}


def memory_block(fit: dict, model_cfg, *, element_bytes: int, recompute: str, method: str, device: str,
                 precision: str) -> dict:
    """The cost file's ``memory`` block from a :func:`fit_activation_memory` result and the
    measured model's shape (module docstring)."""
    return {**fit,
            "per_hidden": fit["bytes_per_token_per_layer"] / model_cfg.hidden_size,
            "per_head": fit["bytes_per_token_pair_per_layer"] / model_cfg.num_attention_heads,
            "per_vocab": fit["bytes_per_token_outside_layers"] / model_cfg.vocab_size,
            "element_bytes": int(element_bytes), "recompute": recompute, "method": method, "device": device,
            "precision": precision,
            "model": {k: getattr(model_cfg, k) for k in ("arch", "hidden_size", "num_attention_heads",
                                                          "num_query_groups", "head_dim", "moe_ffn_hidden_size",
                                                          "moe_router_topk", "num_experts", "vocab_size")}}


def memory_from_dict(d: dict, where: str) -> MeasuredActivations:
    missing = [k for k in ("per_hidden", "per_head", "per_vocab", "element_bytes", "recompute") if k not in d]
    if missing:
        raise ValueError(f"{where}: the memory block lacks {missing}; write it with `neon-hpc costfit --out`")
    return MeasuredActivations(per_hidden=d["per_hidden"], per_head=d["per_head"], per_vocab=d["per_vocab"],
                               element_bytes=d["element_bytes"], recompute=d["recompute"],
                               source=f"{where} (memory: {d.get('method', '?')} on {d.get('device', '?')})")


def load_memory(path: str | Path) -> MeasuredActivations:
    """The ``memory`` block of a cost file (``neon-hpc costfit --out``)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{p}: activation file not found; write one with `neon-hpc costfit --out {p}`") \
            from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("memory"), dict):
        raise ValueError(f"{p}: no 'memory' block (a cost file from `neon-hpc costfit --out` "
                         f"without --no-memory has one)")
    return memory_from_dict(data["memory"], str(p))

