"""The sbatch script that reaches Slurm is reviewed like code: golden file + structure checks."""

from __future__ import annotations

import subprocess

from neon_hpc import config
from neon_hpc.launch.slurm import render_sbatch
from repo_paths import REPO


def test_golden_sbatch_matches_renderer():
    cfg = config.load(REPO / "configs" / "tiny_cpu.yaml")
    golden = (REPO / "sbatch" / "tiny_cpu.example.sbatch").read_text()
    rendered = render_sbatch(cfg, "configs/tiny_cpu.yaml")
    assert rendered == golden, ("sbatch/tiny_cpu.example.sbatch is out of date; regenerate it with "
                                "`neon-hpc launch configs/tiny_cpu.yaml --render > sbatch/tiny_cpu.example.sbatch` "
                                "and review the diff")


def test_cluster_example_renders_both_groups_and_signals():
    cfg = config.load(REPO / "configs" / "kimi_k2_1300xh200.yaml")
    text = render_sbatch(cfg, "configs/kimi_k2_1300xh200.yaml")
    head, _, tail = text.partition("#SBATCH hetjob\n")
    assert "#SBATCH --nodes=131" in head and "#SBATCH --gpus-per-node=8" in head
    assert "#SBATCH --nodes=32" in tail and "#SBATCH --ntasks-per-node=8" in tail
    assert "#SBATCH --signal=USR1@600" in head and "#SBATCH --requeue" in head
    assert "#SBATCH --account=lab-xrd" in head
    assert "srun --het-group=0 --kill-on-bad-exit=1" in text and "srun --het-group=1 --kill-on-bad-exit=1" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_no_requeue_when_disabled():
    cfg = config.load(REPO / "configs" / "tiny_cpu.yaml", ["launch.requeue=false"])
    assert "#SBATCH --no-requeue" in render_sbatch(cfg, "x.yaml")
