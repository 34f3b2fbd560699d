"""Route rows between the engine and the trainer: decoder-layer rows -> MoE-layer rows.

SGLang (and the embedded engine) send one routed-experts row per *decoder layer*, zeros for
layers that never route (DeepSeek-V3's dense first layers); the trainer's routers are its
MoE layers.  :func:`to_trainer_rows` maps every trajectory of a step through the
architecture's :class:`~neon_hpc.arch.base.RouteRows`.  A layer axis that
does not fit the route rows (an engine that reports MoE layers only, another model's routes) is
not a per-token glitch that replay could skip: it would silently turn replay off for every
trajectory, so it raises :class:`~neon_hpc.arch.base.RouteRowsError` naming the
count and the expected rows.  Per-token problems (row count, expert ids) stay the trainer's
``check_routes``, counted in ``replay_docs_missing``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from neon_hpc import arch
from neon_hpc.arch import RouteRowsError
from neon_hpc.config.model import ModelConfig


def to_trainer_rows(trajectories: Sequence[Any], model_cfg: ModelConfig) -> int:
    """Replace each trajectory's ``routed_experts`` ``[tokens, decoder layers, k]`` by its MoE rows
    ``[tokens, moe layers, k]`` (in place); returns how many were mapped.  Trajectories without
    routes are left alone (the trainer counts them)."""
    route_rows = arch.get(model_cfg.arch).route_rows(model_cfg)
    bad: list[tuple[Any, RouteRowsError]] = []
    mapped = 0
    for t in trajectories:
        r = getattr(t, "routed_experts", None)
        if r is None:
            continue
        try:
            t.routed_experts = route_rows.to_moe(np.asarray(r), where=f"trajectory {getattr(t, 'task_id', '?')}")
            mapped += 1
        except RouteRowsError as e:
            bad.append((t, e))
    if bad:
        raise RouteRowsError(f"{len(bad)} of {len(trajectories)} trajectories carry routes with the wrong layer axis "
                               f"(router replay would be off for them): {bad[0][1]}")
    return mapped
