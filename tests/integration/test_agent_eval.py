"""The evaluation harness can tell success from failure.

A scripted endpoint (real HTTP, SGLang's /generate wire format and an OpenAI-style chat API)
plays a policy that calls a tool and then answers from the ground truth: it must score 100%.
One that answers nothing must score 0%.  Also: XRD episodes on the tiny preset against the
embedded engine (real tools, real grader) keep exact books.
"""
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from neon_hpc import envs
from neon_hpc.config.rollout import RolloutConfig
from neon_hpc.envs.xrd import eval_cli
from neon_hpc.envs.xrd.config import XRDConfig
from neon_hpc.envs.xrd.env import sample_label
from neon_hpc.envs.xrd.science.tasks import load_tasks
from neon_hpc.models.tokenizer import load_tokenizer
from neon_hpc.rollout.agent import run_group
from neon_hpc.rollout.engines import wire

TOK = load_tokenizer()


TRUTH = {sample_label(t.id): ", ".join(f"{pid} {wf}" for pid, _f, wf in t.truth)
         for split in ("test_id", "test_ood") for t in load_tasks("tiny", split, 0, 3)}
FIT_PHASES = {sample_label(t.id): [pid for pid, _f, _w in t.truth]
              for split in ("test_id", "test_ood") for t in load_tasks("tiny", split, 0, 3)}


class Scripted(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, policy):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.policy, self.requests, self.seen = policy, 0, {}

    def reply(self, conversation: str) -> str:
        if self.policy == "silent":
            return ""
        if self.policy == "judge_yes":
            return "YES"
        label = re.search(r"Sample (\S+), measured", conversation).group(1)
        if "<|tool|>" not in conversation and "Tool result" not in conversation:
            if self.policy == "fit":          # fit the true phases; the tool's text shows its threshold
                return ('<tool_call>{"name": "fit_phases", "arguments": {"phases": %s}}</tool_call>'
                        % json.dumps(FIT_PHASES[label]))
            return '<tool_call>{"name": "find_peaks", "arguments": {"max_peaks": 5}}</tool_call>'
        if self.policy == "fit":
            self.seen[label] = [float(z) for z in re.findall(r'"detection_z_min":\s*([0-9.]+)', conversation)]
        answer = TRUTH[label]
        return answer + "</answer>" if conversation.endswith("<answer>") else f"<answer>{answer}</answer>"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, obj):
        out = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self):
        self._send({"model_path": "scripted", "weight_version": "0", "num_moe_layers": 2, "moe_router_topk": 2})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests += 1
        if self.path == "/generate":
            ids = body["input_ids"]
            out = TOK.encode(self.server.reply(TOK.decode(ids)))[: body["sampling_params"]["max_new_tokens"]]
            meta = {"prompt_tokens": len(ids), "completion_tokens": len(out), "weight_version": "0",
                    "finish_reason": {"type": "stop", "matched": 1},
                    "output_token_logprobs": [[-0.5, t, None] for t in out]}
            if body.get("return_routed_experts"):
                rows = wire.routed_rows(len(ids), len(out), body.get("routed_experts_start_len", 0))
                meta["routed_experts"] = wire.encode_routes(np.zeros((rows, 2, 2), np.int32))
            return self._send({"output_ids": out, "meta_info": meta})
        if self.path == "/v1/chat/completions":
            convo = "\n".join(m["content"] for m in body["messages"])
            text = self.server.reply(convo.replace("Last turn: answer now with <answer>...</answer>.", ""))
            text = text.replace("</tool_call>", "").replace("</answer>", "")   # stop strings are trimmed
            return self._send({"choices": [{"message": {"role": "assistant", "content": text},
                                            "finish_reason": "stop"}],
                               "usage": {"total_tokens": len(convo) // 4, "completion_tokens": len(text) // 4}})
        self.send_error(404)


@pytest.fixture
def scripted():
    servers = []

    def make(policy):
        srv = Scripted(policy)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"
    make.servers = servers
    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.mark.parametrize("api", ["generate", "chat"])
def test_truth_policy_scores_100_and_silent_policy_0(scripted, tmp_path, api):
    common = ["--api", api, "--preset", "tiny", "--split", "test_id,test_ood", "--n", "3", "--prompt-style", "full",
              "--max-turns", "3", "--max-new-tokens", "200", "--max-total-tokens", "20000", "--no-progress"]
    assert eval_cli.main(["--endpoint", scripted("truth"), "--out", str(tmp_path / "good"), *common]) == 0
    report = json.loads((tmp_path / "good" / "eval.json").read_text())
    for split in ("test_id", "test_ood"):
        s = report["summaries"][split]
        assert s["success_rate"] == 1.0 and s["episodes"] == 3 and s["errors"] == 0
        assert s["phase_f1"] == 1.0 and s["weight_mae"] < 1e-6 and s["tool_calls_mean"] == 1.0
    assert "| test_ood | 3 | 100.0% |" in (tmp_path / "good" / "eval.md").read_text()
    assert eval_cli.main(["--endpoint", scripted("silent"), "--out", str(tmp_path / "bad"), *common]) == 0
    bad = json.loads((tmp_path / "bad" / "eval.json").read_text())["summaries"]["test_id"]
    assert bad["success_rate"] == 0.0 and bad["success_ci95"][1] < 0.8


def test_minimal_toolset_refuses_full_tools(scripted, tmp_path):
    args = ["--endpoint", scripted("truth"), "--api", "generate", "--preset", "tiny", "--split", "test_id",
            "--n", "2", "--tools", "minimal", "--prompt-style", "full", "--max-turns", "3",
            "--max-new-tokens", "200", "--max-total-tokens", "20000", "--no-progress", "--out", str(tmp_path)]
    assert eval_cli.main(args) == 0
    s = json.loads((tmp_path / "eval.json").read_text())["summaries"]["test_id"]
    assert s["tool_errors"] == 2 and s["success_rate"] == 1.0   # find_peaks is not in the minimal set


@pytest.fixture(scope="module")
def engine():
    from neon_hpc.rollout.engines.embedded import start_server
    from test_agent_episode import tiny_weights
    handle = start_server(tiny_weights(3), in_process=True)
    yield handle
    handle.stop()


def test_tiny_xrd_group_on_the_embedded_engine(engine):
    from neon_hpc.rollout.engines.client import EngineClient
    task = load_tasks("tiny", "train", 0, 1)[0]
    cfg = RolloutConfig(max_turns=2, max_new_tokens=8, answer_max_new_tokens=2, max_total_tokens=512)
    trajs = run_group(EngineClient(engine.url), task, TOK, cfg, group_size=4, seed=3,
                      env=envs.get("xrd").bind(XRDConfig()))
    assert len({t.group_id for t in trajs}) == 1
    for t in trajs:
        t.check()
        assert t.task_id == task.id and t.metadata["finish"] == "answer"
        assert 0.0 <= t.rewards["dense"] <= 1.0 and t.reward == t.rewards["dense"]
        assert t.routed_experts.shape == (t.num_tokens, 2, 2)
        assert np.all(t.loss_mask[t.turn_offsets[-1] - 2:] <= 1)
        gen_last = t.loss_mask[t.turn_offsets[-2]:t.turn_offsets[-1]].sum()
        assert gen_last <= 2                                   # the forced answer is short
        assert TOK.decode(t.tokens[:t.turn_offsets[1]]).startswith("<|system|>xrd<|end|><|user|>elements ")


def test_judge_panel_and_the_neon_hpc_command(scripted, tmp_path):
    from neon_hpc.cli import main as neon_hpc
    judge = scripted("judge_yes")
    args = ["xrd", "eval", "--endpoint", scripted("silent"), "--api", "generate", "--preset", "tiny",
            "--split", "test_id", "--n", "2", "--judge", f"{judge}=j1", "--judge", f"{judge}=j2",
            "--no-progress", "--out", str(tmp_path)]
    assert neon_hpc(args) == 0                      # neon-hpc xrd eval --endpoint delegates here
    s = json.loads((tmp_path / "eval.json").read_text())["summaries"]["test_id"]
    assert s["success_rate"] == 0.0 and s["judge_success_rate"] == 1.0 and s["judge_agreement"] == 0.0
    assert "judge agreement" in (tmp_path / "eval.md").read_text()


def test_group_trajectories_survive_a_shard_round_trip_with_their_routes(engine, tmp_path):
    from neon_hpc.rollout.engines.client import EngineClient
    from neon_hpc.store import read_shard, write_shard
    task = load_tasks("tiny", "train", 0, 2)[1]
    cfg = RolloutConfig(max_turns=2, max_new_tokens=6, answer_max_new_tokens=2, max_total_tokens=512)
    trajs = run_group(EngineClient(engine.url), task, TOK, cfg, group_size=2, seed=9,
                      env=envs.get("xrd").bind(XRDConfig()))
    write_shard(tmp_path / "s.h5", trajs, writer_id="test")
    back = read_shard(tmp_path / "s.h5")
    assert len(back) == 2 and all(a.same_as(b) for a, b in zip(trajs, back))
    assert back[0].routed_experts.shape == (back[0].num_tokens, 2, 2)
    assert back[0].metadata["route_versions"] == [[0, 0]]


def test_unreachable_endpoint_fails_fast_with_a_message(tmp_path, capsys):
    rc = eval_cli.main(["--endpoint", "http://127.0.0.1:9", "--api", "generate", "--no-progress",
                        "--out", str(tmp_path)])
    assert rc == 2 and "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
    assert not (tmp_path / "eval.json").exists()


# --- --protocol: fit_phases' detection threshold never comes from what is scored --------------

def _fit_run(scripted, tmp_path, *args):
    url = scripted("fit")
    rc = eval_cli.main(["--endpoint", url, "--api", "chat", "--prompt-style", "full", "--max-turns", "3",
                        "--max-new-tokens", "200", "--max-total-tokens", "40000", "--no-progress",
                        "--out", str(tmp_path), *args])
    assert rc == 0
    return json.loads((tmp_path / "eval.json").read_text()), scripted.servers[-1].seen


@pytest.mark.slow
def test_protocol_fit_on_train_uses_the_threshold_fitted_on_train_tasks(scripted, tmp_path, monkeypatch):
    from neon_hpc.envs.xrd.science import evaluate
    from neon_hpc.envs.xrd.science.fitting import DETECTION_Z_MIN
    # the run's own fit (fitting it again here would double the test's time), recorded with its arguments
    calls, fit = [], evaluate.thresholds_fitted_on_train

    def recording(*args):
        calls.append((args, fit(*args)))
        return calls[-1][1]
    monkeypatch.setattr(evaluate, "thresholds_fitted_on_train", recording)
    report, seen = _fit_run(scripted, tmp_path, "--preset", "tiny", "--split", "test_id,test_ood", "--n", "3",
                            "--protocol", "fit-on-train")
    assert [args for args, _ in calls] == [("tiny", 3, 0)]       # once per run: --preset, --n, --seed 0
    th, info = calls[0][1]
    assert all(t.startswith("tiny-train-") for t in info["train_tasks"]) and len(info["train_tasks"]) == 3
    assert th.z_min != DETECTION_Z_MIN           # else the test could not tell the two apart
    assert report["meta"]["protocol"] == "fit-on-train"
    assert report["protocol"]["test_id"]["thresholds"] == th.__dict__
    assert len(report["episodes"]) == 6
    for ep in report["episodes"]:
        assert ep["detection_z_min"] == th.z_min and ep["thresholds_fitted_on"] == info["train_tasks"]
        assert ep["task_id"] not in ep["thresholds_fitted_on"] and ep["success"] == 1.0
    assert len(seen) == 6 and all(v == [th.z_min] for v in seen.values())   # what fit_phases told the model
    fixed, seen = _fit_run(scripted, tmp_path / "fixed", "--preset", "tiny", "--split", "test_id", "--n", "2")
    assert all(v == [DETECTION_Z_MIN] for v in seen.values()) and len(seen) == 2
    assert all(ep["detection_z_min"] is None for ep in fixed["episodes"])


def test_protocol_refuses_splits_it_cannot_score_before_any_request(tmp_path, capsys):
    base = ["--endpoint", "http://127.0.0.1:9", "--api", "chat", "--no-progress", "--out", str(tmp_path)]
    assert eval_cli.main(base + ["--protocol", "loo", "--split", "test_id"]) == 2
    assert "--protocol loo" in capsys.readouterr().err
    assert eval_cli.main(base + ["--protocol", "fit-on-train", "--split", "test_id,train"]) == 2
    assert "fit-on-train" in capsys.readouterr().err
    assert not (tmp_path / "eval.json").exists()


@pytest.mark.slow
def test_protocol_loo_fits_each_mixture_on_the_others(scripted, tmp_path, monkeypatch):
    from neon_hpc.envs.xrd.science import evaluate
    from neon_hpc.envs.xrd.science.baseline import THRESHOLD_GRID
    from neon_hpc.envs.xrd.science.evaluate import choose_thresholds, mixture_of
    from neon_hpc.envs.xrd.science.grader import grade
    from neon_hpc.envs.xrd.science.real import load_real_tasks, real_data_dir
    if real_data_dir() is None:
        pytest.skip("shared/data/xrd-real not found (set NEON_XRD_REAL_DATA)")
    tasks = load_real_tasks("precursor_mixture")[:4]            # 2 mixtures x 2 scans
    for t in tasks:
        label = sample_label(t.id)
        TRUTH[label] = ", ".join(f"{pid or f} {wf}" for pid, f, wf in t.truth)
        FIT_PHASES[label] = [pid for pid, _f, _w in t.truth]
    # the expectation below grades the baseline traces the run itself made (tracing 4 real scans
    # again would double the test's time), recorded by task id as the run's trace_all returns them
    traced, trace_all = {}, evaluate.trace_all

    def recording(ts, *a, **kw):
        out = trace_all(ts, *a, **kw)
        traced.update({u.id: tr for u, tr in zip(ts, out[0])})
        return out
    monkeypatch.setattr(evaluate, "trace_all", recording)
    report, seen = _fit_run(scripted, tmp_path, "--split", "real", "--n", "4", "--protocol", "loo")
    assert len(report["episodes"]) == 4 and set(report["protocol"]["real"]["folds"]) == {mixture_of(t) for t in tasks}
    assert sorted(traced) == sorted(t.id for t in tasks)          # the run traced exactly the scored tasks
    traces = [traced[t.id] for t in tasks]
    for t in tasks:
        ep = next(e for e in report["episodes"] if e["task_id"] == t.id)
        rest = [i for i, u in enumerate(tasks) if mixture_of(u) != mixture_of(t)]
        assert sorted(ep["thresholds_fitted_on"]) == sorted(tasks[i].id for i in rest)   # never its own mixture
        answers = [[(None, grade(traces[i].decide(th).phases, tasks[i].truth)) for th in THRESHOLD_GRID]
                   for i in rest]
        expected = THRESHOLD_GRID[choose_thresholds(answers, THRESHOLD_GRID)]
        assert ep["detection_z_min"] == expected.z_min
        assert seen[sample_label(t.id)] == [expected.z_min]
