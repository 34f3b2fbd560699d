"""Check that the megatron-core model and the HF model agree, at any TP/EP layout.

``python -m neon_hpc.models.parity --hf DIR --tp 2 --ep 2`` starts ``tp*ep/…`` gloo ranks
(world size = max(tp, ep)), loads the HF weights in ``DIR`` into each rank's megatron shard,
runs a forward (and a backward, to exercise the MoE dispatcher both ways) and compares the
gathered logits with the HF model's.  The test suite calls :func:`megatron_logits` directly.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch


def _worker(rank: int, world: int, port: int, hf_dir: str, tp: int, ep: int, ids: np.ndarray, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from neon_hpc.models import convert, hf, megatron

    coords = megatron.init_parallel(tp=tp, ep=ep)
    model_hf = hf.load_hf(hf_dir)
    cfg = hf.model_config_from_hf(model_hf.config)
    full = convert.hf_to_megatron(model_hf.state_dict(), cfg)
    model = megatron.build_gpt_model(cfg, tp=tp, ep=ep)
    convert.load_into_megatron(model, convert.shard_for_rank(full, cfg, coords["tp_rank"], tp, coords["ep_rank"], ep))
    model.eval()
    logits = megatron.forward_logits(model, torch.from_numpy(ids))
    # A backward through the same graph: exercises the alltoall dispatcher's reverse path.
    logits.float().logsumexp(-1).mean().backward()
    grads_finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None)
    if rank == 0:
        np.savez(out, logits=logits.detach().numpy(), grads_finite=np.array(grads_finite))
    megatron.destroy_parallel()


def megatron_logits(hf_dir: str | os.PathLike, ids: np.ndarray, tp: int = 1, ep: int = 1) -> tuple[np.ndarray, bool]:
    """Logits of the megatron model (``max(tp, ep)`` gloo processes) built from ``hf_dir``.

    Returns ``(logits [batch, seq, vocab], all gradients finite)``.
    """
    import torch.multiprocessing as mp

    from neon_hpc.models.megatron import _free_port

    world = max(tp, ep)
    if world % tp or world % ep:
        raise ValueError(f"tp={tp} and ep={ep}: one must divide the other")
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "logits.npz")
        mp.start_processes(_worker, args=(world, _free_port(), str(hf_dir), tp, ep, np.asarray(ids, np.int64), out),
                           nprocs=world, join=True, start_method="spawn")
        with np.load(out) as z:
            return z["logits"], bool(z["grads_finite"])


def hf_logits(hf_dir: str | os.PathLike, ids: np.ndarray) -> np.ndarray:
    from neon_hpc.models import hf
    model = hf.load_hf(hf_dir)
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(np.asarray(ids, np.int64))).logits.numpy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m neon_hpc.models.parity", description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True, help="HF weights folder (config.json + model.safetensors)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--tol", type=float, default=1e-4)
    a = p.parse_args(argv)
    from neon_hpc.models import hf
    vocab = hf.load_hf(a.hf).config.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, size=(2, a.seq))
    ref = hf_logits(a.hf, ids)
    got, finite = megatron_logits(a.hf, ids, a.tp, a.ep)
    err = float(np.abs(ref - got).max())
    print(f"tp={a.tp} ep={a.ep} max|logits_hf - logits_megatron|={err:.3g} (tol {a.tol}) grads_finite={finite}")
    return 0 if err <= a.tol and finite else 1


if __name__ == "__main__":
    sys.exit(main())
