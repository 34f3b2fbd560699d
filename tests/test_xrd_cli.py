"""`neon-hpc xrd ...` end to end (library, tasks, eval, --endpoint delegation)."""
import json
import sys
import types

from neon_hpc.cli import main as neon_main
from neon_hpc.xrd.cli import AGENT_EVAL_MODULE, main


def test_library_summary_and_listing(capsys):
    assert neon_main(["xrd", "library"]) == 0
    assert "phases (aflow:" in capsys.readouterr().out
    assert main(["library", "--elements", "Ti,O"]) == 0
    out = capsys.readouterr().out
    assert "cur:TiO2_rutile" in out and "cur:NiO_bunsenite" not in out


def test_tasks_then_eval_from_the_files(tmp_path, capsys):
    assert main(["tasks", "--preset", "tiny", "--split", "test_ood", "--n", "3", "--out", str(tmp_path / "t"),
                 "--no-real"]) == 0
    assert "wrote 3 tasks" in capsys.readouterr().out
    assert main(["eval", "--solver", "baseline", "--tasks", str(tmp_path / "t"), "--json",
                 str(tmp_path / "r.json")]) == 0
    assert "success=" in capsys.readouterr().out
    res = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert res["n"] == 3 and 0 <= res["success"] <= 1 and len(res["rows"]) == 3


def test_unknown_solver_is_an_error(capsys):
    assert main(["eval", "--solver", "oracle", "--preset", "tiny", "--n", "1"]) == 2
    assert "unknown solver" in capsys.readouterr().err


def test_endpoint_is_delegated_to_the_agent_evaluator(monkeypatch):
    seen = {}
    fake = types.ModuleType(AGENT_EVAL_MODULE)
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, AGENT_EVAL_MODULE, fake)
    assert main(["eval", "--endpoint", "http://127.0.0.1:9/v1", "--split", "test_id"]) == 0
    assert seen["argv"] == ["--endpoint", "http://127.0.0.1:9/v1", "--split", "test_id"]


def test_endpoint_without_the_agent_module_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, AGENT_EVAL_MODULE, None)      # import fails like a missing module
    rc = main(["eval", "--endpoint", "http://127.0.0.1:9/v1"])
    assert rc == 3 and "not in this checkout" in capsys.readouterr().err
