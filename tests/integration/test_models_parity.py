"""The policy model: one config, two homes (HF transformers and megatron-core), same numbers.

Real transformers, real megatron-core on gloo in spawned processes (TP=1, then TP=2/EP=2 with
sequence parallelism and the alltoall MoE dispatcher), real safetensors files.
"""

import numpy as np
import pytest
import torch

from neon_hpc.config.model import ModelConfig
from neon_hpc.models import convert, hf

# Tolerance for float32 logits of magnitude ~10: the two homes sum in different orders
# (fused QKV, grouped experts, SP all-gathers), nothing more.
LOGIT_TOL = 1e-4


def _decisive_hf_model(cfg: ModelConfig):
    """HF model with weights large enough that routing and logits are far from uniform."""
    model = hf.build_hf_model(cfg, seed=7)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = ModelConfig()
    out = tmp_path_factory.mktemp("hf") / "v_0"
    hf.save_hf(_decisive_hf_model(cfg), cfg, out)
    return out


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, ModelConfig().vocab_size, size=(2, 12))


def test_hf_save_load_roundtrip_is_exact(tmp_path):
    cfg = ModelConfig()
    model = _decisive_hf_model(cfg)
    out = hf.save_hf(model, cfg, tmp_path / "w")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    disk = hf.read_hf_state_dict(out)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in disk  # per-expert on-disk spelling
    loaded = hf.load_hf(out)
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert hf.model_config_from_hf(loaded.config) == ModelConfig(init_checkpoint="", seed=cfg.seed)


def test_save_hf_refuses_to_overwrite_and_leaves_no_staging(tmp_path):
    cfg = ModelConfig()
    model = hf.build_hf_model(cfg)
    hf.save_hf(model, cfg, tmp_path / "v_1")
    with pytest.raises(Exception, match="already exists"):
        hf.save_hf(model, cfg, tmp_path / "v_1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v_1"]


def test_hf_megatron_state_dict_roundtrip_is_exact():
    cfg = ModelConfig()
    disk = hf.to_disk_state_dict(_decisive_hf_model(cfg).state_dict())
    meg = convert.hf_to_megatron(disk, cfg)
    assert meg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (
        (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim, cfg.hidden_size)
    back = convert.megatron_to_hf(meg, cfg)
    assert set(back) == set(disk)
    for k in disk:
        assert torch.equal(back[k], disk[k]), k


def test_save_hf_refuses_megatron_keys_and_takes_the_converted_dict(tmp_path):
    cfg = ModelConfig()
    model = _decisive_hf_model(cfg)
    meg = convert.hf_to_megatron(model.state_dict(), cfg)
    with pytest.raises(ValueError, match="megatron_to_hf"):
        hf.save_hf(meg, cfg, tmp_path / "v_1")
    loaded = hf.load_hf(hf.save_hf(convert.megatron_to_hf(meg, cfg), cfg, tmp_path / "v_2"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k


def test_shard_for_rank_splits_by_query_group_and_expert():
    cfg = ModelConfig()
    full = convert.hf_to_megatron(hf.build_hf_model(cfg).state_dict(), cfg)
    s = convert.shard_for_rank(full, cfg, tp_rank=1, tp=2, ep_rank=1, ep=2)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(s[qkv], full[qkv][full[qkv].shape[0] // 2:])
    # expert 3 is local expert 1 on ep rank 1; experts 0/1 live on ep rank 0
    assert torch.equal(s["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"],
                       full["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"])
    assert not any(".local_experts.2." in k for k in s)


def _same_experts(a, b):
    # the set of chosen experts per token and layer (order within top-k is irrelevant to replay)
    return np.array_equal(np.sort(a, axis=-1), np.sort(b, axis=-1))


def test_megatron_logits_and_routes_equal_hf_tp1(hf_dir, ids):
    from neon_hpc.models import parity
    ref, ref_routes = parity.hf_logits(hf_dir, ids, with_routes=True)
    got, finite, routes = parity.megatron_logits(hf_dir, ids, tp=1, ep=1, with_routes=True)
    assert np.abs(ref).max() > 1.0  # the comparison is not between two near-zero tensors
    assert np.abs(ref - got).max() < LOGIT_TOL
    assert routes.shape == ref_routes.shape == (2, 12, 2, 2)
    assert _same_experts(routes, ref_routes)
    assert len(np.unique(ref_routes)) == 4  # every expert is used: routing is not degenerate
    assert finite


@pytest.mark.slow
def test_megatron_logits_and_routes_equal_hf_tp2_ep2(hf_dir, ids):
    from neon_hpc.models import parity
    ref, ref_routes = parity.hf_logits(hf_dir, ids, with_routes=True)
    got, finite, routes = parity.megatron_logits(hf_dir, ids, tp=2, ep=2, with_routes=True)
    assert np.abs(ref - got).max() < LOGIT_TOL
    assert _same_experts(routes, ref_routes)
    assert finite
