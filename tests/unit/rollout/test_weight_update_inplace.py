"""Weight updates inside a response (engine.weight_update), on the real embedded engine over HTTP.

in_place: the node's sequence (fleet.update_weights: pause in_place, load with flush_cache=false,
continue) swaps weights between two decode steps of a running request. The response reports
two SGLang spans; its tokens before the swap are the old weights' (teacher-forced forward on
v0), after it the new weights' *on the KV cache of the old ones* (a step-by-step decode with
the cache kept reproduces them; a full recompute on v1 does not). between_requests: the same
update waits for the request, which stays on one version. The client turns spans into
per-token and per-route-row versions.
"""
import concurrent.futures as cf
import time

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from neon_hpc.rollout.engines.client import EngineError
from neon_hpc.rollout.engines.embedded import LoadedModel
from neon_hpc.rollout.engines.fleet import update_weights
from test_engine_embedded import PROMPT, TOL, engine, teacher_forced, weights  # noqa: F401  (fixtures)

N = 40


def running_job(sched, at_least: int, timeout: float = 60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        jobs = list(sched._running)
        if jobs and len(jobs[0].out) >= at_least:
            return jobs[0]
        time.sleep(0.001)
    raise AssertionError("the request never got going")


def _decode_with_kept_cache(models, prompt, out, k):
    """Logprobs of ``out`` decoded step by step as the engine does, v0 for the first ``k``
    tokens, then v1 continuing on the same cache."""
    m0, m1 = (LoadedModel(models[v], "", v) for v in ("0", "1"))
    cache = DynamicCache(config=m0.model.config)
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    pos = torch.arange(len(prompt))[None]
    logits, _ = m0.forward(ids, mask, pos, cache)
    lps = []
    for j, tok in enumerate(out):
        lps.append(torch.log_softmax(logits[0], -1)[tok].item())
        if j == len(out) - 1:
            break
        m = m0 if j + 1 < k else m1          # the forward that samples token j+1
        mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], 1)
        pos = pos[:, -1:] + 1
        logits, _ = m.forward(torch.tensor([[tok]]), mask, pos, cache)
    return np.array(lps)


def test_in_place_update_splits_a_running_response_into_two_spans_and_keeps_its_kv_cache(engine, weights):  # noqa: F811
    (h, client), (root, models) = engine, weights
    sched = h.server.scheduler
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(client.generate, PROMPT, {"temperature": 0, "max_new_tokens": N, "ignore_eos": True},
                        True, True)
        running_job(sched, 3)
        client.pause_generation(mode="in_place")
        try:
            # SGLang cannot flush its cache under held requests: the engine refuses it as loudly
            with pytest.raises(EngineError, match="flush_cache"):
                client.update_weights_from_disk(str(root / "v_1"), weight_version=1)
        finally:
            client.continue_generation()
        running_job(sched, 6)
        upd = update_weights(client, str(root / "v_1"), "1", "in_place")
        res = fut.result(timeout=120)
    assert upd["success"] and upd["num_paused_requests"] == 1
    spans = res.weight_versions
    assert [s["version"] for s in spans] == ["0", "1"], spans
    k = spans[0]["end"]
    assert spans == [{"version": "0", "start": 0, "end": k}, {"version": "1", "start": k, "end": N}]
    assert 6 <= k < N and res.weight_version == "1" and len(res.output_ids) == N
    got = np.array(res.output_logprobs)
    old, _ = teacher_forced(models["0"], PROMPT, res.output_ids)
    assert np.abs(got[:k] - old[:k]).max() < TOL                 # before the swap: v0
    kept = _decode_with_kept_cache(models, PROMPT, res.output_ids, k)
    assert np.abs(got - kept).max() < TOL                        # after: v1 on the kept cache
    recomputed, _ = teacher_forced(models["1"], PROMPT, res.output_ids)
    assert np.abs(got[k:] - recomputed[k:]).max() > 100 * TOL    # not a recompute on v1
    assert np.abs(got[k:] - old[k:]).max() > 100 * TOL           # not the old weights
    # per-token versions and route-row versions follow the spans
    assert res.token_versions() == [0] * k + [1] * (N - k)
    rows = res.route_row_versions(0)
    p = len(PROMPT)
    assert len(rows) == p + N and rows[:p] == [0] * p
    assert rows[p:p + k - 1] == [0] * (k - 1) and rows[p + k - 1:] == [1] * (N - k + 1)
    assert res.routed_experts.shape[0] == p + N - 1


def test_between_requests_update_waits_for_the_running_response(engine, weights):  # noqa: F811
    (h, client), (root, models) = engine, weights
    with cf.ThreadPoolExecutor(2) as ex:
        fut = ex.submit(client.generate, PROMPT, {"temperature": 0, "max_new_tokens": N, "ignore_eos": True})
        running_job(h.server.scheduler, 3)
        upd = ex.submit(update_weights, client, str(root / "v_1"), "1", "between_requests")
        res = fut.result(timeout=120)
        assert upd.result(timeout=120)["success"]
    assert res.weight_versions == [{"version": "0", "start": 0, "end": N}] and res.weight_version == "0"
    lps, _ = teacher_forced(models["0"], PROMPT, res.output_ids)
    assert np.abs(np.array(res.output_logprobs) - lps).max() < TOL
    assert client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 2}).weight_versions[0]["version"] == "1"


def test_client_refuses_spans_that_do_not_cover_the_output():
    from neon_hpc.rollout.engines.client import _spans
    assert _spans([{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}], 5, "u") == \
        [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    for bad in ([{"version": "3", "start": 0, "end": 2}], [{"version": "3", "start": 1, "end": 5}],
                [{"version": "3", "start": 0, "end": 3}, {"version": "4", "start": 2, "end": 5}], []):
        with pytest.raises(EngineError, match="weight_versions"):
            _spans(bad, 5, "u")


def test_replay_cache_tags_route_rows_with_the_spans_versions():
    from neon_hpc.replay.cache import RouteCache
    cache = RouteCache("delta")
    prompt, out = [1, 2, 3], [4, 5, 6, 7]
    routes = np.zeros((len(prompt) + len(out) - 1, 2, 2), np.int32)
    # a response whose output tokens 0-1 came from v3 and 2-3 from v4 (GenerateResult.route_row_versions)
    rows = [3, 3, 3] + [3, 4, 4, 4]
    cache.absorb(prompt, out, routes, 0, rows)
    assert cache.version_runs() == [[0, 3], [4, 4]]
    # the next turn's prefill ran on v4: the v3 rows are a version change (refresh: next request full)
    cache.absorb(prompt + out + [8], [9], np.zeros((1, 2, 2), np.int32), 7, [4, 4])
    assert cache.stats.fallbacks["version_change"] == 1
