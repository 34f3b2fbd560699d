"""Cross-entropy over sequence chunks (``neon_hpc.train.xent``): the same loss and gradients as the
output layer followed by the full-vocabulary cross-entropy, with no tensor of ``S x V`` logits.

Tolerances: fp32 1e-5 relative (the matmuls and log-sum-exp are the same per position; only the
weight gradient is summed over chunks in another order); bf16 as bf16 rounding allows (2e-2).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from repo_paths import REPO

# the repository root, whichever tier folder this file is in
sys.path.insert(0, str(REPO / "tests"))


def reference(h, w, labels):
    logits = torch.matmul(h, w.t()).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           reduction="none").view(labels.shape)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [7, 64, 1000])
@pytest.mark.parametrize("save", ["all", "none", "some"])
def test_chunked_ce_equals_the_full_cross_entropy(dtype, tol, rows, save):
    """Every chunk's softmax kept (megatron's memory), none (all recomputed), or the first few."""
    from neon_hpc.train.xent import ChunkedVocabParallelCE
    g = torch.Generator().manual_seed(1)
    s, b, hdim, v = 50, 1, 32, 97
    h0 = torch.randn(s, b, hdim, generator=g).to(dtype)
    w0 = (torch.randn(v, hdim, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, v, (s, b), generator=g)
    gout = torch.rand(s, b, generator=g)
    h1, w1 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = reference(h1, w1, labels)
    (ref * gout).sum().backward()
    h2, w2 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    budget = {"all": None, "none": 0, "some": 2 * rows * b * v * 4}[save]
    got = ChunkedVocabParallelCE.apply(h2, w2, labels, rows, 0, None, budget)
    (got * gout).sum().backward()
    assert got.dtype == torch.float32 and got.shape == (s, b)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(h2.grad.float(), h1.grad.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(w2.grad.float(), w1.grad.float(), rtol=tol, atol=tol)


def test_labels_outside_this_ranks_vocabulary_shard_pick_nothing():
    """Under TP a rank holds vocabulary ``[start, start + V/tp)``: a label outside contributes no
    logit: its loss is the local log-sum-exp minus the max (megatron's, in the max-subtracted
    space; the rank holding the label adds it through the all-reduce)."""
    from neon_hpc.train.xent import ChunkedVocabParallelCE
    h = torch.randn(4, 1, 8)
    w = torch.randn(10, 8)
    labels = torch.tensor([[3], [25], [12], [19]])       # shard [10, 20)
    got = ChunkedVocabParallelCE.apply(h, w, labels, 2, 10, None)
    logits = (h @ w.t()).float()
    lse = torch.logsumexp(logits, -1)
    want = lse - logits.max(-1)[0]
    for i, lab in enumerate(labels[:, 0].tolist()):
        if 10 <= lab < 20:
            want[i] = lse[i] - logits[i, 0, lab - 10]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trainer_forward_matches_megatrons_cross_entropy(precision, monkeypatch):
    """The trainer's forward (chunked CE, chunks forced small) against the same model's stock
    output layer + ``vocab_parallel_cross_entropy``: logprobs and parameter gradients."""
    from neon_hpc import config as C
    from neon_hpc.train import backend as B, xent
    from neon_hpc.train.batch import build_microbatch
    from neon_hpc.train.loop import prepare_step
    from neon_hpc.train.sections import TrainerSections
    from test_train_precision import CONFIGS, trajectories

    cfg = C.load(CONFIGS["qwen3_moe"])
    be = B.setup(cfg.model, lr=3e-3, seed=3, precision=precision)
    try:
        data = prepare_step(trajectories(cfg, 0), 1, TrainerSections.of(cfg))
        pieces = [p for mb in data.pieces[0] for p in mb]
        mb = build_microbatch(data.trajectories, pieces, data.advantages, route_shape=(
            be.num_moe_layers(), be.model_cfg.moe_router_topk, be.model_cfg.num_experts), dense_mask=True)
        monkeypatch.setattr(xent, "MIN_ROWS", 8)
        monkeypatch.setattr(xent, "CHUNK_BYTES", 8 * 4 * cfg.model.vocab_size)      # 8 rows a chunk
        monkeypatch.setattr(xent, "SAVE_BYTES", 2 * 8 * 4 * cfg.model.vocab_size)   # 2 kept, the rest recomputed
        assert mb.seq_len > 3 * 8

        def run(chunked: bool):
            for m in be.models:
                for p in m.parameters():
                    p.grad = None
            be.zero_grad()
            if chunked:
                logp = B.forward_logp(be, mb)
            else:
                real = xent.deferred
                monkeypatch.setattr(xent, "deferred", lambda enabled=True: real(False))
                try:
                    logp = B.forward_logp(be, mb)
                finally:
                    monkeypatch.setattr(xent, "deferred", real)
            (logp * mb.loss_mask).sum().backward()
            grads = {n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).detach().float().clone()
                     for m in be.models for n, p in m.named_parameters()}
            return logp.detach().clone(), grads

        lp_ref, g_ref = run(False)
        lp, g = run(True)
        tol = 1e-5 if precision == "fp32" else 2e-2
        torch.testing.assert_close(lp, lp_ref, rtol=tol, atol=tol)
        for n in g_ref:
            torch.testing.assert_close(g[n], g_ref[n], rtol=tol, atol=tol * max(1.0, float(g_ref[n].abs().max())),
                                       msg=lambda m, n=n: f"{n}: {m}")
    finally:
        B.teardown()


def test_no_tensor_holds_every_positions_logits():
    """With nothing kept (past the budget), forward and backward of the chunked CE never make a
    tensor of ``S x V`` elements, and the graph keeps no logits at all."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from neon_hpc.train.xent import ChunkedVocabParallelCE

    s, hdim, v, rows = 64, 16, 50, 8
    largest = [0]

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == v:
                    largest[0] = max(largest[0], t.numel())
            return out

    h = torch.randn(s, 1, hdim, requires_grad=True)
    w = torch.randn(v, hdim, requires_grad=True)
    labels = torch.randint(0, v, (s, 1))
    with Largest():
        ChunkedVocabParallelCE.apply(h, w, labels, rows, 0, None, 0).sum().backward()
    assert rows * v <= largest[0] < s * v          # a chunk's logits (or the weight), never all of them
    out = ChunkedVocabParallelCE.apply(h, w, labels, rows, 0, None, 0)
    kept = out.grad_fn.saved_tensors
    assert sum(t.numel() for t in kept if t.dim() and t.shape[-1] == v) == 0
    out = ChunkedVocabParallelCE.apply(h, w, labels, rows, 0, None, 3 * rows * v * 4)
    assert sum(t.numel() for t in out.grad_fn.saved_tensors if t.shape[-1] == v) == 3 * rows * v   # the budget
