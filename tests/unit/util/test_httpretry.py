"""One error taxonomy and one retry policy (neon_hpc.util.httpretry) for the engine client, replay and chat.

The errors classified are the real ones the clients raise: the engine client against a closed
port and a server answering 503/400, and the openai client against a closed port.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from neon_hpc import replay
from neon_hpc.rollout.agent import chat
from neon_hpc.rollout.engines.client import EngineClient, EngineError
from neon_hpc.util.httpretry import RetryPolicy, is_transient, retryable_status


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Status(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.hits += 1
        status = self.server.statuses[min(self.server.hits - 1, len(self.server.statuses) - 1)]
        out = json.dumps({"error": {"message": f"status {status}"}}).encode()
        self.send_response(status)
        if status == 503:
            self.send_header("Retry-After", "0")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def status_server():
    servers = []

    def make(*statuses):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), Status)
        srv.daemon_threads, srv.statuses, srv.hits = True, statuses, 0
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"
    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


def test_one_taxonomy_for_every_client(status_server):
    assert replay.is_transient is is_transient is chat.is_transient     # written once, imported
    assert [s for s in (400, 404, 408, 409, 422, 429, 500, 501, 502, 503, 504, 505) if retryable_status(s)] == \
        [408, 429, 500, 502, 503, 504]
    engine = EngineClient(f"http://127.0.0.1:{closed_port()}", timeout=5)
    with pytest.raises(ConnectionError) as refused:
        engine.model_info()
    assert is_transient(refused.value)
    srv, url = status_server(503, 400)
    errs = []
    for _ in range(2):
        with pytest.raises(EngineError) as info:
            EngineClient(url, timeout=5).generate([1, 2], {"max_new_tokens": 1})
        errs.append(info.value)
    assert [(e.status, e.transient, is_transient(e)) for e in errs] == [(503, True, True), (400, False, False)]
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{closed_port()}/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.APIConnectionError) as conn:
        oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert is_transient(conn.value)


def test_policy_backs_off_exponentially_and_stops_on_permanent_errors():
    waits, calls = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise TimeoutError("slow")
        return "ok"

    assert RetryPolicy(retries=3, backoff_s=0.5, max_backoff_s=1.5).call(flaky, sleep=waits.append) == "ok"
    assert waits == [0.5, 1.0, 1.5] and len(calls) == 4
    calls.clear()
    with pytest.raises(TimeoutError):
        RetryPolicy(retries=1).call(flaky, sleep=waits.append)
    assert len(calls) == 2                                    # retries spent: the last error, as it came
    with pytest.raises(EngineError):
        RetryPolicy(retries=5).call(lambda: calls.append(2) or (_ for _ in ()).throw(EngineError(400, "bad")),
                                    sleep=waits.append)
    assert calls.count(2) == 1                                # a 4xx is never retried
    with pytest.raises(ValueError, match="retries"):
        RetryPolicy(retries=-1)


def test_retry_after_is_honoured_up_to_the_cap(status_server):
    srv, url = status_server(503)
    with pytest.raises(EngineError) as info:
        EngineClient(url, timeout=5).generate([1], {"max_new_tokens": 1})
    oa = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.InternalServerError) as busy:
        oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    p = RetryPolicy(retries=2, backoff_s=3.0, max_backoff_s=8.0)
    assert p.delay(1, busy.value) == 0.0                      # the server's Retry-After: 0
    assert p.delay(2, info.value) == 6.0                      # no response headers kept: our backoff
    assert srv.hits == 2


class KeepAlive(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.server.peers.append(self.client_address)        # one entry per request: which socket
        out = json.dumps({"model_path": "m", "moe_router_topk": 2}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def test_engine_clients_share_pooled_connections():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    srv.daemon_threads, srv.peers = True, []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        for _ in range(3):
            assert EngineClient(url, timeout=5).model_info()["moe_router_topk"] == 2   # a fresh client each time
        one = EngineClient(url, timeout=5)
        for _ in range(3):
            one.model_info()
        assert len(srv.peers) == 6 and len(set(srv.peers)) == 1     # six requests, one TCP connection
    finally:
        srv.shutdown()
        srv.server_close()
