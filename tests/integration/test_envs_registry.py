"""Environments as plugins (issue 32 item 1, ``neon_hpc/envs/``): a throwaway environment from a test
folder (``tests/throwaway_env``) is registered at run time, chosen by ``env.kind``, and runs an
episode through the real agent loop (a scripted engine: exact token books); the config refuses an
unknown kind naming the registered ones; ``neon-hpc env list`` prints them, name first; the
rollout worker's view carries the chosen plugin's section; the second environment (``digits``)
grades what the loop reads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from neon_hpc import config, envs
from neon_hpc.config.rollout import RolloutConfig
from neon_hpc.rollout.agent import run_group
from neon_hpc.rollout.agent.evalset import eval_tasks
from neon_hpc.rollout.sections import WorkerSections
from repo_paths import REPO
from test_agent_episode import TOK, ScriptedClient, check_books
from throwaway_env import EVAL_SPLITS, PLUGIN as ECHO

TINY = str(REPO / "configs" / "tiny_cpu.yaml")


@pytest.fixture
def echo():
    envs.register(ECHO, EVAL_SPLITS)
    yield envs.get("echo")
    envs.unregister("echo")


def test_a_registered_environment_is_chosen_by_env_kind_and_runs_an_episode(echo):
    cfg = config.load(TINY, ["env={kind: echo}", "eval.seed=2"])
    sec = WorkerSections.of(cfg)
    assert sec.env.kind == "echo" and sec.env is cfg.env                # the plugin's own section
    source = echo.tasks(sec.env)
    task = source.train()[0]
    assert source.seed == 0 and task.word == "alpha"
    rollout = RolloutConfig(max_turns=4, max_new_tokens=24, max_total_tokens=512,
                            max_tool_chars=32)
    client = ScriptedClient(["<tool_call>peek</tool_call>", "<answer>alpha</answer>"] * 2)
    trajs = run_group(client, task, TOK, rollout, group_size=2, env=echo.bind(sec.env))
    assert len(trajs) == 2 and len({t.group_id for t in trajs}) == 1
    for t in trajs:
        check_books(t)
        assert t.task_id == task.id and t.metadata["finish"] == "answer" and t.metadata["turns"] == 2
        assert t.rewards == {"success": 1.0, "dense": 1.0} and t.metadata["grade"] == {"truth": "alpha", "peeks": 1}
        text = TOK.decode(t.tokens.tolist())
        assert text.startswith("<|system|>echo<|end|><|user|>peek then answer") and "word alpha" in text
    # a wrong answer grades 0 through the same loop
    bad = run_group(ScriptedClient(["<answer>beta</answer>"]), task, TOK, rollout, group_size=1,
                    env=echo.bind(cfg.env))[0]
    assert bad.rewards["success"] == 0.0 and bad.metadata["tool_calls"] == 0
    # the eval set comes from the plugin's task source
    held = eval_tasks(cfg.eval, source)
    assert [t.id for t in held] == [f"echo-{cfg.eval.split}-2-{i}" for i in range(cfg.eval.num_tasks)]


def test_a_task_without_its_plugin_is_refused_by_the_agent_loop(echo):
    task = echo.tasks(config.load(TINY).eval).train()[0]
    with pytest.raises(TypeError, match=r"env=neon_hpc.envs.configured\(cfg\)"):
        run_group(ScriptedClient(["<answer>x</answer>"]), task, TOK, RolloutConfig(), group_size=1)


def test_an_unknown_kind_is_refused_naming_the_registered_ones(echo):
    with pytest.raises(config.ConfigError, match=r"env.kind: got 'nope'; allowed: a registered environment: "
                                                 r"digits, xrd, echo \(neon-hpc env list\)"):
        config.load(TINY, ["env={kind: nope}"])
    with pytest.raises(ValueError, match="already registered"):
        envs.register(ECHO, EVAL_SPLITS)
    with pytest.raises(ValueError, match="unknown environment 'nope'; registered: digits, xrd, echo"):
        envs.get("nope")


def test_unregistered_the_throwaway_is_refused_again():
    assert "echo" not in envs.kinds()
    with pytest.raises(config.ConfigError,
                       match=r"env.kind: got 'echo'; allowed: a registered environment: digits, xrd"):
        config.load(TINY, ["env={kind: echo}"])
    with pytest.raises(ValueError, match="is installed"):
        envs.unregister("xrd")


def test_env_list_prints_the_registered_kinds_name_first():
    out = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "env", "list"], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout.splitlines()
    assert [line.split()[0] for line in out] == list(envs.kinds()) == ["digits", "xrd"]
    # each line: the name, the about line, how a journalled episode resumes (snapshot or replay)
    from neon_hpc.envs.base import RESUME_MODES
    assert all(line.split(maxsplit=1)[1] == f"{envs.REGISTRY[line.split()[0]].about} "
               f"({RESUME_MODES[envs.REGISTRY[line.split()[0]].resume]})" for line in out)


def test_the_default_is_xrd_and_its_worker_view_carries_the_xrd_section():
    cfg = config.load(TINY)
    assert cfg.env.kind == "xrd" and WorkerSections.of(cfg).env is cfg.env and type(cfg.env).__name__ == "XRDConfig"
    assert "kind: xrd" in config.dump(cfg) and config.load(TINY, ["env.preset=easy"]).env.preset == "easy"


def test_an_environments_key_under_another_kind_and_the_old_xrd_section_are_refused_with_the_fix(tmp_path):
    with pytest.raises(config.ConfigError, match=r"env.preset: a field of kind xrd, not of kind digits: remove it, "
                                                 r"or set env.kind: xrd"):
        config.load(TINY, ["env.kind=digits"])
    old = tmp_path / "old.yaml"
    old.write_text("xrd:\n  preset: tiny\n")
    with pytest.raises(config.ConfigError, match=r"old.yaml: xrd: moved to env: with kind: xrd \(move the xrd: keys "
                                                 r"under env:\)"):
        config.load(old)


def test_digits_tasks_are_split_for_good_and_graded_through_the_loop():
    digits = envs.get("digits")
    source = digits.tasks(None)
    train = {(t.a, t.b) for t in source.train()}
    held = {(t.a, t.b) for t in source.held_out("test_id", 64, 0)}
    assert train and held and not train & held                       # never eval on what RL trains on
    task = source.train()[0]
    cfg = RolloutConfig(max_turns=2, max_new_tokens=8, answer_max_new_tokens=3, max_total_tokens=256)
    right, near = (run_group(ScriptedClient([f"<answer>{s}</answer>"]), task, TOK, cfg, group_size=1,
                             env=digits.bind(None))[0]
                   for s in (task.a + task.b, task.a + task.b + 1))
    assert right.rewards == {"success": 1.0, "dense": 1.0}
    assert near.rewards["success"] == 0.0 and near.rewards["dense"] == pytest.approx(1 - 1 / 18)
    assert TOK.decode(right.tokens.tolist()).startswith(f"<|system|>digits<|end|><|user|>add {task.a} {task.b}")


def test_digits_demonstrations_are_what_the_agent_loop_records_for_the_same_answer():
    import numpy as np

    from neon_hpc.envs.digits.plugin import make_demos
    from neon_hpc.rollout.agent import run_episode
    cfg = config.load(TINY).rollout
    tasks = envs.get("digits").tasks(None).demo(10)
    demos = make_demos(tasks, TOK, cfg, imperfect=0.3, seed=0)
    assert [d.metadata["demo"] for d in demos].count("wrong_sum") == 3
    for task, d in zip(tasks, demos):
        assert d.rewards["success"] == float(d.metadata["demo"] == "solver")
        t = run_episode(ScriptedClient([f"<answer>{d.metadata['answer']}</answer>"]), task, TOK, cfg,
                        env=envs.get("digits").bind(None))
        assert np.array_equal(t.tokens, d.tokens) and np.array_equal(t.loss_mask, d.loss_mask)
        assert list(t.turn_offsets) == list(d.turn_offsets) and t.rewards == d.rewards
    with pytest.raises(ValueError, match="train tasks only"):
        make_demos(envs.get("digits").tasks(None).held_out("test_id", 1, 0), TOK, cfg, 0.0, 0)


def test_the_xrd_section_sets_the_episodes_tools_and_prompt_style():
    """env.tools / env.prompt_style (the XRD environment's env: variant) reach its episodes; the
    rollout section gives only the generic limits."""
    task = envs.configured(config.load(TINY)).tasks().train(1)[0]
    default = config.load(TINY)
    env = envs.configured(default).environment(task, default.rollout)
    assert env.style == "compact" and len(env.tools) > 2 and env.system_text() == "xrd"   # tiny preset: auto -> compact
    cfg = config.load(TINY, ["env.tools=minimal", "env.prompt_style=full", "rollout.max_tool_chars=300"])
    env = envs.configured(cfg).environment(task, cfg.rollout)
    assert env.style == "full" and set(env.tools) == {"get_pattern", "simulate_phase"} and env.max_tool_chars == 300
    assert "simulate_phase" in env.system_text() and "search_phases\"" not in env.system_text()


def test_eval_split_is_one_of_the_chosen_environments_held_out_splits(echo, capsys):
    from neon_hpc.cli import main as cli_main
    with pytest.raises(config.ConfigError, match=r"tiny_cpu.yaml \(with --set eval.split=train\): eval.split: got "
                       r"'train'; allowed: a held-out split of environment xrd: test_id, test_ood, test_temporal"):
        config.load(TINY, ["eval.split=train"])
    with pytest.raises(config.ConfigError, match=r"eval.split: got 'test_ood'; allowed: a held-out split of "
                                                 r"environment digits: test_id$"):
        config.load(TINY, ["env={kind: digits}", "eval.split=test_ood"])
    assert config.load(TINY, ["env={kind: echo}", "eval.split=test_ood"]).eval.split == "test_ood"   # its registration
    assert cli_main(["config", "check", TINY, "--set", "eval.split=test_odd"]) == 2
    assert "eval.split: got 'test_odd'; allowed: a held-out split of environment xrd: test_id, test_ood" \
        in capsys.readouterr().err
    # what a registry line declares, its task source takes
    for kind in ("xrd", "digits"):
        source = envs.configured(config.load(TINY, [f"env={{kind: {kind}}}"])).tasks()
        for split in envs.eval_splits(kind):
            assert len(source.held_out(split, 2, 0)) == 2, (kind, split)


THIRD_PARTY = {
    "echo_pkg/__init__.py": "",
    "echo_pkg/settings.py": (
        "from dataclasses import dataclass\n"
        "from neon_hpc.util.constraints import at_least, section\n\n"
        "from typing import Literal\nfrom neon_hpc.envs.base import EnvSettings\n\n"
        "@section\n@dataclass\nclass EchoSettings(EnvSettings):\n    kind: Literal['echo3'] = 'echo3'\n"
        "    seed: int = 3\n    CHECKS = {'seed': at_least(0)}\n"),
    "echo_pkg/entry.py": (
        "from neon_hpc.envs.base import EnvEntry\nfrom echo_pkg.settings import EchoSettings\n"
        "ENTRY = EnvEntry(name='echo3', plugin='echo_pkg.plugin', about='a third party echo', "
        "eval_splits=('test_id',), settings=EchoSettings, cli='echo_pkg.cli', cli_help='echo3 cmd')\n"),
    "echo_pkg/plugin.py": (
        "import dataclasses\nfrom throwaway_env import PLUGIN as ECHO\n"
        "PLUGIN = dataclasses.replace(ECHO, name='echo3')\n"),
    "echo_pkg/cli.py": "def main(argv):\n    print('ECHO3', argv)\n    return 0\n",
    "echo_pkg-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: echo-pkg\nVersion: 0.1\n",
    "echo_pkg-0.1.dist-info/entry_points.txt": "[neon_hpc.envs]\necho3 = echo_pkg.entry:ENTRY\n",
}


def test_a_third_party_environment_is_added_by_installing_a_package(tmp_path):
    """An environment from another distribution (its entry point in its own metadata; nothing of
    neon_hpc edited): listed, its settings section composed into the config and validated, chosen by
    env.kind, its tasks built from its section, its command on the top-level CLI."""
    for rel, text in THIRD_PARTY.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO / "tests"), str(REPO)]))

    def neon(*args, check=True):
        return subprocess.run([sys.executable, "-m", "neon_hpc.cli", *args], capture_output=True, text=True,
                              env=env, cwd=REPO, check=check)
    assert "echo3  a third party echo" in neon("env", "list").stdout
    assert "ECHO3 ['a', 'b']" in neon("echo3", "a", "b").stdout
    neon("config", "check", TINY, "--set", "env={kind: echo3}", "--set", "eval.split=test_id")
    bad = neon("config", "check", TINY, "--set", "env={kind: echo3}", "--set", "env.seed=-1", check=False)
    assert bad.returncode != 0 and "env.seed" in bad.stderr + bad.stdout
    code = ("from neon_hpc import config, envs\n"
            f"cfg = config.load({TINY!r}, ['env={{kind: echo3}}', 'env.seed=2', 'eval.split=test_id'])\n"
            "bound = envs.configured(cfg)\n"
            "print('SEED', bound.plugin.tasks(bound.settings).seed, type(cfg.env).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert "SEED 2 EchoSettings" in out.stdout, out.stdout + out.stderr
    # without the package the kind is unknown again, naming the installed ones
    plain = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "config", "check", TINY,
                            "--set", "env={kind: echo3}"],
                           capture_output=True, text=True, cwd=REPO)
    assert plain.returncode != 0 and "digits, xrd" in plain.stderr + plain.stdout
