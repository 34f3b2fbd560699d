"""Episodes against an OpenAI-style chat endpoint (``POST {url}/v1/chat/completions``).

For evaluation only: a chat API returns text, not token ids, logprobs or routes, so these
episodes have no token books.  The same environment, parser and limits as the token-level
loop apply; tool results go back as ``user`` messages (``<|tool|>``-less APIs differ on the
``tool`` role without native tool calls).  Native OpenAI ``tool_calls`` in a response are
also accepted.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import requests

from neon_hpc.replay import is_transient
from neon_hpc.rollout.agent.parse import Answer, Malformed, ToolCall, parse_action, too_long

FORMAT_HINT = ("Call a tool as <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call> (one per "
               "message) and give the final answer as <answer>...</answer>.")


class ChatClient:
    """Minimal OpenAI-compatible chat client with retries on transient HTTP errors."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 120.0,
                 retries: int = 3, backoff_s: float = 0.5):
        self.url = base_url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.model, self.timeout_s, self.retries, self.backoff_s = model, timeout_s, retries, backoff_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = requests.Session()

    def complete(self, messages: list[dict], max_tokens: int, temperature: float) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature, "stop": ["</tool_call>", "</answer>"]}
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                r = self.session.post(f"{self.url}/chat/completions", json=body, timeout=self.timeout_s,
                                      headers=self.headers)
                r.raise_for_status()
                return r.json()
            except Exception as e:  # noqa: BLE001 - classified by is_transient
                if not is_transient(e):
                    raise
                last = e
        raise RuntimeError(f"{self.url}/chat/completions failed after {self.retries + 1} attempts: {last}")


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

    def _ask(self) -> tuple[str, list]:
        resp = self.client.complete(self.messages, self.cfg.max_new_tokens, self.cfg.temperature)
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
        self.messages.append({"role": "assistant", "content": text})
        return text, msg.get("tool_calls") or []

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
        self.messages.append({"role": "user", "content": "Tool result: " + self.env.format_result(result)})
        return False
