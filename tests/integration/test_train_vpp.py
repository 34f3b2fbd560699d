"""Interleaved pipeline parallelism (``train.virtual_pipeline_stages``): real processes, gloo.

A 4-layer tiny qwen3_moe at PP=2 x V=2 (two model chunks of one layer per stage: stage 0
holds layers 0 and 2, stage 1 layers 1 and 3, so every micro-batch crosses the pair three
times) trains the same data as one process: losses and gradient norms within 1e-5 (the norm
covers every chunk of both stages, so a chunk that got another layer's routes, the wrong
activations or a mis-scaled loss moves it), with every micro-batch replaying its routes
(routes differ per layer, so a route row given to the wrong chunk changes the loss).  The
run asks for 3 micro-batches per step, which megatron's default group size (PP) refuses, so
the group-size choice of ``balance.pipeline.microbatch_group_size`` is exercised.  Its step-2
checkpoint resumes bit-exactly at PP=2 x V=2 and on the reference's losses at PP=1 and at
PP=2 x V=1 (torch_dist resharding); its step-3 checkpoint reshards to the same HF bytes as
its direct export.  With two data ranks per stage (world 4), split pieces (the cost method
cutting sequences across DP=2, or zigzag pieces over CP=2) train the same losses and gradient
norms inside the interleaved schedule.  Layouts that cannot interleave are refused by
``neon-hpc config check`` naming the key.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from neon_hpc import config as C
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.util.logs import read_metrics
from test_train_loop import _trajectories as _loop_trajectories, add_shards, start, wait_ok, weights
from test_train_pp import rewound_copy

LAYERS, PER_STEP, STEPS = 4, 8, 3
VPP = ("train.pipeline_parallel=2", "train.virtual_pipeline_stages=2", "balance.min_microbatches=3")


def _trajectories(step: int, rng: np.random.Generator):
    """test_train_loop's trajectories (same draws), with routes for this model's LAYERS."""
    return _loop_trajectories(step, rng, layers=LAYERS)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from neon_hpc.config.model import ModelConfig
    from neon_hpc.config.store import StoreConfig
    from neon_hpc.models.hf import build_hf_model, save_hf
    from neon_hpc.store import ShardWriter

    root = tmp_path_factory.mktemp("vpp_data")
    mcfg = ModelConfig(num_layers=LAYERS)
    init = save_hf(build_hf_model(mcfg, seed=17), mcfg, root / "init_hf")
    scratch = RunDir(root / "scratch").create()
    rng = np.random.default_rng(23)
    w = ShardWriter(scratch.root, "fixture", StoreConfig(flush_trajectories=10 * PER_STEP))
    shards = []
    for step in range(1, STEPS + 1):
        for t in _trajectories(step, rng):
            w.add(t)
        shards.append(w.flush())
        time.sleep(0.002)               # shard names start with a ms timestamp: keep claim order
    return {"init": init, "shards": shards}


def new_run(root, data, *sets: str) -> RunDir:
    cfg = C.load(None, [f"train.steps={STEPS}", f"train.trajectories_per_step={PER_STEP}",
                        "train.checkpoint_every=2", "train.publish_every=2", "train.lr=0.002",
                        "offpolicy.max_staleness=8", "train.wait_for_data_s=300", f"model.num_layers={LAYERS}",
                        f"model.init_checkpoint={data['init']}", *sets])
    run = RunDir(root / "run").create()
    run.run_yaml.write_text(C.dump(cfg))
    add_shards(run, data, range(1, STEPS + 1))
    return run


def metrics(run) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run.root, "trainer") if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    """The one-process reference and the PP=2 x V=2 run (one after the other: each rendezvous
    port is free when its run starts)."""
    out = {"reference": new_run(tmp_path_factory.mktemp("vpp_ref"), data),
           "vpp": new_run(tmp_path_factory.mktemp("vpp2"), data, *VPP)}
    wait_ok(out["reference"], start(out["reference"], 1))
    wait_ok(out["vpp"], start(out["vpp"], 2))
    return out


RESUME = {   # name: (processes, --set overrides) for a restart from the V=2 run's step-2 checkpoint
    "same": (2, ()),
    "pp1": (1, ("train.pipeline_parallel=1", "train.virtual_pipeline_stages=1", "balance.min_microbatches=0")),
    "pp2_v1": (2, ("train.virtual_pipeline_stages=1",)),
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, runs):
    """The V=2 run rewound to its step-2 checkpoint and restarted in each layout of RESUME."""
    out = {}
    for name, (world, sets) in RESUME.items():
        out[name] = rewound_copy(runs["vpp"], tmp_path_factory.mktemp(f"vpp_resume_{name}") / "run", 2)
        wait_ok(out[name], start(out[name], world, *sets))
    return out


def _assert_matches(got: dict, want: dict, steps, grad_rel: float = 1e-5) -> None:
    for s in steps:
        assert got[s]["loss"] == pytest.approx(want[s]["loss"], rel=1e-5, abs=1e-7), s
        assert got[s]["grad_norm"] == pytest.approx(want[s]["grad_norm"], rel=grad_rel), s


# --------------------------------------------------------------------------------------
# layer assignment and refusals (fast: no model is built)

def test_chunk_layers_follow_megatrons_interleaved_assignment():
    from neon_hpc.train.layout import chunk_layers
    # even: 8 layers, PP=2 x V=2: virtual pass c covers layers [4c, 4c+4), stage r its r-th half
    assert chunk_layers([4, 4], 2) == [[(0, 2), (4, 2)], [(2, 2), (6, 2)]]
    # uneven (first 4, last 2): each pass is [2 of stage 0, 1 of stage 1]
    assert chunk_layers([4, 2], 2) == [[(0, 2), (3, 2)], [(2, 1), (5, 1)]]
    assert chunk_layers([3, 2], 1) == [[(0, 3)], [(3, 2)]]
    with pytest.raises(ValueError):
        chunk_layers([3, 2], 2)


def test_microbatch_group_size_is_megatrons_default_when_it_can_be():
    from neon_hpc.balance.pipeline import microbatch_group_size
    assert microbatch_group_size(4, 2) == 2          # depth-first: megatron's default
    assert microbatch_group_size(3, 2) == 3          # 3 % 2 = 1 < PP: one group of 3
    assert microbatch_group_size(7, 4) == 7          # 7 % 4 = 3, 7 % 5 = 2, 7 % 6 = 1 (< PP); 7 % 7 = 0
    assert microbatch_group_size(9, 4) == 5          # 9 % 4 = 1 < PP; 9 % 5 = 4: groups of 5 and 4
    for n in range(2, 30):
        for pp in range(2, n + 1):
            g = microbatch_group_size(n, pp)
            assert pp <= g <= n and (n % g == 0 or n % g >= pp)
    with pytest.raises(ValueError, match="at least pipeline_parallel"):
        microbatch_group_size(1, 2)


@pytest.mark.parametrize("sets, key", [
    (["train.virtual_pipeline_stages=2"], "train.virtual_pipeline_stages"),                      # V without PP
    (["train.virtual_pipeline_stages=3", "train.pipeline_parallel=2", "model.num_layers=4"],
     "train.virtual_pipeline_stages"),                                                           # 2 per stage
    (["train.virtual_pipeline_stages=2", "train.pipeline_parallel=2", "model.num_layers=5",
      "train.pipeline_first_stage_layers=3"], "train.virtual_pipeline_stages"),                  # uneven: 3 + 2
    (["train.virtual_pipeline_stages=2", "train.pipeline_parallel=2", "model.num_layers=4",
      "balance.min_microbatches=1"], "balance.min_microbatches"),                                # M < PP
], ids=["no_pp", "layers", "uneven", "microbatches"])
def test_config_check_refuses_layouts_that_cannot_interleave(tmp_path, sets, key):
    base = tmp_path / "run.yaml"
    base.write_text(C.dump(C.load(None, ["train.data_parallel=1"])))
    args = [sys.executable, "-m", "neon_hpc.cli", "config", "check", str(base)]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    # the message starts with the key (the echoed --set values name the keys too)
    assert f"): {key}: " in out.stderr, out.stderr


def test_config_check_accepts_an_uneven_layout_that_interleaves():
    from neon_hpc.train.layout import layout_errors
    cfg = C.load(None, ["train.virtual_pipeline_stages=2", "train.pipeline_parallel=2", "model.num_layers=6",
                        "train.pipeline_first_stage_layers=4"])
    assert layout_errors(cfg) == []


# --------------------------------------------------------------------------------------
# training, for real

@pytest.mark.slow
def test_pp2_vpp2_trains_the_reference_losses_and_gradients(runs):
    got, want = metrics(runs["vpp"]), metrics(runs["reference"])
    assert sorted(got) == list(range(1, STEPS + 1))
    _assert_matches(got, want, range(1, STEPS + 1))
    for s in got:
        assert got[s]["microbatches"] == 3
        assert got[s]["replay_docs_missing"] == 0 and got[s]["replayed_microbatches"] == 3
    import json
    state = json.loads((runs["vpp"].checkpoint(STEPS) / "trainer_state.json").read_text())
    assert state["layout"]["pp"] == 2 and state["layout"]["vpp"] == 2
    a, b = weights(runs["vpp"], STEPS), weights(runs["reference"], STEPS)
    assert sorted(a) == sorted(b)
    for k in b:   # Adam's first steps: see test_train_loop.test_parallel_layouts_match_tp1
        d = np.abs(a[k].numpy() - b[k].numpy())
        assert float(d.max()) <= 2 * 0.002 * STEPS + 1e-6, k
        assert (d > 1e-5).mean() < 1e-3, k


@pytest.mark.slow
def test_pp2_vpp2_resume_at_the_same_layout_is_bit_exact(runs, resumed):
    run, orig = resumed["same"], runs["vpp"]
    got, want = metrics(run), metrics(orig)
    assert got[3]["loss"] == want[3]["loss"] and got[3]["grad_norm"] == want[3]["grad_norm"]
    a, b = weights(run, 3), weights(orig, 3)
    for k in b:
        np.testing.assert_array_equal(a[k].numpy(), b[k].numpy(), err_msg=k)
    log = "\n".join(p.read_text() for p in run.root.glob("logs/trainer/*.log"))
    assert "rng restored" in log


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp1", "pp2_v1"])
def test_pp2_vpp2_checkpoint_resumes_in_another_layout(runs, resumed, name):
    run = resumed[name]
    _assert_matches(metrics(run), metrics(runs["reference"]), [3], grad_rel=1e-4)
    log = "\n".join(p.read_text() for p in run.root.glob("logs/trainer/*.log"))
    assert "reseeded: layout changed" in log


@pytest.mark.slow
def test_reshard_reads_a_pp2_vpp2_checkpoint(tmp_path, runs):
    from neon_hpc.config.model import ModelConfig
    from neon_hpc.models.hf import hf_config, read_hf_state_dict
    from neon_hpc.reshard.pipeline import convert

    out = tmp_path / "hf"
    convert(str(runs["vpp"].checkpoint(STEPS)), str(out),
            hf_config=hf_config(ModelConfig(num_layers=LAYERS)).to_dict(), use_mpi=False)
    got, want = read_hf_state_dict(out), weights(runs["vpp"], STEPS)     # the direct export of the same step
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k].numpy(), want[k].numpy(), err_msg=k)


# --------------------------------------------------------------------------------------
# interleaving with split sequences / CP (4 processes: PP=2 x V=2 x 2 data ranks)

SPLIT_LAYOUTS = {
    # the cost method cuts the sequences over the 12-token cap into pieces on both DP ranks
    "dp2_split": ("train.data_parallel=2", "balance.tokens_per_microbatch=12"),
    # every piece of >= 8 tokens zigzagged over the CP pair
    "cp2": ("train.context_parallel=2", "balance.split_threshold_tokens=8"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SPLIT_LAYOUTS))
def test_pp2_vpp2_with_split_pieces_trains_the_reference(tmp_path, data, runs, name):
    """World 4: each of the two data ranks of a stage holds its pieces of a micro-batch and
    the K/V all-gather runs per chunk inside the interleaved schedule; losses and gradient
    norms as one process, every micro-batch replaying its routes."""
    run = new_run(tmp_path, data, *VPP, *SPLIT_LAYOUTS[name])
    wait_ok(run, start(run, 4), timeout=600)
    got, want = metrics(run), metrics(runs["reference"])
    assert sorted(got) == list(range(1, STEPS + 1))
    _assert_matches(got, want, range(1, STEPS + 1))
    for s, r in got.items():
        assert r["microbatches"] >= 3 and r["exchanged_microbatches"] > 0, r
        # summed over the two data ranks (a rank's empty slot replays nothing)
        assert r["replay_docs_missing"] == 0 and r["replayed_microbatches"] >= r["microbatches"], r
        if name == "dp2_split":
            assert r["assignment"]["split_sequences"] > 0 and r["assignment"]["vpp"] == 2, r["assignment"]
