"""Episodes against an OpenAI-compatible chat endpoint (``POST {url}/v1/chat/completions``).

For evaluation only: a chat API returns text, not token ids, logprobs or routes, so these
episodes have no token books.  The same environment, parser and limits as the token-level
loop apply.  The client is the official ``openai`` package (its connection pool and timeout),
retried by the project's one policy (``neon_hpc.util.httpretry``).  The environment's tools go out as native
tools (``tools=``, their JSON schemas); a native call in ``message.tool_calls`` is answered with a ``tool``
message carrying its ``tool_call_id``.  A model that writes ``<tool_call>{...}</tool_call>`` in its text instead is
read as before (the text protocol is the fallback), and its results go back as ``user``
messages.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import openai

from neon_hpc.rollout.agent.parse import Answer, Malformed, ToolCall, parse_action, too_long
from neon_hpc.util.bounded import MESSAGE_CAP, clip_text
from neon_hpc.util.httpretry import RetryPolicy, is_transient

FORMAT_HINT = ("Call a tool as <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call> (one per "
               "message) and give the final answer as <answer>...</answer>.")
STOP = ["</tool_call>", "</answer>"]


class ChatError(RuntimeError):
    """A chat request that failed for good (retries spent, or not retryable)."""


class ChatClient:
    """OpenAI-compatible chat client: ``openai.OpenAI`` (pooled connections, ``timeout_s`` per
    attempt) retried by the project's one policy (:class:`neon_hpc.util.httpretry.RetryPolicy`:
    ``retries`` retries, exponential backoff from ``backoff_s``, Retry-After honoured) on the
    errors :func:`neon_hpc.util.httpretry.is_transient` calls transient (connection errors, timeouts,
    408, 429, 5xx but 501/505).  ``native_tools=False`` never sends ``tools=`` (for servers that
    refuse it); the text protocol then carries every call."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 120.0,
                 retries: int = 3, backoff_s: float = 0.5, native_tools: bool = True):
        self.url = base_url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.model, self.timeout_s, self.native_tools = model, timeout_s, native_tools
        self.policy = RetryPolicy(retries=retries, backoff_s=backoff_s)
        # no key: no Authorization header at all (a local server), and never OPENAI_API_KEY from the
        # environment, which must not travel to whatever endpoint was named (_enforce_credentials is the
        # client's own switch for that, a constructor argument of the pinned openai==3.51.0).
        # max_retries=0: the retries are the policy's, one taxonomy for every client of the project
        self.client = openai.OpenAI(base_url=self.url, api_key=api_key or "", timeout=timeout_s, max_retries=0,
                                    _enforce_credentials=False)
        self._headers = {} if api_key else {"Authorization": openai.omit}

    @property
    def retries(self) -> int:
        return self.policy.retries

    def complete(self, messages: list[dict], max_tokens: int, temperature: float,
                 tools: list[dict] | None = None) -> dict:
        """One chat completion as the JSON object the server sent (``choices``, ``usage``...)."""
        extra = {"tools": tools} if tools and self.native_tools else {}
        try:
            resp = self.policy.call(lambda: self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=max_tokens, temperature=temperature, stop=STOP,
                extra_headers=self._headers, **extra))
        except openai.APIError as e:
            how = f"transient, gave up after {self.policy.attempts} attempts" if is_transient(e) else "not retryable"
            raise ChatError(clip_text(f"{self.url}/chat/completions failed ({how}): {type(e).__name__}: {e}",
                                      MESSAGE_CAP)) from e
        return resp.to_dict()


@dataclass
class ChatEpisode:
    client: ChatClient
    env: Any
    cfg: Any
    messages: list = field(default_factory=list)
    answer_text: str | None = None
    finish: str = "max_turns"
    counts: dict = field(default_factory=lambda: {"tool_calls": 0, "tool_errors": 0, "malformed_calls": 0,
                                                  "no_action_turns": 0})
    tokens: int = 0
    gen_tokens: int = 0

    def run(self) -> "ChatEpisode":
        t0 = time.monotonic()
        self.messages = [{"role": "system", "content": self.env.system_text() + "\n" + FORMAT_HINT},
                         {"role": "user", "content": self.env.task_text()}]
        for turn in range(self.cfg.max_turns):
            if time.monotonic() - t0 > self.cfg.episode_timeout_s:
                self.finish = "timeout"
                break
            if turn == self.cfg.max_turns - 1:
                self.messages.append({"role": "user", "content": "Last turn: answer now with <answer>...</answer>."})
            text, native = self._ask()
            if self._act(text, native):
                break
        return self

    def _tool_schemas(self) -> list[dict] | None:
        """The environment's tools as OpenAI ``tools=`` entries (None when it has none)."""
        tools = getattr(self.env, "tools", None) or {}
        return [t.openai_schema() for t in tools.values() if hasattr(t, "openai_schema")] or None

    def _ask(self) -> tuple[str, list]:
        resp = self.client.complete(self.messages, self.cfg.max_new_tokens, self.cfg.temperature,
                                    tools=self._tool_schemas())
        usage = resp.get("usage") or {}
        self.tokens = int(usage.get("total_tokens", self.tokens))
        self.gen_tokens += int(usage.get("completion_tokens", 0))
        msg = (resp.get("choices") or [{}])[0].get("message") or {}
        text = msg.get("content") or ""
        finish = (resp.get("choices") or [{}])[0].get("finish_reason")
        if finish == "stop" and "<tool_call>" in text and "</tool_call>" not in text:
            text += "</tool_call>"     # the stop string is trimmed by OpenAI-style servers
        if finish == "stop" and "<answer>" in text and "</answer>" not in text:
            text += "</answer>"
        native = [c for c in msg.get("tool_calls") or [] if isinstance(c, dict)]
        turn = {"role": "assistant", "content": text}
        if native:
            turn["tool_calls"] = native     # the tool messages that follow answer these ids
        self.messages.append(turn)
        return text, native

    def _act(self, text: str, native: list) -> bool:
        if native:
            fn = native[0].get("function", {})
            raw_args = fn.get("arguments") or "{}"
            action = too_long("tool call arguments", raw_args) if isinstance(raw_args, str) else None
            if action is None:
                try:
                    action = ToolCall(fn.get("name", ""), json.loads(raw_args))
                except (json.JSONDecodeError, TypeError) as e:
                    action = Malformed(f"tool call arguments are not JSON ({getattr(e, 'msg', e)})")
        else:
            action = parse_action(text)
        if isinstance(action, Answer):
            self.answer_text, self.finish = action.text, "answer"
            return True
        if isinstance(action, ToolCall):
            self.counts["tool_calls"] += 1
            result = self.env.run_tool(action)
            if isinstance(result, dict) and "error" in result:
                self.counts["tool_errors"] += 1
        elif isinstance(action, Malformed):
            self.counts["malformed_calls"] += 1
            result = {"error": f"malformed tool call: {action.reason}"}
        else:
            self.counts["no_action_turns"] += 1
            result = {"error": "no tool call and no answer. " + FORMAT_HINT}
        if not native:
            self.messages.append({"role": "user", "content": "Tool result: " + self.env.format_result(result)})
            return False
        # every native call gets its tool message (an API refuses a conversation that leaves one unanswered)
        self.messages.append({"role": "tool", "tool_call_id": native[0].get("id", ""),
                              "content": self.env.format_result(result)})
        for extra in native[1:]:
            self.messages.append({"role": "tool", "tool_call_id": extra.get("id", ""),
                                  "content": self.env.format_result(
                                      {"error": "not run: one tool call per turn; call it again on its own"})})
        return False
