"""Publishing trainer weights for the engines: ``weights/v_N`` (HF safetensors), then ``LATEST``.

The one place that turns the trainer's state into engine weights (``train.publish_via``):

- ``direct`` (default): gather the full megatron state dict on rank 0
  (:func:`neon_hpc.train.backend.full_state_dict`), convert with
  ``neon_hpc.models.convert.megatron_to_hf``, write with ``neon_hpc.models.hf.save_hf`` (staged
  and renamed into place).  Fine for small models.
- ``reshard``: the loop checkpoints first, then rank 0 converts that torch_dist checkpoint
  with ``neon_hpc.reshard.convert`` (chunk by chunk, streamed; also staged and renamed).

Either way ``weights/LATEST`` is written last.

Published directories are immutable: if ``v_N`` already exists (a step re-run after a crash
between publish and checkpoint), it is kept and only ``LATEST`` is refreshed.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from neon_hpc.config.model import ModelConfig
from neon_hpc.models.convert import megatron_to_hf
from neon_hpc.models.hf import save_hf, hf_config
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.reshard.pipeline import convert
from neon_hpc.train.backend import Backend, full_state_dict


def publish_weights(run: RunDir, be: Backend, model_cfg: ModelConfig, version: int,
                    step: int | None = None, via: str = "direct",
                    checkpoint_dir: Path | None = None) -> tuple[Path, float, bool]:
    """Collective: publish this backend's weights as ``weights/v_{version}``, then ``LATEST``.

    ``via="direct"``: gather and convert in memory (small models).  ``via="reshard"``: convert
    ``checkpoint_dir`` (the torch_dist checkpoint of these very weights) with
    ``neon_hpc.reshard.convert`` on rank 0, chunk by chunk and streamed, never holding
    the whole model.  Returns ``(path, seconds, written)``; ``written`` is False when
    ``v_{version}`` existed.
    """
    t0 = time.perf_counter()
    final = run.weights_version(version)
    if via == "direct":
        written = _direct(run, be, model_cfg, final)
    elif via == "reshard":
        if checkpoint_dir is None:
            raise ValueError("publish via reshard needs the checkpoint of the weights to publish")
        written = _reshard(be, model_cfg, Path(checkpoint_dir), final)
    else:
        raise ValueError(f"train.publish_via must be 'direct' or 'reshard', got {via!r}")
    if be.layout.rank == 0:
        latest = run.latest_weights()
        if latest is None or latest[0] <= version:
            run.publish_latest(version, step=step if step is not None else version)
    return final, time.perf_counter() - t0, written


def _direct(run: RunDir, be: Backend, model_cfg: ModelConfig, final: Path) -> bool:
    full = full_state_dict(be)          # every rank takes part; rank 0 gets the result
    if be.layout.rank != 0 or final.exists():
        return False
    save_hf(megatron_to_hf(full, model_cfg), model_cfg, final)
    return True


def _reshard(be: Backend, model_cfg: ModelConfig, checkpoint_dir: Path, final: Path) -> bool:
    written = False
    if be.layout.rank == 0 and not final.exists():
        # the function, not the package attribute: importing the submodule rebinds that name
        convert(str(checkpoint_dir), str(final), hf_config=hf_config(model_cfg).to_dict(), use_mpi=False)
        written = True
    if be.layout.world > 1:
        dist.barrier()
    return written
