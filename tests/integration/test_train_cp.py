"""Piece attention (neon_hpc.models.cp_attention) against one process, on real megatron-core over gloo.

Two processes hold one document as the plan's arbitrary early/late mix (rank 0 chunks {0, 3},
rank 1 chunks {1, 2}) beside whole short documents; their logits and summed gradients must
equal one process running the whole packed micro-batch with megatron's stock
``DotProductAttention`` (dense block-causal mask, packed positions).  And a head/tail cut where
one rank holds no cut document (its backward must still join the exchange).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ranks import run_ranks
from repo_paths import REPO

# documents (index -> length) and who holds what: doc 0 (16 tokens) in four chunks of 4
LENGTHS = [16, 5, 7]
SLOT = [
    [(0, 0, 4), (1, 0, 5), (0, 12, 16)],      # rank 0: chunks 0 and 3 of doc 0 around doc 1
    [(0, 4, 8), (2, 0, 7), (0, 8, 12)],       # rank 1: chunks 1 and 2 of doc 0, doc 2
]
PAD = 2                                      # rank 1 pads its micro-batch with 2 pad rows
# three data ranks: doc 0 cut between ranks 0 and 1, rank 2 a bystander holding only a whole
# document (it joins the slot's all-gather, as every rank of the exchange group does, but no
# query of it reads a gathered row)
BYSTANDER = [
    [(0, 0, 10), (1, 0, 5)],
    [(0, 10, 16)],
    [(2, 0, 7)],
]
SLOTS = {"mix": (SLOT, PAD), "bystander": (BYSTANDER, 0)}


def _tokens(seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).astype(np.int64) for n in LENGTHS]


def _weights(seed: int = 4) -> torch.Tensor:
    """A fixed per-(row, vocab) weight so the test loss touches every logit."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(LENGTHS), 256, generator=g)


def _ref_row(doc: int, pos: int) -> int:
    return sum(LENGTHS[:doc]) + pos


def _model_config(arch: str):
    from neon_hpc.config.model import ModelConfig
    if arch == "qwen3_moe":
        return ModelConfig()
    from neon_hpc import config as C
    return C.load(str(REPO / "configs" / "tiny_dsv3_cpu.yaml")).model


def _worker(out: str, arch: str, slot: str = "mix") -> None:
    import torch.distributed as dist

    from neon_hpc.models import megatron as mm
    from neon_hpc.models.cp_attention import build_piece_map, piece_map
    from neon_hpc.train.batch import block_causal_mask
    mm.init_parallel(tp=1, ep=1, pp=1, backend="gloo", seed=7)
    me = dist.get_rank()
    model = mm.build_gpt_model(_model_config(arch), seed=7)
    toks, w = _tokens(), _weights()
    params = [p for p in model.parameters()]

    # reference: the whole packed micro-batch in this process, stock attention
    ids = torch.from_numpy(np.concatenate(toks)).unsqueeze(0)
    s = ids.shape[1]
    logits_ref = model(input_ids=ids, position_ids=torch.arange(s).unsqueeze(0),
                       attention_mask=block_causal_mask(LENGTHS))
    (torch.log_softmax(logits_ref[0].float(), -1) * w).sum().backward()
    g_ref = [p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None

    # pieces: this rank's rows only, K/V of doc 0 exchanged
    plan_slot, pad = SLOTS[slot]
    pieces = plan_slot[me]
    rows = [_ref_row(d, q) for (d, a, b) in pieces for q in range(a, b)]
    n_pad = pad if me == 1 else 0
    my_ids = torch.from_numpy(np.concatenate([toks[d][a:b] for (d, a, b) in pieces] + [np.zeros(n_pad, np.int64)]))
    pos = torch.from_numpy(np.concatenate([np.arange(a, b) for (_d, a, b) in pieces] + [np.zeros(n_pad, np.int64)]))
    lay = build_piece_map(plan_slot, me, len(rows) + n_pad, group=dist.group.WORLD)
    with piece_map(lay):
        logits = model(input_ids=my_ids.unsqueeze(0), position_ids=pos.unsqueeze(0), attention_mask=None)
    real = logits[0, :len(rows)].float()
    (torch.log_softmax(real, -1) * w[rows]).sum().backward()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    for g in grads:
        dist.all_reduce(g)
    res = {
        "exchanged": lay.exchanges, "rows_per_rank": lay.rows_per_rank,
        "logit_err": float((real - logits_ref[0, rows].float()).abs().max()),
        "logit_scale": float(logits_ref.abs().max()),
        "grad_err": max(float((a - b).abs().max()) for a, b in zip(grads, g_ref)),
        "grad_scale": max(float(b.abs().max()) for b in g_ref),
        "params_with_grad": sum(int(bool(g.abs().sum() > 0)) for g in grads),
    }
    Path(out).write_text(json.dumps(res))
    mm.destroy_parallel()


def _run_pair(tmp_path: Path, arch: str, slot: str = "mix") -> list[dict]:
    world = len(SLOTS[slot][0])
    run_ranks(world, lambda r: [__file__, str(tmp_path / f"r{r}.json"), arch, slot])
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])   # GQA (PieceAttention), MLA (SDPA core)
def test_early_late_chunks_match_one_process_exactly(tmp_path, arch):
    res = _run_pair(tmp_path, arch)
    for r, x in enumerate(res):
        assert x["exchanged"] and x["rows_per_rank"] == 8, x
        assert x["logit_err"] <= 1e-5 * max(1.0, x["logit_scale"]), (r, x)
        assert x["grad_err"] <= 1e-5 * max(1.0, x["grad_scale"]), (r, x)
        assert x["params_with_grad"] > 10, x


@pytest.mark.slow
def test_a_bystander_rank_still_joins_the_backward_exchange(tmp_path):
    """Rank 2 holds no piece of a cut document: nothing it computes reads the gathered K/V, so
    without care autograd skips the gather's backward there and ranks 0 and 1 wait in its
    all-reduce (found by bench_train_balance at DP=4: a hang).  Exact against one process."""
    res = _run_pair(tmp_path, "qwen3_moe", "bystander")
    assert len(res) == 3
    for r, x in enumerate(res):
        assert x["exchanged"] and x["rows_per_rank"] == 10, x
        assert x["logit_err"] <= 1e-5 * max(1.0, x["logit_scale"]), (r, x)
        assert x["grad_err"] <= 1e-5 * max(1.0, x["grad_scale"]), (r, x)


def test_piece_map_of_a_slot_is_consistent_and_masks_by_document_position():
    from neon_hpc.models.cp_attention import build_piece_map
    l0 = build_piece_map(SLOT, 0, 13)
    l1 = build_piece_map(SLOT, 1, 15 + PAD)
    assert l0.rows_per_rank == l1.rows_per_rank == 8       # doc 0's rows of the busier rank
    assert l0.send_idx.tolist() == [0, 1, 2, 3, 9, 10, 11, 12]
    assert l1.send_idx.tolist() == [0, 1, 2, 3, 11, 12, 13, 14]
    assert l1.pad_idx.tolist() == [15, 16]
    assert l0.pos.tolist()[:13] == [0, 1, 2, 3, 0, 1, 2, 3, 4, 12, 13, 14, 15]
    # rank 0's doc 0: local keys 0..3, 12..15 and rank 1's 8 rows 4..11, all sorted by position;
    # queries at 0..3 are one causal run, at 12..15 a run over all 16 keys (lower-right mask)
    g = l0.groups[0]
    assert g.key_pos.tolist() == list(range(16)) and g.q_pos.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert g.key_idx.tolist() == [0, 1, 2, 3] + [13 + j for j in range(8, 16)] + [9, 10, 11, 12]
    assert g.runs == [(0, 4, 4), (4, 8, 16)] and g.remote
    # whole short documents exchange nothing
    assert not l0.groups[1].remote and l0.groups[1].rows == (4, 9) and l0.groups[1].runs == [(0, 5, 5)]
    # a slot with no document across ranks has no exchange at all, on every rank
    lone = [[(1, 0, 5)], [(2, 0, 7)]]
    assert not build_piece_map(lone, 0, 5).exchanges and not build_piece_map(lone, 1, 7).exchanges


if __name__ == "__main__":
    torch.set_num_threads(1)
    _worker(*sys.argv[1:])
