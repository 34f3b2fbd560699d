"""Continuous batching in the embedded engine, on the real engine over HTTP (in process, to
hold the running batch at a known step).

A long request is decoding; requests that arrive meanwhile join its batch at the next step
(one narrower, one wider than the running rows, so both sides of the left-padded KV cache
get padded), decode with it, and are answered while the long one still runs. Each newcomer's
tokens equal those of the same seeded request run alone, and its logprobs equal a
teacher-forced forward; the long request's tokens and logprobs are untouched by the rows that
joined and left its batch.
"""
import concurrent.futures as cf
import time

import numpy as np

from neon_hpc.rollout.engines.client import EngineClient
from neon_hpc.rollout.engines.embedded import start_server
from test_engine_embedded import PROMPT, TOL, engine, teacher_forced, weights  # noqa: F401  (fixtures)

LONG = 300
SP = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 10, "seed": 5}
NARROW = [9, 4]                                    # shorter than the running row
WIDE = [(11 * j) % 200 + 1 for j in range(60)]     # longer than the running row (3 + held tokens)


def _wait(cond, what: str, timeout: float = 60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = cond()
        if got:
            return got
        time.sleep(0.001)
    raise AssertionError(what)


def _join_mid_batch(client, sched, long_prompt):
    """Solo runs of NARROW and WIDE, then the same requests sent while ``long_prompt`` decodes
    (the batch held at a known step until both are queued); returns (alone, joined, long job,
    long future) with the long request still running."""
    alone = {name: client.generate(p, SP, True, True) for name, p in (("narrow", NARROW), ("wide", WIDE))}
    ex = cf.ThreadPoolExecutor(3)
    fut = ex.submit(client.generate, long_prompt, {"temperature": 0, "max_new_tokens": LONG,
                                                   "ignore_eos": True}, True, True)
    long_job = _wait(lambda: next((j for j in list(sched._running) if len(j.out) >= 5), None),
                     "the long request never got going")
    # hold the batch between two steps, queue the newcomers, let them in together
    client.pause_generation(mode="in_place")
    try:
        held_at = len(long_job.out)
        assert len(long_prompt) + held_at < len(WIDE)
        news = {name: ex.submit(client.generate, p, SP, True, True) for name, p in (("narrow", NARROW), ("wide", WIDE))}
        _wait(lambda: len(sched._queue) == 2, "the newcomers never reached the queue")
        assert len(long_job.out) == held_at           # held while paused, newcomers not admitted
    finally:
        client.continue_generation()
    joined = {name: f.result(timeout=120) for name, f in news.items()}
    ex.shutdown(wait=False)
    return alone, joined, long_job, fut


def _same(a, b) -> None:
    assert a.output_ids == b.output_ids                # batch composition does not change tokens
    assert np.abs(np.array(a.output_logprobs) - np.array(b.output_logprobs)).max() < TOL
    assert np.array_equal(a.routed_experts, b.routed_experts)


def test_a_request_arriving_mid_batch_joins_it_and_is_answered_before_the_long_member_ends(engine, weights):  # noqa: F811
    (h, client), (_, models) = engine, weights
    sched = h.server.scheduler
    long_prompt = PROMPT[:3]
    alone, got, long_job, fut = _join_mid_batch(client, sched, long_prompt)
    # answered while the long member is still decoding
    assert not fut.done() and len(long_job.out) < LONG
    assert sched.stats["max_batch"] == 3
    _wait(lambda: len(sched._running) == 1 or fut.done(), "the finished newcomers never left the batch")
    long_res = fut.result(timeout=120)
    for name, prompt in (("narrow", NARROW), ("wide", WIDE)):
        res = got[name]
        _same(res, alone[name])
        lps, routes = teacher_forced(models["0"], prompt, res.output_ids)
        assert np.abs(np.array(res.output_logprobs) - lps).max() < TOL, name
        assert np.array_equal(res.routed_experts, routes[:len(prompt) + len(res.output_ids) - 1])
    assert len(long_res.output_ids) == LONG
    lps, routes = teacher_forced(models["0"], long_prompt, long_res.output_ids)
    assert np.abs(np.array(long_res.output_logprobs) - lps).max() < TOL
    assert np.array_equal(long_res.routed_experts, routes[:len(long_prompt) + LONG - 1])
    assert long_res.weight_versions == [{"version": "0", "start": 0, "end": LONG}]


def test_deepseek_v3_rows_join_and_leave_the_batch_exactly(tmp_path):
    """The mission's architecture (MLA: keys and values of different head dims in the cache)."""
    from model_fixtures import decisive_hf, tiny_dsv3
    from neon_hpc.models.hf import save_hf

    cfg = tiny_dsv3()
    path = save_hf(decisive_hf(cfg, 7), cfg, tmp_path / "v_0")
    with start_server(path, max_batch_size=4, in_process=True) as h:
        client = EngineClient(h.url, timeout=120)
        sched = h.server.scheduler
        alone, got, long_job, fut = _join_mid_batch(client, sched, PROMPT[:4])
        assert not fut.done() and sched.stats["max_batch"] == 3
        long_res = fut.result(timeout=120)
        long_alone = client.generate(PROMPT[:4], {"temperature": 0, "max_new_tokens": LONG, "ignore_eos": True},
                                     True, True)
    for name in ("narrow", "wide"):
        _same(got[name], alone[name])
    _same(long_res, long_alone)


def test_unpaused_update_admits_no_newcomer_until_the_running_rows_finish(engine, weights):  # noqa: F811
    """SGLang's writer lock: the request queued behind a pending update runs on the new weights
    only, the running one on the old weights only; neither waits for the other's whole batch."""
    (h, client), (root, models) = engine, weights
    sched = h.server.scheduler
    with cf.ThreadPoolExecutor(3) as ex:
        first = ex.submit(client.generate, PROMPT, {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True})
        _wait(lambda: any(len(j.out) >= 3 for j in list(sched._running)), "the first request never got going")
        upd = ex.submit(client.update_weights_from_disk, str(root / "v_1"), 1)
        _wait(lambda: sched._update is not None, "the update never reached the scheduler")
        second = ex.submit(client.generate, PROMPT, {"temperature": 0, "max_new_tokens": 8})
        _wait(lambda: len(sched._queue) == 1 or second.done(), "the second request never queued")
        a, b = first.result(timeout=120), second.result(timeout=120)
        assert upd.result(timeout=120)["success"]
    assert a.weight_versions == [{"version": "0", "start": 0, "end": 200}]
    assert b.weight_versions == [{"version": "1", "start": 0, "end": 8}]
    for res, v in ((a, "0"), (b, "1")):
        lps, _ = teacher_forced(models[v], PROMPT, res.output_ids)
        assert np.abs(np.array(res.output_logprobs) - lps).max() < TOL
