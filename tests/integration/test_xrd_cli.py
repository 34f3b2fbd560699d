"""`neon-hpc xrd ...` end to end (library, tasks, eval, --endpoint delegation)."""
import json
import sys
import types

from neon_hpc.cli import main as neon_main
from neon_hpc.envs.xrd.science.cli import main


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


AGENT_EVAL_MODULE = "neon_hpc.envs.xrd.eval_cli"


def test_endpoint_is_routed_to_the_agent_evaluator_by_the_xrd_plugin(monkeypatch):
    seen = {}
    fake = types.ModuleType(AGENT_EVAL_MODULE)
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, AGENT_EVAL_MODULE, fake)
    assert neon_main(["xrd", "eval", "--endpoint", "http://127.0.0.1:9/v1", "--split", "test_id"]) == 0
    assert seen["argv"] == ["--endpoint", "http://127.0.0.1:9/v1", "--split", "test_id"]
    seen.clear()
    assert neon_main(["xrd", "eval", "--split", "real", "--endpoint=http://127.0.0.1:9"]) == 0
    assert seen["argv"] == ["--split", "real", "--endpoint=http://127.0.0.1:9"]


def test_neon_hpc_xrd_is_the_plugins_command_and_the_top_cli_routes_nothing():
    from neon_hpc import cli, envs
    assert cli.commands()["xrd"][0] == envs.get("xrd").cli == "neon_hpc.envs.xrd.cli"
    assert not hasattr(cli, "ROUTES")


def test_the_xrd_cli_alone_refuses_endpoint_and_names_the_command(capsys):
    assert main(["eval", "--endpoint", "http://127.0.0.1:9/v1"]) == 2
    err = capsys.readouterr().err
    assert "neon-hpc xrd eval --endpoint URL" in err and AGENT_EVAL_MODULE in err


def test_xrd_never_imports_the_rollout_layer():
    """Dependency direction (issue 23): the environment is below the agent that drives it."""
    import ast
    import subprocess
    from pathlib import Path

    import neon_hpc.envs.xrd.science
    pkg = Path(neon_hpc.envs.xrd.science.__file__).parent
    for f in sorted(pkg.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("neon_hpc.rollout") for n in names), f"{f.name} imports {names}"
            assert not (isinstance(node, ast.Constant) and isinstance(node.value, str)
                        and node.value.startswith("neon_hpc.rollout")), f"{f.name} names {node.value!r}"
    mods = ", ".join(f"neon_hpc.envs.xrd.science.{f.stem}" for f in sorted(pkg.glob("*.py")) if f.stem != "__init__")
    code = (f"import sys, importlib\nfor m in '{mods}'.split(', '): importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m.startswith('neon_hpc.rollout'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
