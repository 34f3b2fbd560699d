"""`neon-hpc balance calibrate|dry-run` as real processes, the calibration fit, the
measured compute's attention and the config wiring."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from neon_hpc import config
from neon_hpc.balance import CostModel
from neon_hpc.balance.calibrate import _features, fit, fit_microbatches
from neon_hpc.balance.configured import cost_model_for_config, load_cost_file, plan_for_config
from neon_hpc.balance.measure import attend

NEON = [sys.executable, "-m", "neon_hpc.cli"]
REPO = Path(__file__).resolve().parents[1]


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


def test_calibrate_command_writes_a_loadable_cost_file(tmp_path):
    out = tmp_path / "cost.json"
    r = run("balance", "calibrate", "--lengths", "32,128,256,512", "--repeats", "1", "--out", str(out),
            check=False)
    assert r.returncode == 0, r.stderr
    assert "fit: t =" in r.stdout
    rep = json.loads(out.read_text())
    cm = load_cost_file(out)
    assert cm.source == "calibration" and cm.a + cm.b > 0
    assert np.isfinite(rep["fit"]["rel_rms"])
    assert {c["case"].split()[0] for c in rep["checks"]} == {"6", "chunk", "zigzag"}
    assert len(rep["fit"]["points"]) == 4 + 3                  # single sequences + packed
    # the config points at it
    cfg = config.load(None, [f"balance.cost_file={out}"])
    assert cost_model_for_config(cfg) == cm


def test_dry_run_prints_every_planner_and_json_plan(tmp_path):
    r = run("balance", "dry-run", "--lengths", "900,12000,300,4000,70000,2500", "--dp", "2",
            "--token-cap", "65536")
    for name in ("cost", "tokenkk", "flopkk", "sequential"):
        assert name in r.stdout
    r = run("balance", "dry-run", "--synthetic", "mixture:64", "--dp", "4", "--pp", "2",
            "--token-cap", "131072", "--json")
    plan = json.loads(r.stdout)
    assert len(plan["ranks"]) == 4 and plan["pp_stages"] == 2
    assert plan["makespan"] <= plan["shadow"]["tokenkk"]


def test_dry_run_errors_name_the_problem(tmp_path):
    r = run("balance", "dry-run", "--lengths", "1,x", check=False)
    assert r.returncode == 2 and "--lengths" in r.stderr
    r = run("balance", "dry-run", "--lengths", "5", "--cost-file", str(tmp_path / "nope.json"), check=False)
    assert r.returncode == 2 and "neon-hpc balance calibrate" in r.stderr
    r = run("balance", "dry-run", "--lengths-file", str(tmp_path / "missing.txt"), check=False)
    assert r.returncode == 2 and "cannot read it" in r.stderr
    (tmp_path / "l.json").write_text('[900, "x"]')
    r = run("balance", "dry-run", "--lengths-file", str(tmp_path / "l.json"), check=False)
    assert r.returncode == 2 and "list of integers" in r.stderr
    r = run("balance", "dry-run", "--lengths", "5", "--set", "balance.tokens_per_microbatch=0", check=False)
    assert r.returncode == 2 and "balance.tokens_per_microbatch" in r.stderr


def test_plan_for_config_uses_train_and_balance_sections():
    cfg = config.load(str(REPO / "configs" / "kimi_k2_1300xh200.yaml"))
    plan = plan_for_config(np.full(64, 9000), cfg)
    assert (plan.dp, plan.pp_stages, plan.cp, plan.token_cap) == (1, 8, 4, 65536)
    assert plan.num_microbatches >= 8
    assert plan.cost.a == pytest.approx(CostModel.from_model_config(cfg.model).a)
    manual = config.load(None, ["balance.cost_a=2.0", "balance.cost_b=0.5"])
    assert cost_model_for_config(manual) == CostModel(a=2.0, b=0.5, source="config balance.cost_a/cost_b")
