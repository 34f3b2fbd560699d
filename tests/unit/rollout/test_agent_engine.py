"""Episodes against the embedded engine over real HTTP: the books a trainer reads are exact.

The tiny random model writes gibberish, which is the point: whatever it writes, the
episode survives, the token sequence is the concatenation of its turns, the logprobs are
the model's own (checked by a teacher-forced forward of the final sequence), and the routes
equal one full export of the final sequence, row for row.
"""
from dataclasses import replace

import numpy as np
import pytest
import torch

from neon_hpc.config.rollout import RolloutConfig
from neon_hpc.models.tokenizer import load_tokenizer
from neon_hpc.rollout.agent import run_episode, run_group
from neon_hpc.rollout.agent.template import ChatTemplate
from neon_hpc.rollout.engines.client import EngineClient
from neon_hpc.rollout.engines.embedded import start_server
from test_agent_episode import ToyEnv, tiny_weights

TOK = load_tokenizer()
CFG = RolloutConfig(max_turns=3, max_new_tokens=6, max_total_tokens=256, temperature=1.0)


@pytest.fixture(scope="module")
def served():
    path = tiny_weights(3)
    handle = start_server(path, in_process=True)
    yield handle, path
    handle.stop()


def teacher_forced_logprobs(path, tokens):
    from neon_hpc.models.hf import load_hf
    model = load_hf(path)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = np.zeros(len(tokens), np.float32)
    out[1:] = lp[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()
    return out


def test_episode_books_are_exact_over_http(served):
    handle, path = served
    client = EngineClient(handle.url)
    traj = run_episode(client, ToyEnv(), TOK, CFG, seed=11).check()
    n, mask = traj.num_tokens, traj.loss_mask.astype(bool)
    offs = traj.turn_offsets
    assert offs[0] == 0 and offs[-1] == n and len(offs) == traj.metadata["turns"] + 1
    # the opening and every environment piece are exactly the template's tokens
    tpl = ChatTemplate(TOK)
    opening = tpl.opening(ToyEnv().system_text(), ToyEnv().task_text())
    assert traj.tokens[:len(opening)].tolist() == opening and not mask[:len(opening)].any()
    for k in range(1, len(offs) - 1):          # each later turn starts with env tokens, then generation
        seg = mask[offs[k]:offs[k + 1]]
        assert not seg[0] and seg[-1] and np.all(np.diff(seg.astype(int)) >= 0)
    # logprobs are the served model's own, token by token
    ref = teacher_forced_logprobs(path, traj.tokens.tolist())
    np.testing.assert_allclose(traj.logprobs[mask], ref[mask], atol=2e-3)
    assert np.all(traj.logprobs[~mask] == 0) and np.all(traj.versions[~mask] == -1)
    assert np.all(traj.versions[mask] == 0)
    # routes equal one full export of the final sequence
    full = client.generate(traj.tokens.tolist(), {"max_new_tokens": 0}, return_logprob=False,
                           return_routed_experts=True).routed_experts
    np.testing.assert_array_equal(traj.routed_experts[:-1], full)
    assert traj.metadata["replay"]["delta_requests"] == traj.metadata["turns"] - 1


def test_gibberish_is_survived_and_counted(served):
    handle, _ = served
    trajs = run_group(EngineClient(handle.url), ToyEnv(), TOK, replace(CFG, max_turns=4), group_size=3, seed=5)
    for t in trajs:
        md = t.metadata
        assert md["finish"] == "answer"                       # the forced last turn always answers
        assert md["no_action_turns"] + md["malformed_calls"] + md["tool_calls"] == md["turns"] - 1
        assert t.rewards["success"] in (0.0, 1.0)


def test_limits_end_episodes_cleanly(served):
    handle, _ = served
    client = EngineClient(handle.url)
    opening = len(ChatTemplate(TOK).opening(ToyEnv().system_text(), ToyEnv().task_text()))
    t = run_episode(client, ToyEnv(), TOK, replace(CFG, max_turns=10, max_total_tokens=opening + 20,
                                                   force_answer=False), seed=1).check()
    assert t.metadata["finish"] == "token_budget" and t.num_tokens <= opening + 20
    t = run_episode(client, ToyEnv(), TOK, replace(CFG, max_turns=2, force_answer=False), seed=2).check()
    assert t.metadata["turns"] <= 2 and t.metadata["finish"] in ("max_turns", "answer")
    t = run_episode(client, ToyEnv(), TOK, replace(CFG, episode_timeout_s=0.0), seed=3).check()
    assert t.metadata["finish"] == "timeout" and t.num_generated == 0 and t.routed_experts is None
