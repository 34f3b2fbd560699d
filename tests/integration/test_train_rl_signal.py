"""RL signal through the whole gradient path: a tiny learnable task, rollouts sampled from the policy.

Task: a policy over a 16-token vocabulary (otherwise the embedded model config) sees the
prompt ``[BOS, p]`` for p in 0..7 and answers with one token ``a``; reward 1 when
``a // 2 == p`` (2 of the 16 tokens are right for each prompt), so a uniform policy scores
1/8.  (With the default 256-token vocabulary a GRPO update moves only the tokens actually
sampled, so discovering 32 right tokens per prompt takes far more than a few dozen steps.)  This test is the
rollout side: it loads ``weights/LATEST`` (HF safetensors, as an engine would), samples answers, records their
logprobs and each token's routed experts (teacher-forced router top-k of the same forward), writes one shard
per step; the trainer (a real ``python -m neon_hpc.train`` process) claims it, trains with
router replay and TIS, and publishes the next version.  Asynchrony is real but bounded:
each step's data comes from the newest published weights at the time it is sampled.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from neon_hpc.util.logs import read_metrics

STEPS, PROMPTS, SAMPLES = 10, 8, 8
CHANCE = 1 / 8
VOCAB, BOS = 16, 15


def sample_step(model, version: int, rng_seed: int):
    from neon_hpc.store import Trajectory
    g = torch.Generator().manual_seed(rng_seed)
    prompts = torch.tensor([[BOS, p] for p in range(PROMPTS) for _ in range(SAMPLES)])
    with torch.no_grad():
        logits = model(input_ids=prompts).logits[:, -1].double()
        answers = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        logp = torch.log_softmax(logits, -1).gather(1, answers)[:, 0]
        full = torch.cat([prompts, answers], dim=1)
        out = model(input_ids=full, output_router_logits=True)
    k = model.config.num_experts_per_tok
    routes = torch.stack([rl.topk(k, dim=-1).indices.view(len(full), 3, k) for rl in out.router_logits], dim=2)
    trajs, rewards = [], []
    for i in range(len(full)):
        p, a = i // SAMPLES, int(answers[i, 0])
        reward = float(a // 2 == p)
        rewards.append(reward)
        trajs.append(Trajectory(
            tokens=full[i].numpy().astype(np.int32), loss_mask=np.array([0, 0, 1], np.uint8),
            logprobs=np.array([0, 0, logp[i]], np.float32), versions=np.array([-1, -1, version], np.int32),
            routed_experts=routes[i].numpy().astype(np.int32), reward=reward, task_id=f"p{p}",
            group_id=f"v{version}p{p}"))
    return trajs, float(np.mean(rewards))


@pytest.mark.slow
def test_reward_rises_from_chance_to_twice_chance(tmp_path):
    from neon_hpc import config as C
    from neon_hpc.config.store import StoreConfig
    from neon_hpc.models.hf import load_hf
    from neon_hpc.protocol.rundir import RunDir
    from neon_hpc.store import ShardWriter
    from test_train_loop import start, wait_ok

    cfg = C.load(None, [f"train.steps={STEPS}", f"train.trajectories_per_step={PROMPTS * SAMPLES}",
                        "train.lr=0.01", f"model.vocab_size={VOCAB}", "train.checkpoint_every=1000",
                        "train.publish_every=1",
                        "train.wait_for_data_s=120", "offpolicy.max_staleness=2", "model.seed=3", "train.seed=3"])
    run = RunDir(tmp_path / "run").create()
    run.run_yaml.write_text(C.dump(cfg))
    procs = start(run)
    writer = ShardWriter(run.root, "rl-test", StoreConfig(flush_trajectories=10_000))
    curve = []
    for step in range(1, STEPS + 1):
        deadline = time.monotonic() + 120
        while (run.latest_weights() or (-1,))[0] < step - 1:      # newest weights, at most 1 behind
            if procs[0].poll() is not None or time.monotonic() > deadline:
                wait_ok(run, procs, timeout=1)
                pytest.fail("trainer did not publish the next version")
            time.sleep(0.05)
        version, path = run.latest_weights()
        trajs, reward = sample_step(load_hf(path), version, rng_seed=step)
        curve.append(reward)
        for t in trajs:
            writer.add(t)
        writer.flush()
    wait_ok(run, procs, timeout=120)
    print("reward curve (rollout side):", " ".join(f"{r:.2f}" for r in curve))
    trained = [r for r in read_metrics(run.root, "trainer") if "loss" in r]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    assert all(r["replay_docs_missing"] == 0 for r in trained)
    assert curve[0] < 2 * CHANCE                          # v_0 (untrained) is near chance
    assert np.mean(curve[-3:]) >= 2 * CHANCE, json.dumps(curve)
