#!/usr/bin/env python
"""Benchmark: the converter vs a materialize-then-convert baseline and the read+write floor, in one run.

Builds (once, cached in --workdir) a synthetic Megatron-layout torch_dist checkpoint saved by
megatron-core from 2 gloo processes: MoE with many experts, bf16 weights, one fp32 optimizer
state per weight in the same files, sealed with the digests (integrity.json) neon-hpc's
trainer writes.  Then, with the checkpoint dropped from the page cache before each run
(posix_fadvise DONTNEED on every file):

  baseline  what a user would write: megatron-core's dist_checkpointing.load_plain_tensors
            (every tensor materialized, optimizer state included), the same name rules in
            memory, then the sharded safetensors writer transformers' save_pretrained uses
            (huggingface_hub.save_torch_state_dict) and transformers' AutoConfig for config.json
  fast1     tools/reshard.py, one process (digests verified while reading)
  fast1_nov tools/reshard.py --no-verify-digests (the cost of the digest check)
  fast2     mpiexec -n 2 tools/reshard.py
  floor1/2  raw pread of exactly the byte ranges the model needs + raw fsynced write of the
            output's size, by 1 process and by 2 processes (each rank's share of the tasks)

The lean serial mode (``--mode serial``) is what ``--verify`` compares against; it is not timed here.
Each converter run is a fresh process (start-up and imports count).  Reported per run: wall
time, bytes read and written (/proc/PID/io), peak RSS summed over processes.

  python tools/bench_reshard.py                 # default: ~1.2 GB of bf16 weights, ~3.7 GB checkpoint
  python tools/bench_reshard.py --size-gb 4     # bigger (more layers)

Last line: RESULT reshard_speedup_vs_baseline=... reshard_speedup_vs_baseline_2ranks=...
reshard_floor_efficiency=... reshard_floor_efficiency_2ranks=... reshard_rss_ratio=...
reshard_digest_cost=...   (speedup = baseline / converter time; floor efficiency = floor time /
converter time at the same rank count; rss ratio = converter / baseline; digest cost =
verified / unverified time - 1, target <= 0.05)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchlib import drop_cache  # noqa: E402  (tools/ is on sys.path when a script runs)
from neon_hpc.reshard.synthetic import SynthSpec  # noqa: E402  (no torch/megatron at import)

PY = sys.executable
MPIEXEC = str(Path(PY).parent / "mpiexec")


def spec_for(size_gb: float) -> SynthSpec:
    base = SynthSpec(layers=1, experts=64, hidden=1024, moe_ffn=384, heads=16, groups=4, head_dim=64,
                     vocab=32000, tp=2, procs=2, optimizer_states=1)
    per_layer = SynthSpec(**{**asdict(base), "layers": 2}).model_bytes() - base.model_bytes()
    layers = max(1, round((size_gb * 1e9 - base.model_bytes() + per_layer) / per_layer))
    return SynthSpec(**{**asdict(base), "layers": layers})


def ensure_checkpoint(workdir: Path, spec: SynthSpec) -> Path:
    tag = "_".join(f"{k}{v}" for k, v in asdict(spec).items())
    ckpt = workdir / f"ckpt_{zlib.crc32(tag.encode()):08x}"
    if (ckpt / "DONE").exists() and json.loads((ckpt / "DONE").read_text()) == asdict(spec) \
            and (ckpt / "ckpt" / "integrity.json").exists():
        return ckpt
    shutil.rmtree(ckpt, ignore_errors=True)
    print(f"generating synthetic checkpoint ({spec.model_bytes() / 1e9:.2f} GB weights, {spec.layers} layers x "
          f"{spec.experts} experts) in {ckpt} ...", flush=True)
    t = time.monotonic()
    from neon_hpc.reshard.synthetic import generate
    generate(ckpt / "ckpt", spec)
    (ckpt / "hf").mkdir(parents=True)
    (ckpt / "hf" / "config.json").write_text(json.dumps(spec.hf_config()))
    (ckpt / "DONE").write_text(json.dumps(asdict(spec)))
    print(f"  generated in {time.monotonic() - t:.0f}s", flush=True)
    return ckpt


def ckpt_files(ckpt: Path) -> list[Path]:
    return [p for p in (ckpt / "ckpt").iterdir() if p.is_file()]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}


def run_converter(ckpt: Path, out: Path, n: int, extra: tuple[str, ...] = ()) -> dict:
    shutil.rmtree(out, ignore_errors=True)     # left by an interrupted run
    drop_cache(ckpt_files(ckpt))
    args = [PY, str(REPO / "tools" / "reshard.py"), "--src", str(ckpt / "ckpt"), "--dst", str(out),
            "--hf-config-dir", str(ckpt / "hf"), "--quiet", "--json", *extra]
    cmd = ([MPIEXEC, "-n", str(n)] if n > 1 else []) + args
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    wall = time.monotonic() - t
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-4000:]}")
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    out_bytes = sum(p.stat().st_size for p in out.iterdir())
    shutil.rmtree(out)
    return {"wall_s": wall, "rss_bytes": stats["peak_rss_bytes_sum"], "io": stats["proc_io"], "out_bytes": out_bytes,
            "digests_verified": stats["digests_verified"]}


BASELINE = r"""
import json, os, resource, sys
import torch, torch.distributed as dist
src, hf_dir, out = sys.argv[1:4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4])
dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import dist_checkpointing
from huggingface_hub import save_torch_state_dict
from transformers import AutoConfig
from neon_hpc.reshard.pipeline import build_tasks
from neon_hpc.reshard.serial import convert_all
work, _, _ = build_tasks(src, hf_dir)                   # the name rules only (metadata)
full = dist_checkpointing.load_plain_tensors(src)      # every tensor, optimizer state included
hf = {k: v.clone() for k, v in convert_all(work, full).items()}   # own storage: safetensors refuses views
del full
save_torch_state_dict(hf, out, max_shard_size="5GB")
AutoConfig.from_pretrained(hf_dir).save_pretrained(out)
io = {k: int(v) for k, v in (l.split(": ") for l in open("/proc/self/io").read().splitlines())}
print(json.dumps({"rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "io": io}))
dist.destroy_process_group()
"""


def run_baseline(ckpt: Path, out: Path) -> dict:
    from neon_hpc.util.netutil import free_port
    shutil.rmtree(out, ignore_errors=True)     # left by an interrupted run
    drop_cache(ckpt_files(ckpt))
    out.mkdir()
    cmd = [PY, "-c", BASELINE, str(ckpt / "ckpt"), str(ckpt / "hf"), str(out), str(free_port())]
    env = dict(_env(), PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.monotonic() - t
    if r.returncode:
        sys.exit(f"baseline failed:\n{r.stderr[-4000:]}")
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    out_bytes = sum(p.stat().st_size for p in out.iterdir())
    shutil.rmtree(out)
    return {"wall_s": wall, "rss_bytes": stats["rss_bytes"], "io": stats["io"], "out_bytes": out_bytes}


def _floor_share(ckpt: Path, ranges: list, out: Path, out_bytes: int) -> None:
    fds = {}
    for f, off, n in ranges:
        fd = fds.setdefault(f, os.open(ckpt / "ckpt" / f, os.O_RDONLY))
        os.pread(fd, n, off)
    for fd in fds.values():
        os.close(fd)
    buf = os.urandom(1 << 24)
    with open(out, "wb") as fh:
        left = out_bytes
        while left > 0:
            left -= fh.write(buf[:min(left, len(buf))])
        fh.flush()
        os.fsync(fh.fileno())
    out.unlink()


def floor_run(ckpt: Path, out_dir: Path, n: int) -> dict:
    """n processes at once, each reading exactly its task rank's byte ranges (file order) and
    writing its rank's output size, fsynced."""
    import multiprocessing as mp

    from neon_hpc.reshard.pipeline import build_tasks
    work, _, _ = build_tasks(ckpt / "ckpt", ckpt / "hf", ranks=n)
    shares = [(sorted((c.file, c.offset, c.length) for t in work.tasks_of(r) for _, c in t.chunks),
               sum(s.size for s in work.shards_of(r))) for r in range(n)]
    drop_cache(ckpt_files(ckpt))
    ctx = mp.get_context("fork")
    t = time.monotonic()
    procs = [ctx.Process(target=_floor_share, args=(ckpt, rg, out_dir / f"floor{r}.bin", ob))
             for r, (rg, ob) in enumerate(shares)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode:
            sys.exit(f"floor process failed ({p.exitcode})")
    return {"wall_s": time.monotonic() - t, "read_bytes": sum(n for rg, _ in shares for _, _, n in rg),
            "write_bytes": sum(ob for _, ob in shares)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=1.2, help="bf16 model weights to generate (GB)")
    p.add_argument("--workdir", default="/tmp/neon_bench_reshard", help="checkpoint cache + outputs")
    p.add_argument("--repeat", type=int, default=1, help="runs per variant (best time kept)")
    a = p.parse_args(argv)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    spec = spec_for(a.size_gb)
    ckpt = ensure_checkpoint(work, spec)
    ck_bytes = sum(p.stat().st_size for p in ckpt_files(ckpt))
    print(f"checkpoint: {ck_bytes / 1e9:.2f} GB on disk ({spec.model_bytes() / 1e9:.2f} GB bf16 weights, "
          f"{spec.layers} layers x {spec.experts} experts, fp32 optimizer state in the same files)", flush=True)
    res = {}
    variants = [("baseline", None, 1, ()), ("fast1", "fast", 1, ()), ("fast1_nov", "fast", 1, ("--no-verify-digests",)),
                ("fast2", "fast", 2, ())]
    for _ in range(a.repeat):          # interleaved, so drifting load hits every variant alike
        for name, mode, n, extra in variants:
            r = run_baseline(ckpt, work / f"out_{name}") if mode is None else \
                run_converter(ckpt, work / f"out_{name}", n, extra)
            if name not in res or r["wall_s"] < res[name]["wall_s"]:
                res[name] = r
        for n in (1, 2):
            fl = floor_run(ckpt, work, n)
            if f"floor{n}" not in res or fl["wall_s"] < res[f"floor{n}"]["wall_s"]:
                res[f"floor{n}"] = fl
    for name, *_ in variants:
        r = res[name]
        print(f"{name:9s} {r['wall_s']:7.2f} s  read {r['io'].get('read_bytes', 0) / 1e9:6.2f} GB  "
              f"write {r['io'].get('write_bytes', 0) / 1e9:6.2f} GB  peak RSS (sum) {r['rss_bytes'] / 1e9:6.2f} GB"
              + ("" if name == "baseline" else f"  digests {'verified' if r['digests_verified'] else 'not verified'}"),
              flush=True)
    for n in (1, 2):
        fl = res[f"floor{n}"]
        print(f"floor{n}    {fl['wall_s']:7.2f} s  (read {fl['read_bytes'] / 1e9:.2f} GB, write "
              f"{fl['write_bytes'] / 1e9:.2f} GB, {n} process(es))", flush=True)
    if not res["fast1"]["digests_verified"] or res["fast1_nov"]["digests_verified"]:
        sys.exit("the benchmark checkpoint's digests were not used as intended (fast1 must verify, fast1_nov not)")
    b = res["baseline"]["wall_s"]
    print(f"RESULT reshard_speedup_vs_baseline={b / res['fast1']['wall_s']:.2f} "
          f"reshard_speedup_vs_baseline_2ranks={b / res['fast2']['wall_s']:.2f} "
          f"reshard_floor_efficiency={res['floor1']['wall_s'] / res['fast1']['wall_s']:.2f} "
          f"reshard_floor_efficiency_2ranks={res['floor2']['wall_s'] / res['fast2']['wall_s']:.2f} "
          f"reshard_rss_ratio={res['fast1']['rss_bytes'] / res['baseline']['rss_bytes']:.3f} "
          f"reshard_rss_ratio_2ranks={res['fast2']['rss_bytes'] / res['baseline']['rss_bytes']:.3f} "
          f"reshard_digest_cost={res['fast1']['wall_s'] / res['fast1_nov']['wall_s'] - 1:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
