"""The optimizer without apex (``neon_hpc.train.optimizer_shim``): megatron-core's optimizer with
multi-tensor grad norm, clip and main -> model copy, on the same code path CPU and CUDA use.

Real megatron-core (single gloo rank), the tiny Qwen3-MoE config, both precisions: the patches
are in effect, an optimizer step dispatches no per-parameter loop (an aten-op census,
``neon_hpc.train.census``) and reads the device back at most once, and the norm / clip / copy
helpers equal torch's per-tensor reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from neon_hpc.train.census import census


@pytest.fixture
def gloo():
    import torch.distributed as dist

    from neon_hpc.util.netutil import free_port
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        yield
        dist.destroy_process_group()
    else:
        yield


def test_norm_clip_copy_match_the_per_tensor_reference(gloo):
    from neon_hpc.train.optimizer_shim import clip_by_total_norm, copy_this_to_that, grad_norm_fp32
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 17, 64, 5)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 3
    want = float(torch.nn.utils.get_total_norm([p.grad for p in params], 2.0))
    got = grad_norm_fp32([p.grad for p in params])
    assert math.isclose(got, want, rel_tol=1e-6)
    assert grad_norm_fp32([p.grad for p in params], norm_type=math.inf) == max(float(p.grad.abs().max())
                                                                               for p in params)
    assert grad_norm_fp32([]) == 0.0
    before = [p.grad.clone() for p in params]
    clip_by_total_norm(params, 1.0, got)
    for b, p in zip(before, params):
        torch.testing.assert_close(p.grad, b * (1.0 / (got + 1e-6)), rtol=0, atol=0)
    clip_by_total_norm(params, 1e9, got)          # factor >= 1: untouched
    src = [torch.randn(4, generator=g), torch.randn(2, 3, generator=g)]
    dst = [torch.zeros(4, dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16)]
    copy_this_to_that(src, dst)
    for s, d in zip(src, dst):
        assert torch.equal(d, s.to(torch.bfloat16))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_optimizer_step_has_no_per_parameter_loop(precision):
    from neon_hpc import config as C
    from neon_hpc.train import backend as B, optimizer_shim
    from neon_hpc.train.loop import prepare_step, train_step
    from neon_hpc.train.loss import loss_settings
    from neon_hpc.train.sections import TrainerSections
    from test_train_precision import CONFIGS, trajectories

    cfg = C.load(CONFIGS["qwen3_moe"])
    be = B.setup(cfg.model, lr=3e-3, seed=3, precision=precision)
    try:
        assert optimizer_shim.applied()["multi_tensor"]
        lcfg = loss_settings(cfg)
        sec = TrainerSections.of(cfg)
        train_step(be, prepare_step(trajectories(cfg, 0), 1, sec), lcfg)      # Adam state exists now
        n_params = sum(1 for m in be.models for _ in m.parameters())
        # non-zero gradients in every main grad, then the optimizer step alone under the census
        for m in be.models:
            for p in m.parameters():
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad.copy_(torch.randn_like(p.main_grad))
        with census() as c:
            ok, norm, _ = be.optimizer.step()
        assert ok and np.isfinite(norm)
        assert n_params > 20
        ops = c.packets()
        assert not c.per_tensor(n_params), ops.most_common(8)
        assert ops["_local_scalar_dense"] <= 2, ops.most_common(8)   # the norm (and Adam's step count on CPU)
        assert ops["linalg_vector_norm"] == 0 and ops["_foreach_norm"] >= 1
    finally:
        B.teardown()
