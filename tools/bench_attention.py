#!/usr/bin/env python
"""The trainer's attention on the CPU: fused SDPA per run (``cp_attention.piece_attention``)
against the einsum path it replaced (``cp_attention.reference_piece_attention``, the baseline).

One layer's core attention, forward + backward, on packed documents of a piece map (one
rank, no exchange): per shape and path a fresh process (one CPU thread) runs a warm-up, then
``--reps`` timed calls; it reports the median CPU time of the process (one thread: its own
compute, not time waiting for a core on a shared machine; wall time printed beside it) and the
peak RSS over the RSS before the first timed call (the attention's own memory: inputs are
allocated before).  The paths
alternate shape by shape.  Default: 4 documents x 1024 and 1 x 8192 tokens, 4 query heads over
2 KV groups of dim 32 (hidden 128), float32.

Last line: ``RESULT fused_speedup_<shape>=... fused_mem_ratio_<shape>=... ...`` (reference
time / fused time; reference peak / fused peak) for every shape.

    .venv/bin/python tools/bench_attention.py                     # ~2 min on one idle core
    .venv/bin/python tools/bench_attention.py --shapes 1x16384 --paths fused
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16")


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(a) -> None:
    import torch

    from neon_hpc.models.cp_attention import build_piece_map, piece_attention, reference_piece_attention
    torch.set_num_threads(1)
    fn = piece_attention if a.path == "fused" else reference_piece_attention
    n_docs, n = (int(x) for x in a.shape.split("x"))
    s = n_docs * n
    dt = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, 1, h, d, generator=g).to(dt).requires_grad_()
               for h, d in ((a.heads, a.dim), (a.groups, a.dim), (a.groups, a.v_dim or a.dim)))
    w = torch.randn(s, 1, a.heads * (a.v_dim or a.dim), generator=g)
    lay = build_piece_map([[(i, 0, n) for i in range(n_docs)]], 0, s)
    small = build_piece_map([[(0, 0, 64)]], 0, 64)
    (fn(q[:64], k[:64], v[:64], small).float().sum()).backward()          # warm-up
    times, cpu, peak = [], [], 0
    for r in range(a.reps):
        q.grad = k.grad = v.grad = None
        before = max(_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        t, c = time.perf_counter(), time.process_time()
        (fn(q, k, v, lay).float() * w).sum().backward()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        if r == 0:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    print(json.dumps({"s": statistics.median(times), "cpu_s": statistics.median(cpu), "peak": peak}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="4x1024,1x8192", help="documents x tokens, comma-separated")
    ap.add_argument("--paths", default="reference,fused", help="reference (the baseline) and/or fused")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--v-dim", type=int, default=0, help="value head dim (MLA-like); 0 = --dim")
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    paths = a.paths.split(",")
    res: dict[tuple[str, str], dict] = {}
    print(f"heads {a.heads} over {a.groups} KV groups, head dim {a.dim}/{a.v_dim or a.dim}, {a.dtype}, "
          f"forward + backward, one thread, median of {a.reps}")
    print(f"{'shape':>9} {'path':>10} {'cpu s':>8} {'wall s':>8} {'peak MiB':>9}")
    for shape in a.shapes.split(","):
        for path in paths:
            cmd = [sys.executable, __file__, "--child", "--path", path, "--shape", shape, "--heads", str(a.heads),
                   "--groups", str(a.groups), "--dim", str(a.dim), "--v-dim", str(a.v_dim), "--dtype", a.dtype,
                   "--reps", str(a.reps)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))
            res[shape, path] = r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{shape:>9} {path:>10} {r['cpu_s']:8.3f} {r['s']:8.3f} {r['peak'] / 2**20:9.1f}", flush=True)
    kv = []
    if "reference" in paths and "fused" in paths:
        for shape in a.shapes.split(","):
            ref, fus = res[shape, "reference"], res[shape, "fused"]
            kv.append(f"fused_speedup_{shape}={ref['cpu_s'] / fus['cpu_s']:.2f}")
            kv.append(f"fused_mem_ratio_{shape}={ref['peak'] / max(fus['peak'], 1):.1f}")
    else:
        kv += [f"{p}_cpu_s_{sh}={r['cpu_s']:.3f} {p}_peak_mib_{sh}={r['peak'] / 2**20:.1f}"
               for (sh, p), r in res.items()]
    print("RESULT " + " ".join(kv))


if __name__ == "__main__":
    main()
