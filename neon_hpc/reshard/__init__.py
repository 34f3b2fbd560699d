"""Megatron torch_dist checkpoint -> HF safetensors, chunk by chunk, executed over MPI ranks.

Public entry point: :func:`convert` (in-process, one rank by default); CLI: ``tools/reshard.py``
or ``neon-hpc reshard``.  See README.md beside this file.
"""

from __future__ import annotations


def convert(src, dst, hf_config_dir=None, arch=None, ranks=None, **kwargs) -> dict:
    """See :func:`neon_hpc.reshard.pipeline.convert` (imported lazily: keeps start-up light)."""
    # deferred: heavy (neon_hpc.reshard.pipeline: pydantic, xxhash)
    from neon_hpc.reshard.pipeline import convert as _convert
    return _convert(src, dst, hf_config_dir=hf_config_dir, arch=arch, ranks=ranks, **kwargs)


__all__ = ["convert"]
