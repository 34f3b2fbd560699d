"""The task builder and the metadata reader on plain numbers: no torch_dist files, no torch I/O; and the
config derived from checkpoint shapes against the trainer's (shapes of the real models' state dicts)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from neon_hpc.checkpoint.metadata import Checkpoint, CheckpointError, Chunk, TensorMeta, read_checkpoint
from neon_hpc.reshard.slabs import MappingError, ModelSpec, Op, apply_op
from neon_hpc.reshard.tasks import make_tasks

SPEC = ModelSpec("qwen3_moe", vocab_size=250, num_attention_heads=4, num_key_value_heads=2, head_dim=2)
L, E, I, H = 2, 3, 4, 8


def _ckpt(tensors: dict[str, tuple[tuple, list[tuple[tuple, tuple]]]], file_size: int = 10**9) -> Checkpoint:
    """A Checkpoint from {key: (shape, [(offsets, sizes), ...])}; chunks laid out in one file."""
    metas, pos = {}, 0
    for key, (shape, chunks) in tensors.items():
        tm = TensorMeta(key, shape, "bfloat16")
        for off, size in chunks:
            n = 2 * int(torch.tensor(size).prod()) + 100
            tm.chunks.append(Chunk(off, size, "__0_0.distcp", pos, n))
            pos += n
        metas[key] = tm
    return Checkpoint(Path("/ckpt"), metas, [], {"__0_0.distcp": file_size})


def _expert_fc1(tp: int = 2) -> dict:
    """Stacked expert fc1 [L, E, 2I, H] saved like megatron's SwiGLU factory: 2*tp row chunks per expert."""
    chunks = [((l, e, f * (2 * I // (2 * tp)), 0), (1, 1, 2 * I // (2 * tp), H))
              for l in range(L) for e in range(E) for f in range(2 * tp)]
    return {"decoder.layers.mlp.experts.experts.linear_fc1.weight": ((L, E, 2 * I, H), chunks)}


def test_expert_chunks_become_one_task_per_expert_with_gate_and_up():
    work = make_tasks(_ckpt(_expert_fc1(tp=2)), SPEC)
    assert len(work.tasks) == L * E
    for t in work.tasks:
        assert len(t.chunks) == 4 and len(t.slabs) == 1     # 2 gate + 2 up fragments, read once each
        names = [o.name for o in t.slabs[0].outputs]
        l, e = t.slabs[0].index
        assert names == [f"model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
                         f"model.layers.{l}.mlp.experts.{e}.up_proj.weight"]
        assert all(o.shape == (I, H) for o in t.slabs[0].outputs)
        assert t.streamable and t.memory_bytes == (I // 2) * H * 2   # one chunk in memory at a time


def test_a_chunk_spanning_many_slabs_is_read_once():
    ck = _ckpt({"decoder.layers.mlp.experts.experts.linear_fc2.weight": ((L, E, H, I), [((0, 0, 0, 0), (L, E, H, I))])})
    work = make_tasks(ck, SPEC)
    assert len(work.tasks) == 1
    assert len(work.tasks[0].chunks) == 1 and len(work.tasks[0].slabs) == L * E


def test_tasks_are_balanced_largest_first():
    work = make_tasks(_ckpt(_expert_fc1(tp=1)), SPEC, ranks=4)
    loads = [sum(t.read_bytes + t.write_bytes for t in work.tasks_of(r)) for r in range(4)]
    biggest = max(t.read_bytes + t.write_bytes for t in work.tasks)
    assert max(loads) - min(loads) <= biggest
    again = make_tasks(_ckpt(_expert_fc1(tp=1)), SPEC, ranks=4)   # every rank builds them alone: must agree
    assert [(t.id, t.rank, t.chunks) for t in again.tasks] == [(t.id, t.rank, t.chunks) for t in work.tasks]
    assert {s.rank for s in work.shards} == {0, 1, 2, 3}  # each rank writes its own file(s)


def test_shard_cap_splits_files_and_headers_are_valid_safetensors():
    work = make_tasks(_ckpt(_expert_fc1(tp=1)), SPEC, ranks=2, shard_cap=3 * I * H * 2)
    assert len(work.shards) > 2
    seen = set()
    for s in work.shards:
        assert s.data_bytes <= 3 * I * H * 2
        n = int.from_bytes(s.header[:8], "little")
        assert len(s.header) == 8 + n and n % 8 == 0
        meta = json.loads(s.header[8:])
        spans = sorted(tuple(v["data_offsets"]) for k, v in meta.items() if k != "__metadata__")
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no holes
        seen |= set(meta) - {"__metadata__"}
    assert seen == set(work.index_json()["weight_map"])


def test_vocab_padding_is_trimmed_and_qkv_split_per_group():
    ck = _ckpt({"embedding.word_embeddings.weight": ((256, H), [((0, 0), (128, H)), ((128, 0), (128, H))]),
                "decoder.layers.self_attention.linear_qkv.weight": ((L, 2 * (2 + 2) * 2, H),
                                                                     [((0, 0, 0), (L, 16, H))])})
    work = make_tasks(ck, SPEC)
    shapes = {o.name: o.shape for t in work.tasks for s in t.slabs for o in s.outputs}
    assert shapes["model.embed_tokens.weight"] == (250, H)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (8, H)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (4, H)
    qkv_task = next(t for t in work.tasks if "linear_qkv" in t.slabs[0].key)
    assert not qkv_task.streamable      # q/k/v rows interleave per group: assembled per layer


def test_qkv_op_takes_each_groups_rows():
    # 2 groups x (2 q heads, k, v) x head_dim 2: row r holds value r.
    slab = torch.arange(16.0).reshape(16, 1)
    q = apply_op(Op("qkv", ("q", 2, 2, 2)), slab).flatten().tolist()
    k = apply_op(Op("qkv", ("k", 2, 2, 2)), slab).flatten().tolist()
    v = apply_op(Op("qkv", ("v", 2, 2, 2)), slab).flatten().tolist()
    assert q == [0, 1, 2, 3, 8, 9, 10, 11] and k == [4, 5, 12, 13] and v == [6, 7, 14, 15]


def test_unknown_model_key_is_named_before_anything_is_written():
    ck = _ckpt({"decoder.layers.self_attention.linear_mystery.weight": ((L, H, H), [((0, 0, 0), (L, H, H))])})
    with pytest.raises(MappingError, match="linear_mystery"):
        make_tasks(ck, SPEC)


def test_optimizer_state_is_not_planned():
    ck = _ckpt({**_expert_fc1(), "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight":
                ((L, E, 2 * I, H), [((0, 0, 0, 0), (L, E, 2 * I, H))])})
    work = make_tasks(ck, SPEC)
    assert all(not k.startswith("optimizer") for t in work.tasks for k, _ in t.chunks)


def test_truncated_or_missing_file_is_found_from_metadata():
    fc1 = _expert_fc1()
    with pytest.raises(CheckpointError, match="truncated"):
        make_tasks(_ckpt(fc1, file_size=1000), SPEC)
    with pytest.raises(CheckpointError, match="missing"):
        make_tasks(_ckpt(fc1, file_size=-1), SPEC)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned_by_pickle",))


def test_foreign_pickle_in_metadata_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": _Evil()}))
    with pytest.raises(CheckpointError, match="refuses to unpickle global (posix|os).system"):
        read_checkpoint(ck)
    assert not (tmp_path / "pwned_by_pickle").exists()


def test_missing_metadata_names_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"\.metadata is missing"):
        read_checkpoint(tmp_path)


def test_unknown_architecture_is_named():
    with pytest.raises(MappingError, match="unknown architecture 'llama'"):
        ModelSpec.from_hf_config({"model_type": "llama", "num_attention_heads": 4, "hidden_size": 8})
    assert ModelSpec.from_hf_config({"model_type": "kimi_k2"}).arch == "deepseek_v3"


def _shapes_of(cfg) -> Checkpoint:
    """The torch_dist keys and shapes (no data) of ``cfg``'s model: per-layer keys, experts on an axis."""
    import re

    from model_fixtures import decisive_hf
    from neon_hpc.models import convert
    metas = {}
    for k, v in convert.hf_to_megatron(decisive_hf(cfg, 0).state_dict(), cfg).items():
        if (m := re.match(r"(decoder\.layers\.\d+\.mlp\.experts)\.local_experts\.\d+\.(.+)", k)):
            k, shape = f"{m.group(1)}.experts.{m.group(2)}", (cfg.num_experts, *v.shape)
        else:
            shape = tuple(v.shape)
        metas[k] = TensorMeta(k, shape, "float32")
    return Checkpoint(Path("/ckpt"), metas, [], {})


@pytest.mark.parametrize("which", ["qwen3_moe", "deepseek_v3", "deepseek_v3_no_q_lora"])
def test_config_derived_from_shapes_is_the_trainers_on_every_field_it_does_not_guess(which):
    """``--allow-guessed-config`` and the trainer's config.json describe an architecture once
    (its folder's hfmap.py): on the fields shapes can tell they agree, and the config passes the shape check."""
    from dataclasses import replace

    from model_fixtures import tiny_dsv3
    from neon_hpc import arch
    from neon_hpc.config.model import ModelConfig
    from neon_hpc.reshard import hfconfig
    cfg = {"qwen3_moe": ModelConfig(), "deepseek_v3": tiny_dsv3(),
           "deepseek_v3_no_q_lora": replace(tiny_dsv3(), q_lora_rank=0)}[which]
    ck = _shapes_of(cfg)
    derived, guessed = hfconfig._derive(ck, cfg.arch)
    want = arch.get(cfg.arch).hf_config_dict(cfg)
    told = {k: v for k, v in derived.items() if not any(g.split()[0] == k for g in guessed)}
    assert len(told) >= 10 and {k: want[k] for k in told} == told
    hfconfig.check_config_shapes(want, ck)


def test_kimi_k2_is_accepted_as_deepseek_v3_everywhere_an_arch_is_named():
    from neon_hpc.reshard.cli import parse_args
    from neon_hpc.reshard.slabs import canonical_arch
    assert canonical_arch("kimi_k2") == "deepseek_v3"
    assert ModelSpec.from_hf_config({"model_type": "qwen3_moe"}, arch="kimi_k2").arch == "deepseek_v3"
    assert parse_args(["--src", "x", "--dry-run", "--arch", "kimi_k2"]).arch == "kimi_k2"
    with pytest.raises(MappingError, match="unknown architecture 'llama'"):
        canonical_arch("llama", "deepseek_v3")
