"""The embedded engine under hostile requests: each bad request fails alone with a 4xx.

One real engine process (the CLI, as an operator starts it: no --allowed-root) on the tiny
model, whose context is 2,048 tokens.  Valid requests are sent in the same burst as each bad
one and must all succeed; raw sockets send what no HTTP client library would (a negative or
non-numeric Content-Length, an oversized body, a body cut short, stalled connections).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from neon_hpc.config.model import ModelConfig
from neon_hpc.models import hf
from neon_hpc.util.bounded import MESSAGE_CAP

pytestmark = pytest.mark.slow   # one engine process for the module (~40 s to start on 2 shared cores)

CONTEXT = ModelConfig().max_position_embeddings
BUDGET_S = 2.0


def _save_model(path: Path, seed: int) -> None:
    cfg = ModelConfig()
    model = hf.build_hf_model(cfg, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    hf.save_hf(model, cfg, path)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    _save_model(root / "weights" / "v_0", 11)
    _save_model(root / "weights" / "v_1", 22)
    _save_model(root / "elsewhere" / "v_9", 33)
    return root


@pytest.fixture(scope="module")
def engine(weights):
    """The CLI engine, started the way an operator would (no --allowed-root)."""
    cmd = [sys.executable, "-m", "neon_hpc.rollout.engines.embedded", "--model", str(weights / "weights" / "v_0"),
           "--max-batch-size", "8", "--request-time-budget-s", str(BUDGET_S)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("LISTENING "), line
    url = line.split()[1]
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    host, port = url.removeprefix("http://").split(":")
    yield url, (host, int(port))
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def post(url: str, path: str, body, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, {"_raw_len": len(raw), **json.loads(raw or b"{}")}


def valid(i: int) -> dict:
    return {"input_ids": [1 + i, 2, 3, 4], "sampling_params": {"max_new_tokens": 6, "temperature": 1.0,
                                                               "sampling_seed": i}}


def healthy(url: str) -> bool:
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return r.status == 200


BAD = {
    "temperature NaN": b'{"input_ids": [1, 2, 3], "sampling_params": {"temperature": NaN}}',
    "temperature 1e400": b'{"input_ids": [1, 2, 3], "sampling_params": {"temperature": 1e400}}',
    "top_p -Infinity": b'{"input_ids": [1, 2, 3], "sampling_params": {"top_p": -Infinity}}',
    "sampling_seed 2**64": {"input_ids": [1, 2, 3], "sampling_params": {"sampling_seed": 2**64}},
    "sampling_seed -1": {"input_ids": [1, 2, 3], "sampling_params": {"sampling_seed": -1}},
    "max_new_tokens 10**9 ignore_eos": {"input_ids": [1, 2, 3],
                                        "sampling_params": {"max_new_tokens": 10**9, "ignore_eos": True}},
    "prompt 4096 tokens": {"input_ids": [5] * 4096, "sampling_params": {"max_new_tokens": 1}},
    "prompt 30000 tokens": {"input_ids": [5] * 30000, "sampling_params": {"max_new_tokens": 1}},
    "prompt + generation over context": {"input_ids": [5] * (CONTEXT - 10), "sampling_params": {"max_new_tokens": 20}},
    "token id 10**400": b'{"input_ids": [1, 1' + b"0" * 400 + b"]}",
    "body is a list": [],
    "body is null": b"null",
    "nested 100k deep": b"[" * 100_000 + b"]" * 100_000,
    "not UTF-8": b'{"input_ids": [1], "rid": "\xff\xfe"}',
    "empty sequence in a batch": {"input_ids": [[1, 2], []]},
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_request_fails_alone_while_its_batch_succeeds(engine, name):
    url, _ = engine
    with cf.ThreadPoolExecutor(7) as ex:
        good = [ex.submit(post, url, "/generate", valid(i)) for i in range(6)]
        bad = ex.submit(post, url, "/generate", BAD[name])
        status, body = bad.result()
        results = [f.result() for f in good]
    assert 400 <= status < 500, (name, status, body)
    assert body["error"]["message"], body
    for st, res in results:
        assert st == 200 and len(res["output_ids"]) == 6, (st, res)


def test_generation_within_the_context_is_served(engine):
    url, _ = engine
    st, res = post(url, "/generate", {"input_ids": [5] * (CONTEXT - 4), "sampling_params": {"max_new_tokens": 4}})
    assert st == 200 and res["meta_info"]["completion_tokens"] <= 4


def test_time_budget_ends_a_long_request_and_others_are_answered(engine):
    """max_new_tokens up to the context with ignore_eos: the budget ends it (abort, named),
    and the requests behind it are answered."""
    url, _ = engine
    long_req = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": CONTEXT - 3, "ignore_eos": True}}
    with cf.ThreadPoolExecutor(4) as ex:
        long_f = ex.submit(post, url, "/generate", long_req)
        time.sleep(0.3)
        others = [ex.submit(post, url, "/generate", valid(i)) for i in range(3)]
        st, res = long_f.result()
        done = [f.result() for f in others]
    assert st == 200, res
    fin = res["meta_info"]["finish_reason"]
    if fin["type"] == "length":   # a machine fast enough to generate the whole context in the budget
        pytest.skip(f"generated {CONTEXT - 3} tokens within {BUDGET_S}s; the budget was not reached")
    assert fin["type"] == "abort" and "time budget" in fin["message"], fin
    assert 0 < res["meta_info"]["completion_tokens"] < CONTEXT - 3
    for st2, r in done:
        assert st2 == 200 and len(r["output_ids"]) == 6


def _raw(addr, head: bytes, body: bytes = b"", read_first: bool = True) -> tuple[int, bytes]:
    """Send a raw request; returns (status, response body). Reads the answer before sending the body
    when ``read_first`` (a server that refuses without reading must answer at once)."""
    s = socket.create_connection(addr, timeout=60)
    try:
        s.sendall(head)
        if body and not read_first:
            s.sendall(body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head_txt, _, rest = data.partition(b"\r\n\r\n")
        status = int(head_txt.split()[1])
        length = next((int(ln.split(b":")[1]) for ln in head_txt.split(b"\r\n")
                       if ln.lower().startswith(b"content-length")), 0)
        while len(rest) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        if body and read_first:
            try:
                s.sendall(body)
            except OSError:
                pass   # the server closed the connection: it did not read the body
        return status, rest
    finally:
        s.close()


def _head(length: str, extra: str = "") -> bytes:
    return (f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


@pytest.mark.parametrize("length,status", [("-1", 400), ("abc", 400), ("1e3", 400), (str(80 << 20), 413)])
def test_content_length_is_checked_before_the_body_is_read(engine, length, status):
    """Refused at once, before any of an 80 MB body is read (the answer comes before it is sent)."""
    url, addr = engine
    body = b"x" * (80 << 20) if length in ("-1", str(80 << 20)) else b'{"input_ids": [1]}'
    got, resp = _raw(addr, _head(length), body)
    assert got == status, resp[:500]
    assert len(resp) < MESSAGE_CAP + 200
    assert healthy(url)


def test_chunked_and_duplicate_lengths_are_refused(engine):
    url, addr = engine
    st, _ = _raw(addr, b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
                 b"5\r\nhello\r\n0\r\n\r\n")
    assert st == 411
    st, _ = _raw(addr, _head("2", "Content-Length: 3\r\n"), b"{}")
    assert st == 400
    assert healthy(url)


def test_a_body_cut_short_is_refused_and_the_server_serves(engine):
    url, addr = engine
    s = socket.create_connection(addr, timeout=60)
    s.sendall(_head("1000") + b'{"input_ids": [1')
    s.shutdown(socket.SHUT_WR)
    data = s.recv(65536)
    s.close()
    assert data == b"" or b" 400 " in data.split(b"\r\n")[0]
    assert healthy(url)


def test_huge_unknown_field_comes_back_small(engine):
    url, _ = engine
    st, body = post(url, "/generate", {"input_ids": [1], "x" * (10 << 20): 1})
    assert st == 400 and body["_raw_len"] < MESSAGE_CAP + 200, body["_raw_len"]
    assert "truncated" in body["error"]["message"]


def test_junk_concurrency_and_stalled_connections_leave_it_serving(engine):
    """What held under the chaos run, kept: 50 concurrent requests, junk bodies of 50 MB and
    200 stalled connections; the engine keeps answering."""
    url, addr = engine
    stalled = []
    try:
        for _ in range(200):
            s = socket.create_connection(addr, timeout=60)
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le")   # and then nothing
            stalled.append(s)
        junk = os.urandom(50 << 20)
        with cf.ThreadPoolExecutor(16) as ex:
            junk_f = [ex.submit(post, url, "/generate", junk) for _ in range(2)]
            many = [ex.submit(post, url, "/generate", valid(i)) for i in range(50)]
            assert all(f.result()[0] == 400 for f in junk_f)
            assert all(f.result()[0] == 200 for f in many)
        assert healthy(url)
    finally:
        for s in stalled:
            s.close()


def test_cli_defaults_allowed_root_to_its_weights_directory(engine, weights):
    url, _ = engine
    st, body = post(url, "/update_weights_from_disk", {"model_path": str(weights / "elsewhere" / "v_9")})
    assert st == 400 and body["success"] is False, body
    st, body = post(url, "/update_weights_from_disk",
                    {"model_path": str(weights / "weights" / "v_0" / ".." / ".." / "elsewhere" / "v_9")})
    assert st == 400 and body["success"] is False, body
    st, body = post(url, "/update_weights_from_disk", {"model_path": str(weights / "weights" / "v_1"),
                                                       "weight_version": "1"})
    assert st == 200 and body["success"] is True, body


def test_client_quotes_a_huge_server_error_bounded():
    """An upstream server (SGLang) that echoes a huge input in its error: the client's
    EngineError message stays small, marked as cut."""
    from neon_hpc.rollout.engines.client import _error_message
    msg = _error_message(json.dumps({"error": {"message": "bad: " + "q" * (5 << 20)}}).encode())
    assert len(msg) <= MESSAGE_CAP and "truncated" in msg and msg.startswith("bad: q")
