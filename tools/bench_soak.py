"""Soak: what grows over a long run. Two parts, both against the real components.

1. **Claim soak** (always): real shard writers publish small shards into ``ready/`` and the real
   ``store.claim_step`` claims them step after step until ``claimed/`` holds ``--claim-shards``
   shards (thousands). Per claim: latency, and the filesystem metadata operations the claiming
   process makes (``os.listdir/scandir/stat/lstat/open/rename/replace/mkdir/unlink/rmdir`` and
   ``open``, counted by wrapping them; h5py's own C-level opens are not seen). Growth is the
   mean of the last 10 % of claims over the first 10 % (1.0 = flat).
2. **Run soak** (``--run-s > 0``): ``neon-hpc run`` on the tiny model with ``--workers`` rollout
   workers and short episodes, for a bounded time. Every ``--sample-s`` it records the RSS of
   every process by role (launcher, trainer, node, engine, worker: each process's own RSS;
   per role the largest) and the ``ready/`` backlog; then it stops the run with SIGINT. The
   RSS slope is a least-squares fit over the samples after the first quarter (warm-up); the
   slope of each quarter is printed too (warm-up shows as a slope that falls to ~0 quarter by
   quarter, a leak as one that stays), and the raw series is written to ``soak_rss.jsonl``
   beside the run directory. Per role it also names the largest rise between two samples (when,
   from, to: a one-time high-water mark shows as one such step). ``--memdebug N`` runs the
   trainer with ``NEON_TRAIN_MEMDEBUG=N`` (``neon_hpc/train/heap.py``) and summarises its
   malloc records: bytes in use vs. RSS (the trainer trims freed arena memory after every step;
   ``NEON_TRAIN_MALLOC_TRIM=0`` in the environment turns that off, to compare).

Ends with ``RESULT soak_rss_growth_mb_per_h=... soak_claim_latency_growth=...
soak_backlog_max=... soak_metadata_ops_per_claim_first=... soak_metadata_ops_per_claim_last=...``
(``soak_rss_growth_mb_per_h`` and ``soak_backlog_max`` are ``nan`` without the run soak).

    python tools/bench_soak.py --claim-shards 3000                   # part 1 only
    python tools/bench_soak.py --run-s 1800 --workers 16            # both
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_OS_OPS = ("listdir", "scandir", "stat", "lstat", "open", "rename", "replace", "mkdir", "unlink", "rmdir")


@contextlib.contextmanager
def count_metadata_ops():
    """Count calls of the filesystem metadata functions above (and builtins.open) in this process."""
    counts = {"n": 0}
    saved = {name: getattr(os, name) for name in _OS_OPS}
    saved_open = builtins.open

    def wrap(fn):
        def inner(*a, **k):
            counts["n"] += 1
            return fn(*a, **k)
        return inner

    for name, fn in saved.items():
        setattr(os, name, wrap(fn))
    builtins.open = wrap(saved_open)
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(os, name, fn)
        builtins.open = saved_open


def claim_soak(root: Path, total_shards: int, per_step: int) -> dict:
    from neon_hpc.config.store import StoreConfig
    from neon_hpc.protocol.rundir import RunDir
    from neon_hpc.store import ShardWriter, claim_step
    from neon_hpc.store.synthetic import make_trajectory
    from neon_hpc.train.offpolicy import StalePolicy

    run = RunDir(root).create()
    rng = np.random.default_rng(0)
    writer = ShardWriter(run.root, "soak", StoreConfig(flush_trajectories=1, fsync=False))
    lat, ops, claimed = [], [], []
    step = 0
    while step * per_step < total_shards:
        step += 1
        for _ in range(per_step):
            writer.add(make_trajectory(rng, 64, version=step - 1))
        with count_metadata_ops() as c:
            t0 = time.perf_counter()
            claim_step(run.root, step, want=per_step, consumer="soak", admit=StalePolicy(step - 1, 4, "drop"),
                       timeout_s=60)
            lat.append(time.perf_counter() - t0)
        ops.append(c["n"])
        claimed.append(step * per_step)
    k = max(1, len(lat) // 10)
    return {"claims": len(lat), "shards": claimed[-1], "latency_first_s": float(np.mean(lat[:k])),
            "latency_last_s": float(np.mean(lat[-k:])), "growth": float(np.mean(lat[-k:]) / np.mean(lat[:k])),
            "ops_first": float(np.mean(ops[:k])), "ops_last": float(np.mean(ops[-k:]))}


def _role(cmd: str) -> str | None:
    for key, role in (("roles rollout-worker", "worker"), ("roles rollout-node", "node"),
                      ("roles trainer", "trainer"), ("neon_hpc.cli run", "launcher")):
        if key in cmd:
            return role
    return "engine" if "engine" in cmd else None


def fit_slopes(samples: list[tuple[float, dict[str, float]]], lo: float, hi: float) -> dict[str, float]:
    """Least-squares RSS slope (MB/h) per role over the samples with ``lo <= t <= hi`` seconds."""
    out = {}
    win = [s for s in samples if lo <= s[0] <= hi]
    for role in sorted({r for _, d in win for r in d}):
        pts = [(t, d[role]) for t, d in win if role in d]
        if len(pts) >= 3:
            ts, ys = np.array([t for t, _ in pts]) / 3600.0, np.array([y for _, y in pts])
            out[role] = float(np.polyfit(ts, ys, 1)[0])
    return out


def _windows(run_s: float) -> list[tuple[float, float]]:
    """Consecutive quarters of the run: warm-up shows as a slope that falls window by window."""
    q = run_s / 4
    return [(i * q, (i + 1) * q) for i in range(4)]


def largest_rise(samples: list[tuple[float, dict[str, float]]]) -> dict[str, tuple[float, float, float]]:
    """Per role, the largest RSS rise between consecutive samples: (t of the later one, from MB, to MB)."""
    out: dict[str, tuple[float, float, float]] = {}
    last: dict[str, float] = {}
    for t, d in samples:
        for role, mb in d.items():
            best = out.get(role)
            if role in last and mb > last[role] and (best is None or mb - last[role] > best[2] - best[1]):
                out[role] = (t, last[role], mb)
            last[role] = mb
    return out


def memdebug_summary(path: Path) -> dict | None:
    """The trainer's NEON_TRAIN_MEMDEBUG records: RSS and malloc in-use, first and last quarter means."""
    if not path.exists():
        return None
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r.get("malloc")]
    if len(recs) < 4:
        return None
    q = len(recs) // 4

    def mean(rs, f):
        return float(np.mean([f(r) for r in rs])) / 1024

    trims = [r["trim_ms"] for r in recs if r.get("trim_ms") is not None]
    return {"records": len(recs), "steps": (recs[0]["step"], recs[-1]["step"]),
            "rss_mb": (mean(recs[:q], lambda r: r["rss_kb"]), mean(recs[-q:], lambda r: r["rss_kb"])),
            "in_use_mb": (mean(recs[:q], lambda r: r["malloc"]["used_kb"]),
                          mean(recs[-q:], lambda r: r["malloc"]["used_kb"])),
            "threads": recs[-1]["threads"], "heaps": recs[-1]["malloc"].get("heaps"),
            "trimmed": bool(recs[-1].get("trimmed")), "trim_ms_mean": float(np.mean(trims)) if trims else math.nan,
            "max_seq_seen": recs[-1].get("max_seq_seen")}


def run_soak(root: Path, run_s: float, workers: int, sample_s: float, memdebug: int = 0) -> dict:
    import psutil

    from neon_hpc.store.claim import ready_count
    cmd = [sys.executable, "-m", "neon_hpc.cli", "run", str(REPO / "configs" / "tiny_cpu.yaml"), "--run-dir",
           str(root), "--quiet", "--no-plot", "--set", "train.steps=100000", "--set", f"rollout.num_workers={workers}",
           "--set", "rollout.max_new_tokens=4", "--set", "train.checkpoint_every=50",
           "--set", "warm_start.enabled=false", "--set", "eval.num_tasks=0"]
    out = open(root.parent / "soak_launcher.txt", "ab")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if memdebug:
        env["NEON_TRAIN_MEMDEBUG"] = str(memdebug)
    p = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=out, start_new_session=True, env=env)
    samples: list[tuple[float, dict[str, float]]] = []
    backlog = []
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < run_s and p.poll() is None:
            time.sleep(sample_s)
            per_role: dict[str, float] = {}
            for q in psutil.process_iter(["cmdline", "memory_info"]):
                try:
                    c = " ".join(q.info["cmdline"] or [])
                    if str(root) not in c:
                        continue
                    role = _role(c)
                    if role:
                        per_role[role] = max(per_role.get(role, 0.0), q.info["memory_info"].rss / 2**20)
                except (psutil.Error, TypeError):
                    continue
            samples.append((time.monotonic() - t0, per_role))
            with contextlib.suppress(FileNotFoundError, OSError):
                backlog.append(ready_count(root)[0])
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=240)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    with open(root.parent / "soak_rss.jsonl", "w") as f:     # the raw series, for other windows
        for t, d in samples:
            f.write(json.dumps({"t": round(t, 1), **{k: round(v, 1) for k, v in d.items()}}) + "\n")
    slopes = fit_slopes(samples, run_s / 4, run_s)
    windows = {f"{lo / 60:.0f}-{hi / 60:.0f}min": fit_slopes(samples, lo, hi)
               for lo, hi in _windows(run_s)}
    steps = 0
    with contextlib.suppress(FileNotFoundError):
        steps = len({json.loads(line).get("step") for line in (root / "logs" / "trainer" / "metrics.jsonl")
                     .read_text().splitlines() if line.strip()})
    return {"slopes_mb_per_h": slopes, "windows": windows, "backlog_max": max(backlog, default=0),
            "samples": len(samples), "steps": steps, "rss_last_mb": samples[-1][1] if samples else {},
            "rises": largest_rise(samples),
            "memdebug": memdebug_summary(root / "logs" / "trainer" / "memdebug_0.jsonl")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--claim-shards", type=int, default=3000)
    ap.add_argument("--per-step", type=int, default=10, help="shards per claim in the claim soak")
    ap.add_argument("--run-s", type=float, default=0.0, help="run soak duration (0: skip it)")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--memdebug", type=int, default=0, help="record the trainer's memory every N steps (0: off)")
    ap.add_argument("--work-dir", default=None)
    a = ap.parse_args(argv)
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="neon-soak."))
    work.mkdir(parents=True, exist_ok=True)
    c = claim_soak(work / "claims", a.claim_shards, a.per_step)
    print(f"claim soak: {c['claims']} claims, {c['shards']} shards in claimed/; latency "
          f"{c['latency_first_s'] * 1e3:.1f} ms -> {c['latency_last_s'] * 1e3:.1f} ms (x{c['growth']:.2f}); "
          f"metadata ops per claim {c['ops_first']:.0f} -> {c['ops_last']:.0f}", flush=True)
    rss, backlog = math.nan, math.nan
    if a.run_s > 0:
        r = run_soak(work / "run", a.run_s, a.workers, a.sample_s, a.memdebug)
        print(f"run soak: {a.run_s:.0f}s, {a.workers} workers, {r['steps']} steps, {r['samples']} samples; "
              f"RSS slope MB/h by role {json.dumps({k: round(v, 1) for k, v in r['slopes_mb_per_h'].items()})}; "
              f"last RSS MB {json.dumps({k: round(v) for k, v in r['rss_last_mb'].items()})}; "
              f"ready/ backlog max {r['backlog_max']}", flush=True)
        for name, sl in r["windows"].items():
            print(f"  RSS slope MB/h over {name}: {json.dumps({k: round(v, 1) for k, v in sl.items()})}", flush=True)
        for role, (t, lo, hi) in sorted(r["rises"].items()):
            print(f"  largest RSS rise between two samples: {role} {lo:.0f} -> {hi:.0f} MB (+{hi - lo:.1f}) "
                  f"at {t / 60:.1f} min", flush=True)
        md = r["memdebug"]
        if md:
            print(f"  trainer memory records (steps {md['steps'][0]}-{md['steps'][1]}, {md['records']} records, "
                  f"malloc_trim after each step: {md['trimmed']}, {md['trim_ms_mean']:.1f} ms): RSS "
                  f"{md['rss_mb'][0]:.0f} -> {md['rss_mb'][1]:.0f} MB, malloc in use {md['in_use_mb'][0]:.0f} -> "
                  f"{md['in_use_mb'][1]:.0f} MB (first vs last quarter); {md['threads']} threads, {md['heaps']} "
                  f"arenas, longest sequence {md['max_seq_seen']}", flush=True)
        rss = max(r["slopes_mb_per_h"].values(), default=math.nan)
        backlog = r["backlog_max"]
    print(f"work dir {work}")
    print(f"RESULT soak_rss_growth_mb_per_h={rss:.1f} soak_claim_latency_growth={c['growth']:.2f} "
          f"soak_backlog_max={backlog} soak_metadata_ops_per_claim_first={c['ops_first']:.0f} "
          f"soak_metadata_ops_per_claim_last={c['ops_last']:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
