"""DeepSeek-V3 routes from engine to trainer: SGLang's rows (one row per decoder layer,
zeros for the dense first layer) from the real embedded engine over HTTP, mapped to the
trainer's MoE layers through the architecture, replayed exactly by megatron; a wrong layer axis fails
loudly.  The model: MLA, 1 dense + 2 MoE layers, a shared expert, sigmoid router with a
non-zero expert-score bias and grouped top-k (2 groups, 1 chosen): configs/tiny_dsv3_cpu.yaml."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_fixtures import decisive_hf, tiny_dsv3
from neon_hpc.arch import RouteRowsError, get as get_architecture
from neon_hpc.config.model import ModelConfig
from neon_hpc.store import Trajectory

CFG = tiny_dsv3()
ROUTE_ROWS = get_architecture(CFG.arch).route_rows(CFG)


@pytest.fixture(scope="module")
def trainer():
    from neon_hpc.models.convert import hf_to_megatron
    from neon_hpc.train import backend as B

    be = B.setup(CFG, tp=1, ep=1, replay=True, seed=3)
    engine = decisive_hf(CFG, 7)
    B.load_full_state_dict(be, hf_to_megatron(engine.state_dict(), CFG))
    yield be, engine
    B.teardown()


def routing_maps(be, mb, replay: bool):
    """Replayed (or free) forward the way the trainer runs it: no dense mask, the micro-batch's
    piece map active (per-document causal attention by true position)."""
    from neon_hpc.models.cp_attention import build_piece_map, piece_map
    from neon_hpc.train.backend import forward_logp
    maps = []
    hooks = [layer.mlp.router.register_forward_hook(lambda _m, _i, out: maps.append(out[1].detach().clone()))
             for layer in be.model.decoder.layers if hasattr(layer.mlp, "router")]
    try:
        with torch.no_grad(), piece_map(build_piece_map([mb.pieces], 0, mb.seq_len)):
            logp = forward_logp(be, mb, replay=replay)
    finally:
        for h in hooks:
            h.remove()
    return logp[0], maps


def one_hot(routes_layer: np.ndarray) -> torch.Tensor:
    m = torch.zeros(routes_layer.shape[0], CFG.num_experts, dtype=torch.bool)
    m.scatter_(1, torch.from_numpy(routes_layer.astype(np.int64)), True)
    return m


def build(trajs):
    from neon_hpc.replay.rows import to_trainer_rows
    from neon_hpc.train.batch import build_microbatch, input_lengths
    to_trainer_rows(trajs, CFG)
    pieces = [(i, 0, n) for i, n in enumerate(input_lengths(trajs))]
    return build_microbatch(trajs, pieces, [0.0] * len(trajs), dense_mask=False,
                            route_shape=(len(ROUTE_ROWS.moe_rows), CFG.moe_router_topk, CFG.num_experts))


def engine_trajectories(engine, tmp_path, n: int = 3) -> list[Trajectory]:
    from neon_hpc.models.hf import save_hf
    from neon_hpc.rollout.engines.client import EngineClient
    from neon_hpc.rollout.engines.embedded import start_server

    path = save_hf(engine, CFG, tmp_path / "v_0")
    rng = np.random.default_rng(4)
    trajs = []
    with start_server(path, in_process=True) as srv:
        client = EngineClient(srv.url)
        info = client.model_info()
        assert info["routed_experts_rows"] == CFG.num_layers and info["num_moe_layers"] == 2
        for i in range(n):
            prompt = rng.integers(0, CFG.vocab_size, 5 + 3 * i).tolist()
            out = client.generate(prompt, {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 10 + i},
                                  return_logprob=True, return_routed_experts=True)
            tokens = np.array(prompt + out.output_ids, np.int32)
            k = CFG.moe_router_topk
            assert out.routed_experts.shape == (len(tokens) - 1, CFG.num_layers, k)   # SGLang: every decoder layer
            assert (out.routed_experts[:, 0] == 0).all()                               # the dense layer: zeros
            routes = np.concatenate([out.routed_experts, np.zeros((1, CFG.num_layers, k), np.int32)])
            mask = np.r_[np.zeros(len(prompt)), np.ones(len(out.output_ids))].astype(np.uint8)
            lp = np.r_[np.zeros(len(prompt)), out.output_logprobs].astype(np.float32)
            trajs.append(Trajectory(tokens=tokens, loss_mask=mask, logprobs=lp,
                                    versions=np.where(mask > 0, int(out.weight_version), -1).astype(np.int32),
                                    routed_experts=routes, task_id=f"e{i}", group_id="g"))
    return trajs


def test_engine_routes_replay_exactly_in_the_trainer(trainer, tmp_path):
    be, engine = trainer
    assert be.num_moe_layers() == 2
    mb = build(engine_trajectories(engine, tmp_path))
    assert mb.routed_experts_missing == 0 and mb.routed_experts.shape[1] == 2
    logp, maps = routing_maps(be, mb, replay=True)
    assert len(maps) == 2
    for j, rmap in enumerate(maps):
        assert torch.equal(rmap.bool(), one_hot(mb.routed_experts[:, j]))
    on = mb.loss_mask[0] > 0
    diff = (logp[on].double() - mb.behaviour_logprobs[0][on].double()).abs().max().item()
    print(f"deepseek_v3 trainer (replay) vs embedded engine logprob max |diff| {diff:.2e}")
    assert diff < 1e-4


def test_teacher_forced_hf_routes_equal_megatron_free_routing(trainer):
    """Teacher-forced HF routes (laid out as SGLang's) replay exactly, and with the same weights
    megatron's own sigmoid+bias grouped top-k picks the same experts without replay."""
    from neon_hpc.arch.base import RouteRows
    from neon_hpc.models.hf import hf_routers
    be, engine = trainer
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, 24).astype(np.int32)
    found = []
    hooks = [r.register_forward_hook(lambda _m, _i, o: found.append(o[2])) for _, r in
             hf_routers(engine)]
    with torch.no_grad():
        engine(input_ids=torch.from_numpy(tokens.astype(np.int64))[None])
    for h in hooks:
        h.remove()
    moe = np.stack([f.numpy() for f in found], axis=1).astype(np.int32)       # [tokens, 2, k]
    wire = ROUTE_ROWS.from_moe(moe)
    assert isinstance(ROUTE_ROWS, RouteRows) and wire.shape[1] == 3 and (wire[:, 0] == 0).all()
    t = Trajectory(tokens=tokens, loss_mask=np.ones(len(tokens), np.uint8), logprobs=np.zeros(len(tokens), np.float32),
                   versions=np.zeros(len(tokens), np.int32), routed_experts=wire, task_id="tf", group_id="g")
    mb = build([t])
    _, free = routing_maps(be, mb, replay=False)
    _, replayed = routing_maps(be, mb, replay=True)
    for j in range(2):
        assert torch.equal(free[j].bool(), one_hot(mb.routed_experts[:, j])), f"MoE layer {j}"
        assert torch.equal(replayed[j].bool(), one_hot(mb.routed_experts[:, j])), f"MoE layer {j} (replay)"


@pytest.mark.parametrize("rows", [2, 4])
def test_wrong_route_rows_fail_loudly(rows):
    """MoE-only rows (2) or one extra layer (4) for a 3-layer model: an error naming the expected rows."""
    from neon_hpc.replay.rows import to_trainer_rows
    good = Trajectory(tokens=np.arange(6, dtype=np.int32), loss_mask=np.ones(6, np.uint8),
                      logprobs=np.zeros(6, np.float32), versions=np.zeros(6, np.int32),
                      routed_experts=np.zeros((6, 3, 2), np.int32), task_id="ok", group_id="g")
    bad = Trajectory(tokens=np.arange(6, dtype=np.int32), loss_mask=np.ones(6, np.uint8),
                     logprobs=np.zeros(6, np.float32), versions=np.zeros(6, np.int32),
                     routed_experts=np.zeros((6, rows, 2), np.int32), task_id="bad", group_id="g")
    with pytest.raises(RouteRowsError, match=r"1 of 2 trajectories.*has 3 route rows.*MoE layers at \[1, 2\]") as e:
        to_trainer_rows([good, bad], CFG)
    if rows == 2:
        assert "MoE layers only" in str(e.value)


def test_qwen3_routes_every_layer():
    q = ModelConfig()
    lay = get_architecture("qwen3_moe").route_rows(q)
    r = np.arange(2 * q.num_layers * 2).reshape(2, q.num_layers, 2)
    assert lay.rows == q.num_layers and lay.to_moe(r) is r
