"""Benchmark the embedded engine: batched scheduling vs one request at a time.

Both runs serve the same tiny MoE over real HTTP with the same concurrent client load
(``--concurrency`` threads, ``--requests`` requests of ``--new-tokens`` greedy tokens with
routed experts); the baseline is the same engine with ``max_batch_size=1``.

    python tools/bench_engine.py [--requests 32] [--concurrency 16] [--new-tokens 16]

Ends with ``RESULT batched_tok_s=... sequential_tok_s=... speedup=... max_batch=...``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def _run(path: Path, max_batch: int, requests: int, concurrency: int, new_tokens: int) -> tuple[float, int]:
    from neon_hpc.rollout.engines.client import EngineClient
    from neon_hpc.rollout.engines.embedded import start_server

    with start_server(path, max_batch_size=max_batch) as handle:
        client = EngineClient(handle.url)
        client.generate([1, 2, 3], {"temperature": 0, "max_new_tokens": 2})  # warm-up
        prompts = [[(7 * i + j) % 200 + 1 for j in range(8 + i % 16)] for i in range(requests)]
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(concurrency) as ex:
            results = list(ex.map(lambda p: client.generate(
                p, {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
                return_routed_experts=True), prompts))
        dt = time.perf_counter() - t0
        info = json.loads(urllib.request.urlopen(handle.url + "/get_server_info", timeout=10).read())
    tokens = sum(len(r.output_ids) for r in results)
    print(f"max_batch_size={max_batch}: {tokens} tokens in {dt:.2f}s = {tokens / dt:.1f} tok/s "
          f"(largest batch {info['stats']['max_batch']})", flush=True)
    return tokens / dt, info["stats"]["max_batch"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=16)
    a = p.parse_args(argv)
    from neon_hpc.config.model import ModelConfig
    from neon_hpc.models.hf import build_hf_model, save_hf

    with tempfile.TemporaryDirectory() as d:
        cfg = ModelConfig()
        path = Path(d) / "v_0"
        save_hf(build_hf_model(cfg), cfg, path)
        seq, _ = _run(path, 1, a.requests, a.concurrency, a.new_tokens)
        bat, largest = _run(path, a.max_batch, a.requests, a.concurrency, a.new_tokens)
    print(f"RESULT batched_tok_s={bat:.1f} sequential_tok_s={seq:.1f} speedup={bat / seq:.2f} "
          f"max_batch={largest} requests={a.requests} new_tokens={a.new_tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
