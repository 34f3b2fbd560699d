"""`neon-hpc costfit` and `neon-hpc balance dry-run` as real processes, the calibration fit, the
measured compute's attention and the config wiring."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from neon_hpc import config
from neon_hpc.balance import CostModel
from neon_hpc.balance.configured import assignment_for_config, cost_model_for_config, load_cost_file
from neon_hpc.train.costfit.fit import _features, fit, fit_microbatches
from neon_hpc.train.costfit.standin import attend
from repo_paths import REPO

NEON = [sys.executable, "-m", "neon_hpc.cli"]


def run(*args, check=True):
    return subprocess.run(NEON + list(args), capture_output=True, text=True, cwd=REPO, check=check)


def test_fit_recovers_known_coefficients():
    n = np.array([64, 128, 256, 512, 1024, 2048])
    t = 1e-3 + 2e-5 * n + 3e-8 * n * n
    f = fit(n, t)
    assert f["c0"] == pytest.approx(1e-3, rel=1e-6)
    assert f["a"] == pytest.approx(2e-5, rel=1e-6)
    assert f["b"] == pytest.approx(3e-8, rel=1e-6)
    assert f["rel_rms"] < 1e-9
    with pytest.raises(ValueError, match="at least 3"):
        fit([64, 128], [1.0, 2.0])


def test_fit_separates_microbatch_and_document_overheads():
    mbs = [[(0, n)] for n in (64, 256, 1024, 2048)] + [[(0, 32)] * 16, [(0, 64)] * 8, [(0, 128)] * 4]
    truth = np.array([2e-3, 5e-4, 1e-5, 2e-8])
    t = [truth @ np.array(_features(mb)) for mb in mbs]
    f = fit_microbatches(mbs, t)
    assert [f["c0"], f["piece"], f["a"], f["b"]] == pytest.approx(list(truth), rel=1e-6)


def test_chunk_attention_equals_masked_reference():
    # a piece [start, start+n) attends to the prefix K/V and causally to its own keys
    torch.manual_seed(0)
    H, G, d, n, start = 4, 2, 16, 24, 40
    q = torch.randn(n, H * d)
    k_own = torch.randn(n, G * d)
    v_own = torch.randn(n, G * d)
    kp = torch.randn(1, H, start, d)
    vp = torch.randn(1, H, start, d)
    out = attend(q, k_own, v_own, start, H, G, d, prefix=(kp, vp))
    k_full = torch.cat([kp, k_own.view(n, G, d).transpose(0, 1).unsqueeze(0).repeat_interleave(H // G, 1)], 2)
    v_full = torch.cat([vp, v_own.view(n, G, d).transpose(0, 1).unsqueeze(0).repeat_interleave(H // G, 1)], 2)
    qh = q.view(n, H, d).transpose(0, 1).unsqueeze(0)
    mask = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(qh, k_full, v_full, attn_mask=mask)
    assert torch.allclose(out, ref.squeeze(0).transpose(0, 1).reshape(n, H * d), atol=1e-5)


SHAPE = ["--set", "model.hidden_size=256", "--set", "model.head_dim=64", "--set", "model.ffn_hidden_size=512",
         "--set", "model.moe_ffn_hidden_size=256"]


def test_calibrate_times_the_trainers_step_and_measures_its_memory(tmp_path):
    """The real trainer step (megatron-core, CPU here): the cost model is the fit of the step's own
    timings, the device and kernels recorded, a memory block the capacity planner then uses.
    Timings are checked against each other, not against constants: which of the per-token and
    per-token-pair terms a 7-point fit puts the growth in depends on the machine's noise (a loaded
    machine gave a=0.0), that the step grows with its tokens does not."""
    out = tmp_path / "cost.json"
    r = run("costfit", "--lengths", "64,256,512,1024", "--repeats", "1", "--out", str(out), *SHAPE,
            check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fit: t =" in r.stdout and "device: cpu" in r.stdout and "B/token/layer" in r.stdout
    rep = json.loads(out.read_text())
    m = rep["machine"]
    assert m["runner"].startswith("trainer step") and m["device_type"] == "cpu" and m["torch"] == torch.__version__
    assert m["param_dtype"] == "float32" and m["kernels"]["core_attention"] and m["kernels"]["experts"]
    cm = load_cost_file(out)
    assert cm.source == "calibration" and cm.mb_overhead > 0
    # the trainer was timed: its step at 1024 tokens costs several times its step at 64 (~5x here)
    points = rep["fit"]["points"]
    single = {p["tokens"]: p["measured_s"] for p in points if p["pieces"] == 1}
    assert single[1024] > 2 * single[64], points
    # the cost model is the fit of exactly these timings, and it carries the growth they show
    mbs = [[(0, p["tokens"] // p["pieces"])] * p["pieces"] for p in points]
    refit = fit_microbatches(mbs, [p["measured_s"] for p in points])
    assert [cm.mb_overhead, cm.piece_overhead, cm.a, cm.b] == pytest.approx(
        [refit["c0"], refit["piece"], refit["a"], refit["b"]], rel=1e-9, abs=1e-15)
    assert [p["predicted_s"] for p in points] == pytest.approx([q["predicted_s"] for q in refit["points"]])
    assert cm.chunk_cost(0, 1024) > cm.chunk_cost(0, 64) and min(cm.a, cm.b) >= 0
    assert rep["step_overhead_s"] > 0                          # finalize + optimizer, beside the cost model
    assert len(rep["fit"]["points"]) == 4 + 3                  # single sequences + packed
    assert {c["case"].split()[0] for c in rep["checks"]} == {"6", "mixed", "single"}
    cfg = config.load(None, [f"balance.cost_file={out}"])
    assert cost_model_for_config(cfg) == cm
    # memory: steps at 2 and 4 layers; more layers hold more, and bytes per token per layer > 0
    mem = rep["memory"]
    peak = {(p["layers"], p["tokens"]): p["peak_bytes"] for p in mem["points"]}
    assert peak[(4, 1024)] > peak[(2, 1024)] > peak[(2, 256)]
    assert mem["bytes_per_token_per_layer"] > 0 and mem["per_hidden"] == mem["bytes_per_token_per_layer"] / 256
    assert mem["element_bytes"] == 4 and mem["recompute"] == "none" and "RSS" in mem["method"]
    # the capacity planner reads it: measured coefficients, and they decide the fit (a GPU sized between
    # the states plus half the measured activations and the states plus all of them)
    from neon_hpc.plan import report
    from neon_hpc.plan.params import from_experiment
    tiny = str(REPO / "configs" / "tiny_cpu.yaml")
    sets = [f"plan.activation_file={out}", "model.hidden_size=256", "model.head_dim=64",
            "balance.tokens_per_microbatch=4096"]
    s = from_experiment(config.load(tiny, sets), tiny)
    assert s.params.act_per_hidden == mem["per_hidden"] and s.source("act_per_hidden").startswith("measured")
    lay = report.trainer_layout(s.params, 1)
    states = lay.bytes_per_gpu - lay.activation_bytes
    gpu = (states + 0.75 * lay.activation_bytes) / s.params.train_memory_fraction
    halved = tmp_path / "halved.json"
    halved.write_text(json.dumps(dict(rep, memory={**mem, **{k: mem[k] / 2 for k in ("per_hidden", "per_head",
                                                                                     "per_vocab")}})))
    measured = from_experiment(config.load(tiny, sets + [f"plan.gpu_memory_bytes={gpu}"]), tiny)
    too_small = from_experiment(config.load(tiny, sets + [f"plan.gpu_memory_bytes={gpu}",
                                                          f"plan.activation_file={halved}"]), tiny)
    assert not report.trainer_layout(measured.params, 1).fits
    assert report.trainer_layout(too_small.params, 1).fits


def test_calibrate_stand_in(tmp_path):
    out = tmp_path / "cost.json"
    r = run("costfit", "--stand-in", "--lengths", "32,128,256,512", "--repeats", "1",
            "--out", str(out), check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert "stand-in" in rep["machine"]["runner"] and "memory" not in rep
    assert {c["case"].split()[0] for c in rep["checks"]} == {"6", "chunk", "zigzag"}


def test_setup_extras_are_the_configs_precision_and_recompute():
    from neon_hpc.train.costfit.step import setup_extras
    t = config.load(None, ["train.recompute=full", "train.precision=bf16"]).train
    assert setup_extras(t) == {"precision": "bf16", "recompute": "full"}


def test_dry_run_prints_every_method_and_json_assignment(tmp_path):
    r = run("balance", "dry-run", "--lengths", "900,12000,300,4000,70000,2500", "--dp", "2",
            "--token-cap", "65536")
    for name in ("cost", "tokenkk", "flopkk", "sequential"):
        assert name in r.stdout
    assert any(line.split()[:2] == ["method", "makespan"] for line in r.stdout.splitlines() if line.strip())
    r = run("balance", "dry-run", "--synthetic", "mixture:64", "--dp", "4", "--pp", "2",
            "--token-cap", "131072", "--json")
    asg = json.loads(r.stdout)
    assert len(asg["ranks"]) == 4 and asg["pp_stages"] == 2
    assert asg["makespan"] <= asg["shadow"]["tokenkk"]
    assert asg["method"] == "cost" and asg["method_s"] > 0 and "planner" not in asg


def test_dry_run_errors_name_the_problem(tmp_path):
    r = run("balance", "dry-run", "--lengths", "1,x", check=False)
    assert r.returncode == 2 and "--lengths" in r.stderr
    r = run("balance", "dry-run", "--lengths", "5", "--cost-file", str(tmp_path / "nope.json"), check=False)
    assert r.returncode == 2 and "neon-hpc costfit" in r.stderr
    r = run("balance", "dry-run", "--lengths-file", str(tmp_path / "missing.txt"), check=False)
    assert r.returncode == 2 and "cannot read it" in r.stderr
    (tmp_path / "l.json").write_text('[900, "x"]')
    r = run("balance", "dry-run", "--lengths-file", str(tmp_path / "l.json"), check=False)
    assert r.returncode == 2 and "list of integers" in r.stderr
    r = run("balance", "dry-run", "--lengths", "5", "--set", "balance.tokens_per_microbatch=0", check=False)
    assert r.returncode == 2 and "balance.tokens_per_microbatch" in r.stderr


def test_assignment_for_config_uses_train_and_balance_sections():
    cfg = config.load(str(REPO / "configs" / "kimi_k2_1300xh200.yaml"))
    asg = assignment_for_config(np.full(64, 9000), cfg)
    assert (asg.dp, asg.pp_stages, asg.cp, asg.token_cap) == (1, 8, 4, 65536)
    assert asg.num_microbatches >= 8
    assert asg.cost.a == pytest.approx(CostModel.from_model_config(cfg.model).a)
    manual = config.load(None, ["balance.cost_a=2.0", "balance.cost_b=0.5"])
    assert cost_model_for_config(manual) == CostModel(a=2.0, b=0.5, source="config balance.cost_a/cost_b")
