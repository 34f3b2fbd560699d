"""``neon-hpc run`` (``ops.run``): the local launcher's run, then its plot, drawn here (the
launcher, a layer below the operator tools, returns how the run ended and imports no plotter)."""

from __future__ import annotations

from pathlib import Path

from neon_hpc.launch import local
from neon_hpc.ops import run as run_cmd


def _fake(monkeypatch, ended: local.Ended) -> list[str]:
    drawn: list[str] = []
    monkeypatch.setattr(local, "run", lambda argv: ended)
    monkeypatch.setattr(run_cmd, "plot_run", lambda root: drawn.append(root) or Path(root) / "plots" / "run.png")
    return drawn


def test_the_plot_is_drawn_after_the_run(monkeypatch, tmp_path, capsys):
    drawn = _fake(monkeypatch, local.Ended(0, tmp_path))
    assert run_cmd.main(["x.yaml"]) == 0
    assert drawn == [str(tmp_path)] and f"plot: {tmp_path / 'plots' / 'run.png'}" in capsys.readouterr().out


def test_no_plot_when_none_is_due(monkeypatch):
    drawn = _fake(monkeypatch, local.Ended(3))       # --no-plot, no step done, or refused by the lease
    assert run_cmd.main(["x.yaml"]) == 3 and drawn == []


def test_the_cli_runs_it_with_nothing_handed_in():
    from neon_hpc import cli
    assert cli.COMMANDS["run"][0] == "neon_hpc.ops.run" and not hasattr(cli, "HANDED_IN")
