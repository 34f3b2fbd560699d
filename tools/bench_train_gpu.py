#!/usr/bin/env python
"""The trainer's step against the same model written plainly in PyTorch, on this machine's device.

In one process, on the same tokens, interleaved after warm-up:

- **trainer**: neon-hpc's own step: ``train.backend.setup`` (megatron-core GPTModel, DDP,
  megatron's optimizer; ``train.precision`` as given, bf16 by default on CUDA), then per step
  ``train.loop.prepare_step`` (advantages, the balance assignment) and ``train.loop.train_step``
  (micro-batches with router replay, the piece attention, forward/backward, optimizer);
- **reference**: the same architecture written in this file (Qwen3-MoE: RMSNorm, GQA with
  per-head q/k norm and RoPE, softmax top-k router, SwiGLU experts through
  ``torch._grouped_mm``; attention as ``scaled_dot_product_attention`` per document), the same
  precision recipe (bf16 parameters, fp32 master copies, fused AdamW over them on CUDA; fp32
  and fused AdamW on CPU), cross-entropy over the same input/label tokens.

Per shape (documents x tokens): tokens/s of each (input tokens, ``n - 1`` per document),
their ratio, the peak memory of each (CUDA: ``max_memory_allocated``; CPU: sampled RSS, see
``train.heap.PeakMemory``), and MFU by the project's FLOP model
(``balance.cost.flops_breakdown``: ``a n + b n^2`` per document) against the device's dense
peak: 989 TFLOP/s bf16 on CUDA (H200), on CPU the fp32 matmul rate measured at start.  Times
are wall-clock on CUDA; on CPU they are this process's CPU time (``--clock``; the matmul peak
too, so MFU is compute over compute), because on a shared machine a neighbour's load
stretches wall time by whatever it happens to be doing.

Then the trainer alone: one document of growing length (the linear-memory check: peak at
16k over peak at 8k, both as measured and above the pre-step baseline) and the longest single
document that trains (``--max-doc``: lengths doubling until out of memory on CUDA; the
largest of the memory lengths on CPU).  With ``--archs`` including ``deepseek_v3`` the trainer
runs the MLA model of the same sizes at the headline shape too (``dsv3_over_qwen``: its
tokens/s over Qwen3-MoE's).

    python tools/bench_train_gpu.py                  # CPU: reduced shapes, a few minutes on 2 cores
    python tools/bench_train_gpu.py --device cuda    # the H200 shapes of issue 30 (1.83 B Qwen3-MoE)

Last line: ``RESULT trainer_over_reference=... rss_16k_over_8k=... max_doc_tokens=... mfu=...
device=cpu|cuda`` (ratio and MFU at the headline shape, the first of ``--shapes``), with
``reference_mfu``, ``dsv3_over_qwen`` and the precision after them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
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
    """``docs`` trajectories of ``tokens`` tokens (4 prompt tokens, the rest generated), with
    routes for every decoder layer (the trainer replays them)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(docs):
        mask = np.r_[np.zeros(4), np.ones(tokens - 4)].astype(np.uint8)
        routes = np.argsort(rng.random((tokens, cfg.num_layers, cfg.num_experts)), axis=-1)[..., :cfg.moe_router_topk]
        out.append(Trajectory(tokens=rng.integers(0, cfg.vocab_size, tokens).astype(np.int32), loss_mask=mask,
                              logprobs=np.where(mask > 0, -8.0, 0).astype(np.float32),
                              versions=np.where(mask > 0, 0, -1).astype(np.int32),
                              routed_experts=routes.astype(np.int32), reward=float(i % 2),
                              task_id=f"t{i // 2}", group_id=f"t{i // 2}"))
    return out


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
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


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


def compare(args, cfg: ModelConfig, cuda: bool, device: torch.device, precision: str, peak: float) -> dict:
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    max_tokens = max(d * n for d, n in shapes)
    trainer = Trainer(cfg, precision, args.recompute, max_tokens)
    ref = ReferenceStep(cfg, trainer.be.precision, device)
    rows = []
    print(f"{'shape':>10} {'trainer tok/s':>14} {'reference tok/s':>16} {'ratio':>6} {'trainer peak':>13} "
          f"{'reference peak':>15} {'mfu':>6} {'ref mfu':>7}", flush=True)
    for docs, n in shapes:
        trajs = documents(cfg, docs, n, seed=docs * n)
        tok = input_tokens(trajs)
        res = {"trainer": [], "reference": []}
        mem = {"trainer": 0, "reference": 0}
        failed = {}
        for rep in range(args.warmup + args.reps):
            for name, fn in (("trainer", trainer.step), ("reference", ref.step)):
                if name in failed:
                    continue
                try:
                    dt, pk, _ = timed(fn, trajs, cuda)
                except Exception as e:
                    if not is_oom(e):
                        raise
                    failed[name] = "out of memory"
                    if cuda:
                        torch.cuda.empty_cache()
                    continue
                if rep >= args.warmup:
                    res[name].append(dt)
                    mem[name] = max(mem[name], pk)
        med = {k: float(np.median(v)) if v else math.nan for k, v in res.items()}
        tps = {k: tok / v for k, v in med.items()}
        fl = step_flops(cfg, trajs)
        row = dict(shape=f"{docs}x{n}", trainer_tok_s=tps["trainer"], reference_tok_s=tps["reference"],
                   ratio=tps["trainer"] / tps["reference"], trainer_peak=mem["trainer"],
                   reference_peak=mem["reference"], mfu=fl / med["trainer"] / peak,
                   reference_mfu=fl / med["reference"] / peak, failed=failed)
        rows.append(row)
        fail = "  " + ", ".join(f"{k}: {v}" for k, v in failed.items()) if failed else ""
        print(f"{row['shape']:>10} {row['trainer_tok_s']:>14.0f} {row['reference_tok_s']:>16.0f} {row['ratio']:>6.2f} "
              f"{gb(row['trainer_peak']):>13} {gb(row['reference_peak']):>15} {row['mfu']:>6.3f} "
              f"{row['reference_mfu']:>7.3f}{fail}", flush=True)
    del ref
    return {"rows": rows, "trainer": trainer}


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--shapes", default=None, help="documents x tokens, comma-separated; the first is the headline")
    p.add_argument("--memory-lengths", default=None, help="single-document lengths of the linear-memory check")
    p.add_argument("--max-doc", type=int, default=131072, help="CUDA: the longest single document to try")
    p.add_argument("--archs", default="qwen3_moe,deepseek_v3")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                   help="auto: wall on CUDA; on CPU this process's CPU time (all its threads), which a "
                        "busy neighbour on a shared machine does not inflate (tokens/s and MFU both use it)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    kind = "cuda" if cuda else "cpu"
    global clock
    args.clock = args.clock if args.clock != "auto" else ("wall" if cuda else "cpu")
    clock = CLOCK[args.clock]
    args.shapes = args.shapes or SHAPES[kind]
    args.memory_lengths = args.memory_lengths or MEMORY_LENGTHS[kind]
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    from neon_hpc.train.backend import resolve_precision
    precision = resolve_precision(args.precision)
    if cuda and precision != "bf16":
        p.error("--device cuda runs bf16: the reference's experts are torch._grouped_mm, which takes bf16 on CUDA")
    peak = matmul_peak(cuda, torch.bfloat16 if precision == "bf16" else torch.float32)
    cfg = model_config(kind, "qwen3_moe")
    from neon_hpc.models import cpu_shim
    cpu_shim.apply()
    print(f"device {kind} ({cpu_shim.kernels()['device']}), precision {precision}, recompute {args.recompute}, "
          f"threads {torch.get_num_threads()}, clock {args.clock}, MFU against {peak / 1e12:.2f} TFLOP/s "
          f"({'H200 bf16 dense peak' if cuda else 'fp32 matmul measured here'})", flush=True)
    print(f"model: Qwen3-MoE hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_attention_heads} heads / "
          f"{cfg.num_query_groups} KV, head {cfg.head_dim}, {cfg.num_experts} experts top-{cfg.moe_router_topk}, "
          f"expert FFN {cfg.moe_ffn_hidden_size}, vocab {cfg.vocab_size}", flush=True)
    got = compare(args, cfg, cuda, device, precision, peak)
    rows, trainer = got["rows"], got["trainer"]
    if cuda:
        torch.cuda.empty_cache()
    mem = linear_memory(args, trainer, cfg, cuda)
    ratio = ratio_above = math.nan
    if 8192 in mem and 16384 in mem:
        ratio = mem[16384][0] / mem[8192][0]
        ratio_above = (mem[16384][0] - mem[16384][1]) / max(mem[8192][0] - mem[8192][1], 1)
        print(f"peak 16k / peak 8k: {ratio:.2f} (above the step's start: {ratio_above:.2f})", flush=True)
    max_doc = max(mem, default=0)
    if cuda:
        print("\nlongest single document:", flush=True)
        max_doc = max(max_doc, longest_document(trainer, cfg, max(max_doc, 8192) * 2, args.max_doc))
    trainer.close()
    dsv3 = math.nan
    if "deepseek_v3" in args.archs.split(","):
        mcfg = model_config(kind, "deepseek_v3")
        d, n = parse_shape(args.shapes.split(",")[0])
        t = Trainer(mcfg, precision, args.recompute, d * n)
        trajs = documents(mcfg, d, n, seed=7)
        times = [timed(t.step, trajs, cuda)[0] for _ in range(args.warmup + args.reps)][args.warmup:]
        t.close()
        dsv3_tps = input_tokens(trajs) / float(np.median(times))
        dsv3 = dsv3_tps / rows[0]["trainer_tok_s"]
        print(f"\nDeepSeek-V3 (MLA, same sizes) trainer at {d}x{n}: {dsv3_tps:.0f} tok/s, {dsv3:.2f}x Qwen3-MoE's",
              flush=True)
    head = rows[0]
    print(f"RESULT trainer_over_reference={head['ratio']:.3f} rss_16k_over_8k={ratio:.3f} max_doc_tokens={max_doc} "
          f"mfu={head['mfu']:.4f} device={kind} reference_mfu={head['reference_mfu']:.4f} "
          f"rss_16k_over_8k_above_start={ratio_above:.3f} dsv3_over_qwen={dsv3:.3f} precision={precision}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
