"""Chat episodes through the official openai client against a local OpenAI-compatible server.

The server (real HTTP, started here) answers ``/v1/chat/completions`` like OpenAI: a transient
503 first, then native ``tool_calls``, then an answer.  The ``openai`` package is the client under
test (its timeout, auth headers and errors, retried by ``neon_hpc.util.httpretry``); the episode runs
the real XRD tools.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from neon_hpc.config.rollout import RolloutConfig
from neon_hpc.envs.xrd.env import XRDEnv
from neon_hpc.envs.xrd.science.tasks import load_tasks
from neon_hpc.rollout.agent.chat import STOP, ChatClient, ChatEpisode, ChatError

CFG = RolloutConfig(max_turns=3, max_new_tokens=200, max_total_tokens=20000, temperature=0.0)
ANSWER = "NiO 100"


def completion(body, message, finish="stop"):
    return 200, {"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()),
                 "model": body["model"], "choices": [{"index": 0, "message": {"role": "assistant", **message},
                                                       "finish_reason": finish, "logprobs": None}],
                 "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107}}


def error(status, message):
    return lambda body: (status, {"error": {"message": message, "type": "server_error", "code": None}})


def native_calls(body):
    return completion(body, {"content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "find_peaks", "arguments": '{"max_peaks": 5}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_pattern", "arguments": "{}"}}]},
        finish="tool_calls")


def answer(body):
    return completion(body, {"content": f"<answer>{ANSWER}"})        # the stop string is trimmed


def text_call(body):
    return completion(body, {"content": '<tool_call>{"name": "find_peaks", "arguments": {"max_peaks": 3}}'})


def slow(seconds, then):
    def step(body):
        time.sleep(seconds)
        return then(body)
    return step


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, script):
        super().__init__(("127.0.0.1", 0), Handler)
        self.script, self.seen = list(script), []


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = len(self.server.seen)
        self.server.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        status, obj = self.server.script[min(n, len(self.server.script) - 1)](body)
        out = json.dumps(obj).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
        except (BrokenPipeError, ConnectionResetError):    # the client gave up on a slow answer
            pass


@pytest.fixture
def serve():
    servers = []

    def make(*script):
        srv = Server(script)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"
    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.fixture(scope="module")
def env():
    return XRDEnv(load_tasks("tiny", "train", n=1)[0], tools="full", style="full")


def test_native_tool_calls_after_a_transient_503(serve, env, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")     # must not travel to the endpoint
    srv, url = serve(error(503, "engine warming up"), native_calls, answer)
    ep = ChatEpisode(ChatClient(url, "xrd-model", retries=2, timeout_s=30), env, CFG).run()

    assert ep.finish == "answer" and ep.answer_text == ANSWER
    assert ep.counts == {"tool_calls": 1, "tool_errors": 0, "malformed_calls": 0, "no_action_turns": 0}
    assert ep.tokens == 107 and ep.gen_tokens == 14
    assert len(srv.seen) == 3                                  # the 503 was retried by the client
    (p1, h1, b1), (p2, _, b2), (_, _, b3) = srv.seen
    assert p1 == "/v1/chat/completions" and b1 == b2             # the same request again
    assert h1["user-agent"].startswith("OpenAI/Python") and "authorization" not in h1
    assert b1["model"] == "xrd-model" and b1["stop"] == STOP and b1["max_tokens"] == 200
    assert [t["function"]["name"] for t in b1["tools"]] == list(env.tools)
    assert all(t["type"] == "function" and t["function"]["parameters"] == env.tools[t["function"]["name"]].parameters
               for t in b1["tools"])
    # the next request carries the assistant's tool calls and one tool message per call id
    asst, first, second = b3["messages"][2:5]
    assert asst["role"] == "assistant" and [c["id"] for c in asst["tool_calls"]] == ["call_1", "call_2"]
    assert first["role"] == "tool" and first["tool_call_id"] == "call_1"
    assert json.loads(first["content"])["peaks"]                   # the real find_peaks ran
    assert second["tool_call_id"] == "call_2" and "not run: one tool call per turn" in second["content"]
    assert len(b3["messages"]) == 5


def test_text_protocol_is_the_fallback(serve, env):
    srv, url = serve(text_call, answer)
    ep = ChatEpisode(ChatClient(url, "m", api_key="sk-local"), env, CFG).run()
    assert ep.finish == "answer" and ep.counts["tool_calls"] == 1 and ep.counts["tool_errors"] == 0
    _, headers, last = srv.seen[-1]
    assert headers["authorization"] == "Bearer sk-local"
    asst, result = last["messages"][2:4]
    assert asst == {"role": "assistant", "content": '<tool_call>{"name": "find_peaks", "arguments": '
                                                     '{"max_peaks": 3}}</tool_call>'}
    assert result["role"] == "user" and result["content"].startswith("Tool result: ")
    assert not any(m["role"] == "tool" for m in last["messages"])


def test_native_tools_off_sends_no_tools(serve, env):
    srv, url = serve(answer)
    ChatEpisode(ChatClient(url, "m", native_tools=False), env, CFG).run()
    assert "tools" not in srv.seen[0][2]


def test_timeout_is_retried_then_succeeds(serve):
    srv, url = serve(slow(3.0, answer), answer)
    resp = ChatClient(url, "m", timeout_s=0.5, retries=1).complete([{"role": "user", "content": "hi"}], 8, 0.0)
    assert resp["choices"][0]["message"]["content"] == f"<answer>{ANSWER}" and len(srv.seen) == 2


def test_failures_are_reported_with_the_endpoint(serve):
    srv, url = serve(error(400, "max_tokens too large"))
    with pytest.raises(ChatError, match=r"/v1/chat/completions failed \(not retryable\): BadRequestError"):
        ChatClient(url, "m", retries=3).complete([{"role": "user", "content": "hi"}], 8, 0.0)
    assert len(srv.seen) == 1                                      # a 400 is not retried
    srv, url = serve(error(503, "x" * 100_000))
    with pytest.raises(ChatError, match=r"transient, gave up after 2 attempts\): InternalServerError") as info:
        ChatClient(url, "m", retries=1).complete([{"role": "user", "content": "hi"}], 8, 0.0)
    assert len(srv.seen) == 2 and len(str(info.value)) <= 2000 and "truncated" in str(info.value)
