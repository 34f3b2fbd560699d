"""Real megatron-core checkpoints of the tiny Qwen3-MoE, converted and loaded by transformers:
the HF logits must equal the megatron-core model's (float32; tolerance 1e-4, observed ~1e-6).

Checkpoints are saved once per session from two gloo processes at TP=1, TP=2, EP=2 and
TP=2/EP=2 (TP=1/EP=1 in a 2-process world is DP=2; TP>1 runs with sequence parallelism).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neon_hpc.reshard import convert
from reshard_fixtures import LAYOUTS, layout_name, shared

TOL = 1e-4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return shared(tmp_path_factory) / "layouts"


def hf_logits(model_dir, ids: np.ndarray) -> np.ndarray:
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)).logits.float().numpy()


@pytest.mark.parametrize("tp,ep", LAYOUTS, ids=[layout_name(*x) for x in LAYOUTS])
def test_converted_checkpoint_gives_megatron_logits(saved, tmp_path, tp, ep):
    d = saved / layout_name(tp, ep)
    stats = convert(d / "ckpt", tmp_path / "hf", hf_config_dir=saved / "hf_config", verify=0)
    assert stats["tensors"] == 2 + 1 + 2 * (4 + 2 + 1 + 2 + 4 * 3)   # emb, lm_head, norm; per layer
    ids = np.load(saved / "ids.npy")
    ref = np.load(d / "logits.npy")
    got = hf_logits(tmp_path / "hf", ids)
    assert got.shape == ref.shape
    err = float(np.abs(got - ref).max())
    assert err < TOL, f"max |logits_hf - logits_megatron| = {err}"
    assert float(np.abs(ref).max()) > 0.1   # logits are not trivially zero


def test_layouts_convert_to_identical_tensors_across_save_layouts(saved, tmp_path):
    """A TP=2/EP=2 save and a TP=1 save of different weights differ, but each converts
    identically over 1 or 3 ranks (fast path is layout- and rank-independent)."""
    d = saved / layout_name(2, 2)
    a = convert(d / "ckpt", tmp_path / "a", hf_config_dir=saved / "hf_config", ranks=1)
    b = convert(d / "ckpt", tmp_path / "b", hf_config_dir=saved / "hf_config", ranks=3)
    from safetensors.torch import load_file
    ta = {k: v for f in (tmp_path / "a").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    tb = {k: v for f in (tmp_path / "b").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert a["files"] == 1 and b["files"] == 3
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
