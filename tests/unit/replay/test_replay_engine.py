"""Delta router replay against the embedded engine over real HTTP.

Routes assembled from deltas equal one full export at the end, row for row (turn boundaries
included), for random multi-turn conversations; a changed prefix, a weight update between
turns, a dropped response and a truncated payload each take the documented fallback and are
counted.  Faults are injected by a real HTTP proxy in front of the real engine.
"""
import base64
import json
import random
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import requests

from neon_hpc.replay import ReplayConversation

EngineClient = pytest.importorskip("neon_hpc.rollout.engines.client",
                                   reason="engine client not built yet").EngineClient
from neon_hpc.rollout.engines.embedded import start_server  # noqa: E402

LAYERS, TOPK = 2, 2


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    import shutil

    from test_agent_episode import tiny_weights
    root = tmp_path_factory.mktemp("weights")
    shutil.copytree(tiny_weights(3), root / "v_0")        # the engine reads the version from v_N
    shutil.copytree(tiny_weights(4), root / "v_1")
    return root


@pytest.fixture(scope="module")
def engine(weights):
    handle = start_server(weights / "v_0", in_process=True, allowed_root=str(weights))
    yield handle
    handle.stop()


def full_export(client, tokens):
    """One request over the whole sequence, generating nothing: rows [0, n-1)."""
    res = client.generate(list(tokens), {"max_new_tokens": 0}, return_logprob=False,
                          return_routed_experts=True, routed_experts_start_len=None)
    return np.asarray(res.routed_experts), res


def converse(conv, rnd, turns, tokens=None):
    tokens = list(tokens or [])
    for k in range(turns):
        prompt = tokens + [rnd.randrange(16, 250) for _ in range(rnd.randrange(1, 12))]
        res = conv.generate(prompt, {"temperature": 1.0, "max_new_tokens": rnd.randrange(1, 7),
                                     "sampling_seed": rnd.randrange(1 << 30), "stop_token_ids": [1]})
        tokens = prompt + list(res.output_ids)
    return tokens


def test_random_conversations_delta_equals_one_full_export(engine):
    client = EngineClient(engine.url)
    rnd = random.Random(7)
    for _ in range(3):
        conv = ReplayConversation(client, mode="delta")
        tokens = converse(conv, rnd, turns=rnd.randrange(2, 6))
        full, _ = full_export(client, tokens)
        got = conv.routed_experts(len(tokens))
        assert got.shape == (len(tokens), LAYERS, TOPK)
        np.testing.assert_array_equal(got[:-1], full)
        assert sum(conv.stats.fallbacks.values()) == 0
        assert conv.stats.delta_requests == conv.stats.requests - 1 > 0


def test_full_mode_gets_the_same_rows_with_more_bytes(engine):
    client = EngineClient(engine.url)
    results = {}
    for mode in ("full", "delta"):
        conv = ReplayConversation(client, mode=mode)
        tokens = converse(conv, random.Random(3), turns=4)
        results[mode] = (tokens, conv.routed_experts(len(tokens)), conv.stats.route_bytes)
    assert results["full"][0] == results["delta"][0]          # seeded sampling: same conversation
    np.testing.assert_array_equal(results["full"][1], results["delta"][1])
    assert results["full"][2] > results["delta"][2]


def test_changed_prefix_falls_back_and_is_counted(engine):
    client = EngineClient(engine.url)
    conv = ReplayConversation(client, mode="delta")
    tokens = converse(conv, random.Random(11), turns=2)
    tokens[3] = (tokens[3] + 1) % 250 or 17                     # history edited by the client
    tokens = converse(conv, random.Random(12), turns=2, tokens=tokens)
    assert conv.stats.fallbacks["prefix_mismatch"] == 1
    full, _ = full_export(client, tokens)
    np.testing.assert_array_equal(conv.routed_experts(len(tokens))[:-1], full)


def test_weight_update_mid_conversation_refreshes(engine, weights):
    client = EngineClient(engine.url)
    conv = ReplayConversation(client, mode="delta")
    try:
        tokens = converse(conv, random.Random(5), turns=2)
        assert conv.cache.version_runs() == [[0, 0]]
        r = requests.post(engine.url + "/update_weights_from_disk",
                          json={"model_path": str(weights / "v_1"), "weight_version": "1"}, timeout=60)
        assert r.json()["success"], r.text
        tokens = converse(conv, random.Random(6), turns=1, tokens=tokens)
        assert conv.stats.fallbacks["version_change"] == 1
        assert conv.cache.version_runs()[0] == [0, 0] and conv.cache.version_runs()[-1][1] == 1
        tokens = converse(conv, random.Random(7), turns=1, tokens=tokens)   # the refresh
        assert conv.cache.version_runs() == [[0, 1]]
        full, res = full_export(client, tokens)
        assert res.weight_version == "1"
        np.testing.assert_array_equal(conv.routed_experts(len(tokens))[:-1], full)
    finally:
        requests.post(engine.url + "/update_weights_from_disk",
                      json={"model_path": str(weights / "v_0"), "weight_version": "0"}, timeout=60)


class FaultProxy(ThreadingHTTPServer):
    """Forwards to the engine; ``faults`` is a list of 'drop' / 'cut_row' / None per request."""

    daemon_threads = True

    def __init__(self, target, faults):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.target, self.faults, self.seen = target, list(faults), 0


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        with urllib.request.urlopen(self.server.target + self.path, timeout=60) as r:
            self._reply(r.read())

    def _reply(self, out: bytes):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        fault = self.server.faults.pop(0) if self.server.faults else None
        self.server.seen += 1
        if fault == "drop":                       # the response never arrives
            self.close_connection = True
            self.connection.shutdown(2)
            return
        req = urllib.request.Request(self.server.target + self.path, data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            payload = json.loads(r.read())
        if fault == "cut_row":                    # a payload one row short
            raw = base64.b64decode(payload["meta_info"]["routed_experts"])
            payload["meta_info"]["routed_experts"] = base64.b64encode(raw[:-LAYERS * TOPK * 4]).decode()
        self._reply(json.dumps(payload).encode())


@pytest.mark.parametrize("fault, reason", [("drop", "dropped"), ("cut_row", "row_mismatch")])
def test_dropped_or_short_response_is_retried_with_a_full_export(engine, fault, reason):
    proxy = FaultProxy(engine.url, [None, fault])
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        client = EngineClient(f"http://127.0.0.1:{proxy.server_address[1]}")
        conv = ReplayConversation(client, mode="delta", backoff_s=0.0)
        try:
            tokens = converse(conv, random.Random(21), turns=3)
        except Exception as e:  # a client that checks the row count itself raises on cut_row
            pytest.fail(f"the fallback did not absorb the fault: {type(e).__name__}: {e}")
        assert conv.stats.fallbacks[reason] == 1 and conv.retries == 1
        assert proxy.seen == 4
        full, _ = full_export(EngineClient(engine.url), tokens)
        np.testing.assert_array_equal(conv.routed_experts(len(tokens))[:-1], full)
    finally:
        proxy.shutdown()
        proxy.server_close()
