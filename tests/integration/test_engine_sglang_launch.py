"""SGLang launch lines: the text that reaches the cluster is checked against golden files.

Regenerate after an intended change with ``NEON_UPDATE_GOLDEN=1 pytest tests/integration/test_engine_sglang_launch.py``
and review the diff like code.
"""
import os
import subprocess
import sys

import pytest

from neon_hpc import config
from neon_hpc.rollout.engines.sglang_launch import endpoint_urls, format_commands, render_commands
from repo_paths import REPO, TESTS

ROOT = REPO
GOLDEN = TESTS / "golden"

CASES = {
    "sglang_kimi_k2_pd.txt": ("configs/kimi_k2_1300xh200.yaml", []),
    "sglang_kimi_k2_colocated.txt": ("configs/kimi_k2_1300xh200.yaml",
                                     ["engine.pd_disaggregation=false", "engine.num_engines=2",
                                      "engine.extra_args=[--mem-fraction-static, '0.85']"]),
    "sglang_tiny_cpu.txt": ("configs/tiny_cpu.yaml", []),
}


@pytest.mark.parametrize("golden", sorted(CASES))
def test_rendered_commands_match_golden(golden):
    path, overrides = CASES[golden]
    text = format_commands(render_commands(config.load(ROOT / path, overrides)))
    target = GOLDEN / golden
    if os.environ.get("NEON_UPDATE_GOLDEN"):
        target.write_text(text)
    assert text == target.read_text(), f"launch lines changed; review and regenerate {target}"


def test_pd_fleet_has_prefill_decode_and_router():
    cfg = config.load(ROOT / "configs/kimi_k2_1300xh200.yaml")
    cmds = render_commands(cfg)
    assert len(cmds) == cfg.engine.num_engines + 1
    modes = [c[c.index("--disaggregation-mode") + 1] for c in cmds[:-1]]
    assert modes == ["prefill"] * 4 + ["decode"] * 12  # a quarter prefill by default
    router = cmds[-1]
    assert router[:4] == ["python", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    assert router.count("--prefill") == 4 and router.count("--decode") == 12
    assert endpoint_urls(cfg) == ["http://${NEON_LB_HOST}:8000"]


def test_every_engine_returns_routed_experts_and_wide_ep_flags():
    cfg = config.load(ROOT / "configs/kimi_k2_1300xh200.yaml")
    for cmd in render_commands(cfg)[:-1]:
        assert "--enable-return-routed-experts" in cmd
        assert cmd[cmd.index("--tp-size") + 1] == "64" and cmd[cmd.index("--ep-size") + 1] == "64"
        assert cmd[cmd.index("--moe-a2a-backend") + 1] == "deepep"
        assert "--enable-dp-attention" in cmd and cmd[cmd.index("--nnodes") + 1] == "8"


def test_bad_engine_layout_is_a_config_error():
    with pytest.raises(config.ConfigError, match="engine.ep_size"):
        config.load(ROOT / "configs/kimi_k2_1300xh200.yaml", ["engine.ep_size=16"])


def test_cli_prints_the_same_lines():
    out = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "engine", "sglang-cmd", "configs/tiny_cpu.yaml"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith((GOLDEN / "sglang_tiny_cpu.txt").read_text())
    assert "NEON_ENGINE_URLS=" in out.stdout
