#!/usr/bin/env python
"""Trajectory store vs a raw sequential file, same bytes, same durability, same run.

Store side: ShardWriter (HDF5, per-segment CRC-32, fsync, rename into ready/) and
read_shard (every check: schema, shapes, offsets, checksums). Raw side: the same payload
bytes per shard written with one write() + fsync, and read back with readinto(). Reads are
cold by default: pages are dropped from the page cache (fadvise DONTNEED after fsync), as
on a trainer node that did not write the file.

    python tools/bench_store.py                    # default: about 150 MB, a minute or two here
    python tools/bench_store.py --realistic        # 64 x 8k-32k tokens, 61 layers x top-8 (~1.3 GB)
    python tools/bench_store.py --compare-filters  # also: none / lzf / gzip on the routes dataset

Last line: RESULT store_write_vs_raw=<ratio> store_read_vs_raw=<ratio> bytes_per_token=<n> ...
(ratios are throughputs, store / raw, best of --repeat runs each; 1.0 = as fast as raw).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchlib import drop_cache  # tools/ is on sys.path when a script runs
from neon_hpc.config.store import StoreConfig
from neon_hpc.store import ShardWriter, Trajectory, read_shard
from neon_hpc.store.writer import write_shard


def make_load(a: argparse.Namespace) -> list[Trajectory]:
    """Random trajectories; routes are slices of one random pool (generating 1 GB of fresh
    random ids would dominate the run; the I/O and checksum paths do not care)."""
    rng = np.random.default_rng(a.seed)
    lengths = rng.integers(a.min_tokens, a.max_tokens + 1, size=a.trajectories)
    pool = rng.integers(0, a.experts, size=(int(lengths.max()) + 4096, a.layers, a.top_k)).astype(
        np.uint8 if a.experts <= 256 else np.uint16)
    trajs = []
    for i, n in enumerate(lengths.tolist()):
        mask = np.zeros(n, np.uint8)
        mask[n // 8:] = 1
        start = int(rng.integers(0, 4096))
        trajs.append(Trajectory(
            tokens=rng.integers(0, 150_000, n).astype(np.int32), loss_mask=mask,
            logprobs=np.where(mask == 1, -rng.random(n), 0).astype(np.float32),
            versions=np.where(mask == 1, 3, -1).astype(np.int32),
            routed_experts=pool[start:start + n], reward=float(rng.random()),
            task_id=f"bench-{i}", group_id=f"g{i // 8}", turn_offsets=np.array([0, n // 8, n])).check())
    return trajs


def payload_chunks(t: Trajectory) -> list[memoryview]:
    arrays = [t.tokens, t.loss_mask, t.logprobs, t.versions, t.routed_experts]
    return [memoryview(np.ascontiguousarray(x)).cast("B") for x in arrays]


def batches(trajs: list[Trajectory], per_shard: int) -> list[list[Trajectory]]:
    return [trajs[i:i + per_shard] for i in range(0, len(trajs), per_shard)]


def raw_write(root: Path, trajs, per_shard: int) -> tuple[float, list[Path]]:
    root.mkdir(parents=True)
    paths, t0 = [], time.perf_counter()
    for k, batch in enumerate(batches(trajs, per_shard)):
        p = root / f"raw_{k:04d}.bin"
        with open(p, "wb") as f:
            for t in batch:
                for mv in payload_chunks(t):
                    f.write(mv)
            f.flush()
            os.fsync(f.fileno())
        paths.append(p)
    return time.perf_counter() - t0, paths


def raw_read(paths: list[Path]) -> float:
    t0 = time.perf_counter()
    for p in paths:
        buf = np.empty(p.stat().st_size, dtype=np.uint8)
        with open(p, "rb", buffering=0) as f:
            f.readinto(memoryview(buf))
    return time.perf_counter() - t0


def store_write(root: Path, trajs, per_shard: int, cfg: StoreConfig) -> tuple[float, list[Path]]:
    t0 = time.perf_counter()
    with ShardWriter(root, "bench", cfg) as w:
        for t in trajs:
            w.add(t)
    return time.perf_counter() - t0, [i.path for i in w.published]


def store_read(paths: list[Path]) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = sum(len(read_shard(p)) for p in paths)
    return time.perf_counter() - t0, n


def cpu_timed(fn, *args):
    """(result, CPU seconds of this process, threads included): less disturbed by other
    processes than wall time, so it isolates the store's own overhead."""
    c0 = time.process_time()
    out = fn(*args)
    return out, time.process_time() - c0


def run_pair(base: Path, trajs, a, cfg: StoreConfig, rep: int) -> dict:
    raw_dir, store_dir = base / f"raw{rep}", base / f"store{rep}"
    (rw, raw_paths), rw_cpu = cpu_timed(raw_write, raw_dir, trajs, a.per_shard)
    (sw, store_paths), sw_cpu = cpu_timed(store_write, store_dir, trajs, a.per_shard, cfg)
    if not a.hot:
        drop_cache(raw_paths + store_paths)
    rr, rr_cpu = cpu_timed(raw_read, raw_paths)
    (sr, n), sr_cpu = cpu_timed(store_read, store_paths)
    if n != len(trajs):
        raise SystemExit(f"read back {n} trajectories, wrote {len(trajs)}")
    out = {"raw_write": rw, "store_write": sw, "raw_read": rr, "store_read": sr,
           "raw_write_cpu": rw_cpu, "store_write_cpu": sw_cpu, "raw_read_cpu": rr_cpu, "store_read_cpu": sr_cpu,
           "store_bytes": sum(p.stat().st_size for p in store_paths),
           "raw_bytes": sum(p.stat().st_size for p in raw_paths)}
    shutil.rmtree(raw_dir)
    shutil.rmtree(store_dir)
    return out


def compare_filters(base: Path, trajs, a) -> None:
    sample = trajs[:max(1, min(len(trajs), a.per_shard))]
    payload = sum(sum(mv.nbytes for mv in payload_chunks(t)) for t in sample)
    print(f"\nrouted_experts filters on one shard ({payload / 1e6:.0f} MB payload, uniform random ids):")
    print(f"  {'filter':<8} {'write MB/s':>10} {'read MB/s':>10} {'file/payload':>13}")
    for comp in ("none", "lzf", "gzip"):
        cfg = StoreConfig(routed_experts_compression=comp, fsync=True)
        p = base / f"filter_{comp}.h5"
        t0 = time.perf_counter()
        write_shard(p, sample, "bench", "bench", cfg)
        drop_cache([p])
        tw = time.perf_counter() - t0
        if not a.hot:
            drop_cache([p])
        t0 = time.perf_counter()
        read_shard(p)
        tr = time.perf_counter() - t0
        print(f"  {comp:<8} {payload / tw / 1e6:>10.0f} {payload / tr / 1e6:>10.0f} "
              f"{p.stat().st_size / payload:>13.3f}")
        p.unlink()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--min-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=384)
    p.add_argument("--per-shard", type=int, default=8, help="trajectories per shard (flush count)")
    p.add_argument("--repeat", type=int, default=9, help="alternating raw/store repetitions (best and median reported)")
    p.add_argument("--compression", choices=["none", "gzip", "lzf"], default="none")
    p.add_argument("--realistic", action="store_true", help="64 x 8k-32k tokens (about 1.3 GB; minutes)")
    p.add_argument("--hot", action="store_true", help="read from the page cache instead of cold")
    p.add_argument("--compare-filters", action="store_true")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir under /tmp)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.realistic:
        a.trajectories, a.min_tokens, a.max_tokens = 64, 8192, 32768
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    trajs = make_load(a)
    tokens = sum(t.num_tokens for t in trajs)
    payload = sum(sum(mv.nbytes for mv in payload_chunks(t)) for t in trajs)
    print(f"load: {len(trajs)} trajectories, {tokens} tokens, {a.layers}x top-{a.top_k} of {a.experts} "
          f"experts, {payload / 1e6:.0f} MB payload, {a.per_shard} per shard, "
          f"{'hot' if a.hot else 'cold'} reads", flush=True)
    base = Path(tempfile.mkdtemp(prefix="bench_store.", dir=a.dir))
    cfg = StoreConfig(flush_trajectories=a.per_shard, flush_bytes=1 << 40, flush_seconds=1e9,
                      routed_experts_compression=a.compression)
    try:
        runs = []
        for rep in range(a.repeat):
            r = run_pair(base, trajs, a, cfg, rep)
            runs.append(r)
            print(f"  rep {rep}: write raw {payload / r['raw_write'] / 1e6:.0f} MB/s, store "
                  f"{payload / r['store_write'] / 1e6:.0f} MB/s | read raw {payload / r['raw_read'] / 1e6:.0f} "
                  f"MB/s, store {payload / r['store_read'] / 1e6:.0f} MB/s | CPU s write {r['raw_write_cpu']:.2f}/"
                  f"{r['store_write_cpu']:.2f}, read {r['raw_read_cpu']:.2f}/{r['store_read_cpu']:.2f} (raw/store)",
                  flush=True)
        if a.compare_filters:
            compare_filters(base, trajs, a)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    # Best-of-N per side: on a shared, noisy machine the fastest repetition is the one least
    # disturbed by other work; the median ratios are printed too.
    best = {k: min(r[k] for r in runs) for k in runs[0]}
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"median ratios: write {med['raw_write'] / med['store_write']:.3f}, "
          f"read {med['raw_read'] / med['store_read']:.3f}")
    print(f"RESULT store_write_vs_raw={best['raw_write'] / best['store_write']:.3f} "
          f"store_read_vs_raw={best['raw_read'] / best['store_read']:.3f} "
          f"bytes_per_token={best['store_bytes'] / tokens:.1f} raw_bytes_per_token={best['raw_bytes'] / tokens:.1f} "
          f"store_write_MBps={payload / best['store_write'] / 1e6:.0f} "
          f"store_read_MBps={payload / best['store_read'] / 1e6:.0f} "
          f"store_cpu_write_s={best['store_write_cpu']:.2f} raw_cpu_write_s={best['raw_write_cpu']:.2f} "
          f"store_cpu_read_s={best['store_read_cpu']:.2f} raw_cpu_read_s={best['raw_read_cpu']:.2f} tokens={tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
