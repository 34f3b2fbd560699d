"""Episode bookkeeping with a scripted in-process policy (no HTTP): exact token books,
tool errors and malformed calls survived and counted, limits end episodes cleanly.

The over-HTTP versions against the embedded engine live in test_agent_engine.py.
"""
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from neon_hpc.config.rollout import RolloutConfig
from neon_hpc.models.tokenizer import load_tokenizer
from neon_hpc.rollout.agent import ToolCall, run_episode, run_group
from test_replay_cache import oracle

TOK = load_tokenizer()


@dataclass
class Result:
    output_ids: list
    output_logprobs: list
    routed_experts: object
    weight_version: str
    finish_reason: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    meta_info: dict = field(default_factory=dict)


class ScriptedClient:
    """Answers each turn with the next scripted text; routes from the causal oracle."""

    def __init__(self, script, version="3"):
        self.script, self.version, self.requests = list(script), version, []

    def generate(self, input_ids, sampling_params, return_logprob=True, return_routed_experts=False,
                 routed_experts_start_len=None):
        self.requests.append((list(input_ids), dict(sampling_params), routed_experts_start_len))
        text = self.script.pop(0) if self.script else "..."
        out = TOK.encode(text)[: sampling_params["max_new_tokens"]]
        start = routed_experts_start_len or 0
        routes = oracle(list(input_ids) + out)[start:len(input_ids) + len(out) - 1] if return_routed_experts else None
        lps = [-0.1 * (i + 1) for i in range(len(out))]
        return Result(out, lps, routes, self.version, prompt_tokens=len(input_ids))


class ToyEnv:
    """Answer the secret number; the `lookup` tool reveals it."""

    task_id = "toy-1"

    def __init__(self, secret=42):
        self.secret = secret

    def system_text(self):
        return "find the number"

    def task_text(self):
        return "call lookup"

    def run_tool(self, call: ToolCall):
        if call.name != "lookup":
            return {"error": f"unknown tool {call.name!r}; tools: lookup"}
        return {"number": self.secret}

    def format_result(self, result):
        return " ".join(f"{k} {v}" for k, v in result.items())

    def parse_answer(self, text):
        try:
            return int(text.strip())
        except ValueError:
            return None

    def grade(self, predicted):
        ok = predicted == self.secret
        return float(ok), 1.0 if ok else 0.0, {"predicted": predicted}


CFG = RolloutConfig(max_turns=4, max_new_tokens=24, max_total_tokens=512)


def check_books(traj):
    traj.check()
    n = traj.num_tokens
    offs = traj.turn_offsets
    assert offs[0] == 0 and offs[-1] == n
    assert np.all(traj.logprobs[traj.loss_mask == 0] == 0)
    assert np.all(traj.versions[traj.loss_mask == 0] == -1)
    assert np.all(traj.versions[traj.loss_mask == 1] == 3)
    assert traj.routed_experts.shape == (n, 3, 2)
    np.testing.assert_array_equal(traj.routed_experts[:-1], oracle(traj.tokens.tolist())[:-1])


def test_turns_concatenate_to_the_final_sequence_and_masks_logprobs_routes_align():
    client = ScriptedClient(["<tool_call>lookup</tool_call>", "<answer>42</answer>"])
    traj = run_episode(client, ToyEnv(), TOK, CFG)
    check_books(traj)
    assert traj.metadata["finish"] == "answer" and traj.rewards == {"success": 1.0, "dense": 1.0}
    # every request's prompt is exactly the sequence before that turn's generation
    for k, (prompt, _sp, _start) in enumerate(client.requests):
        gen_start = traj.turn_offsets[k + 1] - int(traj.loss_mask[traj.turn_offsets[k]:traj.turn_offsets[k + 1]].sum())
        assert prompt == traj.tokens[:gen_start].tolist()
    gen = traj.tokens[traj.loss_mask == 1].tolist()
    assert TOK.decode(gen) == "<tool_call>lookup</tool_call><answer>42</answer>"
    assert traj.logprobs[traj.loss_mask == 1][0] == pytest.approx(-0.1)
    assert client.requests[1][2] == traj.turn_offsets[1] - 1   # delta asked from prev_seqlen - 1


def test_malformed_calls_and_tool_errors_are_fed_back_and_counted():
    script = ["<tool_call>{\"name\": oops</tool_call>", "<tool_call>nope x=1</tool_call>",
              "just chatting", "41"]
    traj = run_episode(ScriptedClient(script), ToyEnv(), TOK, CFG)
    check_books(traj)
    md = traj.metadata
    assert (md["malformed_calls"], md["tool_errors"], md["no_action_turns"], md["tool_calls"]) == (1, 1, 1, 1)
    env_text = TOK.decode(traj.tokens[traj.loss_mask == 0])
    assert "malformed tool call" in env_text and "unknown tool 'nope'" in env_text
    assert md["finish"] == "answer" and traj.reward == 0.0   # forced answer 41 is wrong


def test_turn_limit_forces_an_answer_on_the_last_turn():
    traj = run_episode(ScriptedClient(["<tool_call>lookup</tool_call>"] * 5 + ["42"]), ToyEnv(), TOK,
                       replace(CFG, max_turns=2))
    assert traj.metadata["turns"] == 2 and traj.metadata["finish"] == "answer"
    assert "<|assistant|><answer>" in TOK.decode(traj.tokens)


def test_token_budget_ends_the_episode_cleanly():
    cfg = replace(CFG, max_total_tokens=40, force_answer=False)
    traj = run_episode(ScriptedClient(["<tool_call>lookup</tool_call>"] * 10), ToyEnv(), TOK, cfg)
    check_books(traj)
    assert traj.metadata["finish"] == "token_budget"
    assert traj.num_tokens <= 40 and traj.reward == 0.0


def test_replay_off_and_full_modes():
    for mode in ("off", "full"):
        client = ScriptedClient(["<tool_call>lookup</tool_call>", "42"])
        traj = run_episode(client, ToyEnv(), TOK, replace(CFG, max_turns=2), replay=mode)
        assert traj.reward == 1.0
        if mode == "off":
            assert traj.routed_experts is None
        else:
            assert all(start is None for _p, _s, start in client.requests)
            np.testing.assert_array_equal(traj.routed_experts[:-1], oracle(traj.tokens.tolist())[:-1])


def test_group_shares_a_group_id_and_grades_each_member():
    class Alternating(ScriptedClient):
        def generate(self, input_ids, sp, **kw):
            self.script = ["42" if len(self.requests) % 2 == 0 else "7"]
            return super().generate(input_ids, sp, **kw)

    trajs = run_group(Alternating([]), ToyEnv(), TOK, replace(CFG, max_turns=1), group_size=4)
    assert len(trajs) == 4 and len({t.group_id for t in trajs}) == 1 and trajs[0].group_id
    assert sorted(t.reward for t in trajs) == [0.0, 0.0, 1.0, 1.0]


_WEIGHTS: dict = {}


def tiny_weights(seed: int = 3):
    """HF weights of the tiny default model, built once per test process and shared by the
    engine tests of test_agent_* and test_replay_* (building is the slow part here)."""
    if seed not in _WEIGHTS:
        import atexit
        import shutil
        import tempfile
        from pathlib import Path

        from neon_hpc.config.model import ModelConfig
        from neon_hpc.models.hf import build_hf_model, save_hf
        root = Path(tempfile.mkdtemp(prefix="neon-agent-tests-"))
        atexit.register(shutil.rmtree, root, True)
        cfg = ModelConfig()
        _WEIGHTS[seed] = save_hf(build_hf_model(cfg, seed=seed), cfg, root / "v_0")  # version 0
    return _WEIGHTS[seed]
