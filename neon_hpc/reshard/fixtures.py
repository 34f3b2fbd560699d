"""Test fixtures: real megatron-core checkpoints of the tiny Qwen3-MoE at several layouts.

``save_layouts(out_dir, layouts)`` starts two gloo processes once, and for each ``(tp, ep)``
builds the megatron-core GPTModel (``neon_hpc.models``), moves every weight away from its
initial value (norms away from 1, so swapped norms would show in the logits), computes the
logits of fixed token ids, and saves the model's sharded state dict with
``dist_checkpointing.save`` (torch_dist).  Written per layout ``L = tp{tp}_ep{ep}``:
``L/ckpt/`` (the checkpoint), ``L/logits.npy``, and once ``hf_config/config.json`` and
``ids.npy``.  megatron-core is imported here only in the spawned processes; the converter
never imports this module.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np


def layout_name(tp: int, ep: int) -> str:
    return f"tp{tp}_ep{ep}"


def _perturb(model, tp_rank: int, ep_rank: int) -> None:
    """Add seeded noise; replicated params get the same noise on every rank (seed = name)."""
    import torch
    for name, p in model.named_parameters():
        seed = zlib.crc32(name.encode())
        if ".experts." in name:   # expert weight: distinct per EP rank (expert TP = 1; replicated over expert-DP)
            seed += ep_rank * 104729
        elif getattr(p, "tensor_model_parallel", False):  # TP shard: distinct per TP rank
            seed += tp_rank * 7919
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _worker(rank: int, world: int, port: int, out: str, layouts: list, seq: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from neon_hpc.models import hf, megatron
    from neon_hpc.models.config import ModelConfig

    cfg = ModelConfig()
    out_p = Path(out)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, seq))
    if rank == 0:
        hf.hf_config(cfg).save_pretrained(out_p / "hf_config")
        np.save(out_p / "ids.npy", ids)
    for tp, ep in layouts:
        coords = megatron.init_parallel(tp=tp, ep=ep)
        model = megatron.build_gpt_model(cfg, tp=tp, ep=ep)
        _perturb(model, coords["tp_rank"], coords["ep_rank"])
        model.eval()
        with torch.no_grad():
            logits = megatron.forward_logits(model, torch.from_numpy(ids))
        d = out_p / layout_name(tp, ep)
        if rank == 0:
            (d / "ckpt").mkdir(parents=True)
            np.save(d / "logits.npy", logits.float().numpy())
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), str(d / "ckpt"))
        dist.barrier()
    megatron.destroy_parallel()


def save_layouts(out_dir: str | os.PathLike, layouts=((1, 1), (2, 1), (1, 2), (2, 2)), seq: int = 8) -> Path:
    """Save one checkpoint per (tp, ep) layout from two gloo processes; returns ``out_dir``."""
    import torch.multiprocessing as mp
    from neon_hpc.models.megatron import _free_port
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(2, _free_port(), str(out), [tuple(x) for x in layouts], seq),
                       nprocs=2, join=True, start_method="spawn")
    return out
