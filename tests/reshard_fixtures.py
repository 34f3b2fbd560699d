"""Test fixtures for the reshard tests: real megatron-core checkpoints of the tiny Qwen3-MoE at
several layouts, of the tiny DeepSeek-V3 (MLA), and the synthetic checkpoint.

Test support, so it lives under ``tests/`` (the reshard tool imports none of the models;
this module builds them).

``save_layouts(out_dir, layouts)`` starts two gloo processes once, and for each ``(tp, ep)``
builds the megatron-core GPTModel (``neon_hpc.models``), moves every weight away from its
initial value (norms away from 1, so swapped norms would show in the logits), computes the
logits of fixed token ids, and saves the model's sharded state dict with
``dist_checkpointing.save`` (torch_dist).  Written per layout ``L = tp{tp}_ep{ep}``:
``L/ckpt/`` (the checkpoint), ``L/logits.npy``, and once ``hf_config/config.json`` and
``ids.npy``.  megatron-core is imported here only in the spawned processes.
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


def _start(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    torch.set_num_threads(1)


def _worker(rank: int, world: int, port: int, out: str, layouts: list, seq: int) -> None:
    _start(rank, world, port)
    _layouts_in_group(out, layouts, seq)
    from neon_hpc.models import megatron
    megatron.destroy_parallel()


def _layouts_in_group(out: str, layouts: list, seq: int) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from neon_hpc.config.model import ModelConfig
    from neon_hpc.models import hf, megatron

    cfg = ModelConfig()
    rank = dist.get_rank()
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
        _seal_on_rank0(d / "ckpt")


def _seal_on_rank0(ckpt: Path) -> None:
    """Write the digests (``integrity.json``) every checkpoint neon-hpc saves carries: reshard
    refuses a checkpoint without them unless told ``--allow-unverified``."""
    import torch.distributed as dist

    from neon_hpc.checkpoint import integrity
    dist.barrier()
    if dist.get_rank() == 0:
        integrity.seal(ckpt)
    dist.barrier()


def save_layouts(out_dir: str | os.PathLike, layouts=((1, 1), (2, 1), (1, 2), (2, 2)), seq: int = 8) -> Path:
    """Save one checkpoint per (tp, ep) layout from two gloo processes; returns ``out_dir``."""
    import torch.multiprocessing as mp

    from neon_hpc.util.netutil import free_port
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(2, free_port(), str(out), [tuple(x) for x in layouts], seq),
                       nprocs=2, join=True, start_method="spawn")
    return out


# ---------------------------------------------------------------------------------------
# DeepSeek-V3 with MLA: the tiny DeepSeek-V3 of configs/tiny_dsv3_cpu.yaml (dense first layer,
# shared expert, sigmoid router with expert bias, grouped top-k), built as the trainer builds it


def mla_model_config():
    """The MLA fixture's model: ``model_fixtures.tiny_dsv3()`` (the example's ``model:``)."""
    from model_fixtures import tiny_dsv3
    return tiny_dsv3()


def mla_hf_config() -> dict:
    """Its HF ``config.json``: what the trainer writes for it (the architecture's ``hf_config_dict``)."""
    from neon_hpc import arch
    cfg = mla_model_config()
    return arch.get(cfg.arch).hf_config_dict(cfg)


def _mla_worker(rank: int, out: str, seq: int) -> None:
    from neon_hpc.models import megatron
    from neon_hpc.util.netutil import free_port
    _start(rank, 1, free_port())
    _mla_in_group(out, seq)
    megatron.destroy_parallel()


def _mla_in_group(out: str, seq: int) -> None:
    """Build (``models.megatron.build_gpt_model``: the architecture's MLA config and local spec with
    its SDPA core attention), run and save the MLA model on every rank of the group (TP=1:
    ranks are DP replicas)."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from neon_hpc.models import megatron
    cfg = mla_model_config()
    megatron.init_parallel(tp=1, ep=1)
    model = megatron.build_gpt_model(cfg)
    _perturb(model, 0, 0)
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):   # a non-zero bias, so a dropped or misnamed bias shows in routing
            buf.copy_(0.5 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(7)))
    model.eval()
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, seq))
    with torch.no_grad():
        logits = megatron.forward_logits(model, torch.from_numpy(ids))
    out_p = Path(out)
    if dist.get_rank() == 0:
        (out_p / "ckpt").mkdir(parents=True)
        np.save(out_p / "ids.npy", ids)
        np.save(out_p / "logits.npy", logits.float().numpy())
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out_p / "ckpt"))
    _seal_on_rank0(out_p / "ckpt")


def save_mla(out_dir: str | os.PathLike, seq: int = 8) -> Path:
    """Save the MLA model's checkpoint, logits and HF ``config.json`` (``hf_config/``) under ``out_dir``."""
    import torch.multiprocessing as mp
    out = Path(out_dir)
    _write_mla_config(out)
    mp.start_processes(_mla_worker, args=(str(out), seq), nprocs=1, join=True, start_method="spawn")
    return out


def _write_mla_config(out: Path) -> None:
    import json
    (out / "hf_config").mkdir(parents=True, exist_ok=True)
    (out / "hf_config" / "config.json").write_text(json.dumps(mla_hf_config(), indent=1))


# ---------------------------------------------------------------------------------------
# everything at once: one pair of processes (megatron-core imports once per process)

LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))


def _all_worker(rank: int, world: int, port: int, out: str, synth: dict, seq: int) -> None:
    _start(rank, world, port)
    import torch.distributed as dist

    from neon_hpc.models import megatron
    from neon_hpc.reshard.synthetic import SynthSpec, save_in_group
    megatron.init_parallel(tp=1, ep=1)              # the gloo group every part below shares
    save_in_group(Path(out) / "synth" / "ckpt", SynthSpec(**synth))
    _layouts_in_group(str(Path(out) / "layouts"), list(LAYOUTS), seq)
    _mla_in_group(str(Path(out) / "mla"), seq)
    dist.barrier()
    megatron.destroy_parallel()


def build_all(out_dir: str | os.PathLike, synth, seq: int = 8) -> Path:
    """The synthetic checkpoint (``synth/``), the Qwen3-MoE layouts (``layouts/``) and the MLA
    model (``mla/``), saved by one pair of gloo processes.  Cached: a second call returns at once."""
    import json
    from dataclasses import asdict

    import torch.multiprocessing as mp

    from neon_hpc.util.netutil import free_port
    out = Path(out_dir)
    if (out / "DONE").exists():
        return out
    if synth.procs != 2:
        raise ValueError("build_all saves from 2 processes; use a SynthSpec with procs=2")
    (out / "synth" / "ckpt").mkdir(parents=True)
    (out / "synth" / "hf").mkdir()
    (out / "synth" / "hf" / "config.json").write_text(json.dumps(synth.hf_config()))
    (out / "synth" / "hf" / "tokenizer.json").write_text("{}")
    _write_mla_config(out / "mla")
    mp.start_processes(_all_worker, args=(2, free_port(), str(out), asdict(synth), seq), nprocs=2,
                       join=True, start_method="spawn")
    (out / "DONE").write_text("ok\n")
    return out


def small_synth_spec():
    """The small synthetic checkpoint the tests use (bf16, TP=2 fragments, vocab 250 padded to 256)."""
    from neon_hpc.reshard.synthetic import SynthSpec
    return SynthSpec(layers=2, experts=4, hidden=32, moe_ffn=16, heads=4, groups=2, head_dim=8, vocab=250,
                     tp=2, procs=2, optimizer_states=1)


def shared(tmp_path_factory) -> Path:
    """pytest helper: every reshard test module shares one :func:`build_all` per session."""
    return build_all(tmp_path_factory.getbasetemp() / "reshard_fixtures", small_synth_spec())
