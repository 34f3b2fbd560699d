"""Test support (kept out of the library): the tiny DeepSeek-V3 of ``configs/tiny_dsv3_cpu.yaml``
and HF weights that make routing decisive (no near-ties) and every tensor distinct."""

from __future__ import annotations

from pathlib import Path

import torch

from neon_hpc.config.model import ModelConfig

TINY_DSV3_YAML = Path(__file__).resolve().parents[1] / "configs" / "tiny_dsv3_cpu.yaml"


def tiny_dsv3() -> ModelConfig:
    """The ``model:`` section of ``configs/tiny_dsv3_cpu.yaml`` (MLA, 1 dense + 2 MoE layers,
    a shared expert, sigmoid router with expert bias and grouped top-k)."""
    from neon_hpc.config import load
    return load(TINY_DSV3_YAML).model


def decisive_hf(cfg: ModelConfig, seed: int, noise: float = 0.0):
    """A fresh HF model whose routers are far from ties, with a non-zero expert-score bias
    (where the architecture has one) and, with ``noise``, every weight moved off its init
    (norms away from 1: a swapped or misnamed tensor shows in the logits)."""
    from neon_hpc.models.hf import build_hf_model
    m = build_hf_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
        for n, p in m.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif noise:
                p.add_(noise * torch.randn(p.shape, generator=g))
    return m
