"""The embedded engine over real HTTP (a child process), driven by our EngineClient.

What is checked: greedy determinism; returned logprobs == a teacher-forced forward of the
same tokens; routed experts == the routers' top-k on that forward; the exact slice for
``routed_experts_start_len``; 4xx for bad requests while the server keeps serving;
concurrent requests batched; weight updates under load with every response naming (and
matching) the weights that generated it; pause/continue.
"""
import concurrent.futures as cf
import json
import time
import urllib.request

import numpy as np
import pytest
import torch

from neon_hpc.config.model import ModelConfig
from neon_hpc.models import hf
from neon_hpc.rollout.engines.client import EngineClient, EngineError
from neon_hpc.rollout.engines.embedded import start_server

TOL = 1e-4  # float32 logprobs: batched/padded KV-cache decode vs one unpadded forward


def _model(seed: int):
    cfg = ModelConfig()
    model = hf.build_hf_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return cfg, model


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    models = {}
    for v, seed in ((0, 11), (1, 22)):
        cfg, m = _model(seed)
        hf.save_hf(m, cfg, root / f"v_{v}")
        models[str(v)] = m
    return root, models


@pytest.fixture(scope="module")
def server(weights):
    root, _ = weights
    handle = start_server(root / "v_0", max_batch_size=8, allowed_root=str(root))
    yield handle
    handle.stop()


@pytest.fixture
def client(server):
    return EngineClient(server.url, timeout=120)


@pytest.fixture
def engine(weights):
    """An in-process engine over ``v_0`` (its scheduler reachable: tests hold a running batch at
    a known step), batch 4, and a client; for the in-place update and continuous-batching tests."""
    root, _ = weights
    h = start_server(root / "v_0", max_batch_size=4, in_process=True, allowed_root=str(root))
    yield h, EngineClient(h.url, timeout=120)
    h.stop()


def teacher_forced(model, prompt, output):
    """Logprobs of ``output`` after ``prompt`` and routes [seqlen, layers, top_k], one forward."""
    seq = list(prompt) + list(output)
    routes = []
    hooks = [m.register_forward_hook(lambda mod, i, o: routes.append(o[2]))
             for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    lp = torch.log_softmax(logits, -1)
    p = len(prompt)
    lps = [lp[p - 1 + j, t].item() for j, t in enumerate(output)]
    return np.array(lps), torch.stack(routes, 1).numpy()


def raw_post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


PROMPT = [5, 17, 42, 9, 100, 3, 77]


def test_greedy_is_deterministic(client):
    a = client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 8})
    b = client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 8})
    assert a.output_ids == b.output_ids and len(a.output_ids) == 8
    assert a.output_logprobs == b.output_logprobs
    assert a.finish_reason == {"type": "length", "length": 8}


def test_logprobs_and_routes_equal_teacher_forced_forward(client, weights):
    _, models = weights
    res = client.generate(PROMPT, {"temperature": 1.0, "max_new_tokens": 10, "seed": 3},
                          return_routed_experts=True)
    lps, routes = teacher_forced(models[res.weight_version], PROMPT, res.output_ids)
    assert np.abs(lps - np.array(res.output_logprobs)).max() < TOL
    seqlen = len(PROMPT) + len(res.output_ids)
    assert res.routed_experts.dtype == np.int32
    assert res.routed_experts.shape == (seqlen - 1, 2, 2)  # [0, seqlen-1), layers, top_k
    assert np.array_equal(res.routed_experts, routes[:seqlen - 1])


def test_seeded_sampling_is_reproducible_and_seed_matters(client):
    sp = {"temperature": 1.0, "max_new_tokens": 12}
    a = client.generate(PROMPT, {**sp, "seed": 1})
    b = client.generate(PROMPT, {**sp, "seed": 1})
    others = [client.generate(PROMPT, {**sp, "seed": s}).output_ids for s in (2, 3, 4)]
    assert a.output_ids == b.output_ids
    assert any(o != a.output_ids for o in others)


def test_stop_token_ends_generation_and_is_returned(client):
    greedy = client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 8}).output_ids
    stop = greedy[3]
    res = client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 8, "stop_token_ids": [stop]})
    first = greedy.index(stop)
    assert res.output_ids == greedy[:first + 1]
    assert res.finish_reason == {"type": "stop", "matched": stop}


def test_routed_experts_start_len_returns_exactly_the_slice(client):
    sp = {"temperature": 0, "max_new_tokens": 6}
    full = client.generate(PROMPT, sp, return_routed_experts=True)
    for start in (3, len(PROMPT) - 1, len(PROMPT)):
        part = client.generate(PROMPT, sp, return_routed_experts=True, routed_experts_start_len=start)
        assert part.output_ids == full.output_ids
        assert np.array_equal(part.routed_experts, full.routed_experts[start:])


def test_wire_format_is_sglangs(server):
    status, out = raw_post(server.url, "/generate", {
        "input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 3, "sampling_seed": 1},
        "return_logprob": True, "return_routed_experts": True, "rid": "abc"})
    assert status == 200
    meta = out["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version",
            "output_token_logprobs", "routed_experts"} <= set(meta)
    assert meta["id"] == "abc" and meta["prompt_tokens"] == len(PROMPT) and meta["weight_version"] == "0"
    lp, tok, text = meta["output_token_logprobs"][0]
    assert tok == out["output_ids"][0] and text is None and lp <= 0
    import base64
    assert len(base64.b64decode(meta["routed_experts"])) == (len(PROMPT) + 3 - 1) * 2 * 2 * 4


@pytest.mark.parametrize("body, fragment", [
    ({"input_ids": [], "sampling_params": {}}, "non-empty"),
    ({"sampling_params": {}}, "input_ids"),
    ({"input_ids": ["a", "b"]}, "token id"),
    ({"input_ids": [1, 2, 300]}, "token id"),
    ({"input_ids": [1, 2], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"regex": "a+"}}, "not supported"),
    ({"input_ids": [1, 2], "return_routed_experts": True, "routed_experts_start_len": 3}, "out of range"),
    ({"input_ids": [1, 2], "routed_experts_start_len": -1}, "out of range"),
    ({"input_ids": [1, 2], "bogus": 1}, "unknown"),
    ({"text": "hello"}, "input_ids"),
    ({"input_ids": [1, 2], "stream": True}, "stream"),
])
def test_bad_requests_get_400_with_a_message_and_the_server_keeps_serving(server, client, body, fragment):
    status, out = raw_post(server.url, "/generate", body)
    assert status == 400
    assert fragment in out["error"]["message"]
    assert client.health()
    assert len(client.generate([1, 2, 3], {"temperature": 0, "max_new_tokens": 2}).output_ids) == 2


def test_client_raises_engine_error_with_status_for_4xx(client):
    with pytest.raises(EngineError) as info:
        client.generate([1, 2], {"temperature": 0}, return_routed_experts=True, routed_experts_start_len=5)
    assert info.value.status == 400 and "out of range" in str(info.value)


def test_concurrent_requests_are_batched_and_each_is_correct(client, server, weights):
    _, models = weights
    prompts = [PROMPT[: 2 + i % 5] + [i] for i in range(12)]
    with cf.ThreadPoolExecutor(12) as ex:
        results = list(ex.map(lambda p: client.generate(p, {"temperature": 0, "max_new_tokens": 6},
                                                        return_routed_experts=True), prompts))
    info = json.loads(urllib.request.urlopen(server.url + "/get_server_info", timeout=10).read())
    assert info["stats"]["max_batch"] > 1
    for p, r in zip(prompts, results):
        lps, routes = teacher_forced(models[r.weight_version], p, r.output_ids)
        assert np.abs(lps - np.array(r.output_logprobs)).max() < TOL
        assert np.array_equal(r.routed_experts, routes[: len(p) + len(r.output_ids) - 1])


def test_update_under_load_no_failures_and_versions_name_the_weights(weights):
    root, models = weights
    handle = start_server(root / "v_0", max_batch_size=4, in_process=True)
    client = EngineClient(handle.url, timeout=120)
    try:
        def one(i):
            return client.generate(PROMPT[: 3 + i % 4], {"temperature": 1.0, "max_new_tokens": 6, "seed": i})
        with cf.ThreadPoolExecutor(6) as ex:
            futures = [ex.submit(one, i) for i in range(24)]
            time.sleep(0.05)
            upd = client.update_weights_from_disk(str(root / "v_1"), weight_version=1)
            after = client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 4})
            results = [f.result() for f in futures]  # no request fails
        assert upd["success"] and "1" in upd["message"]
        assert after.weight_version == "1"
        assert client.model_info()["weight_version"] == "1"
        assert {r.weight_version for r in results} <= {"0", "1"}
        for i, r in enumerate(results):
            prompt = PROMPT[: 3 + i % 4]
            lps, _ = teacher_forced(models[r.weight_version], prompt, r.output_ids)
            assert np.abs(lps - np.array(r.output_logprobs)).max() < TOL, (i, r.weight_version)
    finally:
        handle.stop()


def test_update_with_a_bad_path_fails_and_old_weights_keep_serving(client, weights, tmp_path):
    root, _ = weights
    with pytest.raises(EngineError) as info:
        client.update_weights_from_disk(str(root / "v_9"), weight_version=9)
    assert info.value.status == 400
    with pytest.raises(EngineError, match="escapes"):
        client.update_weights_from_disk(str(tmp_path), weight_version=9)  # outside --allowed-root
    assert client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 2}).weight_version == "0"


def test_pause_in_place_holds_requests_until_continue(client):
    client.pause_generation(mode="in_place")
    try:
        with cf.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(client.generate, PROMPT, {"temperature": 0, "max_new_tokens": 3})
            done, _ = cf.wait([fut], timeout=0.5)
            assert not done  # held while paused
            client.continue_generation()
            assert len(fut.result(timeout=60).output_ids) == 3
    finally:
        client.continue_generation()


def test_pause_abort_ends_in_flight_requests_with_partial_output(client):
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(client.generate, PROMPT, {"temperature": 0, "max_new_tokens": 1500},
                        True, True)
        time.sleep(0.3)
        client.pause_generation(mode="abort")
        try:
            res = fut.result(timeout=60)
        finally:
            client.continue_generation()
    assert res.aborted and res.finish_reason["message"].startswith("Abort")
    assert 0 < len(res.output_ids) < 1500
    assert len(res.output_logprobs) == len(res.output_ids)
    assert res.routed_experts.shape[0] == len(PROMPT) + len(res.output_ids) - 1
    assert len(client.generate(PROMPT, {"temperature": 0, "max_new_tokens": 2}).output_ids) == 2
