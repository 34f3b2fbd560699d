"""The tiny DeepSeek-V3 (MLA; dense first layer, shared expert, sigmoid router with expert bias
and grouped top-k; per-layer keys because the layers are heterogeneous) saved by megatron-core,
converted, and loaded by transformers' DeepseekV3ForCausalLM: logits equal (float32, tolerance 1e-4).

The megatron model is the trainer's own build (``models.megatron.build_gpt_model``: the
architecture's MLA config and local spec, whose core attention is ``models.core_attention``'s SDPA,
since megatron-core's local one cannot take MLA's separate k/v head dims); see
``tests/reshard_fixtures.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neon_hpc.reshard import convert
from reshard_fixtures import shared

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return shared(tmp_path_factory) / "mla"


def test_mla_checkpoint_has_per_layer_keys_and_router_bias(saved):
    from neon_hpc.checkpoint.metadata import read_checkpoint
    keys = set(read_checkpoint(saved / "ckpt").tensors)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in keys            # dense first layer
    assert "decoder.layers.1.mlp.router.expert_bias" in keys
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in keys


def test_mla_converted_checkpoint_gives_megatron_logits(saved, tmp_path):
    from transformers import AutoModelForCausalLM
    convert(saved / "ckpt", tmp_path / "hf", hf_config_dir=saved / "hf_config", verify=0)
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert float(bias.abs().max()) > 0.1                                  # the bias arrived
    ids = np.load(saved / "ids.npy")
    with torch.no_grad():
        got = model.eval()(input_ids=torch.from_numpy(ids)).logits.float().numpy()
    ref = np.load(saved / "logits.npy")
    err = float(np.abs(got - ref).max())
    assert err < 1e-4, f"max |logits_hf - logits_megatron| = {err}"


def test_mla_config_derived_from_shapes_matches_the_model(saved, tmp_path):
    from reshard_fixtures import mla_hf_config
    want = mla_hf_config()
    stats = convert(saved / "ckpt", tmp_path / "hf", arch="deepseek_v3", allow_guessed_config=True)
    import json
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    for k in ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
              "v_head_dim", "n_routed_experts", "first_k_dense_replace", "intermediate_size",
              "moe_intermediate_size", "n_shared_experts", "num_hidden_layers", "vocab_size", "hidden_size"):
        assert cfg[k] == want[k], k
    assert "rope_theta" in stats["guessed_config_fields"]
