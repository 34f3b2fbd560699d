"""Tool calls and their results are bounded, whatever the model (or an attacker) writes.

A 10 MB unknown tool name or a million-key argument object must come back as a short error
with an explicit truncation marker, not whole into the model's context; a tool call is
refused by size before it is parsed; hostile calls never raise and never open a file
outside the paths the tools own.
"""

from __future__ import annotations

import json
import sys

import pytest

from neon_hpc.envs.xrd.env import XRDEnv
from neon_hpc.envs.xrd.science.tasks import build_record_db, load_tasks, make_context
from neon_hpc.envs.xrd.science.tools import MAX_ARGUMENTS, call_tool
from neon_hpc.rollout.agent.chat import ChatEpisode
from neon_hpc.rollout.agent.parse import MAX_TOOL_CALL_CHARS, Malformed, ToolCall, parse_action, parse_tool_call
from neon_hpc.util.bounded import MESSAGE_CAP, clip_text, short_repr

BIG_NAME = "x" * (10 << 20)
MILLION = {f"k{i}": i for i in range(1_000_000)}


@pytest.fixture(scope="module")
def task():
    return load_tasks("tiny", "train", n=1)[0]


@pytest.fixture(scope="module")
def ctx(task):
    return make_context(task, build_record_db([task], include_real=False))


def test_clip_text_marks_and_bounds():
    out = clip_text("a" * 10_000, 100)
    assert len(out) <= 100 and out.endswith("chars]") and "truncated" in out
    n = int(out.split("truncated ")[1].split(" ")[0])
    assert n + out.index("...") == 10_000          # the marker counts exactly what was cut
    assert clip_text("short", 100) == "short"
    assert len(short_repr("y" * 10**7)) < 250 and "truncated 99" in short_repr("y" * 10**7)
    assert short_repr(MILLION) == "<dict of 1000000 items>"


def test_unknown_10mb_tool_name_comes_back_small(ctx):
    out = call_tool(BIG_NAME, {}, ctx)
    assert len(json.dumps(out)) < MESSAGE_CAP and "unknown tool" in out["error"] and "truncated" in out["error"]


def test_million_unknown_keys_come_back_small(ctx):
    out = call_tool("get_pattern", MILLION, ctx)
    assert len(json.dumps(out)) < 500 and f"at most {MAX_ARGUMENTS}" in out["error"]


def test_unknown_keys_are_listed_bounded(ctx):
    args = {("z" * 500) + str(i): 1 for i in range(20)}     # under the size cap: validated, listed bounded
    out = call_tool("get_pattern", args, ctx)
    assert len(json.dumps(out)) < 1200 and "and 12 more" in out["error"] and "truncated" in out["error"]


def test_huge_argument_value_refused_before_validation(ctx):
    out = call_tool("simulate_phase", {"phase": "N" * (5 << 20)}, ctx)
    assert len(json.dumps(out)) < 500 and "characters" in out["error"]


def test_tool_call_refused_by_size_before_parsing():
    text = "<tool_call>" + json.dumps({"name": "get_pattern", "arguments": MILLION}) + "</tool_call>"
    assert len(text) > 8_000_000
    act = parse_action(text)
    assert isinstance(act, Malformed) and str(MAX_TOOL_CALL_CHARS) in act.reason and len(act.reason) < 300
    compact = parse_tool_call(BIG_NAME + " a=1")
    assert isinstance(compact, Malformed) and len(compact.reason) < 300
    ok = parse_tool_call('{"name": "get_pattern", "arguments": {"max_points": 10}}')
    assert isinstance(ok, ToolCall) and ok.arguments == {"max_points": 10}


def test_native_chat_tool_arguments_capped_before_parsing(task):
    """OpenAI-style native tool calls: a million-key arguments string is refused by size."""
    ep = ChatEpisode.__new__(ChatEpisode)          # only the acting step is exercised
    ep.env = XRDEnv(task, tools="full", style="full", max_tool_chars=2000)
    ep.messages, ep.counts = [], {"tool_calls": 0, "tool_errors": 0, "malformed_calls": 0, "no_action_turns": 0}
    native = [{"function": {"name": "get_pattern", "arguments": json.dumps(MILLION)}}]
    assert ep._act("", native) is False
    assert ep.counts["malformed_calls"] == 1 and ep.counts["tool_calls"] == 0
    reply = ep.messages[-1]["content"]
    assert "over the" in reply and str(MAX_TOOL_CALL_CHARS) in reply and len(reply) < 500


def test_env_tool_results_fit_the_context_with_a_marker(task):
    env = XRDEnv(task, tools="full", style="full", max_tool_chars=300)
    res = env.run_tool(ToolCall(BIG_NAME, {}))
    text = env.format_result(res)
    assert len(text) <= 300
    big = env.format_result({"peaks": list(range(10_000))})
    assert len(big) <= 300 and "truncated" in big


HOSTILE = [
    ("simulate_phase", {"phase": "../../../../etc/passwd"}),
    ("simulate_phase", {"phase": "/etc/shadow"}),
    ("search_phases", {"formula": "../" * 50}),
    ("search_history", {"query": "/proc/self/environ"}),
    ("fit_phases", {"phases": ["/etc/passwd", "..\\..\\boot.ini"]}),
    ("get_pattern", {"two_theta_min": float("nan")}),
    ("get_pattern", {"max_points": 10**100}),
    ("find_peaks", {"max_peaks": -(2**70)}),
    ("plot_fit", {"path": "/tmp/../etc/x.png"}),
    ("compare_hypotheses", {"a": [{"$ne": 1}], "b": None}),
    ("\x00", {}),
    ("get_pattern", {"": {"": {"": [[[[[]]]]]}}}),
]


def test_hostile_calls_never_raise_nor_open_files_outside(ctx):
    opened = []

    def hook(event, args):
        if event == "open" and recording[0]:
            opened.append(str(args[0]))

    recording = [False]
    sys.addaudithook(hook)     # audit hooks cannot be removed; this one records only while armed
    recording[0] = True
    try:
        outs = [call_tool(name, args, ctx) for name, args in HOSTILE]
    finally:
        recording[0] = False
    for out in outs:
        assert isinstance(out, dict) and len(json.dumps(out, default=str)) < 20_000
    bad = [p for p in opened if any(s in p for s in ("passwd", "shadow", "environ", "boot.ini", "/etc/"))]
    assert not bad, bad


def test_log_lines_quoting_input_are_capped(tmp_path):
    from neon_hpc.util.bounded import LOG_LINE_CAP
    from neon_hpc.util.logs import RoleLogger
    log = RoleLogger.open(tmp_path, "rollout", 0, echo=False)
    try:
        log.info("engine said: %s", "e" * (10 << 20))
        log.info("short line %d", 7)
    finally:
        log.close()
    lines = (tmp_path / "logs" / "rollout" / "0.log").read_text().splitlines()
    assert len(lines) == 2 and len(lines[0]) < LOG_LINE_CAP + 200 and "truncated" in lines[0]
    assert lines[1].endswith("short line 7")
