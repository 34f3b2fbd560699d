"""The trainer's parallel layout: the rules (re-exported from the train section,
:mod:`neon_hpc.config.train`, where they are written once: the config loader runs them too) and
which layers each model chunk holds.

With ``train.virtual_pipeline_stages: V > 1`` (interleaved 1F1B) each stage's layers are split
into V model chunks of equal size, and chunk ``c`` of stage ``r`` holds the layers
:func:`chunk_layers` gives.  Plain arithmetic (no torch, no processes).
"""

from __future__ import annotations

from neon_hpc.config.cross import Errors, launch_world_errors, layout_errors
from neon_hpc.config.train import stage_layers, world_size

__all__ = ["Errors", "chunk_layers", "launch_world_errors", "layout_errors", "stage_layers", "world_size"]


def chunk_layers(per_stage: list[int], vpp: int) -> list[list[tuple[int, int]]]:
    """``[stage][chunk] = (first global layer, layers)`` for ``vpp`` model chunks per stage.

    megatron-core's interleaved assignment (``get_transformer_layer_offset`` with a
    ``vp_stage``): the model is cut into ``vpp`` consecutive virtual passes of
    ``num_layers / vpp`` layers, and pass ``c`` is spread over the stages in order, stage ``r``
    taking ``per_stage[r] / vpp`` of it.  ``vpp = 1`` is plain PP (one chunk per stage).
    """
    if any(n % vpp for n in per_stage):
        raise ValueError(f"virtual_pipeline_stages={vpp} does not divide the layers per stage {per_stage}")
    total = sum(per_stage) // vpp
    return [[(c * total + sum(per_stage[:r]) // vpp, n // vpp) for c in range(vpp)]
            for r, n in enumerate(per_stage)]
