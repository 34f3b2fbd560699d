#!/usr/bin/env python
"""Benchmark: fast resharding vs the serial baseline vs the disk floor, in one invocation.

Builds (once, cached in --workdir) a synthetic Megatron-layout torch_dist checkpoint saved by
megatron-core from 2 gloo processes: MoE with many experts, bf16 weights, one fp32 optimizer
state per weight in the same files.  Then, with the checkpoint dropped from the page cache
before each run (posix_fadvise DONTNEED on every file):

  floor   raw pread of exactly the byte ranges the model needs + raw write (and fsync) of
          the output's size
  serial  tools/reshard.py --mode serial  (materialize, convert, reshard), one process
  fast1   tools/reshard.py                one process, no MPI
  fast2   mpiexec -n 2 tools/reshard.py

Each run is a fresh process (start-up and imports count).  Reported per run: wall time,
bytes read and written (/proc/PID/io of the converter processes), peak RSS summed over ranks.

  python tools/bench_reshard.py                 # default: ~1.2 GB of bf16 weights, ~3.7 GB checkpoint
  python tools/bench_reshard.py --size-gb 4     # bigger (more layers)

Last line: RESULT reshard_speedup_vs_serial=... reshard_floor_efficiency=...
reshard_rss_ratio=... reshard_scaling_2ranks=...
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

from neon_hpc.reshard.synthetic import SynthSpec  # noqa: E402  (no torch/megatron at import)
from benchlib import drop_cache  # tools/ is on sys.path when a script runs

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
    if (ckpt / "DONE").exists() and json.loads((ckpt / "DONE").read_text()) == asdict(spec):
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


def run_converter(ckpt: Path, out: Path, mode: str, n: int) -> dict:
    drop_cache(ckpt_files(ckpt))
    args = [PY, str(REPO / "tools" / "reshard.py"), "--src", str(ckpt / "ckpt"), "--dst", str(out),
            "--hf-config-dir", str(ckpt / "hf"), "--mode", mode, "--quiet", "--json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    cmd = ([MPIEXEC, "-n", str(n)] if n > 1 else []) + args
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.monotonic() - t
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-4000:]}")
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    out_bytes = sum(p.stat().st_size for p in out.iterdir())
    shutil.rmtree(out)
    return {"wall_s": wall, "rss_bytes": stats["peak_rss_bytes_sum"], "io": stats["proc_io"], "out_bytes": out_bytes}


def floor_run(ckpt: Path, out_dir: Path, out_bytes: int) -> dict:
    """Read exactly the needed byte ranges (file order) and write the output's size, fsynced."""
    from neon_hpc.reshard.pipeline import build_plan
    plan, _, _ = build_plan(ckpt / "ckpt", ckpt / "hf")
    ranges = sorted((c.file, c.offset, c.length) for t in plan.tasks for _, c in t.chunks)
    drop_cache(ckpt_files(ckpt))
    t = time.monotonic()
    fds, nread = {}, 0
    for f, off, n in ranges:
        fd = fds.setdefault(f, os.open(ckpt / "ckpt" / f, os.O_RDONLY))
        nread += len(os.pread(fd, n, off))
    for fd in fds.values():
        os.close(fd)
    t_read = time.monotonic() - t
    buf = os.urandom(1 << 24)
    out = out_dir / "floor.bin"
    t = time.monotonic()
    with open(out, "wb") as f:
        left = out_bytes
        while left > 0:
            left -= f.write(buf[:min(left, len(buf))])
        f.flush()
        os.fsync(f.fileno())
    t_write = time.monotonic() - t
    out.unlink()
    return {"wall_s": t_read + t_write, "read_s": t_read, "write_s": t_write, "read_bytes": nread}


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
    for name, mode, n in [("serial", "serial", 1), ("fast1", "fast", 1), ("fast2", "fast", 2)]:
        runs = [run_converter(ckpt, work / f"out_{name}", mode, n) for _ in range(a.repeat)]
        res[name] = min(runs, key=lambda r: r["wall_s"])
        r = res[name]
        print(f"{name:7s} {r['wall_s']:7.2f} s  read {r['io'].get('read_bytes', 0) / 1e9:6.2f} GB  "
              f"write {r['io'].get('write_bytes', 0) / 1e9:6.2f} GB  peak RSS (sum) {r['rss_bytes'] / 1e9:6.2f} GB",
              flush=True)
    fl = floor_run(ckpt, work, res["fast1"]["out_bytes"])
    print(f"floor   {fl['wall_s']:7.2f} s  (read {fl['read_bytes'] / 1e9:.2f} GB in {fl['read_s']:.2f} s, "
          f"write {res['fast1']['out_bytes'] / 1e9:.2f} GB in {fl['write_s']:.2f} s)", flush=True)
    speedup = res["serial"]["wall_s"] / res["fast1"]["wall_s"]
    eff = fl["wall_s"] / res["fast1"]["wall_s"]
    rss = res["fast1"]["rss_bytes"] / res["serial"]["rss_bytes"]
    scaling = res["fast1"]["wall_s"] / res["fast2"]["wall_s"]
    print(f"RESULT reshard_speedup_vs_serial={speedup:.2f} reshard_floor_efficiency={eff:.2f} "
          f"reshard_rss_ratio={rss:.3f} reshard_scaling_2ranks={scaling:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
