"""The trainer's layouts: the flagship config checks, a shape-reduced copy of its layout trains
for real, checkpoints move between layouts, and layouts the trainer cannot honour are refused
(by ``neon-hpc config check`` and by the trainer, before any model is built) naming the key.

The shape-reduced Kimi layout keeps the structure of ``configs/kimi_k2_1300xh200.yaml``'s
``train:`` section (pipeline stages with a short last stage, expert parallelism over the
ranks of a stage, data parallelism; context parallelism as configured) at sizes two cores
run: 3 layers over PP=2 (2 + 1, like Kimi's 7 x 8 + 5), EP=2, TP=1, 4 ranks.  As configured
it runs Kimi's architecture shrunk (the tiny DeepSeek-V3 of ``configs/tiny_dsv3_cpu.yaml``:
MLA, a dense first layer on stage 0 beside a MoE layer, a shared expert) with the example's
context parallelism (a CP pair cutting documents into early/late chunks when it has CP > 1,
else a DP pair); a second case runs the tiny qwen3_moe with a DP pair (the cost method may
cut a sequence across it) in the CP pair's place.
Each trains the same data as one process to 1e-5 (losses and gradient norms), then its
checkpoint resumes in one process (PP 2 -> 1, EP 2 -> 1, CP or DP 2 -> 1) and continues its
losses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from neon_hpc import config as C
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.util.logs import read_metrics
from repo_paths import REPO as ROOT
from test_train_loop import add_shards, start, wait_ok

KIMI = ROOT / "configs" / "kimi_k2_1300xh200.yaml"
LAYERS, K, E, PER_STEP, STEPS = 3, 2, 4, 8, 3


# --------------------------------------------------------------------------------------
# the flagship config and refusals (fast: no model is built)

def test_kimi_config_passes_config_check_with_the_trainer_rules(tmp_path):
    # model.init_checkpoint is a cluster path (/lustre/...); config check looks for an HF folder
    # there, so it is pointed at one holding the config.json this model implies (no weights)
    import json

    from neon_hpc.arch import get as get_architecture
    hf = tmp_path / "kimi-hf"
    hf.mkdir()
    mcfg = C.load(KIMI).model
    (hf / "config.json").write_text(json.dumps(get_architecture(mcfg.arch).hf_config_dict(mcfg)))
    out = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "config", "check", str(KIMI),
                          "--set", f"model.init_checkpoint={hf}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from neon_hpc.train.layout import layout_errors, stage_layers, world_size
    cfg = C.load(KIMI)
    assert layout_errors(cfg) == []
    assert world_size(cfg) == cfg.launch.train.nodes * cfg.launch.train.tasks_per_node == 256
    t = cfg.train
    assert stage_layers(cfg.model.num_layers, t.pipeline_parallel, t.pipeline_first_stage_layers,
                        t.pipeline_last_stage_layers) == [8] * 7 + [5]


@pytest.mark.parametrize("sets, key", [
    # 32 nodes x 8 = 256 ranks started, twice the configured DP asks for 512
    ([f"train.data_parallel={2 * yaml.safe_load(KIMI.read_text())['train']['data_parallel']}"],
     "train.data_parallel"),
    # 61 layers do not split over 8 even stages
    (["train.pipeline_last_stage_layers=0"], "train.pipeline_parallel"),
    # 5 + 7 * x = 61 has no integer x
    (["train.pipeline_last_stage_layers=6"], "train.pipeline_first_stage_layers"),
    # a stage holds tp*cp*dp = 32 ranks: EP 128 does not fit
    (["train.expert_parallel=128"], "train.expert_parallel"),
    # 8 layers per stage do not make 3 equal model chunks (interleaved PP)
    (["train.virtual_pipeline_stages=3", "train.pipeline_last_stage_layers=0", "model.num_layers=64"],
     "train.virtual_pipeline_stages"),
    # TP 8 splits the vocabulary rows
    (["model.vocab_size=163844"], "train.tensor_parallel"),
], ids=["world", "pp_layers", "uneven_layers", "ep", "vpp", "tp_vocab"])
def test_config_check_refuses_layouts_the_trainer_cannot_run(sets, key):
    with pytest.raises(C.ConfigError) as e:
        C.load(KIMI, sets)
    assert f": {key}: " in str(e.value)


def test_trainer_refuses_a_world_that_is_not_the_layout_before_building(tmp_path):
    cfg = C.load(None, ["train.data_parallel=2", "train.expert_parallel=2"])
    run = RunDir(tmp_path / "run").create()
    run.run_yaml.write_text(C.dump(cfg))
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "neon_hpc.train", "--config", str(run.run_yaml),
                          "--run-dir", str(run.root)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "train.data_parallel" in out.stderr and "1 trainer process(es) started" in out.stderr
    assert not run.checkpoint_steps() and not run.weight_versions()


# --------------------------------------------------------------------------------------
# the shape-reduced Kimi layout, for real

def _trajectories(step: int, rng: np.random.Generator, dense_rows: int = 0):
    """Routes in the engines' layout (one row per decoder layer; zeros for dense layers)."""
    from neon_hpc.store import Trajectory
    out = []
    for i in range(PER_STEP):
        n = int(rng.integers(6, 20))
        prompt = int(rng.integers(2, 4))
        mask = np.r_[np.zeros(prompt), np.ones(n - prompt)].astype(np.uint8)
        routes = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(LAYERS)]) for _ in range(n)])
        routes[:, :dense_rows] = 0
        out.append(Trajectory(tokens=rng.integers(0, 256, n).astype(np.int32), loss_mask=mask,
                              logprobs=np.where(mask > 0, rng.normal(-5.5, 0.3, n), 0).astype(np.float32),
                              versions=np.where(mask > 0, max(0, step - 2), -1).astype(np.int32),
                              routed_experts=routes.astype(np.int32), reward=float(rng.integers(0, 2)),
                              task_id=f"s{step}g{i // 4}", group_id=f"s{step}g{i // 4}"))
    return out


def _model(arch: str):
    """(config file the run starts from, its model section): the tiny qwen3_moe with 3 layers, or
    the tiny DeepSeek-V3 of configs/tiny_dsv3_cpu.yaml (Kimi-K2's architecture: MLA, a dense first
    layer, then MoE layers with a shared expert; 3 layers)."""
    from model_fixtures import TINY_DSV3_YAML, tiny_dsv3
    from neon_hpc.config.model import ModelConfig
    if arch == "deepseek_v3":
        return TINY_DSV3_YAML, tiny_dsv3()
    return None, ModelConfig(num_layers=LAYERS)


def _dataset(root: Path, arch: str):
    from model_fixtures import decisive_hf
    from neon_hpc.config.store import StoreConfig
    from neon_hpc.models.hf import save_hf
    from neon_hpc.store import ShardWriter

    _, mcfg = _model(arch)
    assert mcfg.num_layers == LAYERS and mcfg.num_experts == E and mcfg.moe_router_topk == K
    init = save_hf(decisive_hf(mcfg, seed=13), mcfg, root / "init_hf")
    scratch = RunDir(root / "scratch").create()
    rng = np.random.default_rng(7)
    shards = []
    w = ShardWriter(scratch.root, "fixture", StoreConfig(flush_trajectories=10 * PER_STEP))
    from neon_hpc.arch import get as get_architecture
    dense_rows = mcfg.num_layers - len(get_architecture(mcfg.arch).moe_layers(mcfg))   # the architecture says which
    for step in range(1, STEPS + 1):
        for t in _trajectories(step, rng, dense_rows=dense_rows):
            w.add(t)
        shards.append(w.flush())
        time.sleep(0.002)
    return {"init": init, "shards": shards, "arch": arch}


_DATA: dict[str, dict] = {}
_ONE: dict[str, RunDir] = {}


@pytest.fixture(scope="module")
def kimi_data(tmp_path_factory):
    def get(arch: str):
        if arch not in _DATA:
            _DATA[arch] = _dataset(tmp_path_factory.mktemp(f"data_{arch}"), arch)
        return _DATA[arch]
    return get


def reduced_kimi_sets(cp: int | None = None) -> list[str]:
    """Kimi's train layout structure at toy sizes, 4 ranks (see the module docstring).

    ``cp=None``: as the example has it (a CP pair if its ``context_parallel`` > 1, else a DP
    pair); ``cp=1``: a DP pair; ``cp=2``: a CP pair.  A CP pair cuts documents into early/late
    chunks, so the K/V exchange runs inside 1F1B.
    """
    kimi = yaml.safe_load(KIMI.read_text())
    k = kimi["train"]
    assert k["pipeline_parallel"] > 1 and k["pipeline_last_stage_layers"] > 0 and k["expert_parallel"] > 1
    cp = cp or min(k["context_parallel"], 2)
    sets = ["train.pipeline_parallel=2", "train.pipeline_last_stage_layers=1", f"train.context_parallel={cp}",
            "train.expert_parallel=2", f"train.data_parallel={2 // cp}", "train.tensor_parallel=1"]
    if cp > 1:
        sets.append("balance.split_threshold_tokens=8")   # documents of >= 8 tokens cut over the CP pair
    else:
        split = kimi["balance"].get("split_sequences")
        sets.append(f"balance.split_sequences={'null' if split is None else str(split).lower()}")
    return sets


def _run(tmp: Path, data, *sets: str) -> RunDir:
    base, _ = _model(data["arch"])
    cfg = C.load(base, [f"train.trajectories_per_step={PER_STEP}", "train.checkpoint_every=2",
                        "train.publish_every=1", "train.lr=0.002", "offpolicy.max_staleness=8",
                        "train.wait_for_data_s=300", f"model.init_checkpoint={data['init']}",
                        *([] if base else [f"model.num_layers={LAYERS}"]), *sets])
    run = RunDir(tmp / "run").create()
    run.run_yaml.write_text(C.dump(cfg))
    return run


def metrics(run) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run.root, "trainer") if "loss" in r}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, kimi_data):
    """The same data trained by one process, per architecture."""
    def get(arch: str) -> RunDir:
        if arch not in _ONE:
            data = kimi_data(arch)
            run = _run(tmp_path_factory.mktemp(f"one_{arch}"), data, f"train.steps={STEPS}")
            add_shards(run, data, range(1, STEPS + 1))
            wait_ok(run, start(run, 1))
            _ONE[arch] = run
        return _ONE[arch]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("arch, cp", [("deepseek_v3", None), ("qwen3_moe", 1)],
                         ids=["kimi_arch_as_configured", "qwen3_with_dp2"])
def test_reduced_kimi_layout_trains_like_one_process_and_resumes_in_one(tmp_path, kimi_data, one_process, arch,
                                                                        cp):
    sets = reduced_kimi_sets(cp)
    cp = int(next(x for x in sets if x.startswith("train.context_parallel=")).split("=")[1])
    data, one = kimi_data(arch), one_process(arch)
    run = _run(tmp_path, data, "train.steps=2", *sets)
    add_shards(run, data, [1, 2])
    wait_ok(run, start(run, 4), timeout=400)
    got, want = metrics(run), metrics(one)
    for s in (1, 2):
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-5, abs=1e-7)
        assert got[s]["grad_norm"] == pytest.approx(want[s]["grad_norm"], rel=1e-5)
        assert got[s]["replay_docs_missing"] == 0 and got[s]["replayed_microbatches"] >= 1
        assert got[s]["assignment"]["cp"] == cp and got[s]["assignment"]["pp_stages"] == 2
        if cp > 1:
            assert got[s]["exchanged_microbatches"] >= 1    # documents cut over the CP pair
    # PP 2 -> 1, CP 2 -> 1, EP 2 -> 1: the torch_dist checkpoint reshards into one process
    add_shards(run, data, [3])
    wait_ok(run, start(run, 1, "train.pipeline_parallel=1", "train.pipeline_last_stage_layers=0",
                       "train.context_parallel=1", "train.expert_parallel=1", "train.data_parallel=1",
                       "balance.split_threshold_tokens=0", f"train.steps={STEPS}"))
    got = metrics(run)
    assert sorted(got) == [1, 2, 3]
    assert got[3]["loss"] == pytest.approx(want[3]["loss"], rel=1e-5, abs=1e-7)
    assert got[3]["grad_norm"] == pytest.approx(want[3]["grad_norm"], rel=1e-4)


def test_each_pipeline_stage_replays_the_route_rows_of_its_own_layers():
    from neon_hpc.config.model import ModelConfig
    from neon_hpc.train.backend import Backend, RankLayout
    from neon_hpc.train.layout import stage_layers

    per_stage = stage_layers(5, 2, 0, 2)
    assert per_stage == [3, 2]
    rows = []
    for pp_rank, n in enumerate(per_stage):
        lay = RankLayout(tp=1, ep=1, pp=2, dp=1, rank=pp_rank, world=2, tp_rank=0, ep_rank=0, dp_rank=0,
                     pp_rank=pp_rank, layer_offset=sum(per_stage[:pp_rank]), num_local_layers=n)
        be = Backend(model_cfg=ModelConfig(num_layers=5), layout=lay, model=None, ddp=None, optimizer=None,
                     replay=True)
        rows.append(be.route_rows())
    assert rows == [[0, 1, 2], [3, 4]]


def test_a_stage_with_a_dense_layer_replays_only_its_moe_layers():
    # Kimi-K2 / DeepSeek-V3: the first layer is dense; routes carry the MoE layers' rows only
    from model_fixtures import tiny_dsv3
    from neon_hpc.train.backend import Backend, RankLayout

    mcfg = tiny_dsv3()                      # 3 layers: 0 dense, 1 and 2 MoE
    rows = []
    for pp_rank, (offset, n) in enumerate([(0, 2), (2, 1)]):
        lay = RankLayout(tp=1, ep=1, pp=2, dp=1, rank=pp_rank, world=2, tp_rank=0, ep_rank=0, dp_rank=0,
                     pp_rank=pp_rank, layer_offset=offset, num_local_layers=n)
        rows.append(Backend(model_cfg=mcfg, layout=lay, model=None, ddp=None, optimizer=None,
                            replay=True).route_rows())
    assert rows == [[0], [1]]
