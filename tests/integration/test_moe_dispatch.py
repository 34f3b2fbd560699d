"""The device token dispatcher and the copy-free grouped experts (issue 40, items 1 and 3).

- ``permute`` / ``unpermute`` against megatron's: the same order, values and gradients, bit-exact;
- a model built with the device dispatcher against one with megatron's alltoall dispatcher
  (same seed, same parameters): the same logits and gradients, bit-exact in fp32, with grouped
  and with sequential experts;
- no would-sync op in a MoE layer's forward *and* backward (``neon_hpc.train.census``);
- the experts' weights are views of one ``[E, out, in]`` storage, kept through ``.to()``,
  fed to ``torch._grouped_mm`` without a copy, with each expert's gradient its own;
- at EP = 2 (two gloo ranks, 4 local experts each): megatron's alltoall with the device local
  permutation (``LocalPermuteAlltoAll``) against megatron's own, bit-exact in fp32;
- CUDA-only argument checks on CPU: the experts' forward on fake CUDA tensors
  (``FakeTensorMode``: ``_grouped_mm``'s meta checks of dtypes, int32 offsets, strides).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from neon_hpc.config.model import ModelConfig

CFG = ModelConfig(arch="qwen3_moe", vocab_size=128, hidden_size=32, num_layers=2, num_attention_heads=4,
                  num_query_groups=2, head_dim=8, ffn_hidden_size=64, moe_ffn_hidden_size=16, num_experts=8,
                  moe_router_topk=2, max_position_embeddings=256, seed=1)


def routing(tokens: int, experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :k]
    rmap = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, idx, True)
    return rmap, torch.rand(tokens, experts, generator=g) * rmap


def test_permute_and_unpermute_match_megatrons_exactly():
    from megatron.core.transformer.moe import moe_utils

    from neon_hpc.models.dispatch import permute, unpermute

    T, E, k, H = 37, 8, 3, 16
    rmap, probs = routing(T, E, k, seed=0)
    x = torch.randn(T, H)
    xm, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    pm, pd = probs.clone().requires_grad_(), probs.clone().requires_grad_()
    a, ap, a_idx = moe_utils.permute(xm, rmap, probs=pm, num_out_tokens=T * k)
    b, bp, token, counts = permute(xd, rmap, pd, T * k)
    assert torch.equal(a, b) and torch.equal(ap, bp) and torch.equal(a_idx, token)
    assert torch.equal(counts, rmap.sum(0)) and counts.dtype == torch.int64
    y = torch.randn(T * k, H)
    out_m = moe_utils.unpermute(a * ap[:, None] + y, a_idx, restore_shape=torch.Size((T, H)))
    out_d = unpermute(b * bp[:, None] + y, token, torch.Size((T, H)))
    assert torch.equal(out_m, out_d)
    g = torch.randn(T, H)
    out_m.backward(g)
    out_d.backward(g)
    assert torch.equal(xm.grad, xd.grad) and torch.equal(pm.grad, pd.grad)


def test_unpermute_keeps_the_dtype_and_sums_each_tokens_slots():
    from neon_hpc.models.dispatch import permute, unpermute
    rmap, probs = routing(5, 4, 2, seed=1)
    x = torch.arange(5.0).repeat_interleave(3).view(5, 3).to(torch.bfloat16)
    p, _, token, _ = permute(x, rmap, probs, 10)
    out = unpermute(p, token, torch.Size((5, 3)))
    assert out.dtype == torch.bfloat16 and torch.equal(out, 2 * x)


@pytest.fixture(scope="module")
def parallel():
    from neon_hpc.models import megatron
    megatron.init_parallel(tp=1, ep=1, seed=1)
    yield megatron
    megatron.destroy_parallel()


def _logits_and_grads(megatron, dispatch: str, experts: str, dtype=torch.float32):
    model = megatron.build_gpt_model(CFG, seed=4, dispatch=dispatch, experts=experts, params_dtype=dtype)
    ids = torch.randint(0, CFG.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    logits = megatron.forward_logits(model, ids)
    (logits.float().log_softmax(-1)[0, :, :7].sum()).backward()
    return model, logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("experts", ["grouped", "sequential"])
def test_device_dispatcher_equals_megatrons_alltoall(parallel, experts):
    from neon_hpc.models.dispatch import DeviceDispatcher
    m_dev, l_dev, g_dev = _logits_and_grads(parallel, "device", experts)
    m_meg, l_meg, g_meg = _logits_and_grads(parallel, "megatron", experts)
    assert all(type(layer.mlp.token_dispatcher) is DeviceDispatcher for layer in m_dev.decoder.layers)
    assert [n for n, _ in m_dev.named_parameters()] == [n for n, _ in m_meg.named_parameters()]
    assert torch.equal(l_dev, l_meg)
    assert all(torch.equal(g_dev[n], g_meg[n]) for n in g_meg), [n for n in g_meg
                                                                 if not torch.equal(g_dev[n], g_meg[n])]


def test_moe_layer_forward_and_backward_would_not_sync(parallel):
    from neon_hpc.train.census import census
    model = parallel.build_gpt_model(CFG, seed=4, params_dtype=torch.bfloat16, bf16=True)
    moe = model.decoder.layers[0].mlp
    h = torch.randn(24, 1, CFG.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    with census() as c:
        out, _ = moe(h)
        out.float().square().sum().backward()
    assert c.ops["step"]["aten._grouped_mm.default"] == 6      # 2 forward, 4 backward (inputs, weights)
    assert c.n_syncs() == 0, dict(c.syncs["step"])
    ops = {k.split(".")[1]: v for k, v in c.ops["step"].items()}
    # no weight stack, no chunk sort; the one cat is the backward of the gate/up chunk
    assert "stack" not in ops and "split_with_sizes" not in ops and ops.get("cat", 0) == 1, c.ops["step"]


def test_expert_weights_are_views_of_one_storage_and_stay_so(parallel):
    model = parallel.build_gpt_model(CFG, seed=4)
    ex = model.decoder.layers[1].mlp.experts
    before = {n: p.detach().clone() for n, p in ex.named_parameters()}
    for name in ("linear_fc1", "linear_fc2"):
        stacked = ex._stacks[name]
        ws = [getattr(e, name).weight for e in ex.local_experts]
        assert stacked.shape == (CFG.num_experts, *ws[0].shape)
        assert all(w.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr() for w in ws)
        assert ex.stacked(name, stacked.dtype).data_ptr() == stacked.data_ptr()      # no copy for the GEMM
    ex.to(torch.float64)                     # a move gives every parameter its own storage: linked again
    assert ex._stacks["linear_fc1"].dtype == torch.float64 and ex.stack_fallbacks == 0
    ws = [e.linear_fc2.weight for e in ex.local_experts]
    assert all(w.data_ptr() == ex._stacks["linear_fc2"][i].data_ptr() for i, w in enumerate(ws))
    assert all(torch.equal(p.double(), before[n].double()) for n, p in ex.named_parameters())
    ex.load_state_dict({n: 2 * p.detach() for n, p in ex.named_parameters()}, strict=False)   # copies in place
    assert ex.stack_fallbacks == 0 and torch.equal(ex._stacks["linear_fc1"][3], ex.local_experts[3].linear_fc1.weight)
    ex.local_experts[0].linear_fc1.weight.data = ex.local_experts[0].linear_fc1.weight.data.clone()
    ex.stacked("linear_fc1", torch.float64)  # re-pointed from outside: a stack, counted, still correct
    ex.stacked("linear_fc2", torch.float64)
    assert ex.stack_fallbacks == 1


def test_each_expert_gets_its_own_weight_gradient(parallel):
    model = parallel.build_gpt_model(CFG, seed=4)
    ex = model.decoder.layers[0].mlp.experts
    counts = torch.tensor([3, 0, 2, 5, 1, 0, 4, 1])
    x = torch.randn(int(counts.sum()), CFG.hidden_size)
    probs = torch.rand(len(x))
    out, _ = ex(x, counts, probs)
    out.square().sum().backward()
    grads = [(e.linear_fc1.weight.grad, e.linear_fc2.weight.grad) for e in ex.local_experts]
    for p in ex.parameters():
        p.grad = None
    seq = [torch.split(t, counts.tolist()) for t in (x, probs)]
    total = 0
    for e, xs, ps in zip(ex.local_experts, *seq):
        h = xs @ e.linear_fc1.weight.t()
        gate, up = h.chunk(2, -1)
        total = total + ((torch.nn.functional.silu(gate) * up * ps[:, None]) @ e.linear_fc2.weight.t()).square().sum()
    total.backward()
    for (g1, g2), e in zip(grads, ex.local_experts):
        assert (torch.allclose(g1, e.linear_fc1.weight.grad, atol=1e-5)
                and torch.allclose(g2, e.linear_fc2.weight.grad, atol=1e-5))


def test_grouped_mm_arguments_on_fake_cuda(parallel):
    """The experts' forward as CUDA would run it, on fake CUDA tensors: ``_grouped_mm``'s meta
    checks (bf16 operands, int32 offsets, row-major activations, column-major 16-byte-aligned
    weights) pass for the dispatcher's outputs and the experts' storage views (forward only)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from neon_hpc.models.dispatch import permute, unpermute

    model = parallel.build_gpt_model(CFG, seed=4, params_dtype=torch.bfloat16, bf16=True)
    ex = model.decoder.layers[0].mlp.experts
    T, k = 40, CFG.moe_router_topk
    # no_grad: autograd on fake CUDA tensors asks a CPU-only torch for a CUDA device guard
    with FakeTensorMode(), torch.no_grad():
        ex._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda"))
        assert ex._stacks["linear_fc1"].device.type == "cuda" and ex.stack_fallbacks == 0
        x = torch.empty(T, CFG.hidden_size, dtype=torch.bfloat16, device="cuda")
        rmap = torch.zeros(T, CFG.num_experts, dtype=torch.bool, device="cuda")
        probs = torch.empty(T, CFG.num_experts, dtype=torch.float32, device="cuda")
        px, pp, token, counts = permute(x, rmap, probs, T * k)
        assert counts.device.type == "cuda" and px.shape == (T * k, CFG.hidden_size)
        out, _ = ex(px, counts, pp)
        assert out.device.type == "cuda" and out.dtype == torch.bfloat16 and out.shape == (T * k, CFG.hidden_size)
        assert ex.stack_fallbacks == 0
        y = unpermute(out, token, torch.Size((T, CFG.hidden_size)))
        assert y.shape == (T, CFG.hidden_size) and y.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="int32"):
            torch._grouped_mm(px, ex.stacked("linear_fc1", torch.bfloat16), offs=counts.cumsum(0))
        with pytest.raises(RuntimeError, match="BF16"):
            torch._grouped_mm(px.float(), ex.stacked("linear_fc1", torch.float32), offs=counts.cumsum(0).int())


def _ep_worker(out: str) -> None:
    """One rank of the EP = 2 comparison: logits and gradients with each dispatcher, as JSON."""
    import torch.distributed as dist

    from neon_hpc.models import megatron

    megatron.init_parallel(tp=1, ep=2, seed=1)
    ids = torch.randint(0, CFG.vocab_size, (1, 24), generator=torch.Generator().manual_seed(10 + dist.get_rank()))
    res = {}
    for dispatch in ("device", "megatron"):
        model = megatron.build_gpt_model(CFG, ep=2, seed=4, dispatch=dispatch, experts="grouped")
        logits = megatron.forward_logits(model, ids)
        logits.float().log_softmax(-1)[0, :, :7].sum().backward()
        res[dispatch] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        if dispatch == "device":
            res["types"] = sorted({type(layer.mlp.token_dispatcher).__name__ for layer in model.decoder.layers})
    (ld, gd), (lm, gm) = res["device"], res["megatron"]
    Path(out).write_text(json.dumps({
        "types": res["types"], "local_experts": CFG.num_experts // 2,
        "logits_equal": bool(torch.equal(ld, lm)),
        "grads_unequal": [n for n in gm if not torch.equal(gd[n], gm[n])]}))
    megatron.destroy_parallel()


@pytest.mark.slow
def test_local_permutation_inside_ep2_alltoall_equals_megatrons(tmp_path):
    from ranks import run_ranks
    run_ranks(2, lambda r: [__file__, str(tmp_path / f"r{r}.json")])
    for r in range(2):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        assert got["types"] == ["LocalPermuteAlltoAll"] and got["logits_equal"] and not got["grads_unequal"], got


if __name__ == "__main__":
    torch.set_num_threads(1)
    _ep_worker(*sys.argv[1:])
