"""Packing trajectories into micro-batches, and aligning routes with megatron's token order."""

import numpy as np
import pytest
import torch

from neon_hpc.store import Trajectory
from neon_hpc.train.batch import block_causal_mask, build_microbatch, check_routes, input_lengths, replay_tensors

L, K, E = 2, 2, 4


def traj(n, prompt, seed, routes=True):
    rng = np.random.default_rng(seed)
    mask = np.r_[np.zeros(prompt), np.ones(n - prompt)].astype(np.uint8)
    r = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(n)]) if routes else None
    return Trajectory(tokens=np.arange(100 * seed, 100 * seed + n, dtype=np.int32), loss_mask=mask,
                      logprobs=np.where(mask > 0, -0.1 * np.arange(n), 0).astype(np.float32),
                      versions=np.where(mask > 0, seed, -1).astype(np.int32), routed_experts=r,
                      reward=float(seed), task_id=f"t{seed}", group_id="g")


def test_two_documents_pack_with_shifted_labels_and_block_causal_mask():
    a, b = traj(5, 2, 1), traj(4, 1, 2)
    mb = build_microbatch([a, b], [(0, 0, 4), (1, 0, 3)], [0.5, -1.0], pad_multiple=4, route_shape=(L, K, E))
    assert mb.seq_len == 8 and mb.real_tokens == 7          # 4 + 3 inputs, one pad token
    # inputs drop each document's last token; labels are the next tokens
    assert mb.input_ids[0, :7].tolist() == [100, 101, 102, 103, 200, 201, 202]
    assert mb.labels[0, :7].tolist() == [101, 102, 103, 104, 201, 202, 203]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    # per-label-token fields come from position t+1 of the document
    assert mb.loss_mask[0].tolist() == [0, 1, 1, 1, 1, 1, 1, 0]
    assert mb.versions[0].tolist() == [-1, 1, 1, 1, 2, 2, 2, -1]
    np.testing.assert_allclose(mb.behaviour_logprobs[0, :7].numpy(), [0, -0.2, -0.3, -0.4, -0.1, -0.2, -0.3], atol=1e-6)
    assert mb.advantages[0].tolist() == [0.5] * 4 + [-1.0] * 3 + [0.0]
    m = mb.attention_mask[0, 0]
    assert not m[6, 4] and not m[6, 6] and m[6, 3] and m[4, 5]   # b sees only its own past
    assert m[7, :7].all() and not m[7, 7]                          # pad attends to itself only
    # route row t of a document is the route of input token t; the placeholder last row is never used
    np.testing.assert_array_equal(mb.routed_experts[:4], a.routed_experts[:4])
    np.testing.assert_array_equal(mb.routed_experts[4:7], b.routed_experts[:3])
    np.testing.assert_array_equal(mb.routed_experts[7], [[0, 1], [0, 1]])
    assert mb.doc_starts[:2] == [0, 4]


def test_block_causal_mask_equals_causal_for_one_document():
    m = block_causal_mask([5])[0, 0]
    assert torch.equal(m, torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1))


def test_replay_tensors_follow_sequence_parallel_slices():
    a, b = traj(5, 2, 1), traj(5, 1, 2)
    mb = build_microbatch([a, b], [(0, 0, 4), (1, 0, 4)], [0.0, 0.0], pad_multiple=2, route_shape=(L, K, E))
    full = replay_tensors(mb.routed_experts)
    assert len(full) == L and full[0].shape == (8, K) and full[0].dtype == torch.int64
    r0 = replay_tensors(mb.routed_experts, tp_rank=0, tp_size=2, sequence_parallel=True)
    r1 = replay_tensors(mb.routed_experts, tp_rank=1, tp_size=2, sequence_parallel=True)
    for layer in range(L):
        assert torch.equal(torch.cat([r0[layer], r1[layer]]), full[layer])
        np.testing.assert_array_equal(r1[layer].numpy(), b.routed_experts[:4, layer])
    with pytest.raises(ValueError, match="multiple of TP"):
        replay_tensors(mb.routed_experts[:7], tp_rank=0, tp_size=2, sequence_parallel=True)


def test_missing_or_bad_routes_turn_replay_off_for_that_microbatch():
    good, bare = traj(5, 2, 1), traj(5, 2, 2, routes=False)
    mb = build_microbatch([good, bare], [(0, 0, 4), (1, 0, 4)], [0, 0], route_shape=(L, K, E))
    assert mb.routed_experts is None and mb.routed_experts_missing == 1
    assert "no routed_experts" in check_routes(None, 5, L, K, E)
    dup = good.routed_experts.copy()
    dup[1, 0] = [3, 3]
    assert "same expert twice" in check_routes(dup, 5, L, K, E)
    dup[1, 0] = [4, 0]
    assert "out of range" in check_routes(dup, 5, L, K, E)
    dup[1, 0] = [1, 0]
    dup[4] = 0          # the placeholder last row may hold anything
    assert check_routes(dup, 5, L, K, E) is None


def test_split_pieces_take_their_token_range_and_empty_microbatch_is_all_padding():
    a, b = traj(10, 2, 1), traj(6, 2, 3)
    # chunks 0 and 3 of a (input length 9: [0, 2) and [7, 9)) around whole b
    mb = build_microbatch([a, b], [(0, 0, 2), (1, 0, 5), (0, 7, 9)], [0.5, -1.0], route_shape=(L, K, E))
    tok = np.asarray(a.tokens)
    assert mb.input_ids[0].tolist() == tok[0:2].tolist() + list(b.tokens[:5]) + tok[7:9].tolist()
    assert mb.labels[0, 7:].tolist() == tok[8:10].tolist()
    assert mb.position_ids[0].tolist() == [0, 1, 0, 1, 2, 3, 4, 7, 8]       # true positions
    assert mb.doc_ids.tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0]
    np.testing.assert_array_equal(mb.loss_mask[0, 7:].numpy(), np.asarray(a.loss_mask, np.float32)[8:10])
    # routes of this rank's tokens
    np.testing.assert_array_equal(mb.routed_experts[7:], np.asarray(a.routed_experts)[7:9])
    assert mb.advantages[0].tolist() == [0.5] * 2 + [-1.0] * 5 + [0.5] * 2
    # the dense mask of split pieces is by document position: a's late chunk sees its early one
    m = mb.attention_mask[0, 0]
    assert not m[7, 0] and not m[8, 7] and m[7, 2] and m[0, 1]
    assert build_microbatch([a], [(0, 0, 9)], [0.0], dense_mask=False).attention_mask is None
    with pytest.raises(ValueError, match="out of range"):
        build_microbatch([a], [(0, 5, 12)], [0.0])
    empty = build_microbatch([a], [], [0.0], pad_multiple=2, route_shape=(L, K, E))
    assert empty.seq_len == 2 and empty.loss_mask.sum() == 0 and empty.routed_experts.shape == (2, L, K)


def test_input_lengths_drop_the_unfed_last_token():
    assert input_lengths([traj(5, 1, 1), traj(1, 0, 2)]) == [4, 0]
