"""Per-step weight publishing: direct HF export from the trainer's ranks vs the reshard path.

``train.publish_via`` chooses how the trainer makes ``weights/v_N`` for the engines:

- ``direct``: gather the full state dict on rank 0, convert in memory, write safetensors;
- ``reshard``: write the torch_dist checkpoint of these weights, then convert it chunk by
  chunk with ``neon_hpc.reshard`` (what ``tools/reshard.py`` does after a run).

Both are timed here on the same megatron-core model in one process (one rank, gloo),
``--reps`` publishes each, for the tiny config's model and a larger one, and the published
bytes are compared (they must be identical). The reshard path's time includes its
checkpoint, which it needs at every published version; with ``checkpoint_every = 1`` that
checkpoint would be written anyway, and the last column shows the conversion alone.

    python tools/bench_publish.py [--reps 3] [--sizes tiny,medium]

Last line: ``RESULT publish_reshard_over_direct=<ratio on the largest size>
publish_convert_only_over_direct=<ratio> publish_direct_s=<s> publish_mb=<MB>``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {
    "tiny": {},   # configs/tiny_cpu.yaml's model
    "medium": {"hidden_size": 512, "num_layers": 4, "num_attention_heads": 8, "num_query_groups": 4,
               "head_dim": 64, "moe_ffn_hidden_size": 512, "num_experts": 16, "vocab_size": 4096},
}


def _digest(folder: Path) -> str:
    from safetensors.numpy import load_file
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in sorted(load_file(str(f)).items()):
            h.update(k.encode())
            h.update(v.tobytes())
    return h.hexdigest()


def bench(size: str, reps: int, root: Path) -> dict:
    from neon_hpc import config
    from neon_hpc.protocol.rundir import RunDir
    from neon_hpc.train import checkpoint as ckpt
    from neon_hpc.train.backend import setup
    from neon_hpc.train.publish import publish_weights

    sets = [f"model.{k}={v}" for k, v in SIZES[size].items()]
    cfg = config.load(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml", sets)
    be = setup(cfg.model, lr=1e-3)
    run = RunDir(root / size).create()
    direct, reshard, convert_only = [], [], []
    for r in range(reps):
        v = 2 * r + 1
        t0 = time.perf_counter()
        path_d, _, _ = publish_weights(run, be, cfg.model, v, via="direct")
        direct.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cdir = ckpt.save(run, be, v + 1, {"version": v + 1})
        t1 = time.perf_counter()
        path_r, _, _ = publish_weights(run, be, cfg.model, v + 1, via="reshard", checkpoint_dir=cdir)
        t2 = time.perf_counter()
        reshard.append(t2 - t0)
        convert_only.append(t2 - t1)
        if r == 0:
            same = _digest(path_d) == _digest(path_r)
            mb = sum(f.stat().st_size for f in path_d.glob("*.safetensors")) / 1e6
    out = {"size": size, "mb": mb, "same": same, "direct": statistics.median(direct),
           "reshard": statistics.median(reshard), "convert": statistics.median(convert_only)}
    print(f"{size:<7} {mb:8.1f} MB  direct {out['direct']:.3f}s  reshard (checkpoint + convert) "
          f"{out['reshard']:.3f}s  convert only {out['convert']:.3f}s  identical bytes: {same}", flush=True)
    import torch.distributed as dist
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sizes", default="tiny,medium")
    a = p.parse_args()
    from neon_hpc.util.netutil import free_port
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    root = Path(tempfile.mkdtemp(prefix="bench_publish_"))
    results = []
    try:
        for size in a.sizes.split(","):
            os.environ["MASTER_PORT"] = str(free_port())
            results.append(bench(size, a.reps, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not all(r["same"] for r in results):
        print("ERROR: the two paths published different bytes", file=sys.stderr)
        return 1
    big = results[-1]
    print(f"RESULT publish_reshard_over_direct={big['reshard'] / big['direct']:.3f} "
          f"publish_convert_only_over_direct={big['convert'] / big['direct']:.3f} "
          f"publish_direct_s={big['direct']:.3f} publish_mb={big['mb']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
