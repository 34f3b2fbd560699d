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
import torch.distributed as dist
import torch.multiprocessing as mp

from neon_hpc.util.netutil import free_port


def _worker(rank: int, world: int, port: int, hf_dir: str, tp: int, ep: int, ids: np.ndarray, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from neon_hpc.models import convert, hf, megatron  # deferred: heavy (neon_hpc.models.convert: pydantic)

    coords = megatron.init_parallel(tp=tp, ep=ep)
    model_hf = hf.load_hf(hf_dir)
    cfg = hf.model_config_from_hf(model_hf.config)
    full = convert.hf_to_megatron(model_hf.state_dict(), cfg)
    # deferred: heavy (megatron)
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    RouterReplay.clear_global_router_replay_instances()
    model = megatron.build_gpt_model(cfg, tp=tp, ep=ep, routing_replay=True)
    convert.load_into_megatron(model, convert.shard_for_rank(full, cfg, coords["tp_rank"], tp, coords["ep_rank"], ep))
    model.eval()
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    logits = megatron.forward_logits(model, torch.from_numpy(ids))
    routes = _gather_routes(RouterReplay.get_recorded_data(), ids.shape, tp)
    # A backward through the same graph: exercises the alltoall dispatcher's reverse path.
    logits.float().logsumexp(-1).mean().backward()
    grads_finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None)
    if rank == 0:
        np.savez(out, logits=logits.detach().numpy(), routes=routes, grads_finite=np.array(grads_finite))
    megatron.destroy_parallel()


def _gather_routes(per_layer: list[torch.Tensor], shape: tuple[int, int], tp: int) -> np.ndarray:
    """Recorded top-k ``[s_local*b, k]`` per layer -> ``[b, s, layers, k]`` (SP shards gathered)."""
    from megatron.core import parallel_state as ps  # deferred: heavy (megatron)

    b, s = shape
    layers = []
    for idx in per_layer:
        if tp > 1:  # sequence parallel: each TP rank routed a contiguous slice of the sequence
            parts = [torch.empty_like(idx) for _ in range(tp)]
            dist.all_gather(parts, idx.contiguous(), group=ps.get_tensor_model_parallel_group())
            idx = torch.cat(parts, dim=0)
        layers.append(idx.reshape(s, b, -1).transpose(0, 1))
    return torch.stack(layers, dim=2).numpy().astype(np.int32)


def megatron_logits(hf_dir: str | os.PathLike, ids: np.ndarray, tp: int = 1, ep: int = 1,
                    with_routes: bool = False):
    """Logits of the megatron model (``max(tp, ep)`` gloo processes) built from ``hf_dir``.

    Returns ``(logits [batch, seq, vocab], all gradients finite)``, and with ``with_routes``
    also the routers' top-k ``[batch, seq, layers, top_k]`` as a third element.
    """


    world = max(tp, ep)
    if world % tp or world % ep:
        raise ValueError(f"tp={tp} and ep={ep}: one must divide the other")
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "logits.npz")
        mp.start_processes(_worker, args=(world, free_port(), str(hf_dir), tp, ep, np.asarray(ids, np.int64), out),
                           nprocs=world, join=True, start_method="spawn")
        with np.load(out) as z:
            if with_routes:
                return z["logits"], bool(z["grads_finite"]), z["routes"]
            return z["logits"], bool(z["grads_finite"])


def hf_logits(hf_dir: str | os.PathLike, ids: np.ndarray, with_routes: bool = False):
    """HF logits ``[batch, seq, vocab]`` (and, with ``with_routes``, routes ``[batch, seq, moe layers, top_k]``)."""
    from neon_hpc.models import hf  # deferred: heavy (neon_hpc.models.hf: pydantic)
    model = hf.load_hf(hf_dir)
    found: list[torch.Tensor] = []
    routers = hf.hf_routers(model)
    hooks = [m.register_forward_hook(lambda mod, i, o: found.append(o[2])) for _, m in routers]
    ids_t = torch.from_numpy(np.asarray(ids, np.int64))
    with torch.no_grad():
        logits = model(input_ids=ids_t).logits.numpy()
    for h in hooks:
        h.remove()
    if not with_routes:
        return logits
    b, s = ids_t.shape
    routes = torch.stack([r.reshape(b, s, -1) for r in found], dim=2).numpy().astype(np.int32)
    return logits, routes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m neon_hpc.models.parity", description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True, help="HF weights folder (config.json + model.safetensors)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--tol", type=float, default=1e-4)
    a = p.parse_args(argv)
    from neon_hpc.models import hf  # deferred: heavy (neon_hpc.models.hf: pydantic)
    vocab = hf.load_hf(a.hf).config.vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, size=(2, a.seq))
    ref = hf_logits(a.hf, ids)
    got, finite = megatron_logits(a.hf, ids, a.tp, a.ep)
    err = float(np.abs(ref - got).max())
    print(f"tp={a.tp} ep={a.ep} max|logits_hf - logits_megatron|={err:.3g} (tol {a.tol}) grads_finite={finite}")
    return 0 if err <= a.tol and finite else 1


if __name__ == "__main__":
    sys.exit(main())
