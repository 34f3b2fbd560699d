"""The fixed eval set (``rollout/agent/evalset.py``) and ``RUN/summary.json`` (``launch/warm.py``).

Greedy episodes of held-out tasks on published weights: the same weights on the same tasks give
the same answers and scores; the summary carries the start/end eval beside the span share and
the waste.
"""

from __future__ import annotations

from neon_hpc import config, envs
from neon_hpc.launch.warm import write_summary
from neon_hpc.models.tokenizer import load_tokenizer
from neon_hpc.protocol.rundir import RunDir, read_json
from neon_hpc.rollout.agent.evalset import eval_tasks, evaluate_weights, greedy
from repo_paths import REPO

CFG = config.load(str(REPO / "configs" / "tiny_cpu.yaml"),
                  ["eval.num_tasks=4"])


def test_eval_is_greedy_on_fixed_held_out_tasks_and_lands_in_the_summary(tmp_path):
    from test_agent_episode import tiny_weights
    xrd = envs.configured(CFG)
    tasks = eval_tasks(CFG.eval, xrd.tasks())
    assert [t.id for t in tasks] == [t.id for t in eval_tasks(CFG.eval, xrd.tasks())]
    assert len(tasks) == 4 and all(t.split == "test_id" for t in tasks)
    assert greedy(CFG.rollout).temperature == 0.0 and CFG.rollout.temperature == 1.0
    tok = load_tokenizer("xrd-tiny")
    a = evaluate_weights(tiny_weights(3), tasks, tok, CFG.rollout, CFG.model, env=xrd)
    b = evaluate_weights(tiny_weights(3), tasks, tok, CFG.rollout, CFG.model, env=xrd)
    assert a["n"] == 4 and a["temperature"] == 0.0
    assert [t["task_id"] for t in a["tasks"]] == [t.id for t in tasks]
    assert a["tasks"] == b["tasks"] and a["success"] == b["success"]       # greedy: the same answers
    run = RunDir(tmp_path).create()
    s = write_summary(run, {"trained_multi_version_fraction": 0.3, "wasted_rollout_tokens": 0.0},
                      {"start": {**a, "version": 0}, "end": {**b, "version": 8}}, None, {"cpu_s_launcher": 1.0})
    back = read_json(tmp_path / "summary.json")
    for k in ("eval_success_start", "eval_success_end", "trained_spanning_ge2", "wasted_rollout_tokens"):
        assert k in back and back[k] == s[k]
    assert back["eval_success_start"] == a["success"] and back["eval_version_end"] == 8
