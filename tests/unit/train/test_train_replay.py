"""Router replay in the trainer: the megatron forward takes exactly the recorded experts.

The "engine" here is the HF Qwen3-MoE model that the embedded engine serves, run
teacher-forced over each trajectory: its routers' top-k are the recorded routes and its
log-softmax the recorded logprobs (what the embedded engine returns for those tokens; the
engine's own HTTP path is tested by the engine's tests).  The trainer's megatron model is
loaded with the same weights through the HF -> megatron conversion.
"""

import numpy as np
import pytest
import torch

from neon_hpc.config.model import ModelConfig
from neon_hpc.store import Trajectory

CFG = ModelConfig()


def engine_record(hf, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(routes [n, layers, k], logprobs [n]) of one teacher-forced HF forward."""
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(tokens.astype(np.int64))[None], output_router_logits=True)
    routes = torch.stack([rl.topk(CFG.moe_router_topk, dim=-1).indices for rl in out.router_logits], dim=1)
    logp = torch.log_softmax(out.logits[0].double(), dim=-1)
    lp = np.zeros(len(tokens), np.float32)
    lp[1:] = logp[:-1].gather(1, torch.from_numpy(tokens[1:].astype(np.int64))[:, None])[:, 0].numpy()
    return routes.numpy().astype(np.int32), lp


def make_trajectories(hf, seed: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate((14, 9, 21)):
        tokens = rng.integers(0, CFG.vocab_size, n).astype(np.int32)
        routes, lp = engine_record(hf, tokens)
        mask = np.r_[np.zeros(3), np.ones(n - 3)].astype(np.uint8)
        out.append(Trajectory(tokens=tokens, loss_mask=mask, logprobs=np.where(mask > 0, lp, 0).astype(np.float32),
                              versions=np.where(mask > 0, 0, -1).astype(np.int32), routed_experts=routes,
                              task_id=f"t{i}", group_id="g"))
    return out


@pytest.fixture(scope="module")
def trainer():
    from neon_hpc.models.convert import hf_to_megatron
    from neon_hpc.models.hf import build_hf_model
    from neon_hpc.train import backend as B

    be = B.setup(CFG, tp=1, ep=1, replay=True, seed=3)
    engine = build_hf_model(CFG, seed=7)
    B.load_full_state_dict(be, hf_to_megatron(engine.state_dict(), CFG))
    other_engine = build_hf_model(CFG, seed=8)      # an engine holding different weights
    yield be, engine, other_engine
    B.teardown()


def forward_with_routing_maps(be, mb, replay: bool):
    from neon_hpc.train.backend import forward_logp

    maps = []
    hooks = [layer.mlp.router.register_forward_hook(lambda _m, _i, out: maps.append(out[1].detach().clone()))
             for layer in be.model.decoder.layers]
    try:
        with torch.no_grad():
            logp = forward_logp(be, mb, replay=replay)
    finally:
        for h in hooks:
            h.remove()
    return logp[0], maps


def one_hot_rows(routes_layer: np.ndarray) -> torch.Tensor:
    m = torch.zeros(routes_layer.shape[0], CFG.num_experts, dtype=torch.bool)
    m.scatter_(1, torch.from_numpy(routes_layer.astype(np.int64)), True)
    return m


def build(trajs):
    from neon_hpc.train.batch import build_microbatch, input_lengths
    pieces = [(i, 0, n) for i, n in enumerate(input_lengths(trajs))]
    return build_microbatch(trajs, pieces, [0.0] * len(trajs), route_shape=(CFG.num_layers, CFG.moe_router_topk,
                                                                             CFG.num_experts))


def test_replay_picks_recorded_experts_and_logprobs_match_engine(trainer):
    be, engine, _ = trainer
    mb = build(make_trajectories(engine, seed=0))
    logp, maps = forward_with_routing_maps(be, mb, replay=True)
    assert len(maps) == CFG.num_layers
    for layer, rmap in enumerate(maps):
        assert torch.equal(rmap.bool(), one_hot_rows(mb.routed_experts[:, layer]))
    on = mb.loss_mask[0] > 0
    diff = (logp[on].double() - mb.behaviour_logprobs[0][on].double()).abs()
    assert diff.max().item() < 1e-4, f"trainer vs engine logprob max |diff| {diff.max().item():.2e}"


def test_replay_of_foreign_routes_is_exact_while_free_routing_differs(trainer):
    # Routes recorded by an engine with other weights (the async case: an older version).
    be, _, other = trainer
    mb = build(make_trajectories(other, seed=1))
    _, replayed = forward_with_routing_maps(be, mb, replay=True)
    logp_free, free = forward_with_routing_maps(be, mb, replay=False)
    mismatched_rows = 0
    for layer in range(CFG.num_layers):
        want = one_hot_rows(mb.routed_experts[:, layer])
        assert torch.equal(replayed[layer].bool(), want)
        mismatched_rows += int((free[layer].bool() != want).any(dim=1).sum())
    frac = mismatched_rows / (CFG.num_layers * mb.seq_len)
    print(f"without replay: {mismatched_rows} of {CFG.num_layers * mb.seq_len} token-layer routes "
          f"differ from the engine's ({frac:.0%})")
    assert frac > 0.2          # the trainer's own routing would not have matched the engine's
    assert torch.isfinite(logp_free).all()


def test_free_routing_mismatch_with_same_weights_is_reported(trainer):
    # Same weights, no replay: routes agree except at near-ties; the logprobs still match.
    be, engine, _ = trainer
    mb = build(make_trajectories(engine, seed=2))
    logp, free = forward_with_routing_maps(be, mb, replay=False)
    differ = sum(int((free[l].bool() != one_hot_rows(mb.routed_experts[:, l])).any(dim=1).sum())
                 for l in range(CFG.num_layers))
    print(f"same weights, no replay: {differ} token-layer routes differ from the engine's")
    assert differ <= 2
    on = mb.loss_mask[0] > 0
    if differ == 0:
        assert (logp[on].double() - mb.behaviour_logprobs[0][on].double()).abs().max().item() < 1e-4


def test_routes_and_logprobs_from_the_embedded_engine_over_http(trainer, tmp_path):
    """Sampled generations from the real embedded engine (SGLang wire format): the trainer's
    replayed forward picks the engine's experts at every forwarded position, and its logprobs
    equal the engine's decode-time logprobs."""
    from neon_hpc.models.hf import save_hf
    from neon_hpc.rollout.engines.client import EngineClient
    from neon_hpc.rollout.engines.embedded import start_server

    be, engine, _ = trainer
    path = save_hf(engine, CFG, tmp_path / "v_0")
    rng = np.random.default_rng(4)
    trajs = []
    with start_server(path, in_process=True) as srv:
        client = EngineClient(srv.url)
        for i in range(3):
            prompt = rng.integers(0, CFG.vocab_size, 5 + 3 * i).tolist()
            out = client.generate(prompt, {"temperature": 1.0, "max_new_tokens": 8, "seed": 10 + i},
                                  return_logprob=True, return_routed_experts=True)
            tokens = np.array(prompt + out.output_ids, np.int32)
            n, p = len(tokens), len(prompt)
            assert out.routed_experts.shape == (n - 1, CFG.num_layers, CFG.moe_router_topk)
            routes = np.concatenate([out.routed_experts, np.zeros((1, CFG.num_layers, CFG.moe_router_topk),
                                                                  np.int32)])   # placeholder last row
            mask = np.r_[np.zeros(p), np.ones(n - p)].astype(np.uint8)
            lp = np.r_[np.zeros(p), out.output_logprobs].astype(np.float32)
            trajs.append(Trajectory(tokens=tokens, loss_mask=mask, logprobs=lp,
                                    versions=np.where(mask > 0, int(out.weight_version), -1).astype(np.int32),
                                    routed_experts=routes, task_id=f"e{i}", group_id="g"))
    mb = build(trajs)
    logp, maps = forward_with_routing_maps(be, mb, replay=True)
    for layer, rmap in enumerate(maps):
        assert torch.equal(rmap.bool(), one_hot_rows(mb.routed_experts[:, layer]))
    on = mb.loss_mask[0] > 0
    diff = (logp[on].double() - mb.behaviour_logprobs[0][on].double()).abs().max().item()
    assert diff < 1e-4, f"trainer vs embedded engine logprob max |diff| {diff:.2e}"
