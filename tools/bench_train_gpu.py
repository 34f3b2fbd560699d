#!/usr/bin/env python
"""The trainer's step against the same model written plainly in PyTorch, on this machine's device.

Each side runs in its own process (one after the other, so neither one's memory or allocator
state is in the other's figures), on the same tokens:

- **trainer**: neon-hpc's own step: ``train.backend.setup`` (megatron-core GPTModel, DDP,
  megatron's optimizer; ``train.precision`` as given, bf16 by default on CUDA), then per step
  ``train.loop.prepare_step`` (advantages, the balance assignment) and ``train.loop.train_step``
  (micro-batches with router replay, the piece attention, forward/backward, optimizer);
- **reference**: the same architecture written in this file (Qwen3-MoE: ``F.rms_norm``, GQA with
  per-head q/k norm and RoPE, softmax top-k router, SwiGLU experts through
  ``torch._grouped_mm``; attention as ``scaled_dot_product_attention`` per document), the same
  precision recipe (bf16 parameters, fp32 master copies, fused AdamW over them on CUDA; fp32
  and fused AdamW on CPU), cross-entropy over the same input/label tokens;
- **loop**: the trainer's real loop (``train.loop.run_trainer`` on a run directory with the
  shards ready: claim, step, publish every step, checkpoint every 4) against its bare step
  (``train_step_s`` of the same records), means over 8 steps after the warm-ups (at least two
  checkpoint periods, so the first checkpoints' one-time costs, megatron's save plan among them,
  are not in the window; two checkpoints in it): ``loop_over_step``, what the loop adds to the step's critical path; the
  same loop with synchronous checkpoints (``train.checkpoint_async: false``) in the same run:
  ``loop_over_step_sync_ckpt``.  And the quiet loop (no publish or checkpoint in the window):
  its bare step is the one that no background write shares the machine with, so
  ``loop_over_quiet_step`` (the loop over it) is the whole cost, and ``step_inflation`` (the
  loop's bare step over it) is what the writes beside the steps cost the steps themselves
  (on a 2-core CPU they share the cores with the step; on a GPU node, cores the step leaves idle).

Per shape (documents x tokens), after ``--warmup`` (at least 2) untimed steps, the median of
``--reps`` (at least 5) timed ones: tokens/s of each (input tokens, ``n - 1`` per document),
their ratio, the memory each step takes above what its process held before it (CUDA:
``max_memory_allocated`` minus ``memory_allocated`` at the start; CPU: sampled RSS, see
``train.heap.PeakMemory``), and MFU by the project's FLOP model (``balance.cost.flops_breakdown``)
against the device's dense peak: 989 TFLOP/s bf16 on CUDA (H200; an H100's is the same), on
CPU the fp32 matmul rate measured at start.  Times are wall-clock on CUDA; on CPU this
process's CPU time (``--clock``), with one intra-op thread per worker (``OMP_NUM_THREADS=1``,
``BENCH_CPU_THREADS`` to change it: spinning OpenMP threads would count as CPU time).  One more step of each side
runs under an aten-op census (``neon_hpc.train.census``): the ops it dispatches, the ones that would make the host wait
for a device (scalar read-backs, data-dependent shapes, device-to-host copies), those inside
the MoE layers' forwards, those of the optimizer step issued once per parameter tensor, and
which SDPA kernel and which expert-GEMM path served the shape.

Then the trainer alone: one document of growing length (the linear-memory check) and the
longest single document that trains (``--max-doc``, CUDA); with ``--archs`` including
``deepseek_v3`` the MLA model of the same sizes at the headline shape (``dsv3_over_qwen``).

    python tools/bench_train_gpu.py --device cpu --shapes 2x512 --memory-lengths 1024,2048   # small, CPU
    python tools/bench_train_gpu.py --device cuda    # the H200 shapes of issue 30 (1.83 B Qwen3-MoE)

Last line: ``RESULT trainer_over_reference=... rss_16k_over_8k=... max_doc_tokens=... mfu=...
device=cpu|cuda`` (ratio and MFU at the headline shape, the first of ``--shapes``), then
``reference_mfu``, ``rss_16k_over_8k_above_start``, ``dsv3_over_qwen``, ``precision``,
``ops_over_reference``, ``syncs_per_step``, ``moe_layer_syncs``, ``optimizer_per_param_ops``,
``loop_over_step``, ``loop_over_step_sync_ckpt``, ``loop_over_quiet_step``, ``step_inflation``,
``sdpa=`` and ``experts_gemm=`` (the kernels at the headline shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from neon_hpc import config as C  # noqa: E402
from neon_hpc.balance.cost import flops_breakdown  # noqa: E402
from neon_hpc.config.model import ModelConfig  # noqa: E402
from neon_hpc.store import Trajectory  # noqa: E402
from neon_hpc.store.synthetic import replayed_documents  # noqa: E402
from neon_hpc.train.heap import PeakMemory  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
H200_BF16_PEAK = 989e12

# The model of issue 30's measurement (1.83 B), and a CPU model of the same family scaled down.
MODELS = {
    "cuda": dict(vocab_size=32768, hidden_size=2048, num_layers=8, num_attention_heads=16, num_query_groups=4,
                 head_dim=128, ffn_hidden_size=5632, moe_ffn_hidden_size=1024, num_experts=32, moe_router_topk=4),
    "cpu": dict(vocab_size=4096, hidden_size=256, num_layers=2, num_attention_heads=4, num_query_groups=2,
                head_dim=64, ffn_hidden_size=512, moe_ffn_hidden_size=256, num_experts=8, moe_router_topk=2),
}
MLA = {   # DeepSeek-V3 of the same sizes: MLA (q/k head 128 + 64 RoPE, v 128), 1 dense layer, 1 shared expert
    "cuda": dict(kv_lora_rank=512, q_lora_rank=0, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 first_dense_layers=1, num_shared_experts=1),
    "cpu": dict(kv_lora_rank=64, q_lora_rank=0, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                first_dense_layers=1, num_shared_experts=1),
}
SHAPES = {"cuda": "4x4096,8x2048,1x8192,2x8192,1x16384,1x32768", "cpu": "4x1024,1x4096"}
MEMORY_LENGTHS = {"cuda": "4096,8192,16384", "cpu": "4096,8192,16384"}


def model_config(device: str, arch: str) -> ModelConfig:
    kw = dict(MODELS[device], arch=arch, max_position_embeddings=262144, seed=1)
    if arch == "deepseek_v3":
        kw.update(MLA[device], num_query_groups=kw["num_attention_heads"])
        kw["head_dim"] = kw["qk_nope_head_dim"]
    return ModelConfig(**kw)


def parse_shape(s: str) -> tuple[int, int]:
    docs, tokens = s.lower().split("x")
    return int(docs), int(tokens)


# --------------------------------------------------------------------------------------
# the data: the same documents for both sides

def documents(cfg: ModelConfig, docs: int, tokens: int, seed: int) -> list[Trajectory]:
    """``docs`` trajectories of ``tokens`` tokens with routes for every decoder layer (the
    trainer replays them): ``store.synthetic.replayed_documents`` at the model's shape."""
    return replayed_documents(docs, tokens, vocab=cfg.vocab_size, layers=cfg.num_layers,
                              experts=cfg.num_experts, top_k=cfg.moe_router_topk, seed=seed)


def input_tokens(trajs: list[Trajectory]) -> int:
    return sum(len(t.tokens) - 1 for t in trajs)


def step_flops(cfg: ModelConfig, trajs: list[Trajectory]) -> float:
    f = flops_breakdown(cfg)
    return sum(f["a_flops"] * (len(t.tokens) - 1) + f["b_flops"] * (len(t.tokens) - 1) ** 2 for t in trajs)


# --------------------------------------------------------------------------------------
# the trainer's step

class Trainer:
    def __init__(self, cfg: ModelConfig, precision: str, recompute: str, max_tokens: int) -> None:
        from neon_hpc.train import backend as B
        from neon_hpc.train.corrections import bind
        from neon_hpc.train.sections import TrainerSections

        exp = C.load(REPO / "configs" / "tiny_cpu.yaml")
        # one micro-batch per step, as the reference runs it (the cost method keeps headroom under the cap)
        exp = dataclasses.replace(exp, model=cfg,
                                  balance=dataclasses.replace(exp.balance, tokens_per_microbatch=2 * max_tokens,
                                                              min_microbatches=1, shadow=False))
        self.sec = TrainerSections.of(exp)
        self.lcfg = dict(clip_eps=0.2, kl_coef=0.0, correction=bind("tis", {"cap": 2.0}))
        self.be = B.setup(cfg, lr=1e-5, seed=3, precision=precision, recompute=recompute)

    def step(self, trajs: list[Trajectory]) -> float:
        from neon_hpc.train.loop import prepare_step, train_step
        # prepare_step converts the routes in place (engine rows -> MoE rows): a fresh copy each step
        trajs = [dataclasses.replace(t, routed_experts=t.routed_experts.copy()) for t in trajs]
        return train_step(self.be, prepare_step(trajs, self.be.layout.dp, self.sec), self.lcfg)["loss"]

    def close(self) -> None:
        from neon_hpc.train import backend as B
        B.teardown()


# --------------------------------------------------------------------------------------
# the reference: Qwen3-MoE written plainly

class RMSNorm(torch.nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope(x, pos, theta: float):
    """Rotate-half RoPE of ``x`` [T, heads, d] by positions ``pos`` [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None].to(x.dtype), torch.cat([ang.sin()] * 2, -1)[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Layer(torch.nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        h, H, G, d, E, Fe = (c.hidden_size, c.num_attention_heads, c.num_query_groups, c.head_dim, c.num_experts,
                             c.moe_ffn_hidden_size)
        self.c = c
        self.ln1, self.ln2 = RMSNorm(h, c.norm_epsilon), RMSNorm(h, c.norm_epsilon)
        self.qkv = torch.nn.Linear(h, (H + 2 * G) * d, bias=False)
        self.q_norm, self.k_norm = RMSNorm(d, c.norm_epsilon), RMSNorm(d, c.norm_epsilon)
        self.o = torch.nn.Linear(H * d, h, bias=False)
        self.router = torch.nn.Linear(h, E, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(E, h, 2 * Fe) * 0.02)
        self.w2 = torch.nn.Parameter(torch.randn(E, Fe, h) * 0.02)

    def forward(self, x, pos, spans):
        c = self.c
        T, H, G, d, k = x.shape[0], c.num_attention_heads, c.num_query_groups, c.head_dim, c.moe_router_topk
        q, kk, v = self.qkv(self.ln1(x)).split([H * d, G * d, G * d], -1)
        q = rope(self.q_norm(q.view(T, H, d)), pos, c.rope_theta)
        kk = rope(self.k_norm(kk.view(T, G, d)), pos, c.rope_theta)
        v = v.view(T, G, d)
        att = [F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], kk[s:e].transpose(0, 1)[None],
                                              v[s:e].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
               [0].transpose(0, 1).reshape(e - s, H * d) for s, e in spans]
        x = x + self.o(torch.cat(att))
        y = self.ln2(x)
        probs = torch.softmax(self.router(y).float(), -1)
        top, idx = probs.topk(k, -1)
        top = top / top.sum(-1, keepdim=True)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        tok = order // k
        offs = torch.cumsum(torch.bincount(flat, minlength=c.num_experts), 0).to(torch.int32)
        h1 = torch._grouped_mm(y[tok], self.w1.to(y.dtype), offs=offs)
        g, u = h1.chunk(2, -1)
        a = (F.silu(g) * u * top.flatten()[order][:, None]).to(y.dtype)
        h2 = torch._grouped_mm(a, self.w2.to(y.dtype), offs=offs)
        return x + torch.zeros_like(y).index_add_(0, tok, h2)


class Reference(torch.nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = torch.nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.norm_epsilon)
        self.head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, ids, pos, spans, labels):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, pos, spans)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits, labels, reduction="sum") / labels.numel()


class ReferenceStep:
    """Forward, backward and a fused AdamW step over fp32 master copies of the (bf16) parameters."""

    def __init__(self, cfg: ModelConfig, precision: str, device: torch.device) -> None:
        torch.manual_seed(0)
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.model = Reference(cfg).to(device=device, dtype=self.dtype)
        self.params = list(self.model.parameters())
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params] \
            if self.dtype != torch.float32 else self.params
        self.opt = torch.optim.AdamW(self.masters, lr=1e-5, weight_decay=0.0, fused=True)
        self.device = device

    def step(self, trajs: list[Trajectory]) -> float:
        dev = self.device
        ids = torch.cat([torch.from_numpy(t.tokens[:-1].astype(np.int64)) for t in trajs]).to(dev)
        labels = torch.cat([torch.from_numpy(t.tokens[1:].astype(np.int64)) for t in trajs]).to(dev)
        pos = torch.cat([torch.arange(len(t.tokens) - 1) for t in trajs]).to(dev)
        ends = np.cumsum([len(t.tokens) - 1 for t in trajs])
        spans = list(zip([0, *ends[:-1]], ends))
        loss = self.model(ids, pos, spans, labels)
        loss.backward()
        if self.masters is not self.params:
            for m, p in zip(self.masters, self.params):
                m.grad = p.grad.float()
                p.grad = None
        torch.nn.utils.clip_grad_norm_(self.masters, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not self.params:
            with torch.no_grad():
                for m, p in zip(self.masters, self.params):
                    p.copy_(m)
        return float(loss)


# --------------------------------------------------------------------------------------
# measuring

def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def timed(fn, trajs, cuda: bool) -> tuple[float, int, int]:
    """(seconds on the chosen clock, peak bytes, baseline bytes) of one call."""
    with PeakMemory(cuda) as mem:
        t0 = clock()
        fn(trajs)
        sync(cuda)
        dt = clock() - t0
    return dt, mem.peak, mem.base


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def matmul_peak(cuda: bool, dtype: torch.dtype) -> float:
    """Dense matmul FLOP/s on this device (CPU: the denominator of MFU; CUDA reports the H200 peak)."""
    if cuda:
        return H200_BF16_PEAK
    n, reps = 1024, 8
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = math.inf
    for _ in range(3):           # the best of three: a busy neighbour only slows a trial down
        t0 = clock()
        for _ in range(reps):
            a @ b
        best = min(best, clock() - t0)
    return 2 * n ** 3 * reps / best


def gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


SDPA_KERNELS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable")


def kernel_paths(counts) -> dict[str, str]:
    """Which SDPA kernel(s) and which expert-GEMM path an op census saw."""
    sdpa = "+".join(sorted(k.removeprefix("_scaled_dot_product_") for k in SDPA_KERNELS if counts.get(k))) or "none"
    experts = "grouped_mm" if counts.get("_grouped_mm") else "per_expert_mm"
    return {"sdpa": sdpa, "experts_gemm": experts}


def census(step, trajs, be=None) -> dict:
    """One step under the aten-op census (``neon_hpc.train.census``): ops, would-sync ops,
    MoE-layer (forward) syncs, per-parameter optimizer ops, and the kernel paths."""
    from neon_hpc.train.census import census as op_census
    moe, optimizer, n_params = [], None, 0
    if be is not None:
        from megatron.core.transformer.moe.moe_layer import MoELayer
        moe = [mod for m in be.models for mod in m.modules() if isinstance(mod, MoELayer)]
        optimizer, n_params = be.optimizer, sum(1 for m in be.models for _ in m.parameters())
    with op_census({"moe": moe}, optimizer=optimizer) as c:
        step(trajs)
    return {"ops": c.n_ops(), "syncs": c.n_syncs(), "moe_layer_syncs": c.n_syncs("moe"),
            "optimizer_per_param_ops": sum(c.per_tensor(n_params, "optimizer").values()),
            **kernel_paths(c.packets())}


def measure(name: str, fn, shapes, cfg, args, cuda: bool, peak: float, be=None) -> list[dict]:
    """Per shape: warm-ups, timed reps (median), memory above the start, one census step."""
    rows = []
    for docs, n in shapes:
        trajs = documents(cfg, docs, n, seed=docs * n)
        times, above, failed = [], 0, None
        try:
            for rep in range(args.warmup + args.reps):
                dt, pk, base = timed(fn, trajs, cuda)
                if rep >= args.warmup:
                    times.append(dt)
                    above = max(above, pk - base)
            cen = census(fn, trajs, be)
        except Exception as e:
            if not is_oom(e):
                raise
            failed, cen = "out of memory", {}
            if cuda:
                torch.cuda.empty_cache()
        med = float(np.median(times)) if times and not failed else math.nan
        rows.append(dict(side=name, shape=f"{docs}x{n}", tokens=input_tokens(trajs), step_s=med,
                         tok_s=input_tokens(trajs) / med, peak_above_start=above,
                         mfu=step_flops(cfg, trajs) / med / peak, failed=failed, **cen))
    return rows


def worker_trainer(args, cfg, cuda, precision, peak, shapes) -> dict:
    trainer = Trainer(cfg, precision, args.recompute, max(d * n for d, n in shapes))
    rows = measure("trainer", trainer.step, shapes, cfg, args, cuda, peak, be=trainer.be)
    if cuda:
        torch.cuda.empty_cache()
    mem = linear_memory(args, trainer, cfg, cuda)
    max_doc = max(mem, default=0)
    if cuda:
        print("\nlongest single document:", flush=True)
        max_doc = max(max_doc, longest_document(trainer, cfg, max(max_doc, 8192) * 2, args.max_doc))
    trainer.close()
    return {"rows": rows, "memory": {str(k): v for k, v in mem.items()}, "max_doc": max_doc}


def worker_reference(args, cfg, cuda, precision, peak, shapes) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ref = ReferenceStep(cfg, precision, device)
    return {"rows": measure("reference", ref.step, shapes, cfg, args, cuda, peak)}


def worker_dsv3(args, cfg, cuda, precision, peak, shapes) -> dict:
    mcfg = model_config("cuda" if cuda else "cpu", "deepseek_v3")
    d, n = shapes[0]
    t = Trainer(mcfg, precision, args.recompute, d * n)
    rows = measure("dsv3", t.step, [(d, n)], mcfg, args, cuda, peak)
    t.close()
    return {"rows": rows}


def worker_loop(args, cfg, cuda, precision, peak, shapes) -> dict:
    """The real loop on a run directory (claim, step, publish every step, checkpoint every 4)."""
    import tempfile

    from neon_hpc.config.store import StoreConfig
    from neon_hpc.protocol.rundir import RunDir
    from neon_hpc.store import ShardWriter
    from neon_hpc.train.loop import run_trainer
    from neon_hpc.train.sections import TrainerSections
    from neon_hpc.util.logs import read_metrics

    d, n = shapes[0]
    # the warm-up: --warmup steps, at least two checkpoint periods (8), so the first checkpoints'
    # one-time costs (megatron's save plan, which it reuses from the third save of an unchanged
    # structure; the sharding validation; the writer's first buckets: paid once a job) are outside
    # the window, as the bare step's first-use costs are; the window: 8 steps (two checkpoint
    # periods, checkpoints at its 4th and 8th step), then one more step (its end-of-run checkpoint
    # is outside the window)
    warm, window = max(args.warmup, 8), 8
    steps = warm + window + 1
    root = Path(tempfile.mkdtemp(prefix="bench_loop_"))
    exp = C.load(REPO / "configs" / "tiny_cpu.yaml")
    exp = dataclasses.replace(
        exp, model=cfg,
        balance=dataclasses.replace(exp.balance, tokens_per_microbatch=2 * d * n, min_microbatches=1, shadow=False),
        # quiet: the one publish and checkpoint at the end, outside the window
        train=dataclasses.replace(exp.train, steps=steps, trajectories_per_step=d,
                                  publish_every=steps if args.loop_quiet else 1,
                                  checkpoint_every=steps if args.loop_quiet else 4, publish_via="direct",
                                  precision=precision,
                                  checkpoint_async=not args.checkpoint_sync,
                                  recompute=args.recompute, wait_for_data_s=600.0, lr=1e-5),
        offpolicy=dataclasses.replace(exp.offpolicy, max_staleness=10 ** 6))
    run = RunDir(root / "run").create()
    run.run_yaml.write_text(C.dump(exp))
    w = ShardWriter(run.root, "bench", StoreConfig(flush_trajectories=10 * d))
    for step in range(steps):
        for t in documents(cfg, d, n, seed=1000 + step):
            w.add(t)
        p = w.flush()
        os_rename_ready(run, p)
        time.sleep(0.002)
    rc = run_trainer(TrainerSections.of(exp), str(run.root))
    recs = [r for r in read_metrics(run.root, "trainer") if "train_step_s" in r][warm:warm + window]
    # means over the window: the checkpoints' cost is spread over the steps they cover
    loop = float(np.mean([r["step_time_s"] - r.get("wait_s", 0.0) for r in recs])) if recs else math.nan
    bare = float(np.mean([r["train_step_s"] for r in recs])) if recs else math.nan
    pubs = [r.get("publish_s", 0.0) for r in recs]
    ck = [r["checkpoint_s"] for r in recs if "checkpoint_s" in r]
    return {"rc": rc, "loop_s": loop, "step_s": bare, "loop_over_step": loop / bare,
            "publish_snapshot_s": float(np.median(pubs)) if pubs else math.nan,
            "checkpoint_s": float(np.median(ck)) if ck else math.nan,
            "publish_write_s": [r.get("publish_write_s") for r in recs],
            "checkpoint_write_s": [r["checkpoint_write_s"] for r in recs if "checkpoint_write_s" in r]}


def os_rename_ready(run, shard: Path) -> None:
    """Move a flushed shard into ``trajectories/ready/`` as the store's writers do (atomic rename)."""
    dst = run.traj_ready / shard.name
    if shard.resolve() != dst.resolve():
        shard.rename(dst)


WORKERS = {"trainer": worker_trainer, "reference": worker_reference, "dsv3": worker_dsv3, "loop": worker_loop}


def linear_memory(args, trainer: Trainer, cfg: ModelConfig, cuda: bool) -> dict:
    """The trainer's step on one document of each memory length (ascending): peak and baseline."""
    out = {}
    print(f"\none document, the trainer's step ({'max_memory_allocated' if cuda else 'sampled RSS'}):", flush=True)
    for n in (int(x) for x in args.memory_lengths.split(",")):
        trajs = documents(cfg, 1, n + 1, seed=n)
        try:
            trainer.step(trajs)                       # warm: the allocator's pools for this size
            dt, peak, base = timed(trainer.step, trajs, cuda)
        except Exception as e:
            if not is_oom(e):
                raise
            print(f"  {n:>7} tokens: out of memory", flush=True)
            break
        out[n] = (peak, base, dt)
        print(f"  {n:>7} tokens: peak {gb(peak)}, above the step's start {gb(peak - base)}, {dt:.2f} s", flush=True)
    return out


def longest_document(trainer: Trainer, cfg: ModelConfig, start: int, limit: int) -> int:
    """Doubling single-document lengths from ``start`` until one does not fit (CUDA)."""
    best, n = 0, start
    while n <= limit:
        try:
            trainer.step(documents(cfg, 1, n + 1, seed=n))
            torch.cuda.synchronize()
        except Exception as e:
            if not is_oom(e):
                raise
            torch.cuda.empty_cache()
            print(f"  {n} tokens: out of memory", flush=True)
            break
        print(f"  {n} tokens: trained", flush=True)
        best, n = n, n * 2
    return best


def run_worker(side: str, argv: list[str]) -> dict:
    """``side`` in a fresh process (this script with ``--worker``); its JSON result."""
    import json
    import subprocess
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, __file__, *argv, "--worker", side, "--worker-out", out]
    env = dict(os.environ)
    if not torch.cuda.is_available() or "--device" in argv and argv[argv.index("--device") + 1] == "cpu":
        # one intra-op thread on CPU: idle OpenMP threads spin, and their spinning counts as this
        # process's CPU time (by as much as a busy neighbour makes them wait); one thread has none
        env["OMP_NUM_THREADS"] = env.get("BENCH_CPU_THREADS", "1")
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"bench worker {side!r} failed (exit {proc.returncode}): {' '.join(cmd)}")
    return json.loads(Path(out).read_text())


def setup_device(args):
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    kind = "cuda" if cuda else "cpu"
    global clock
    args.clock = args.clock if args.clock != "auto" else ("wall" if cuda else "cpu")
    clock = CLOCK[args.clock]
    args.shapes = args.shapes or SHAPES[kind]
    args.memory_lengths = args.memory_lengths or MEMORY_LENGTHS[kind]
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    from neon_hpc.train.backend import resolve_precision
    precision = resolve_precision(args.precision)
    return cuda, kind, precision


def main(argv=None) -> int:
    import json
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--shapes", default=None, help="documents x tokens, comma-separated; the first is the headline")
    p.add_argument("--memory-lengths", default=None, help="single-document lengths of the linear-memory check")
    p.add_argument("--max-doc", type=int, default=131072, help="CUDA: the longest single document to try")
    p.add_argument("--archs", default="qwen3_moe,deepseek_v3")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per shape (at least 2)")
    p.add_argument("--reps", type=int, default=5, help="timed steps per shape (at least 5); the median is reported")
    p.add_argument("--no-loop", action="store_true", help="skip the real-loop measurement (loop_over_step=nan)")
    p.add_argument("--checkpoint-sync", action="store_true",
                   help="real loop: synchronous checkpoints (train.checkpoint_async: false); without it the loop "
                        "runs both ways and reports loop_over_step_sync_ckpt beside loop_over_step")
    p.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                   help="auto: wall on CUDA; on CPU this process's CPU time (all its threads), which a "
                        "busy neighbour on a shared machine does not inflate (tokens/s and MFU both use it)")
    p.add_argument("--loop-quiet", action="store_true", help=argparse.SUPPRESS)   # the loop worker's baseline
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    if args.warmup < 2 or args.reps < 5:
        p.error(f"--warmup {args.warmup} --reps {args.reps}: at least 2 warm-ups and 5 timed repetitions")
    cuda, kind, precision = setup_device(args)
    if cuda and precision != "bf16":
        p.error("--device cuda runs bf16: the reference's experts are torch._grouped_mm, which takes bf16 on CUDA")
    peak = matmul_peak(cuda, torch.bfloat16 if precision == "bf16" else torch.float32)
    cfg = model_config(kind, "qwen3_moe")
    shapes = [parse_shape(x) for x in args.shapes.split(",")]
    from neon_hpc.models import cpu_shim
    cpu_shim.apply()
    if args.worker:
        res = WORKERS[args.worker](args, cfg, cuda, precision, peak, shapes)
        Path(args.worker_out).write_text(json.dumps(res))
        return 0
    print(f"device {kind} ({cpu_shim.kernels()['device']}), precision {precision}, recompute {args.recompute}, "
          f"threads {torch.get_num_threads()}, clock {args.clock}, MFU against {peak / 1e12:.2f} TFLOP/s "
          f"({'H200 bf16 dense peak' if cuda else 'fp32 matmul measured here'}), warm-ups {args.warmup}, "
          f"reps {args.reps} (median), each side in its own process", flush=True)
    print(f"model: Qwen3-MoE hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_attention_heads} heads / "
          f"{cfg.num_query_groups} KV, head {cfg.head_dim}, {cfg.num_experts} experts top-{cfg.moe_router_topk}, "
          f"expert FFN {cfg.moe_ffn_hidden_size}, vocab {cfg.vocab_size}", flush=True)
    passed = [a for a in raw if a not in ("--no-loop",)]
    tr = run_worker("trainer", passed)
    ref = run_worker("reference", passed)
    print(f"\n{'shape':>10} {'trainer tok/s':>14} {'reference tok/s':>16} {'ratio':>6} {'trainer +mem':>13} "
          f"{'reference +mem':>15} {'mfu':>6} {'ref mfu':>7} {'ops/ref':>8} {'syncs':>6} {'moe syncs':>9} "
          f"{'opt/param':>9}  sdpa / experts (trainer | reference)", flush=True)
    rows = []
    for t, r in zip(tr["rows"], ref["rows"]):
        row = dict(shape=t["shape"], ratio=t["tok_s"] / r["tok_s"], mfu=t["mfu"], reference_mfu=r["mfu"],
                   ops_over_reference=t.get("ops", math.nan) / r.get("ops", math.nan) if r.get("ops") else math.nan,
                   syncs=t.get("syncs", math.nan), moe_syncs=t.get("moe_layer_syncs", math.nan),
                   opt_ops=t.get("optimizer_per_param_ops", math.nan), sdpa=t.get("sdpa", "?"),
                   experts=t.get("experts_gemm", "?"))
        rows.append(row)
        fail = ("  " + ", ".join(f"{x['side']}: {x['failed']}" for x in (t, r) if x["failed"])
                if t["failed"] or r["failed"] else "")
        print(f"{t['shape']:>10} {t['tok_s']:>14.0f} {r['tok_s']:>16.0f} {row['ratio']:>6.2f} "
              f"{gb(t['peak_above_start']):>13} {gb(r['peak_above_start']):>15} {t['mfu']:>6.3f} {r['mfu']:>7.3f} "
              f"{row['ops_over_reference']:>8.2f} {row['syncs']:>6} {row['moe_syncs']:>9} {row['opt_ops']:>9}  "
              f"{row['sdpa']} / {row['experts']} | {r.get('sdpa', '?')} / {r.get('experts_gemm', '?')}{fail}",
              flush=True)
    mem = {int(k): v for k, v in tr["memory"].items()}
    ratio = ratio_above = math.nan
    if 8192 in mem and 16384 in mem:
        ratio = mem[16384][0] / mem[8192][0]
        ratio_above = (mem[16384][0] - mem[16384][1]) / max(mem[8192][0] - mem[8192][1], 1)
        print(f"peak 16k / peak 8k: {ratio:.2f} (above the step's start: {ratio_above:.2f})", flush=True)
    dsv3 = math.nan
    if "deepseek_v3" in args.archs.split(","):
        d = run_worker("dsv3", passed)["rows"][0]
        dsv3 = d["tok_s"] / tr["rows"][0]["tok_s"]
        print(f"\nDeepSeek-V3 (MLA, same sizes) trainer at {d['shape']}: {d['tok_s']:.0f} tok/s, "
              f"{dsv3:.2f}x Qwen3-MoE's", flush=True)
    loop_ratio = sync_ratio = quiet_ratio = inflation = math.nan
    if not args.no_loop:
        quiet = run_worker("loop", [*passed, "--loop-quiet"])
        print(f"\nquiet loop (no publish or checkpoint in the window): {quiet['loop_s']:.3f} s a step, "
              f"bare step {quiet['step_s']:.3f} s", flush=True)
        if not args.checkpoint_sync:   # the same-run baseline: the loop with synchronous checkpoints
            ls = run_worker("loop", [*passed, "--checkpoint-sync"])
            sync_ratio = ls["loop_over_step"]
            print(f"\nreal loop, synchronous checkpoints: {ls['loop_s']:.3f} s a step against the bare step's "
                  f"{ls['step_s']:.3f} s = {sync_ratio:.3f}; checkpoint {ls['checkpoint_s']:.3f} s on the step",
                  flush=True)
        lp = run_worker("loop", passed)
        loop_ratio = lp["loop_over_step"]
        quiet_ratio, inflation = lp["loop_s"] / quiet["step_s"], lp["step_s"] / quiet["step_s"]
        print(f"\nreal loop at {args.shapes.split(',')[0]} (claim, step, publish every step, checkpoint every 4): "
              f"{lp['loop_s']:.3f} s a step (mean over 8, two checkpoints among them) against the bare step's "
              f"{lp['step_s']:.3f} s = {loop_ratio:.3f}; "
              f"publish snapshot {lp['publish_snapshot_s']:.3f} s on the step, checkpoint {lp['checkpoint_s']:.3f} s, "
              f"publish writes beside the steps {lp['publish_write_s']}, checkpoint writes beside the steps "
              f"{lp['checkpoint_write_s']}; over the quiet loop's bare step: {quiet_ratio:.3f} (its bare "
              f"step {inflation:.3f}x the quiet one's)", flush=True)
    head = rows[0]
    print(f"RESULT trainer_over_reference={head['ratio']:.3f} rss_16k_over_8k={ratio:.3f} "
          f"max_doc_tokens={tr['max_doc']} "
          f"mfu={head['mfu']:.4f} device={kind} reference_mfu={head['reference_mfu']:.4f} "
          f"rss_16k_over_8k_above_start={ratio_above:.3f} dsv3_over_qwen={dsv3:.3f} precision={precision} "
          f"ops_over_reference={head['ops_over_reference']:.3f} syncs_per_step={head['syncs']} "
          f"moe_layer_syncs={head['moe_syncs']} optimizer_per_param_ops={head['opt_ops']} "
          f"loop_over_step={loop_ratio:.3f} loop_over_step_sync_ckpt={sync_ratio:.3f} "
          f"loop_over_quiet_step={quiet_ratio:.3f} step_inflation={inflation:.3f} "
          f"sdpa={head['sdpa']} experts_gemm={head['experts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
