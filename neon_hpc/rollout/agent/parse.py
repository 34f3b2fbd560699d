"""What did the model say: a tool call, an answer, something malformed, or nothing.

Two tool-call spellings are read, so that both real models and the tiny one can act:

- JSON (Hermes/Qwen style): ``<tool_call>{"name": "fit_phases", "arguments": {...}}</tool_call>``
- compact: ``<tool_call>search_phases Ti O limit=3</tool_call>``: the tool name, then bare
  words (positional, bound later to the tool's required parameters in order) and
  ``key=value`` pairs (values parsed as JSON when they parse, else kept as strings).

An answer is the text after ``<answer>`` up to ``</answer>`` (or the end of the output).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from neon_hpc.rollout.agent.template import TAGS
from neon_hpc.util.bounded import short_repr

# a tool call longer than this is refused before it is parsed: a model (or an attacker
# writing into its context) must not make the agent walk a 10 MB JSON object
MAX_TOOL_CALL_CHARS = 16384


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    positional: list = field(default_factory=list)


@dataclass
class Answer:
    text: str


@dataclass
class Malformed:
    reason: str


@dataclass
class Nothing:
    text: str


Action = ToolCall | Answer | Malformed | Nothing


def parse_action(text: str) -> Action:
    """The first action in one model output (an answer wins over a later tool call)."""
    a = text.find(TAGS.answer)
    c = text.find(TAGS.tool_call)
    if a >= 0 and (c < 0 or a < c):
        body = text[a + len(TAGS.answer):]
        end = body.find(TAGS.answer_end)
        return Answer(body if end < 0 else body[:end])
    if c >= 0:
        body = text[c + len(TAGS.tool_call):]
        end = body.find(TAGS.tool_call_end)
        if end < 0:
            return Malformed(f"tool call not closed with {TAGS.tool_call_end}")
        return parse_tool_call(body[:end])
    return Nothing(text)


def too_long(what: str, text: str) -> Malformed | None:
    """A Malformed for a tool call (or its arguments) over :data:`MAX_TOOL_CALL_CHARS`."""
    if len(text) > MAX_TOOL_CALL_CHARS:
        return Malformed(f"{what} of {len(text)} characters is over the {MAX_TOOL_CALL_CHARS}-character "
                         f"limit; send a shorter call")
    return None


def parse_tool_call(body: str) -> ToolCall | Malformed:
    long = too_long("tool call", body)
    if long:
        return long
    body = body.strip()
    if not body:
        return Malformed("empty tool call; write <tool_call>NAME key=value ...</tool_call>")
    if body.startswith("{"):
        return _parse_json_call(body)
    return _parse_compact_call(body)


def _parse_json_call(body: str) -> ToolCall | Malformed:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return Malformed(f"tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Malformed('tool call JSON needs {"name": str, "arguments": {...}}')
    args = obj.get("arguments", obj.get("args", {}))
    if isinstance(args, str):  # some models double-encode
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return Malformed("tool call arguments are a string that is not JSON")
    if not isinstance(args, dict):
        return Malformed("tool call arguments must be a JSON object")
    return ToolCall(obj["name"], args)


def _parse_compact_call(body: str) -> ToolCall | Malformed:
    words = body.split()
    name, args, positional = words[0], {}, []
    if not name.replace("_", "").isalnum():
        return Malformed(f"tool name {short_repr(name, 80)} is not a word")
    for w in words[1:]:
        if "=" in w:
            k, v = w.split("=", 1)
            if not k:
                return Malformed(f"argument {short_repr(w, 80)} has no name before '='")
            args[k] = _scalar(v)
        else:
            positional.append(_scalar(w))
    return ToolCall(name, args, positional)


def _scalar(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v
