"""The planner's activation term (plan/memory.py): the formula, recomputation, and a measured
memory block (balance/memory.py) deciding whether a layout fits."""
import json
from pathlib import Path

import pytest

from neon_hpc import config
from neon_hpc.balance.memory import fit_activation_memory, load_memory
from neon_hpc.plan import report
from neon_hpc.plan.cli import main
from neon_hpc.plan.memory import FORMULA, ActivationTerm, layout_for
from neon_hpc.plan.params import from_experiment
from repo_paths import REPO as ROOT

TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
KIMI = str(ROOT / "configs" / "kimi_k2_1300xh200.yaml")


def term(**kw) -> ActivationTerm:
    base = dict(hidden=1024, heads=8, vocab=32000, num_layers=8, token_cap=4096)
    base.update(kw)
    return ActivationTerm(**base)


def test_formula_by_hand_and_how_tp_cp_pp_divide_it():
    T, h, L, V = 4096, 1024, 8, 32000
    assert term().bytes_per_gpu(tp=1, pp=1, cp=1) == pytest.approx(L * 34 * h * T + 10 * V * T)
    # SP over TP and CP each divide the tokens a GPU keeps; the logits are split by vocabulary over TP
    assert term().bytes_per_gpu(tp=2, pp=1, cp=2) == pytest.approx(L * 34 * h * T / 4 + 10 * V / 2 * T / 2)
    # 1F1B: stage 0 holds pp micro-batches of L/pp layers = L layers' worth; uneven stages round up
    assert term().bytes_per_gpu(tp=1, pp=2, cp=1) == pytest.approx(term().bytes_per_gpu(tp=1, pp=1, cp=1))
    assert term(num_layers=7).bytes_per_gpu(tp=1, pp=2, cp=1) == pytest.approx(8 * 34 * h * T + 10 * V * T)


def test_recomputation_keeps_layer_inputs_and_drops_scores():
    scores = dict(per_head=20.0)                 # a kernel that materialises attention scores
    none = term(**scores).bytes_per_gpu(1, 1, 1)
    selective = term(recompute="selective", **scores).bytes_per_gpu(1, 1, 1)
    full = term(recompute="full", **scores).bytes_per_gpu(1, 1, 1)
    T, h, L, V = 4096, 1024, 8, 32000
    assert none == pytest.approx(L * (34 * h * T + 20 * 8 * T * T) + 10 * V * T)
    assert selective == pytest.approx(L * 34 * h * T + 10 * V * T)          # scores recomputed
    # full: every layer's bf16 input, plus one layer's working set while it is re-run
    assert full == pytest.approx(L * 2 * h * T + 34 * h * T + 10 * V * T)
    assert full < selective < none


def _memory_file(path: Path, per_hidden: float, recompute: str = "none") -> Path:
    path.write_text(json.dumps({"cost_model": {"a": 1e-4, "b": 1e-7, "source": "calibration"},
                                "memory": {"per_hidden": per_hidden, "per_head": 0.0, "per_vocab": 10.0,
                                           "element_bytes": 2, "recompute": recompute,
                                           "method": "test", "device": "test"}}))
    return path


def test_a_measured_memory_block_decides_whether_the_kimi_layout_fits(tmp_path):
    # the shipped Kimi layout (32 trainer nodes) with the formula's 34 B/token/layer/hidden fits;
    # a trainer measured at 3x that (e.g. materialised MoE buffers) does not, at the same layout
    s = from_experiment(config.load(KIMI), KIMI)
    assert s.source("act_per_hidden").startswith("derived (plan.memory.FORMULA")
    base = report.trainer_layout(s.params, 32)
    assert base.fits and base.activation_bytes > 0

    light = _memory_file(tmp_path / "light.json", FORMULA["per_hidden"])
    heavy = _memory_file(tmp_path / "heavy.json", 3 * FORMULA["per_hidden"])
    s_light = from_experiment(config.load(KIMI, [f"plan.activation_file={light}"]), KIMI)
    s_heavy = from_experiment(config.load(KIMI, [f"plan.activation_file={heavy}"]), KIMI)
    assert s_heavy.source("act_per_hidden").startswith("measured (")
    assert report.trainer_layout(s_light.params, 32).fits
    lay = report.trainer_layout(s_heavy.params, 32)
    assert lay.pp > 8 or not lay.fits                 # deeper pipeline or no fit: the config's does not hold it
    assert layout_for(256, 8, 8, 4, 32, s_heavy.params.dense_params, s_heavy.params.expert_params,
                      s_heavy.params.gpu_memory_bytes, s_heavy.params.train_memory_fraction, 384,
                      report.activation_term(s_heavy.params)).problem.count("activations") == 1
    # full recomputation brings the heavy trainer back under the limit at the config's layout
    s_full = from_experiment(config.load(KIMI, [f"plan.activation_file={heavy}", "train.recompute=full"]), KIMI)
    assert report.trainer_layout(s_full.params, 32).fits and report.trainer_layout(s_full.params, 32).pp == 8


def test_a_measurement_with_recomputation_is_refused_for_another_mode(tmp_path):
    f = _memory_file(tmp_path / "full.json", 40.0, recompute="full")
    with pytest.raises(ValueError, match="plan.activation_file.*train.recompute"):
        from_experiment(config.load(TINY, [f"plan.activation_file={f}"]), TINY)
    assert main([TINY, "--steps", "1", "--set", f"plan.activation_file={tmp_path / 'missing.json'}"]) == 2
    (tmp_path / "nomem.json").write_text(json.dumps({"cost_model": {"a": 1.0, "b": 0.0}}))
    with pytest.raises(ValueError, match="no 'memory' block"):
        load_memory(tmp_path / "nomem.json")


def test_memory_fit_recovers_per_layer_outside_and_score_bytes():
    truth = dict(c=5e6, e=3000.0, k=25000.0, q=100.0)
    pts = [(l, n, truth["c"] + truth["e"] * n + l * (truth["k"] * n + truth["q"] * n * n))
           for l in (2, 4) for n in (256, 512, 1024, 2048)]
    f = fit_activation_memory(pts)
    assert f["bytes_fixed"] == pytest.approx(truth["c"], rel=1e-6)
    assert f["bytes_per_token_outside_layers"] == pytest.approx(truth["e"], rel=1e-6)
    assert f["bytes_per_token_per_layer"] == pytest.approx(truth["k"], rel=1e-6)
    assert f["bytes_per_token_pair_per_layer"] == pytest.approx(truth["q"], rel=1e-6)
    with pytest.raises(ValueError, match="two model depths"):
        fit_activation_memory([(2, n, 1e6 * n) for n in (256, 512, 1024)])


def test_recomputation_costs_a_forward_in_the_step_time_model():
    none = from_experiment(config.load(KIMI), KIMI).params
    full = from_experiment(config.load(KIMI, ["train.recompute=full"]), KIMI)
    sel = from_experiment(config.load(KIMI, ["train.recompute=selective"]), KIMI).params
    assert full.params.cost_a == pytest.approx(none.cost_a * 4 / 3) and "x 4/3" in full.source("cost_a")
    assert full.params.cost_b == pytest.approx(none.cost_b * 4 / 3)
    assert sel.cost_a == none.cost_a and sel.cost_b == pytest.approx(none.cost_b * 4 / 3)
