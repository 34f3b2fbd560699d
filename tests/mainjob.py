"""Test support: run the main job (`neon-hpc run CONFIG`) to completion as local processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_main_job(tmp_path_factory, name: str, config: str, *sets: str, timeout: float = 900) -> dict:
    """``neon-hpc run configs/CONFIG --run-dir <tmp>/run --set ...`` to its end: ``{root, rc, out}``
    (``out``: what the launcher printed); fails the test when it outlives ``timeout`` seconds."""
    root = tmp_path_factory.mktemp(name) / "run"
    cmd = [sys.executable, "-m", "neon_hpc.cli", "run", str(REPO / "configs" / config), "--run-dir", str(root)]
    for s in sets:
        cmd += ["--set", s]
    out = root.parent / "launcher.out"
    with open(out, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not finish in {timeout:.0f} s; see {out}")
    return {"root": root, "rc": rc, "out": out.read_text()}
