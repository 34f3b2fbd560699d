"""Publishing trainer weights for the engines: ``weights/v_N`` (HF safetensors), then ``LATEST``.

The one place that turns the trainer's state into engine weights, so the path can switch to
the reshard tool (``neon_hpc.reshard``, checkpoint -> HF over MPI ranks) without touching the
loop.  Today: the direct export: gather the full megatron state dict on rank 0
(:func:`neon_hpc.train.backend.full_state_dict`), convert with
``neon_hpc.models.convert.megatron_to_hf``, write with ``neon_hpc.models.hf.save_hf`` (staged
and renamed into place), then point ``weights/LATEST`` at it.  Fine for small models; a
large one should publish from its checkpoint through the reshard tool.

Published directories are immutable: if ``v_N`` already exists (a step re-run after a crash
between publish and checkpoint), it is kept and only ``LATEST`` is refreshed.
"""

from __future__ import annotations

import time
from pathlib import Path

from neon_hpc.models.config import ModelConfig
from neon_hpc.rundir import RunDir
from neon_hpc.train.backend import Backend, full_state_dict


def publish_weights(run: RunDir, be: Backend, model_cfg: ModelConfig, version: int,
                    step: int | None = None) -> tuple[Path, float, bool]:
    """Collective: publish this backend's weights as ``weights/v_{version}``.

    Returns ``(path, seconds, written)``; ``written`` is False when ``v_{version}`` existed.
    """
    from neon_hpc.models.convert import megatron_to_hf
    from neon_hpc.models.hf import save_hf

    t0 = time.perf_counter()
    full = full_state_dict(be)          # every rank takes part; rank 0 gets the result
    final = run.weights_version(version)
    written = False
    if be.layout.rank == 0:
        if not final.exists():
            save_hf(megatron_to_hf(full, model_cfg), model_cfg, final)
            written = True
        latest = run.latest_weights()
        if latest is None or latest[0] <= version:
            run.publish_latest(version, step=step if step is not None else version)
    return final, time.perf_counter() - t0, written
