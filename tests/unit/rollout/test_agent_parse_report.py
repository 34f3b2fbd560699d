"""Parsing model outputs, and the evaluation report's arithmetic."""
import pytest

from neon_hpc.envs.xrd.report import markdown_table, summarize, wilson_interval
from neon_hpc.rollout.agent import Answer, Malformed, Nothing, ToolCall, parse_action


def test_json_and_compact_tool_calls():
    a = parse_action('thinking <tool_call>{"name": "fit_phases", "arguments": {"phases": ["a", "b"]}}</tool_call>')
    assert a == ToolCall("fit_phases", {"phases": ["a", "b"]})
    a = parse_action("<tool_call>search_phases Ti O limit=3</tool_call>")
    assert a == ToolCall("search_phases", {"limit": 3}, ["Ti", "O"])
    a = parse_action('<tool_call>{"name": "x", "arguments": "{\\"k\\": 1}"}</tool_call>')
    assert a == ToolCall("x", {"k": 1})


@pytest.mark.parametrize("text, reason", [
    ("<tool_call>{\"name\": </tool_call>", "not valid JSON"),
    ("<tool_call>search", "not closed"),
    ("<tool_call>  </tool_call>", "empty"),
    ('<tool_call>{"arguments": {}}</tool_call>', "needs"),
    ("<tool_call>a-b!</tool_call>", "not a word"),
    ("<tool_call>f =3</tool_call>", "no name"),
])
def test_malformed_calls_say_why(text, reason):
    a = parse_action(text)
    assert isinstance(a, Malformed) and reason in a.reason


def test_answers_and_nothing():
    assert parse_action("x <answer>TiO2 60, ZnO 40</answer> y") == Answer("TiO2 60, ZnO 40")
    assert parse_action("<answer>ZnO") == Answer("ZnO")
    assert parse_action("<answer>a</answer><tool_call>f</tool_call>") == Answer("a")
    assert isinstance(parse_action("hello"), Nothing)


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-3)
    lo, hi = wilson_interval(5, 10)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-3), pytest.approx(0.7634, abs=1e-3))
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_summary_and_markdown():
    recs = [{"success": 1, "dense": 1.0, "turns": 2, "tokens": 100, "phase_f1": 1.0, "weight_mae": 2.0},
            {"success": 0, "dense": 0.2, "turns": 4, "tokens": 300, "phase_f1": 0.5, "weight_mae": None,
             "error": "boom", "judge": 1}]
    s = summarize(recs)
    assert s["success_rate"] == 0.5 and s["tokens_per_solve"] == 400 and s["errors"] == 1
    assert s["weight_mae"] == 2.0 and s["phase_f1"] == 0.75 and s["judge_agreement"] == 0.0
    md = markdown_table({"test_id": s})
    assert "| test_id | 2 | 50.0% |" in md and "judge agreement" in md


def test_phase_answers_in_text_json_and_labels():
    from neon_hpc.envs.xrd.answer import parse_phase_answer as p
    assert p("TiO2 P4_2/mnm 60%, ZnO 40") == [("TiO2 P4_2/mnm", 60.0), ("ZnO", 40.0)]
    assert p("ZnO; NiO") == [("ZnO", 0.5), ("NiO", 0.5)]
    assert p("ZnO 0.7, NiO") == [("ZnO", 0.7), ("NiO", pytest.approx(0.3))]
    assert p('[["cur:TiO2_rutile", 0.6], ["ZnO", 0.4]]') == [("cur:TiO2_rutile", 0.6), ("ZnO", 0.4)]
    assert p('[{"phase": "ZnO", "fraction": "40%"}, {"name": "NiO", "wt": 60}]') == [("ZnO", 40.0), ("NiO", 60.0)]
    assert p('{"ZnO": 1}') == [("ZnO", 1.0)]
    assert p("xx B A", labels={"A": "cur:a", "B": "cur:b"}) == [("cur:b", 1.0)]
    assert p(None) == [] and p("") == [] and p("42") == []
