"""The cost model: its coefficients against FLOPs counted by torch, and its algebra."""

import math

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from neon_hpc.balance import CostModel, attention_flops, flops_breakdown
from neon_hpc.config.model import ModelConfig
from neon_hpc.train.costfit.standin import build_model

KIMI = dict(arch="deepseek_v3", vocab_size=163840, hidden_size=7168, num_layers=61,
            num_attention_heads=64, num_query_groups=64, head_dim=128, ffn_hidden_size=18432,
            moe_ffn_hidden_size=2048, num_experts=384, moe_router_topk=8, first_dense_layers=1,
            num_shared_experts=1)
KIMI_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128)


def _dense_causal_attention_flops(H, d, n):
    """FLOPs torch counts for one layer of attention written out as matmuls (full n x n
    scores, masked), forward + backward."""
    q = torch.randn(1, H, n, d, requires_grad=True)
    k = torch.randn(1, H, n, d, requires_grad=True)
    v = torch.randn(1, H, n, d, requires_grad=True)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    with FlopCounterMode(display=False) as fc:
        s = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
        out = s.softmax(-1) @ v
        out.sum().backward()
    return fc.get_total_flops()


def test_b_term_is_half_of_dense_attention_flops_counted_by_torch():
    cfg = ModelConfig()
    cm = CostModel.from_model_config(cfg)
    n = 96
    dense = _dense_causal_attention_flops(cfg.num_attention_heads, cfg.head_dim, n) * cfg.num_layers
    # a dense kernel computes all n^2 pairs; causal attention needs the lower half
    assert cm.b * n * n == pytest.approx(dense / 2, rel=1e-12)


def test_b_term_matches_pair_by_pair_count():
    cfg = ModelConfig()
    cm = CostModel.from_model_config(cfg)
    for n in (1, 7, 1000, 131072):
        # n*(n+1)/2 causal pairs (the diagonal included): b*n^2 is that without the diagonal
        assert attention_flops(cfg, n) == pytest.approx(cm.b * n * (n + 1), rel=1e-12)


def test_a_term_matches_matmul_flops_counted_by_torch():
    cfg = ModelConfig()
    f = flops_breakdown(cfg)
    model = build_model(cfg)
    n = 64
    x = torch.randn(n, cfg.hidden_size)
    with FlopCounterMode(display=False) as fc:
        model(x, [(0, n)]).sum().backward()
    counted = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    # the measured model runs the active experts as one dense SwiGLU and has no router:
    # everything else in `a` is exactly the matmuls torch counted (attention runs in a
    # fused kernel the counter does not see on CPU)
    router = 6 * cfg.hidden_size * cfg.num_experts * f["moe_layers"]
    assert set(counted) == {"aten.mm"}
    assert counted["aten.mm"] == (f["a_flops"] - router) * n


def test_kimi_k2_matches_the_issue_numbers():
    cm = CostModel.from_model_config(ModelConfig(**KIMI), **KIMI_MLA)
    assert cm.detail["attention"] == "mla"
    assert cm.a == pytest.approx(1.9e11, rel=0.02)
    assert cm.b == pytest.approx(3.75e6, rel=0.01)
    # without MLA ranks the same config is counted as GQA with head_dim 128
    gqa = CostModel.from_model_config(ModelConfig(**KIMI))
    assert gqa.detail["attention"] == "gqa"
    assert gqa.b == pytest.approx(6 * 61 * 64 * 128)


def test_shared_experts_and_dense_layers_enter_a():
    cfg = ModelConfig()
    base = flops_breakdown(cfg)
    more = flops_breakdown(cfg, num_shared_experts=1, num_dense_layers=1)
    h = cfg.hidden_size
    per_layer_shared = 3 * h * cfg.moe_ffn_hidden_size
    dense_minus_moe = 3 * h * cfg.ffn_hidden_size - base["moe_mlp_params_per_layer"] - per_layer_shared
    expected = base["active_params_per_token"] + cfg.num_layers * per_layer_shared + dense_minus_moe
    assert more["active_params_per_token"] == expected


def test_packed_cost_is_sum_and_chunks_add_up():
    cm = CostModel(a=3.0, b=0.5, image_cost=7.0)
    lens = [5, 100, 33]
    assert cm.cost(lens) == pytest.approx(sum(cm.seq_cost(n) for n in lens))
    assert cm.cost(lens, images=[1, 0, 2]) == pytest.approx(cm.cost(lens) + 21.0)
    cuts = [0, 10, 37, 64, 100]
    assert sum(cm.chunk_cost(s, e) for s, e in zip(cuts, cuts[1:])) == pytest.approx(cm.seq_cost(100))
    # a late chunk costs more than an early one of the same size
    assert cm.chunk_cost(90, 100) > cm.chunk_cost(0, 10)
    assert math.isclose(cm.crossover_tokens(), 6.0)


def test_cost_model_rejects_bad_numbers():
    with pytest.raises(ValueError, match="CostModel.a"):
        CostModel(a=-1.0, b=1.0)
    with pytest.raises(ValueError, match="both 0"):
        CostModel(a=0.0, b=0.0)
    with pytest.raises(ValueError, match="unknown cost-model keys"):
        CostModel.from_dict({"a": 1.0, "b": 1.0, "c": 2.0})
    assert CostModel.from_dict(CostModel(a=1.0, b=2.0).to_dict()) == CostModel(a=1.0, b=2.0)


def test_seq_costs_vectorised_matches_scalar():
    cm = CostModel.from_model_config(ModelConfig())
    lens = np.array([1, 17, 4096, 70000])
    assert np.allclose(cm.seq_costs(lens), [cm.seq_cost(int(n)) for n in lens], rtol=1e-12)


def test_piece_overhead_makes_cutting_cost_something():
    cm = CostModel(a=1.0, b=0.01, piece_overhead=5.0)
    assert cm.seq_cost(100) == pytest.approx(5.0 + 100 + 100.0)
    assert cm.cost([10, 0, 20]) == pytest.approx(cm.seq_cost(10) + cm.seq_cost(20))
    assert cm.chunk_cost(0, 50) + cm.chunk_cost(50, 100) == pytest.approx(cm.seq_cost(100) + 5.0)
    assert np.allclose(cm.seq_costs([10, 0, 20]), [cm.seq_cost(10), 0.0, cm.seq_cost(20)])
