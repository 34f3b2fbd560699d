#!/usr/bin/env python
"""Device checks a lent GPU runs once (``tools/gpu_check.sh``), each writing JSON under ``--out``.

- ``profile``: one trainer step of the benchmark's model (``tools/bench_train_gpu.py``'s CUDA
  sizes) under ``torch.profiler`` after two warm-ups: the kernels by device time, and the count
  of host synchronisations (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaEventSynchronize``) and memcpys (``cudaMemcpy*`` runtime calls, and device memcpy
  activity by direction); the Chrome trace beside it.
- ``sdpa``: the piece attention at the trainer's real strides and lengths (``n - 1`` tokens of
  a document; Q, K and V views of one fused QKV projection, V the last slice; GQA 16/4 with
  head 128, and MLA's 192/128 q/k and v heads) against the same call forced onto the math
  kernel, forward and input gradients, with the kernel each shape ran on.

    python tools/gpu_probe.py profile --out DIR [--shape 4x4096]
    python tools/gpu_probe.py sdpa --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile(args) -> dict:
    from torch.profiler import ProfilerActivity, profile as prof

    import bench_train_gpu as bench

    cuda = torch.cuda.is_available()
    cfg = bench.model_config("cuda" if cuda else "cpu", "qwen3_moe")
    docs, n = bench.parse_shape(args.shape)
    trainer = bench.Trainer(cfg, "bf16" if cuda else "fp32", "none", docs * n)
    trajs = bench.documents(cfg, docs, n, seed=1)
    for _ in range(2):
        trainer.step(trajs)
    bench.sync(cuda)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with prof(activities=acts) as p:
        trainer.step(trajs)
        bench.sync(cuda)
    trainer.close()
    out = Path(args.out)
    p.export_chrome_trace(str(out / f"trace_{args.shape}.json"))
    events = p.key_averages()
    calls = Counter()
    kernels = []
    for e in events:
        calls[e.key] += e.count
        dev_us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if dev_us and not e.key.startswith(("cuda", "aten::", "autograd")):
            kernels.append((dev_us, e.key, e.count))
    kernels.sort(reverse=True)
    memcpy = {k: v for k, v in calls.items() if k.startswith("cudaMemcpy") or k.startswith("Memcpy")}
    return {"shape": args.shape, "syncs": {k: calls.get(k, 0) for k in SYNC_CALLS},
            "sync_total": sum(calls.get(k, 0) for k in SYNC_CALLS), "memcpy": memcpy,
            "kernels_top": [{"name": k, "device_us": t, "count": c} for t, k, c in kernels[:60]],
            "kernel_launches": calls.get("cudaLaunchKernel", 0) + calls.get("cuLaunchKernel", 0)}


def _fused_views(s: int, heads: int, groups: int, hn: int, hv: int, dtype, device, seed: int):
    """Q, K, V as megatron's attention makes them: views of one ``[s, 1, groups, (rep + 1) * hn + hv]``
    projection (per query group: its query heads, its key, its value), V the last slice."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    rep = heads // groups
    width = rep * hn + hn + hv
    mixed = torch.randn(s, 1, groups, width, generator=g).to(device=device, dtype=dtype).requires_grad_()
    q, k, v = torch.split(mixed, [rep * hn, hn, hv], dim=-1)
    return mixed, q.reshape(s, 1, heads, hn), k, v


def sdpa(args) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from neon_hpc.models.cp_attention import build_piece_map, piece_attention

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cases = [("gqa_16_4_d128", 16, 4, 128, 128), ("mla_192_128", 16, 16, 192, 128)]
    lengths = [int(x) for x in args.lengths.split(",")]
    results = []
    for name, heads, groups, hn, hv in cases:
        for n in lengths:
            s = n - 1                         # a document of n tokens feeds n - 1
            lay = build_piece_map([[(0, 0, s)]], 0, s, device=device)
            outs, grads, kernels = {}, {}, {}
            for mode in ("default", "math"):
                mixed, q, k, v = _fused_views(s, heads, groups, hn, hv, dtype, device, seed=n)
                seen = Counter()
                from torch.utils._python_dispatch import TorchDispatchMode

                class Seen(TorchDispatchMode):
                    def __torch_dispatch__(self, func, types, a=(), kw=None):
                        nm = func.__name__.split(".")[0]
                        if "scaled_dot_product" in nm:
                            seen[nm] += 1
                        return func(*a, **(kw or {}))
                ctx = sdpa_kernel([SDPBackend.MATH]) if mode == "math" else torch.enable_grad()
                with ctx, Seen():
                    o = piece_attention(q, k, v, lay)
                    (o.float().square().mean()).backward()
                outs[mode], grads[mode], kernels[mode] = o.detach().float(), mixed.grad.float(), dict(seen)
                del mixed, q, k, v, o
            err = (outs["default"] - outs["math"]).abs().max().item()
            gerr = (grads["default"] - grads["math"]).abs().max().item()
            scale = max(outs["math"].abs().max().item(), 1e-6)
            gscale = max(grads["math"].abs().max().item(), 1e-12)
            ok = err / scale < 2e-2 and gerr / gscale < 5e-2
            results.append({"case": name, "tokens": n, "fed": s, "max_abs_err": err, "rel_err": err / scale,
                            "grad_rel_err": gerr / gscale, "kernels": kernels["default"], "ok": ok})
            print(json.dumps(results[-1]), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"dtype": str(dtype), "results": results, "ok": all(r["ok"] for r in results)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("profile")
    a.add_argument("--out", required=True)
    a.add_argument("--shape", default="4x4096")
    b = sub.add_parser("sdpa")
    b.add_argument("--out", required=True)
    b.add_argument("--lengths", default="4096,32768")
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from neon_hpc.models import cpu_shim
    cpu_shim.apply()
    res = profile(args) if args.what == "profile" else sdpa(args)
    name = f"{args.what}_{args.shape}.json" if args.what == "profile" else "sdpa_parity.json"
    (Path(args.out) / name).write_text(json.dumps(res, indent=1) + "\n")
    print(f"{args.what}: wrote {Path(args.out) / name}", flush=True)
    return 0 if res.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
