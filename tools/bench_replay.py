#!/usr/bin/env python
"""Benchmark delta router replay against full export, over real HTTP on the embedded engine.

Per mode (``full`` = the baseline, ``delta``) it runs the same 32-turn conversations, each
turn appending environment tokens and generating tokens, growing to long context, and per
turn measures:

- ``route_bytes``: bytes of routed experts on the wire (the base64 text in the response);
- ``serialize_s``: the server-side serialization of those routes (int32 array -> base64 ->
  JSON string), timed here on the identical array, since the engine does not report it;
- ``decode_s``: the client's decode of the received routes (JSON -> base64 -> int32 array);
- ``request_s``: the whole HTTP round trip (generation included; for context only).

Delta's routes are checked against the full export at the end (row for row).  A small model
of the data-parallel stall then scales the measured per-byte costs to a Kimi-K2-class shape
(61 MoE layers, top-8, 64k-token conversations of 32 turns): with ``N`` DP ranks exporting
in lockstep, each turn waits for the slowest rank.

Last line: ``RESULT replay_bytes_full_over_delta=<r> replay_export_time_full_over_delta=<r> ...``.
Default size runs in a few minutes on 2 CPU cores; ``--turns/--env-tokens/--gen-tokens`` scale it.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def serialize_cost(routes: np.ndarray, reps: int) -> float:
    """Seconds to serialize ``routes`` the way an SGLang-style server does (best of reps)."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        json.dumps({"meta_info": {"routed_experts": base64.b64encode(
            np.ascontiguousarray(routes, dtype=np.int32).tobytes()).decode("ascii")}})
        best = min(best, time.perf_counter() - t)
    return best


def decode_cost(routes: np.ndarray, reps: int) -> tuple[float, int]:
    """(seconds, wire bytes) to decode the server's payload for ``routes`` (best of reps)."""
    payload = json.dumps({"meta_info": {"routed_experts": base64.b64encode(
        np.ascontiguousarray(routes, dtype=np.int32).tobytes()).decode("ascii")}})
    wire = len(payload.encode())
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        b64 = json.loads(payload)["meta_info"]["routed_experts"]
        arr = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
        arr.reshape(-1, *routes.shape[1:]) if routes.shape[0] else arr
        best = min(best, time.perf_counter() - t)
    return best, wire


def run_conversation(client, mode: str, turns: int, env_tokens: int, gen_tokens: int, vocab: int,
                     seed: int, reps: int) -> tuple[list[dict], object]:
    from neon_hpc.replay import ReplayConversation

    rnd = random.Random(seed)
    conv = ReplayConversation(client, mode=mode)
    tokens: list[int] = []
    per_turn = []
    for k in range(turns):
        prompt = tokens + [rnd.randrange(16, vocab) for _ in range(env_tokens)]
        t = time.perf_counter()
        res = conv.generate(prompt, {"temperature": 1.0, "max_new_tokens": gen_tokens, "sampling_seed": seed + k,
                                     "ignore_eos": True})
        request_s = time.perf_counter() - t
        start = conv.last_start
        tokens = prompt + list(res.output_ids)
        rows = conv.cache.routed_experts[start:len(tokens) - 1]
        dec_s, wire = decode_cost(rows, reps)
        per_turn.append({"turn": k, "context": len(tokens), "start": start, "rows": int(len(rows)),
                         "route_bytes": wire, "serialize_s": serialize_cost(rows, reps),
                         "decode_s": dec_s, "request_s": request_s})
    return per_turn, conv


def dp_stall_model(cost_per_byte: float, fixed_s: float, ranks: int, turns: int, context: int,
                   layers: int, topk: int, seed: int = 0) -> dict:
    """Seconds all ranks wait on route exports per conversation-length of lockstep turns.

    Each of ``ranks`` DP ranks serves a conversation at a random phase of its 32 turns
    (context grows linearly to ``context`` tokens); at every lockstep turn each rank exports
    its routes (full: the whole context; delta: the newest turn) and the step waits for the
    slowest.  Returns the summed wait for ``turns`` lockstep turns.
    """
    rnd = random.Random(seed)
    per_turn_tokens = context // turns
    row_bytes = layers * topk * 4 * 4 / 3            # int32, base64 on the wire
    phases = [rnd.randrange(turns) for _ in range(ranks)]
    out = {}
    for mode in ("full", "delta"):
        wait = 0.0
        for step in range(turns):
            worst = 0.0
            for r in range(ranks):
                k = (phases[r] + step) % turns
                rows = per_turn_tokens * (k + 1) if mode == "full" else per_turn_tokens
                worst = max(worst, fixed_s + rows * row_bytes * cost_per_byte)
            wait += worst
        out[mode] = wait
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=32)
    ap.add_argument("--env-tokens", type=int, default=96, help="tokens the environment appends per turn")
    ap.add_argument("--gen-tokens", type=int, default=8, help="tokens generated per turn")
    ap.add_argument("--conversations", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4, help="MoE layers of the benchmark model")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each timed (de)serialization")
    ap.add_argument("--dp-ranks", type=int, default=8)
    ap.add_argument("--kimi-context", type=int, default=65536)
    ap.add_argument("--json", default="", help="write per-turn measurements to this file")
    args = ap.parse_args(argv)

    from neon_hpc.config.model import ModelConfig
    from neon_hpc.models.hf import build_hf_model, save_hf
    from neon_hpc.rollout.engines.client import EngineClient
    from neon_hpc.rollout.engines.embedded import start_server

    ctx = args.turns * (args.env_tokens + args.gen_tokens)
    mcfg = ModelConfig(num_layers=args.layers, num_experts=args.experts, moe_router_topk=args.topk,
                       max_position_embeddings=max(2048, ctx + 64))
    with tempfile.TemporaryDirectory() as tmp:
        path = save_hf(build_hf_model(mcfg), mcfg, Path(tmp) / "v_0")
        server = start_server(str(path), "127.0.0.1", port=0)
        try:
            client = EngineClient(server.url)
            results = {}
            for mode in ("full", "delta"):
                rows_all, convs = [], []
                for c in range(args.conversations):
                    per_turn, conv = run_conversation(client, mode, args.turns, args.env_tokens,
                                                      args.gen_tokens, mcfg.vocab_size, 1000 + c, args.reps)
                    rows_all += per_turn
                    convs.append(conv)
                    print(f"[{mode}] conversation {c + 1}/{args.conversations}: {per_turn[-1]['context']} tokens, "
                          f"{sum(p['route_bytes'] for p in per_turn)} route bytes", file=sys.stderr, flush=True)
                results[mode] = (rows_all, convs)
        finally:
            server.stop()

    full_rows, full_convs = results["full"]
    delta_rows, delta_convs = results["delta"]
    for fc, dc in zip(full_convs, delta_convs):
        n = len(dc.cache.tokens)
        if not np.array_equal(fc.cache.tokens, dc.cache.tokens):
            continue   # sampling differed (seeded sampling should make them equal)
        if not np.array_equal(fc.routed_experts(n)[:-1], dc.routed_experts(n)[:-1]):
            print("ERROR: delta routes differ from the full export", file=sys.stderr)
            return 1

    def tot(rows, key):
        return sum(r[key] for r in rows)

    bytes_ratio = tot(full_rows, "route_bytes") / max(1, tot(delta_rows, "route_bytes"))
    export = lambda rows: tot(rows, "serialize_s") + tot(rows, "decode_s")
    time_ratio = export(full_rows) / max(1e-12, export(delta_rows))
    q = max(1, args.turns // 4)
    first = [r["serialize_s"] + r["decode_s"] for r in delta_rows if r["turn"] < q]
    last = [r["serialize_s"] + r["decode_s"] for r in delta_rows if r["turn"] >= args.turns - q]
    flat = statistics.median(last) / max(1e-12, statistics.median(first))
    # per-byte cost from the full mode's largest exports (least dominated by fixed overhead)
    big = sorted(full_rows, key=lambda r: r["route_bytes"])[-max(1, len(full_rows) // 4):]
    per_byte = sum(r["serialize_s"] + r["decode_s"] for r in big) / sum(r["route_bytes"] for r in big)
    fixed = max(0.0, min(r["serialize_s"] + r["decode_s"] for r in delta_rows)
                - per_byte * min(r["route_bytes"] for r in delta_rows))
    stall = dp_stall_model(per_byte, fixed, args.dp_ranks, 32, args.kimi_context, 61, 8)

    print(f"{'turn':>4} {'context':>7} {'full_bytes':>10} {'delta_bytes':>11} {'full_ms':>8} {'delta_ms':>8}")
    for f, d in zip(full_rows[:args.turns], delta_rows[:args.turns]):
        print(f"{f['turn']:>4} {f['context']:>7} {f['route_bytes']:>10} {d['route_bytes']:>11} "
              f"{1e3 * (f['serialize_s'] + f['decode_s']):>8.3f} {1e3 * (d['serialize_s'] + d['decode_s']):>8.3f}")
    print(f"measured cost per wire byte (serialize + decode): {per_byte * 1e9:.3f} ns; fixed {fixed * 1e6:.1f} us")
    print(f"Kimi-K2-class DP stall model ({args.dp_ranks} ranks, 61 layers, top-8, 32 turns to "
          f"{args.kimi_context} tokens): full {stall['full']:.3f} s, delta {stall['delta']:.4f} s per conversation")
    if args.json:
        Path(args.json).write_text(json.dumps({"full": full_rows, "delta": delta_rows, "dp_stall": stall}, indent=1))
    print(f"RESULT replay_bytes_full_over_delta={bytes_ratio:.2f} replay_export_time_full_over_delta={time_ratio:.2f} "
          f"delta_export_last_over_first_quarter={flat:.2f} kimi_dp_stall_full_s={stall['full']:.3f} "
          f"kimi_dp_stall_delta_s={stall['delta']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
