"""`neon-hpc plan`: parameters with sources, calibration from RESULT lines, table, sweep, PNG."""
import importlib.util
import re
import subprocess
import sys

import pytest

from neon_hpc import config
from neon_hpc.plan import measured
from neon_hpc.plan.cli import main
from neon_hpc.plan.params import from_experiment
from repo_paths import REPO as ROOT

KIMI = str(ROOT / "configs" / "kimi_k2_1300xh200.yaml")
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def test_kimi_config_maps_to_the_1300_gpu_layout_with_sources():
    s = from_experiment(config.load(KIMI), KIMI)
    p = s.params
    assert (p.rollout_gpus, p.train_gpus) == (131 * 8, 32 * 8)
    # PD: a quarter of the 16 engines prefill, 12 decode: 1,536 workers x 8 = 12,288 episodes, 3,072 run at once
    assert p.rollout_slots == 1536 * 8 and p.engine_slots == 12 * 256 and p.queued
    assert "prefill engines" in s.source("engine_slots")
    assert p.route_bytes_per_token == pytest.approx(60 * 8 * 4 * 4 / 3)   # first layer dense
    assert "kimi_k2_1300xh200.yaml: launch.rollout" in s.source("rollout_gpus")
    assert s.source("decode_tokens_per_s") == "default plan.decode_tokens_per_s"
    assert s.source("turns_median").startswith("derived")


def load_bench_replay():
    spec = importlib.util.spec_from_file_location("bench_replay", ROOT / "tools" / "bench_replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not (ROOT / "tools" / "bench_replay.py").exists(),
                    reason="tools/bench_replay.py not in this checkout")
def test_replay_stall_figures_invert_to_the_per_byte_cost_that_produced_them(tmp_path):
    per_byte, fixed = 2.5e-10, 3e-5
    stall = load_bench_replay().dp_stall_model(per_byte, fixed, 8, 32, 65536, 61, 8)
    out = tmp_path / "replay.txt"
    out.write_text("some table\nRESULT replay_bytes_full_over_delta=17.1 "
                   f"kimi_dp_stall_full_s={stall['full']:.6f} kimi_dp_stall_delta_s={stall['delta']:.6f}\n")
    s = from_experiment(config.load(KIMI), KIMI)
    cal = measured.apply(s, measured.read_results([str(out)]))
    assert s.params.export_bytes_per_s == pytest.approx(1 / per_byte, rel=1e-3)
    assert s.source("export_bytes_per_s").startswith(f"RESULT {out}:2 kimi_dp_stall")
    assert ("replay_bytes_full_over_delta", f"{out}:2") in [(k, w) for k, w, _ in cal.unused]


def test_direct_and_alias_keys_set_parameters_and_later_lines_win(tmp_path):
    f = tmp_path / "gpu.txt"
    f.write_text("RESULT decode_tokens_per_s=12 mfu=0.2 gpu_bf16_tflops=700 note=fast\n"
                 "RESULT gpu_decode_tokens_per_s=31.5 reshard_bytes_per_s=2e9\n")
    s = from_experiment(config.load(KIMI), KIMI)
    cal = measured.apply(s, measured.read_results([str(f)]))
    p = s.params
    assert p.decode_tokens_per_s == 31.5 and s.source("decode_tokens_per_s") == f"RESULT {f}:2 gpu_decode_tokens_per_s"
    assert p.mfu == 0.2 and p.gpu_flops == pytest.approx(700e12)
    assert p.publish_bytes_per_s == pytest.approx(2e9 * 32)   # per rank x trainer nodes
    assert any(k == "note" and "not a number" in why for k, _, why in cal.unused)


def test_a_file_without_result_lines_is_an_error_that_says_what_to_pass(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("no results here\n")
    with pytest.raises(ValueError, match="no 'RESULT k=v"):
        measured.read_results([str(f)])


def test_cli_prints_sources_policies_sweep_and_writes_png(tmp_path, capsys):
    res = tmp_path / "bench.txt"
    res.write_text("RESULT decode_tokens_per_s=40\n")
    png = tmp_path / "plan.png"
    rc = main([TINY, "--steps", "30", "--sweep", "--sweep-steps", "20", "--png", str(png), "--quiet",
               "--calibrate", str(res), "--set", "plan.sweep_points=3",
               "--set", "offpolicy.max_staleness=2"])   # the labels below name the bound
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(rf"decode_tokens_per_s\s+= 40\s+<- RESULT {re.escape(str(res))}:1 decode_tokens_per_s", out)
    assert re.search(rf"decode_tokens_per_s\s+40\s+RESULT {re.escape(str(res))}:1", out)   # parameters table
    for label in ("sync delta cost", "one_step_off delta cost", "async S=2 delta cost", "async S=2 full cost",
                  "async S=2 delta tokenkk"):
        assert label in out
    assert "recommended:" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_missing_calibration_file_exits_2(tmp_path, capsys):
    assert main([TINY, "--steps", "5", "--calibrate", str(tmp_path / "nope.txt")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_neon_hpc_dispatches_plan():
    r = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "plan", TINY, "--steps", "10", "--quiet"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "policies, 10 simulated trainer steps" in r.stdout


def test_real_benchmark_result_lines_are_sorted_into_used_and_not_used(tmp_path):
    f = tmp_path / "all.txt"
    f.write_text("RESULT balance_predicted_speedup_vs_tokenkk=1.31 balance_measured_speedup_vs_tokenkk=nan "
                 "method_s_10k_1024=0.41 method_cpu_s_10k_1024=0.40\n"
                 "RESULT reshard_speedup_vs_serial=4.1 reshard_floor_efficiency=0.7\n"
                 "RESULT mfu=nan decode_tokens_per_s=-3\n")
    s = from_experiment(config.load(KIMI), KIMI)
    before = s.params.mfu
    cal = measured.apply(s, measured.read_results([str(f)]))
    assert cal.applied == []
    assert s.params.mfu == before and s.params.decode_tokens_per_s == 25.0
    reasons = {k: why for k, _, why in cal.unused}
    assert "runs the balancer itself" in reasons["balance_predicted_speedup_vs_tokenkk"]
    assert "positive finite" in reasons["mfu"] and "positive finite" in reasons["decode_tokens_per_s"]
    assert "wall time" in reasons["method_s_10k_1024"] and "CPU time" in reasons["method_cpu_s_10k_1024"]
    assert set(reasons) >= {"method_s_10k_1024", "reshard_speedup_vs_serial", "reshard_floor_efficiency"}


def test_virtual_pipeline_stages_reach_the_step_time_model():
    """train.virtual_pipeline_stages is the planner's vpp: the interleaved schedule's smaller
    bubble shortens the planned step (balance.pipeline's model), V = 1 is the 1F1B one."""
    import dataclasses

    import numpy as np

    from neon_hpc.plan.steptime import StepTimeModel
    cfg = config.load(TINY, overrides=["train.pipeline_parallel=2", "train.virtual_pipeline_stages=2",
                                       "model.num_layers=4"])
    s = from_experiment(cfg, TINY)
    assert s.params.vpp == 2 and "train.virtual_pipeline_stages" in s.source("vpp")
    lengths = np.random.default_rng(0).integers(64, 1024, 64)
    p2 = dataclasses.replace(s.params, cost_a=1.0, cost_b=1e-3, fixed_step_s=0.0, dp=1, pp=4, cp=1)
    t2 = StepTimeModel(p2).compute_seconds(lengths)
    t1 = StepTimeModel(dataclasses.replace(p2, vpp=1)).compute_seconds(lengths)
    assert t2 < t1
