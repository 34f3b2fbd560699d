"""The trainer's CUDA-only paths (issue 40), skipped without a device; ``tools/gpu_check.sh`` runs
them (``pytest -m cuda``) on a lent GPU.

- ``batch.to_device``: one pinned, non-blocking upload whose views equal the host tensors;
- the chunked cross-entropy in bf16 on the device against the full one, and no ``S x V`` fp32;
- the optimizer without apex on CUDA: multi-tensor, no per-parameter op, at most two read-backs
  in the step; one bf16 training step's loss close to the fp32 one.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from repo_paths import REPO

# the repository root, whichever tier folder this file is in
sys.path.insert(0, str(REPO / "tests"))

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_to_device_is_one_pinned_upload_equal_to_the_host_tensors():
    from neon_hpc.store import Trajectory
    from neon_hpc.train.batch import build_microbatch, replay_rows, replay_tensors, to_device
    rng = np.random.default_rng(0)
    n = 21
    routes = np.stack([np.stack([rng.permutation(6)[:2] for _ in range(3)]) for _ in range(n)]).astype(np.int32)
    t = Trajectory(tokens=rng.integers(0, 50, n).astype(np.int32), loss_mask=np.ones(n, np.uint8),
                   logprobs=rng.normal(-2, 1, n).astype(np.float32), versions=np.zeros(n, np.int32),
                   routed_experts=routes, reward=1.0, task_id="t", group_id="t")
    mb = build_microbatch([t], [(0, 0, n - 1)], [0.5], pad_multiple=8, route_shape=(3, 2, 6), dense_mask=False)
    dev = to_device(mb, "cuda")
    assert dev.host_buffer is not None and dev.host_buffer.is_pinned()
    torch.cuda.synchronize()
    for f in ("input_ids", "position_ids", "labels", "loss_mask", "behaviour_logprobs", "advantages"):
        assert getattr(dev, f).is_cuda and torch.equal(getattr(dev, f).cpu(), getattr(mb, f)), f
    for a, b in zip(replay_rows(dev), replay_tensors(mb.routed_experts)):
        assert a.is_cuda and torch.equal(a.cpu(), b)


def test_chunked_ce_on_the_device():
    from neon_hpc.train.xent import ChunkedVocabParallelCE
    s, h, v, rows = 4096, 256, 32000, 512
    x = torch.randn(s, 1, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (s, 1), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = ChunkedVocabParallelCE.apply(x, w, labels, rows, 0, None)
    loss.sum().backward()
    torch.cuda.synchronize()
    above = torch.cuda.max_memory_allocated() - base
    assert above < s * v * 4 / 2, f"{above / 1e6:.0f} MB above the start: the fp32 logits were held whole"
    gx, gw = x.grad.float(), w.grad.float()
    x.grad = w.grad = None
    logits = (x @ w.t()).float()
    ref = torch.nn.functional.cross_entropy(logits.view(-1, v), labels.view(-1), reduction="none").view(s, 1)
    ref.sum().backward()
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx, x.grad.float(), rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(gw, w.grad.float(), rtol=5e-2, atol=5e-2)


def test_cuda_step_without_apex_is_multi_tensor():
    from neon_hpc import config as C
    from neon_hpc.train import backend as B, optimizer_shim
    from neon_hpc.train.census import census
    from neon_hpc.train.loop import prepare_step, train_step
    from neon_hpc.train.loss import loss_settings
    from neon_hpc.train.sections import TrainerSections
    from test_train_precision import CONFIGS, trajectories

    cfg = C.load(CONFIGS["qwen3_moe"])
    sec = TrainerSections.of(cfg)
    losses = {}
    for precision in ("fp32", "bf16"):
        be = B.setup(cfg.model, lr=3e-3, seed=3, precision=precision)
        try:
            if precision == "bf16":
                assert optimizer_shim.applied()["multi_tensor"]
            losses[precision] = train_step(be, prepare_step(trajectories(cfg, 0), 1, sec), loss_settings(cfg))["loss"]
            n_params = sum(1 for m in be.models for _ in m.parameters())
            with census() as c:
                be.optimizer.step()
            assert not c.per_tensor(n_params), c.packets().most_common(8)
            assert c.packets()["_local_scalar_dense"] <= 2
        finally:
            B.teardown()
    assert abs(losses["fp32"] - losses["bf16"]) < 0.02
