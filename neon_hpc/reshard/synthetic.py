"""Synthetic Megatron-layout torch_dist checkpoints for the benchmark and the tests.

Saved by megatron-core's own ``dist_checkpointing.save`` from ``procs`` gloo processes, so
the file layout (``.metadata``, ``__R_K.distcp``, ``metadata.json``, ``common.pt``) is the real
one: homogeneous layers stacked under one key with a leading layer axis, one chunk per expert
and per ``[gate; up]`` half (TP-split like megatron's SwiGLU factory), fused QKV per query
group, vocab padding, and fp32 optimizer state in the same files.  megatron-core is imported
only here (and only in the saving processes), never by the converter.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from neon_hpc.arch import DEFAULT as ARCH_DEFAULT, get as get_architecture
from neon_hpc.checkpoint import integrity
from neon_hpc.util.netutil import free_port


@dataclass
class SynthSpec:
    layers: int = 2
    experts: int = 8
    hidden: int = 64
    moe_ffn: int = 32
    heads: int = 4
    groups: int = 2
    head_dim: int = 16
    vocab: int = 250             # real vocab; rows are padded to a multiple of 128
    tp: int = 2                  # tensor-parallel fragments in the layout
    procs: int = 2               # processes that save (chunks dealt round-robin)
    optimizer_states: int = 1    # fp32 tensors per parameter under optimizer.state.*
    seed: int = 0

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab // 128) * 128

    def model_bytes(self) -> int:
        """bf16 bytes of the model weights (what the converter writes, before vocab trim)."""
        h, i, e = self.hidden, self.moe_ffn, self.experts
        qkv = (self.heads + 2 * self.groups) * self.head_dim * h
        per_layer = e * 3 * i * h + qkv + h * self.heads * self.head_dim + e * h + 2 * h + 2 * self.head_dim
        return 2 * (self.layers * per_layer + 2 * self.padded_vocab * h + h)

    def hf_config(self) -> dict:
        """The synthetic checkpoint is of the registry's default architecture (GQA, every layer MoE)."""
        facts = get_architecture(ARCH_DEFAULT)
        if facts.attention != "gqa" or facts.default_dense_layers:
            raise ValueError(f"reshard/synthetic.py writes GQA all-MoE checkpoints; {facts.name} is not one")
        out = facts.hf_fields({"vocab_size": self.vocab, "hidden_size": self.hidden, "num_layers": self.layers,
                               "num_attention_heads": self.heads, "num_query_groups": self.groups,
                               "head_dim": self.head_dim, "num_experts": self.experts,
                               "moe_router_topk": min(2, self.experts), "moe_ffn_hidden_size": self.moe_ffn,
                               "ffn_hidden_size": self.moe_ffn * 2, "norm_epsilon": 1e-6,
                               "max_position_embeddings": 2048})
        out.update({"decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 10000.0,
                    "tie_word_embeddings": False, "torch_dtype": "bfloat16"})
        return out


def _sharded_pieces(spec: SynthSpec):
    """Yield (key, global_shape, offsets per axis as (axis, index, fragments), fill seed)."""
    L, E, H, I = spec.layers, spec.experts, spec.hidden, spec.moe_ffn
    d, tp = spec.head_dim, spec.tp
    qkv_rows = (spec.heads + 2 * spec.groups) * d
    yield "embedding.word_embeddings.weight", (spec.padded_vocab, H), [[(0, r, tp)] for r in range(tp)]
    yield "output_layer.weight", (spec.padded_vocab, H), [[(0, r, tp)] for r in range(tp)]
    yield "decoder.final_layernorm.weight", (H,), [[]]
    lay = lambda extra: [[(0, l, L)] + x for l in range(L) for x in extra]  # noqa: E731
    yield "decoder.layers.self_attention.linear_qkv.weight", (L, qkv_rows, H), lay([[(1, r, tp)] for r in range(tp)])
    yield "decoder.layers.self_attention.linear_qkv.layer_norm_weight", (L, H), lay([[]])
    yield ("decoder.layers.self_attention.linear_proj.weight", (L, H, spec.heads * d),
           lay([[(2, r, tp)] for r in range(tp)]))
    yield "decoder.layers.self_attention.q_layernorm.weight", (L, d), lay([[]])
    yield "decoder.layers.self_attention.k_layernorm.weight", (L, d), lay([[]])
    yield "decoder.layers.pre_mlp_layernorm.weight", (L, H), lay([[]])
    yield "decoder.layers.mlp.router.weight", (L, E, H), lay([[]])
    # SwiGLU: the fc1 rows are [gate (tp fragments); up (tp fragments)], one chunk per expert per fragment.
    yield ("decoder.layers.mlp.experts.experts.linear_fc1.weight", (L, E, 2 * I, H),
           lay([[(1, e, E), (2, f, 2 * tp)] for e in range(E) for f in range(2 * tp)]))
    yield ("decoder.layers.mlp.experts.experts.linear_fc2.weight", (L, E, H, I),
           lay([[(1, e, E), (3, r, tp)] for e in range(E) for r in range(tp)]))


def _prepended_axes(key: str) -> int:
    if key.startswith("decoder.layers.mlp.experts."):
        return 2
    return 1 if key.startswith("decoder.layers.") else 0


def _local_shape(global_shape, offsets, n_prepend: int):
    shape = list(global_shape)
    for axis, _idx, frags in offsets:
        shape[axis] //= frags
    return shape[n_prepend:]


def _save_worker(rank: int, path: str, spec_d: dict, port: int) -> None:
    import torch.distributed as dist  # deferred: heavy (torch)
    _cpu_patch()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=spec_d["procs"])
    save_in_group(path, SynthSpec(**spec_d))
    dist.destroy_process_group()


def save_in_group(path: str | os.PathLike, spec: SynthSpec) -> None:
    """Save from every rank of an initialised torch.distributed group of ``spec.procs`` ranks
    (each rank saves every ``procs``-th chunk); ``path`` must exist and be empty."""
    # deferred: heavy (torch)
    import torch
    import torch.distributed as dist

    # deferred: heavy (megatron)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    rank = dist.get_rank()
    if dist.get_world_size() != spec.procs:
        raise ValueError(f"spec.procs={spec.procs} but the process group has {dist.get_world_size()} ranks")
    gen = torch.Generator().manual_seed(spec.seed * 1000 + rank)
    sd, n = {}, 0
    for key, gshape, pieces in _sharded_pieces(spec):
        dtype = torch.float32 if key.endswith("router.weight") else torch.bfloat16
        for offsets in pieces:
            n += 1
            if n % spec.procs != rank:
                continue
            npre = _prepended_axes(key)
            local = torch.randn(_local_shape(gshape, offsets, npre), generator=gen).to(dtype)
            sd[f"m{n}"] = ShardedTensor.from_rank_offsets(key, local, *offsets, replica_id=0, prepend_axis_num=npre)
            for s in range(spec.optimizer_states):
                sd[f"o{n}_{s}"] = ShardedTensor.from_rank_offsets(
                    f"optimizer.state.state{s}.{key}", local.float(), *offsets, replica_id=0,
                    prepend_axis_num=npre)
    dist_checkpointing.save(sd, str(path))
    dist.barrier()
    if rank == 0:     # the digests neon-hpc's trainer writes (integrity.json), so reads are checked
        integrity.seal(path)
    dist.barrier()


def _cpu_patch() -> None:
    """megatron-core's checkpoint writer asks CUDA for a device and a sync; on CPU answer 'cpu'."""
    import torch  # deferred: heavy (torch)
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *a, **k: None


def generate(path: str | os.PathLike, spec: SynthSpec | None = None, port: int | None = None) -> SynthSpec:
    """Write a synthetic checkpoint to ``path`` (created; must not exist) from ``spec.procs`` processes."""
    import torch.multiprocessing as mp  # deferred: heavy (torch)
    spec = spec or SynthSpec()
    port = port or free_port()
    os.makedirs(path)
    mp.start_processes(_save_worker, args=(str(path), asdict(spec), port), nprocs=spec.procs,
                       join=True, start_method="spawn")
    return spec
