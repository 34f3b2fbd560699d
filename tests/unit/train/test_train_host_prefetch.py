"""Host work beside the device (issue 40, item 4): the vectorised piece map against the per-token
rule it replaced, the prefetch thread, the one-buffer upload, and the read-backs of a step.

- ``build_piece_map`` (numpy) equals, field by field, a direct per-token transcription of its
  rule (``_reference_piece_map`` below) on 300 random slots of split documents over 1-3 ranks;
- ``Prefetched`` builds in order, waits per item, re-raises the builder's error;
- ``batch.pack``/``unpack`` (what ``to_device`` copies, pinned, to a GPU) round-trip every tensor;
- a CPU training step dispatches at most 2 scalar read-backs (the grad norm; the step's loss terms
  come back as one transfer, not one ``float()`` each) and no ``nonzero`` (the piece map is host
  numpy, the rotary table's size a host int).
"""

from __future__ import annotations

import random
import sys
import threading
import time

import numpy as np
import pytest
import torch

from repo_paths import REPO

# the repository root, whichever tier folder this file is in
sys.path.insert(0, str(REPO / "tests"))


def _reference_piece_map(slot, me, seq_len):
    """The piece map's rule token by token: (pos, pad, perm, send, [(q, qpos, kidx, kpos, runs)])."""
    def rows(pieces):
        d, p = [], []
        for (i, s, e) in pieces:
            d += [i] * max(e - s, 0)
            p += list(range(s, e))
        return d, p
    owners = {}
    for g, pieces in enumerate(slot):
        for (i, s, e) in pieces:
            if e > s:
                owners.setdefault(i, set()).add(g)
    shared = {i for i, gs in owners.items() if len(gs) > 1}
    doc, pos = rows(slot[me])
    sent = [[r for r, d in enumerate(rows(p)[0]) if d in shared] for p in slot]
    m = max((len(x) for x in sent), default=0)
    rdoc, rpos = [], []
    for g, pieces in enumerate(slot):
        d, p = rows(pieces)
        rdoc += ([-1] * m) if g == me else [d[r] for r in sent[g]] + [-1] * (m - len(sent[g]))
        rpos += [p[r] for r in sent[g]] + [0] * (m - len(sent[g]))
    groups, perm = [], []
    for i in dict.fromkeys(doc):
        q = sorted((r for r in range(len(doc)) if doc[r] == i), key=lambda r: pos[r])
        rr = [r for r in range(len(rdoc)) if rdoc[r] == i] if i in shared else []
        keys = sorted([(pos[r], r) for r in q] + [(rpos[r], seq_len + r) for r in rr], key=lambda x: x[0])
        qp = [pos[r] for r in q]
        runs, q0 = [], 0
        for t in range(1, len(qp) + 1):
            if t == len(qp) or qp[t] != qp[t - 1] + 1:
                before = sum(1 for kp, _ in keys if kp < qp[q0])
                runs.append((q0, t, before + t - q0))
                q0 = t
        groups.append((q, qp, [k for _, k in keys], [kp for kp, _ in keys], runs))
        perm += q
    pad = list(range(len(doc), seq_len))
    return pos + [0] * len(pad), pad, perm + pad, sent[me] if m else None, groups


def _random_slot(rng, ranks):
    slot = [[] for _ in range(ranks)]
    for d in range(rng.randint(1, 6)):
        n = rng.randint(1, 40)
        cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, ranks - 1)))) if n > 1 else []
        bounds = [0] + cuts + [n]
        for a, b in zip(bounds, bounds[1:]):
            slot[rng.randrange(ranks)].append((d, a, b))
    for s in slot:
        rng.shuffle(s)
    return slot


def test_vectorised_piece_map_equals_the_per_token_rule():
    from neon_hpc.models.cp_attention import build_piece_map
    rng = random.Random(0)
    for _ in range(300):
        ranks = rng.randint(1, 3)
        slot = _random_slot(rng, ranks)
        me = rng.randrange(ranks)
        seq_len = sum(e - s for (_, s, e) in slot[me]) + rng.randint(0, 5)
        got = build_piece_map(slot, me, seq_len)
        pos, pad, perm, send, groups = _reference_piece_map(slot, me, seq_len)
        assert got.pos.tolist() == pos and got.pad_idx.tolist() == pad
        assert got.max_pos == max(pos, default=0)
        inverse = got.inverse.tolist() if got.inverse is not None else list(range(seq_len))
        assert [perm[i] for i in inverse] == list(range(seq_len)) or perm == list(range(seq_len))
        assert (got.send_idx.tolist() if got.send_idx is not None else None) == send
        assert len(got.groups) == len(groups)
        for g, (q, qp, kidx, kpos, runs) in zip(got.groups, groups):
            assert g.q_idx.tolist() == q and g.q_pos.tolist() == qp
            assert g.key_idx.tolist() == kidx and g.key_pos.tolist() == kpos and g.runs == runs


def test_piece_map_refuses_a_position_twice():
    from neon_hpc.models.cp_attention import build_piece_map
    with pytest.raises(ValueError, match="holds a position twice"):
        build_piece_map([[(0, 0, 4)], [(0, 2, 6)]], 0, 4)


def test_prefetched_builds_in_order_and_reraises():
    from neon_hpc.train.prefetch import Prefetched
    seen = []

    def build(j):
        seen.append((j, threading.current_thread().name))
        time.sleep(0.01)
        return j * j

    p = Prefetched(5, build)
    assert p[2] == 4 and len(p) == 5
    assert p.all() == [0, 1, 4, 9, 16]
    assert [j for j, _ in seen] == list(range(5)) and all(n != threading.current_thread().name for _, n in seen)

    def bad(j):
        if j == 2:
            raise ValueError("piece (0, 3, 9) is out of range")
        return j

    q = Prefetched(4, bad)
    assert q[1] == 1
    with pytest.raises(ValueError, match="out of range"):
        q[2]


@pytest.fixture
def microbatch():
    from neon_hpc.store import Trajectory
    from neon_hpc.train.batch import build_microbatch
    rng = np.random.default_rng(0)
    trajs = []
    for n in (9, 13):
        mask = np.r_[np.zeros(3), np.ones(n - 3)].astype(np.uint8)
        routes = np.stack([np.stack([rng.permutation(6)[:2] for _ in range(3)]) for _ in range(n)])
        trajs.append(Trajectory(tokens=rng.integers(0, 50, n).astype(np.int32), loss_mask=mask,
                                logprobs=rng.normal(-2, 1, n).astype(np.float32),
                                versions=np.zeros(n, np.int32), routed_experts=routes.astype(np.int32),
                                reward=1.0, task_id="t", group_id="t"))
    return build_microbatch(trajs, [(0, 0, 8), (1, 2, 12)], [0.5, -0.5], pad_multiple=4,
                            route_shape=(3, 2, 6), dense_mask=False)


def test_pack_and_unpack_round_trip(microbatch):
    from neon_hpc.train.batch import pack, replay_rows, replay_tensors, to_device, unpack
    mb = microbatch
    assert to_device(mb, "cpu") is mb                   # CPU: nothing copied
    host, layout = pack(mb)
    out = unpack(mb, host.clone(), layout)
    for f in ("input_ids", "position_ids", "labels", "loss_mask", "behaviour_logprobs", "advantages"):
        a, b = getattr(mb, f), getattr(out, f)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f
    for sp, tp, rank in ((False, 1, 0), (True, 2, 1)):
        want = replay_tensors(mb.routed_experts, rank, tp, sp)
        got = replay_rows(out, rank, tp, sp)
        assert len(got) == len(want) and all(torch.equal(g, w) and g.is_contiguous() for g, w in zip(got, want))


def test_a_training_step_reads_the_device_back_at_most_twice():
    from neon_hpc import config as C
    from neon_hpc.train import backend as B
    from neon_hpc.train.census import census
    from neon_hpc.train.loop import prepare_step, train_step
    from neon_hpc.train.loss import loss_settings
    from neon_hpc.train.sections import TrainerSections
    from test_train_precision import CONFIGS, trajectories

    cfg = C.load(CONFIGS["qwen3_moe"])
    sec = TrainerSections.of(cfg)
    be = B.setup(cfg.model, lr=3e-3, seed=3, precision="bf16")
    try:
        train_step(be, prepare_step(trajectories(cfg, 0), 1, sec), loss_settings(cfg))
        data = prepare_step(trajectories(cfg, 1, count=12), 1, sec)
        with census() as c:
            m = train_step(be, data, loss_settings(cfg))
        assert np.isfinite(m["loss"])
        ops = c.packets()
        assert ops["_local_scalar_dense"] <= 2, ops.most_common(10)
        assert ops["nonzero"] == 0
    finally:
        B.teardown()
