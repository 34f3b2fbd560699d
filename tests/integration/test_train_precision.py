"""The trainer's numerics on the hardware path: bf16 mixed precision, activation recomputation,
grouped-GEMM experts, and megatron without Transformer Engine.

Real megatron-core (single gloo rank), real trainer steps (``prepare_step`` + ``train_step``) on
synthetic trajectories with recorded routes, both architectures of the configs.  Each case
builds its own Backend and tears it down.

Tolerances, stated once:
- bf16 against fp32 over 10 steps: the per-step loss within 0.02 absolute, and the 10 steps'
  update (final minus initial parameters) in the same direction (cosine >= 0.99) and of the
  same size (norms within 1%).  bf16 keeps ~3 significant digits of each activation; the fp32
  main parameters keep the updates from being rounded away (at lr 3e-3 one step moves a weight
  by less than its bf16 spacing, so bf16 parameters alone would lose most of it).  Measured on
  CPU: loss gap 0.0017 (Qwen3-MoE) / 0.0038 (DeepSeek-V3), cosine 0.997 / 0.999.
- grouped experts against megatron's sequential loop: bit-identical in fp32 on CPU
  (``torch._grouped_mm`` runs the same per-expert GEMMs there), 2e-2 in bf16.
- ``recompute: full`` against none: bit-identical in fp32 (the same forward runs again);
  ``selective``: 1e-6 relative (the norms' recompute sums their input gradient in another order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from neon_hpc import config as C
from neon_hpc.store import Trajectory
from repo_paths import REPO

CONFIGS = {"qwen3_moe": REPO / "configs" / "tiny_cpu.yaml", "deepseek_v3": REPO / "configs" / "tiny_dsv3_cpu.yaml"}


def trajectories(cfg, seed: int, count: int = 6) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    m = cfg.model
    out = []
    for i in range(count):
        n = int(rng.integers(12, 40))
        mask = np.r_[np.zeros(4), np.ones(n - 4)].astype(np.uint8)
        routes = np.stack([np.stack([rng.permutation(m.num_experts)[:m.moe_router_topk] for _ in range(m.num_layers)])
                           for _ in range(n)]).astype(np.int32)
        out.append(Trajectory(tokens=rng.integers(0, m.vocab_size, n).astype(np.int32), loss_mask=mask,
                              logprobs=np.where(mask > 0, rng.normal(-5.5, 0.3, n), 0).astype(np.float32),
                              versions=np.where(mask > 0, 0, -1).astype(np.int32), routed_experts=routes,
                              reward=float(rng.integers(0, 2)), task_id=f"g{i // 3}", group_id=f"g{i // 3}"))
    return out


def run_steps(arch: str, steps: int, **setup_kw):
    """(per-step metrics, full fp32 state dict after the steps, backend precision)."""
    from neon_hpc.train import backend as B
    from neon_hpc.train.corrections import bind
    from neon_hpc.train.loop import prepare_step, train_step
    from neon_hpc.train.sections import TrainerSections

    cfg = C.load(CONFIGS[arch])
    sec = TrainerSections.of(cfg)
    lcfg = dict(clip_eps=0.2, kl_coef=0.0, correction=bind("tis", {"cap": 2.0}))
    be = B.setup(cfg.model, lr=3e-3, seed=3, **setup_kw)
    try:
        metrics = [train_step(be, prepare_step(trajectories(cfg, s), 1, sec), lcfg) for s in range(steps)]
        state = {k: v.float().clone() for k, v in B.full_state_dict(be).items()}
        return metrics, state, be.precision
    finally:
        B.teardown()


def rel_l1(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).abs().sum()) for k in a)
    return num / sum(float(a[k].abs().sum()) for k in a)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_bf16_tracks_fp32_for_ten_steps(arch):
    fp32, w32, p32 = run_steps(arch, 10, precision="fp32")
    bf16, w16, p16 = run_steps(arch, 10, precision="bf16")
    assert (p32, p16) == ("fp32", "bf16")
    assert all(w.dtype == torch.float32 for w in w16.values())      # compared as fp32 copies
    loss32 = [m["loss"] for m in fp32]
    loss16 = [m["loss"] for m in bf16]
    gaps = [abs(a - b) for a, b in zip(loss32, loss16)]
    print(f"{arch}: loss fp32 {np.round(loss32, 4)}, bf16 {np.round(loss16, 4)}, max gap {max(gaps):.4f}")
    assert max(gaps) < 0.02
    _, w0, _ = run_steps(arch, 0, precision="fp32")
    u32 = torch.cat([(w32[k] - w0[k]).flatten() for k in w0])
    u16 = torch.cat([(w16[k] - w0[k]).flatten() for k in w0])
    cos = float(torch.nn.functional.cosine_similarity(u32, u16, dim=0))
    size = float(u16.norm() / u32.norm())
    print(f"{arch}: 10 steps' update, bf16 vs fp32: cosine {cos:.4f}, norm ratio {size:.4f}")
    assert cos >= 0.99 and abs(size - 1) < 0.01


def test_bf16_parameters_with_fp32_main_copies_in_the_optimizer():
    from neon_hpc.train import backend as B
    cfg = C.load(CONFIGS["qwen3_moe"])
    be = B.setup(cfg.model, seed=3, precision="bf16")
    try:
        assert {p.dtype for p in be.models[0].parameters()} == {torch.bfloat16}
        mains = [p.main_param for p in be.models[0].parameters()]
        assert mains and {m.dtype for m in mains} == {torch.float32}
        assert all(torch.equal(m.to(torch.bfloat16), p) for m, p in zip(mains, be.models[0].parameters()))
    finally:
        B.teardown()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_grouped_experts_match_megatrons_sequential_loop(precision):
    seq, ws, _ = run_steps("qwen3_moe", 2, precision=precision, experts="sequential")
    grp, wg, _ = run_steps("qwen3_moe", 2, precision=precision, experts="grouped")
    gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(seq, grp)]
    if precision == "fp32":
        assert gaps == [0.0, 0.0] and all(torch.equal(ws[k], wg[k]) for k in ws)
    else:
        assert max(gaps) < 2e-2 and rel_l1(ws, wg) < 1e-2


def test_grouped_experts_are_the_default_and_keep_sequential_parameter_names():
    from neon_hpc.models import experts
    from neon_hpc.train import backend as B
    cfg = C.load(CONFIGS["qwen3_moe"])
    be = B.setup(cfg.model, seed=3)
    try:
        assert experts.expert_impl(cuda=False, dtype=torch.float32) == "grouped"
        mods = [layer.mlp.experts for layer in be.models[0].decoder.layers]
        assert all(type(m) is experts.GroupedExperts for m in mods)
        names = [n for n, _ in be.models[0].named_parameters() if ".experts." in n]
        assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight" in names
    finally:
        B.teardown()


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_recompute_replays_layout_and_routes(arch):
    none, w_none, _ = run_steps(arch, 2, precision="fp32", recompute="none")
    full, w_full, _ = run_steps(arch, 2, precision="fp32", recompute="full")
    sel, w_sel, _ = run_steps(arch, 2, precision="fp32", recompute="selective")
    assert [m["grad_norm"] for m in full] == [m["grad_norm"] for m in none]
    assert all(torch.equal(w_none[k], w_full[k]) for k in w_none)
    for a, b in zip(none, sel):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a["grad_norm"]
    assert rel_l1(w_none, w_sel) < 1e-6


def test_bf16_checkpoint_resumes_bit_exact_in_bf16_and_refuses_fp32(tmp_path):
    from neon_hpc.protocol.rundir import RunDir
    from neon_hpc.train import backend as B, checkpoint as ckpt
    from neon_hpc.train.corrections import bind
    from neon_hpc.train.loop import prepare_step, train_step
    from neon_hpc.train.sections import TrainerSections

    cfg = C.load(CONFIGS["qwen3_moe"])
    sec = TrainerSections.of(cfg)
    lcfg = dict(clip_eps=0.2, kl_coef=0.0, correction=bind("tis", {"cap": 2.0}))
    run = RunDir(tmp_path / "run").create()

    def steps(be, seeds):
        return [train_step(be, prepare_step(trajectories(cfg, s), 1, sec), lcfg)["loss"] for s in seeds]

    be = B.setup(cfg.model, lr=3e-3, seed=3, precision="bf16")
    steps(be, [0, 1])
    ckpt.save(run, be, 2, {"version": 2})
    straight = steps(be, [2, 3])
    after = {k: v.clone() for k, v in B.full_state_dict(be).items()}
    B.teardown()
    assert json.loads((run.checkpoint(2) / "trainer_state.json").read_text())["precision"] == "bf16"

    be = B.setup(cfg.model, lr=3e-3, seed=99, precision="bf16")
    try:
        ckpt.load(run, be, 2)
        resumed = steps(be, [2, 3])
        again = B.full_state_dict(be)
    finally:
        B.teardown()
    assert resumed == straight
    assert all(torch.equal(after[k], again[k]) for k in after)

    be = B.setup(cfg.model, seed=3, precision="fp32")
    try:
        with pytest.raises(ValueError, match="train.precision=bf16.*resume with train.precision: bf16"):
            ckpt.load(run, be, 2)
    finally:
        B.teardown()


NO_TE_ON_CUDA = textwrap.dedent(r"""
    import json, sys
    sys.modules["transformer_engine"] = None        # TE absent: its import raises ImportError
    import torch
    from neon_hpc.models import cpu_shim, experts
    r = {"te": cpu_shim.has_te(), "plan_cuda": cpu_shim.patches_for(cuda=True, te=cpu_shim.has_te()),
         "plan_cpu": cpu_shim.patches_for(cuda=False, te=cpu_shim.has_te()),
         "experts": experts.expert_impl(cuda=False, dtype=torch.bfloat16)}
    # the device query says CUDA while the patches are chosen (what a GPU node reports) ...
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    r["needed_on_cuda"] = cpu_shim.patches_for(cpu_shim.has_cuda(), cpu_shim.has_te())
    torch.cuda.is_available = real
    # ... and a step runs with the no-TE implementations (on this CPU, with the CPU patches too)
    from megatron.core.transformer.moe import moe_utils
    from neon_hpc.train import backend as B
    from neon_hpc.config.model import ModelConfig
    be = B.setup(ModelConfig(), seed=1, precision="bf16", recompute="selective")
    r["te_general_gemm"] = repr(moe_utils.te_general_gemm)
    r["expert_module"] = type(be.models[0].decoder.layers[0].mlp.experts).__name__
    ids = torch.randint(0, 256, (1, 16))
    out = be.ddps[0](input_ids=ids, position_ids=torch.arange(16)[None], attention_mask=None, labels=ids)
    out.sum().backward()
    r["step_ran"] = bool(torch.isfinite(out).all())
    r["kernels"] = cpu_shim.kernels()
    print("RESULT " + json.dumps(r))
""")


def test_cuda_without_transformer_engine_chooses_the_non_te_paths():
    # a fresh interpreter; the rendezvous port this process's in-process Backends set is not its
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", NO_TE_ON_CUDA], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    from neon_hpc.models import cpu_shim
    assert r["te"] is False
    assert r["plan_cuda"] == r["needed_on_cuda"] == list(cpu_shim.NO_TE)
    assert set(r["plan_cpu"]) == set(cpu_shim.NO_TE) | set(cpu_shim.NO_CUDA)
    assert r["experts"] == "grouped" and r["expert_module"] == "GroupedExperts"
    assert r["te_general_gemm"] == "None" and r["step_ran"]
    assert r["kernels"]["transformer_engine"] is False and r["kernels"]["grouped_gemm"] == "torch._grouped_mm"


def test_plan_with_transformer_engine_on_cuda_patches_nothing():
    from neon_hpc.models import cpu_shim
    assert cpu_shim.patches_for(cuda=True, te=True) == []
    assert cpu_shim.patches_for(cuda=False, te=True) == [p for p in cpu_shim.PATCHES if p in cpu_shim.NO_CUDA]


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_router_replay_stays_exact_in_bf16(arch):
    """Under bf16 the routers take exactly the recorded experts (the scores that weight them are
    fp32: ``moe_router_dtype``), on the grouped-GEMM experts."""
    from neon_hpc.train import backend as B
    from neon_hpc.train.batch import build_microbatch, input_lengths
    from neon_hpc.train.loop import prepare_step
    from neon_hpc.train.sections import TrainerSections

    cfg = C.load(CONFIGS[arch])
    be = B.setup(cfg.model, seed=3, precision="bf16")
    try:
        trajs = prepare_step(trajectories(cfg, 5), 1, TrainerSections.of(cfg)).trajectories  # MoE rows
        pieces = [(i, 0, n) for i, n in enumerate(input_lengths(trajs))]
        mb = build_microbatch(trajs, pieces, [0.0] * len(trajs), dense_mask=True,
                              route_shape=(be.num_moe_layers(), cfg.model.moe_router_topk, cfg.model.num_experts))
        routers = [layer.mlp.router for layer in be.models[0].decoder.layers if hasattr(layer.mlp, "router")]
        maps = []
        hooks = [r.register_forward_hook(lambda _m, _i, out: maps.append(out[1].detach().clone())) for r in routers]
        try:
            with torch.no_grad():
                logp = B.forward_logp(be, mb, replay=True)
        finally:
            for h in hooks:
                h.remove()
        assert logp.dtype == torch.float32 and torch.isfinite(logp).all()
        assert len(maps) == be.num_moe_layers() >= 1
        for j, rmap in enumerate(maps):
            want = torch.zeros(mb.seq_len, cfg.model.num_experts, dtype=torch.bool)
            want.scatter_(1, torch.from_numpy(np.ascontiguousarray(mb.routed_experts[:, j])).long(), True)
            assert torch.equal(rmap.bool(), want)
    finally:
        B.teardown()


def test_expert_kernel_choice_by_device_and_dtype(monkeypatch):
    from neon_hpc.models import experts
    assert experts.expert_impl(cuda=False, dtype=torch.float32) == "grouped"     # CPU: any float
    assert experts.expert_impl(cuda=False, dtype=torch.bfloat16) == "grouped"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))   # an H200
    assert experts.expert_impl(cuda=True, dtype=torch.bfloat16) == "grouped"
    assert experts.expert_impl(cuda=True, dtype=torch.float32) == "sequential"  # CUDA's kernel: bf16 only
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert experts.expert_impl(cuda=True, dtype=torch.bfloat16) == "sequential"
