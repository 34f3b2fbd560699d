"""run.yaml is written once: a resumed or requeued run keeps the config it was launched with."""

from __future__ import annotations

from neon_hpc import config
from neon_hpc.config.launch import thread_env, trainer_threads
from neon_hpc.launch.common import prepare_run, write_run_yaml
from neon_hpc.protocol.rundir import read_json
from repo_paths import REPO

TINY = REPO / "configs" / "tiny_cpu.yaml"


def test_overrides_survive_a_resume_with_the_plain_config(tmp_path, capsys):
    run, cfg = prepare_run(config.load(TINY, ["train.steps=4"]), str(tmp_path / "r"), "slurm", "7")
    assert cfg.train.steps == 4 and config.load(run.run_yaml).train.steps == 4
    # a requeued job passes the original file again: run.yaml wins, the difference is named
    run2, cfg2 = prepare_run(config.load(TINY), str(tmp_path / "r"), "slurm", "7")
    assert cfg2.train.steps == 4
    assert "train.steps" in capsys.readouterr().err
    job = read_json(run2.state / "job.json")
    assert job["starts"] == 2 and job["job_id"] == "7"


def test_prepare_clears_flags_of_the_previous_start(tmp_path):
    run, _ = write_run_yaml(config.load(TINY), str(tmp_path / "r"))[:2]
    (run.state / "finished.json").write_text("{}")
    (run.state / "trainer_preempted.json").write_text("{}")
    (run.traj_tmp / ".x.h5.tmp.part").write_text("torn")
    prepare_run(config.load(TINY), str(tmp_path / "r"), "local")
    assert not (run.state / "finished.json").exists() and not (run.state / "trainer_preempted.json").exists()
    assert list(run.traj_tmp.iterdir()) == []


def test_trainer_threads_leave_the_engine_its_cpu_and_split_the_rest_over_ranks():
    """launch.config.trainer_threads: torch would start one thread per CPU in every process."""
    assert trainer_threads(2, 1, beside_rollout=True) == 1      # the 2-core machine: engine 1, trainer 1
    assert trainer_threads(1, 1, beside_rollout=False) == 1     # pinned to one CPU
    assert trainer_threads(16, 2, beside_rollout=True) == 7     # (16 - 1) // 2
    assert trainer_threads(16, 4, beside_rollout=False) == 4
    assert trainer_threads(1, 4, beside_rollout=True) == 1      # never 0


def test_thread_env_leaves_an_operators_setting_alone(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert thread_env(3) == {"OMP_NUM_THREADS": "3"}
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert thread_env(3) == {}
