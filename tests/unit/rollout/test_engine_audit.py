"""The run audit (rollout/engines/embedded/audit.py) on a real embedded engine's responses.

A two-turn trajectory whose first turn an in-place swap lands in (v0 then v1 on the kept KV
cache), its second turn on v1: recomputing each generation as the engine ran it reproduces
every recorded logprob, and a wrong per-token version (the response's one weight_version
for all its tokens) is caught. The command audits a run directory's claimed shards.
"""
import concurrent.futures as cf
import shutil

import numpy as np

from neon_hpc.rollout.engines.embedded import audit
from neon_hpc.rollout.engines.fleet import update_weights
from neon_hpc.store import Trajectory, write_shard
from test_engine_embedded import PROMPT, TOL, engine, weights  # noqa: F401  (fixtures)
from test_weight_update_inplace import running_job

ENV = [3, 4]


def _two_turns(engine, weights):  # noqa: F811
    (h, client), (root, models) = engine, weights
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(client.generate, PROMPT, {"temperature": 1.0, "max_new_tokens": 30, "ignore_eos": True,
                                                  "seed": 7})
        running_job(h.server.scheduler, 6)
        update_weights(client, str(root / "v_1"), "1", "in_place")
        first = fut.result(timeout=120)
    assert [s["version"] for s in first.weight_versions] == ["0", "1"]
    second = client.generate(PROMPT + first.output_ids + ENV,
                             {"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True, "seed": 8})
    return first, second, (lambda v: models[str(v)])


def _trajectory(first, second, first_versions):
    n1, n2, p = len(first.output_ids), len(second.output_ids), len(PROMPT)
    return Trajectory(
        tokens=np.array(PROMPT + first.output_ids + ENV + second.output_ids, np.int32),
        loss_mask=np.array([0] * p + [1] * n1 + [0] * len(ENV) + [1] * n2, np.uint8),
        logprobs=np.array([0.0] * p + first.output_logprobs + [0.0] * len(ENV) + second.output_logprobs,
                          np.float32),
        versions=np.array([-1] * p + first_versions + [-1] * len(ENV) + second.token_versions(), np.int32),
        reward=0.5, task_id="t", group_id="g", turn_offsets=np.array([0, p + n1, p + n1 + len(ENV) + n2]))


def test_recomputed_as_the_engine_ran_it_reproduces_every_logprob(engine, weights):  # noqa: F811
    first, second, model_of = _two_turns(engine, weights)
    t = _trajectory(first, second, first.token_versions())
    assert audit.generation_runs(t.loss_mask) == [(len(PROMPT), len(PROMPT) + 30),
                                                   (len(PROMPT) + 30 + len(ENV), len(t.tokens))]
    gaps = audit.audit_trajectory(t, model_of)
    k = first.weight_versions[0]["end"]
    assert {kind: len(g) for kind, g in gaps.items()} == {"pre_swap": k, "post_swap": 30 - k, "single": 5}
    assert max(g.max() for g in gaps.values()) < TOL


def test_a_wrong_per_token_version_is_caught(engine, weights):  # noqa: F811
    first, second, model_of = _two_turns(engine, weights)
    # the whole first response tagged with its weight_version (the last span's), as a client
    # that ignored the spans would: its tokens before the swap are then audited on v1
    t = _trajectory(first, second, [1] * len(first.output_ids))
    gaps = audit.audit_trajectory(t, model_of)
    assert "post_swap" not in gaps and gaps["single"].max() > 100 * TOL


def test_the_command_audits_a_run_directorys_claimed_shards(engine, weights, tmp_path, capsys):  # noqa: F811
    first, second, _ = _two_turns(engine, weights)
    root = weights[0]
    run = tmp_path / "run"
    for v in ("v_0", "v_1"):
        shutil.copytree(root / v, run / "weights" / v)
    step = run / "trajectories" / "claimed" / "step_1"
    step.mkdir(parents=True)
    good = _trajectory(first, second, first.token_versions())
    write_shard(step / "a.h5", [good])
    assert audit.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert f"audit_post_swap_tokens={30 - first.weight_versions[0]['end']}" in out
    bad = _trajectory(first, second, first.token_versions())
    bad.logprobs[len(PROMPT) + 2] += 0.1       # one logprob from somewhere else
    write_shard(step / "b.h5", [bad])
    assert audit.main([str(run)]) == 1
