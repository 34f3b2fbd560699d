"""The balancer (assign_step): packing under the cap, exact coverage, split placement, CP zigzag,
determinism across processes, the baselines and the pipeline time model."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from neon_hpc.balance import CostModel, Piece, assign_step, check_assignment, pipeline_time
from neon_hpc.balance.cp import cp_shards, zigzag_pairs
from neon_hpc.balance.kk import _karmarkar_karp_lists, _karmarkar_karp_np, karmarkar_karp

KIMI_COST = CostModel(a=1.9e11, b=3.75e6)


def mixture(n, seed=0, scale=1):
    """Issue 7's long tail: 94% in 2k-16k tokens, 6% in 32k-128k (optionally scaled down)."""
    rng = np.random.default_rng(seed)
    L = rng.integers(2048, 16385, n)
    tail = rng.random(n) < 0.06
    L[tail] = rng.integers(32768, 131073, int(tail.sum()))
    return (L // scale).astype(np.int64)


def coverage(asg):
    """seq -> sorted list of (start, end) over the whole plan."""
    out = {}
    for mbs in asg.ranks:
        for mb in mbs:
            for p in mb:
                out.setdefault(p.seq, []).append((p.start, p.end))
    return {s: sorted(v) for s, v in out.items()}


@pytest.mark.parametrize("method", ["cost", "tokenkk", "flopkk", "sequential"])
def test_every_token_assigned_exactly_once(method):
    L = mixture(300, seed=1)
    asg = assign_step(L, dp=16, pp_microbatches=4, token_cap=131072, cost=KIMI_COST, method=method)
    cov = coverage(asg)
    assert sorted(cov) == list(range(len(L)))
    for s, spans in cov.items():
        pos = 0
        for a, b in spans:
            assert a == pos
            pos = b
        assert pos == L[s]
    assert len({len(mbs) for mbs in asg.ranks}) == 1      # one micro-batch count for all ranks


def test_packing_never_exceeds_the_cap_and_splits_what_does_not_fit():
    L = mixture(400, seed=2)
    cap = 32768                       # below the 32k-128k tail: those must be split
    asg = assign_step(L, dp=32, pp_microbatches=2, token_cap=cap, cost=KIMI_COST)
    assert asg.oversize == []
    assert max(asg.microbatch_tokens(r, j) for r in range(32) for j in range(asg.num_microbatches)) <= cap
    split = asg.split_sequences()
    assert set(np.flatnonzero(L > cap)) <= set(split)


def test_split_sequence_is_one_zigzag_unit_per_rank_in_one_slot():
    L = [120000] + [4000] * 60
    asg = assign_step(L, dp=8, token_cap=65536, cost=KIMI_COST)
    pieces = asg.split_sequences()[0]
    ranks = [r for r, _, _ in pieces]
    slots = {j for _, j, _ in pieces}
    assert len(slots) == 1
    k = len(set(ranks))
    assert k >= 2
    # each rank holds chunk u and chunk 2k-1-u of 2k equal chunks: equal tokens per rank
    per_rank = {}
    for r, _, p in pieces:
        per_rank[r] = per_rank.get(r, 0) + p.tokens
    assert max(per_rank.values()) - min(per_rank.values()) <= 2
    for r in set(ranks):
        mine = sorted(p for rr, _, p in pieces if rr == r)
        assert len(mine) == 2 and mine[0].start < 120000 // 2 <= mine[1].start


def test_zigzag_pairs_cover_and_balance_cost():
    cm = CostModel(a=1.0, b=0.01)
    for n, k in ((1000, 4), (1001, 3), (64, 8)):
        units = zigzag_pairs(0, n, k)
        spans = sorted(x for u in units for x in u)
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        costs = [sum(cm.chunk_cost(s, e) for s, e in u) for u in units]
        assert max(costs) / min(costs) < 1.01


def test_cp_shards_cover_each_piece_exactly_and_pair_early_with_late():
    cm = CostModel(a=1.0, b=0.01)
    cp = 4
    mb = [Piece(0, 0, 8000), Piece(1, 2000, 6000), Piece(2, 0, 300), Piece(3, 0, 200)]
    shards = cp_shards(mb, cm, cp, threshold=1000)
    assert len(shards) == cp
    for piece in mb:
        spans = sorted((p.start, p.end) for sh in shards for p in sh if p.seq == piece.seq)
        assert spans[0][0] == piece.start and spans[-1][1] == piece.end
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # the long piece: every CP rank has exactly one early and one late chunk of it
    for q, sh in enumerate(shards):
        mine = sorted(p for p in sh if p.seq == 0)
        assert len(mine) == 2 and mine[0].end <= 4000 <= mine[1].start
    # the short ones stay whole
    assert [p for sh in shards for p in sh if p.seq == 2] == [Piece(2, 0, 300)]


def test_cp_assignment_predicts_the_slowest_cp_rank():
    L = [60000, 3000, 3000, 500]
    cm = CostModel(a=1.0, b=0.001)
    asg = assign_step(L, dp=1, cp=2, token_cap=131072, cost=cm)
    shards = asg.cp_shards(0, 0)
    worst = max(sum(cm.chunk_cost(p.start, p.end) for p in sh) for sh in shards)
    assert asg.makespan == pytest.approx(worst)
    assert asg.makespan < cm.cost(L) * 0.55      # two CP ranks share it nearly evenly


def test_dp1_packs_whole_sequences_into_microbatches_under_the_cap():
    L = [900, 1500, 3000, 700, 2200, 100, 4000]
    asg = assign_step(L, dp=1, token_cap=4096)
    assert asg.num_microbatches >= 4                  # 12400 tokens under a 4096 cap
    assert all(asg.microbatch_tokens(0, j) <= 4096 for j in range(asg.num_microbatches))
    whole = asg.whole_sequences(0)
    assert sorted(i for mb in whole for i in mb) == list(range(len(L)))


def test_too_long_for_dp_ranks_is_reported_not_hung():
    asg = assign_step([5000, 100], dp=1, token_cap=4096)
    assert asg.oversize == [0]
    assert any(mb == [Piece(0, 0, 5000)] for mb in asg.ranks[0])   # alone in its micro-batch
    # with two ranks it is split instead
    assert assign_step([5000, 100], dp=2, token_cap=4096).oversize == []


def test_assignment_is_deterministic_across_processes():
    code = ("import sys, json, numpy as np; sys.path.insert(0, %r)\n"
            "from test_balance_assignment import mixture, KIMI_COST\n"
            "from neon_hpc.balance import assign_step\n"
            "p = assign_step(mixture(500, seed=3), dp=16, pp_microbatches=4, cp=2, token_cap=65536, cost=KIMI_COST)\n"
            "print(json.dumps(p.ranks))" % os.path.dirname(__file__))
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                   text=True, check=True).stdout)
    assert outs[0] == outs[1] and len(json.loads(outs[0])) == 16
    here = assign_step(mixture(500, seed=3), dp=16, pp_microbatches=4, cp=2, token_cap=65536, cost=KIMI_COST)
    assert json.loads(json.dumps(here.ranks)) == json.loads(outs[0])


def test_pipeline_time_is_sum_plus_bubbles_of_the_slowest_microbatch():
    assert pipeline_time([4.0], 4) == pytest.approx(4.0)           # one micro-batch: no overlap
    assert pipeline_time([1.0, 1.0, 1.0, 1.0], 1) == pytest.approx(4.0)
    # p=4: (sum + 3*max)/4
    assert pipeline_time([1.0, 2.0, 1.0, 1.0], 4) == pytest.approx((5.0 + 6.0) / 4)


def test_pipeline_model_prefers_even_microbatches():
    L = mixture(256, seed=4)
    asg = assign_step(L, dp=8, pp_microbatches=8, token_cap=131072, cost=KIMI_COST)
    costs = [[asg.microbatch_cost(r, j) for j in range(asg.num_microbatches)] for r in range(8)]
    mean = np.mean(costs)
    assert max(max(c) for c in costs) < 1.2 * mean
    assert asg.makespan < asg.shadow["flopkk"]


def test_cost_method_beats_token_kk_on_the_long_tail():
    L = mixture(512, seed=5)
    asg = assign_step(L, dp=64, token_cap=65536, cost=KIMI_COST)
    assert asg.imbalance < 1.05
    assert asg.speedup_vs("tokenkk") > 1.5
    assert asg.chosen_from == "cost"


def test_sequential_baseline_keeps_contiguous_blocks():
    L = [10] * 12
    asg = assign_step(L, dp=3, token_cap=1000, method="sequential", shadow=False)
    assert [[p.seq for mb in mbs for p in mb] for mbs in asg.ranks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert asg.shadow == {}


def test_karmarkar_karp_balances_and_keeps_every_item():
    w = [8, 7, 6, 5, 4]
    parts = karmarkar_karp(w, 2)
    assert sorted(i for p in parts for i in p) == list(range(5))
    sums = sorted(sum(w[i] for i in p) for p in parts)
    assert sums == [14, 16]          # LDM's answer on the textbook example (optimum is 15/15)
    assert karmarkar_karp([], 3) == [[], [], []]
    assert len(karmarkar_karp([1.0], 4)) == 4


def test_check_assignment_catches_a_missing_and_a_doubled_token():
    asg = assign_step([100, 200], dp=2, token_cap=4096)
    check_assignment(asg)
    missing = assign_step([100, 200], dp=2, token_cap=4096)
    missing.ranks[0][0] = []
    with pytest.raises(ValueError, match="missing"):
        check_assignment(missing)
    doubled = assign_step([100, 200], dp=2, token_cap=4096)
    doubled.ranks[1][0] = doubled.ranks[1][0] + doubled.ranks[0][0]
    with pytest.raises(ValueError, match="assigned twice"):
        check_assignment(doubled)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="dp"):
        assign_step([1, 2], dp=0)
    with pytest.raises(ValueError, match="unknown method 'greedy'"):
        assign_step([1, 2], dp=1, method="greedy")
    with pytest.raises(ValueError, match=r"lengths\[1\] is negative"):
        assign_step([1, -2], dp=1)


def test_zero_length_sequences_are_left_out_and_empty_input_assigns_nothing():
    asg = assign_step([0, 5, 0], dp=2, token_cap=16)
    assert sorted(coverage(asg)) == [1]
    empty = assign_step([], dp=4, pp_microbatches=2)
    assert empty.makespan == 0 and len(empty.ranks) == 4 and empty.num_microbatches == 2


def test_images_add_their_encoder_cost_to_the_piece_holding_token_zero():
    cm = CostModel(a=1.0, b=0.0, image_cost=100.0)
    asg = assign_step([10, 10], dp=2, token_cap=64, cost=cm, images=[3, 0], shadow=False)
    # 20 token costs + 3 images, counted once, on the rank holding sequence 0's first token
    assert sum(asg.rank_time) == pytest.approx(320.0)
    first = [r for r, mbs in enumerate(asg.ranks) for mb in mbs for p in mb if p.seq == 0 and p.start == 0]
    assert asg.rank_time[first[0]] >= 300.0


def test_split_false_keeps_every_sequence_whole_and_still_balances_cost():
    L = mixture(256, seed=6)
    asg = assign_step(L, dp=16, token_cap=131072, cost=KIMI_COST, split=False)
    assert asg.split_sequences() == {}
    assert asg.makespan <= asg.shadow["tokenkk"] * (1 + 1e-9)
    with_splits = assign_step(L, dp=16, token_cap=131072, cost=KIMI_COST)
    assert with_splits.split_sequences() and with_splits.makespan < asg.makespan


def test_vectorised_karmarkar_karp_gives_the_same_sums():
    w = np.random.default_rng(7).lognormal(8, 1, 900)
    for k in (3, 64, 300):
        fast = _karmarkar_karp_np(w, k)
        assert sorted(i for p in fast for i in p) == list(range(900))
        assert np.allclose(sorted(w[p].sum() for p in fast),
                           sorted(w[p].sum() for p in _karmarkar_karp_lists(w, k)))
