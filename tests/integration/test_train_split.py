"""Split sequences and context parallelism in the real trainer (2 processes, gloo) against one process.

The data set of ``test_train_loop`` (routes recorded, so router replay runs): CP=2 with
zigzag-cut pieces, and DP=2 with the cost method cutting sequences into uneven early/late
pieces across the two ranks, each train the same two steps as a 1-process run.  Plus the
configured plan and the refusals: a method that cannot split, a zigzag threshold below
``2 * cp``, a balancer error stopping the step.
"""

from __future__ import annotations

import numpy as np
import pytest

from neon_hpc import config as C
from neon_hpc.util.logs import read_metrics
from test_train_loop import PER_STEP, add_shards, dataset, losses, new_run, start, wait_ok, weights  # noqa: F401

STEPS = 2


@pytest.fixture(scope="module")
def ref2(tmp_path_factory, dataset):  # noqa: F811
    run = new_run(tmp_path_factory.mktemp("ref2"), dataset, "run", f"train.steps={STEPS}")
    add_shards(run, dataset, range(1, STEPS + 1))
    wait_ok(run, start(run))
    return run


def _assert_same_training(run, ref, lr=0.002):
    """Losses within 1e-5 relative, weights after two Adam steps as test_train_loop explains."""
    got, want = losses(run), losses(ref)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in got:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-7)
    a, b = weights(run, STEPS), weights(ref, STEPS)
    off, total, worst = 0, 0, 0.0
    for k in b:
        d = np.abs(a[k].numpy() - b[k].numpy())
        off, total, worst = off + int((d > 1e-5).sum()), total + d.size, max(worst, float(d.max()))
    assert off / total < 1e-3, f"{off} of {total} weights differ by > 1e-5"
    assert worst <= 2 * lr * STEPS + 1e-6


def _records(run):
    return [r for r in read_metrics(run.root, "trainer") if "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ("train.context_parallel=2", "balance.split_threshold_tokens=8"),      # zigzag pieces >= 8 tokens
    ("train.data_parallel=2", "balance.tokens_per_microbatch=12"),          # cost method splits across DP
], ids=["cp2", "dp2_split"])
def test_split_layouts_train_like_one_process(tmp_path, dataset, ref2, layout):  # noqa: F811
    run = new_run(tmp_path, dataset, "run", f"train.steps={STEPS}", *layout)
    add_shards(run, dataset, range(1, STEPS + 1))
    wait_ok(run, start(run, 2))
    recs = _records(run)
    # the layout really ran pieces with a K/V exchange, and replay covered every document
    assert all(r["exchanged_microbatches"] > 0 for r in recs), recs
    assert all(r["replay_docs_missing"] == 0 and r["replayed_microbatches"] > 0 for r in recs)
    if "train.data_parallel=2" in layout:
        assert all(r["assignment"]["split_sequences"] > 0 for r in recs)
    _assert_same_training(run, ref2)


def test_configured_plan_runs_split_pieces_on_the_ranks_it_names():
    from neon_hpc.train.loop import _assign, rank_pieces
    cfg = C.load(None, ["train.data_parallel=1", "train.context_parallel=2", "balance.split_threshold_tokens=8",
                        "balance.tokens_per_microbatch=64"])
    lengths = [13, 5, 16, 7, 3]                      # 3 < 2*cp: never cut, runs whole on one CP rank
    asg = _assign(lengths, 2, cfg)
    pieces = rank_pieces(asg, 2)
    assert len(pieces) == 2 and len(pieces[0]) == len(pieces[1]) == asg.num_microbatches
    for j in range(asg.num_microbatches):
        seen = sorted((i, s, e) for r in pieces for (i, s, e) in r[j])
        assert seen == sorted((p.seq, p.start, p.end) for p in asg.cp_shards(0, j)[0] + asg.cp_shards(0, j)[1])
    covered = {i: sorted((s, e) for r in pieces for mb in r for (k, s, e) in mb if k == i) for i in range(5)}
    for i, n in enumerate(lengths):
        spans = covered[i]
        assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # sequence 2 (16 tokens) is zigzagged: CP rank 0 holds its first and last quarter
    assert sorted((s, e) for (i, s, e) in pieces[0][0] if i == 2) == [(0, 4), (12, 16)]
    assert [(s, e) for r in pieces for mb in r for (i, s, e) in mb if i == 4] == [(0, 3)]


@pytest.mark.parametrize("sets, key", [
    (["balance.method=tokenkk", "balance.split_sequences=true"], "balance.split_sequences"),
    (["balance.method=sequential", "balance.split_sequences=true"], "balance.split_sequences"),
    (["train.context_parallel=2", "balance.split_threshold_tokens=3"], "balance.split_threshold_tokens"),
    (["balance.split_threshold_tokens=64"], "balance.split_threshold_tokens"),
])
def test_config_check_refuses_what_the_trainer_cannot_run(sets, key):
    with pytest.raises(C.ConfigError, match=key.replace(".", r"\.")):
        C.load(None, sets)


def test_split_default_follows_the_method():
    assert C.load(None).balance.splits is True
    assert C.load(None, ["balance.method=tokenkk"]).balance.splits is False
    assert C.load(None, ["balance.split_sequences=false"]).balance.splits is False


def test_a_balancer_error_stops_the_step(tmp_path):
    from neon_hpc.train.loop import TrainerError, _assign
    cfg = C.load(None, [f"balance.cost_file={tmp_path / 'missing.json'}"])
    with pytest.raises(TrainerError, match=r"balance\.method='cost'.*missing\.json"):
        _assign([5, 9, 3], 1, cfg)
    cfg = C.load(None, ["train.context_parallel=2", "train.data_parallel=1"])
    with pytest.raises(TrainerError, match=r"train\.context_parallel=2 does not divide"):
        _assign([5, 9, 3], 3, cfg)
