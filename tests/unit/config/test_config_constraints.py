"""Every config field is range-checked by one pydantic model (neon_hpc.util.constraints).

The table below is generated from the schema itself: every field of every section (nested
sections included) gets a value just outside what it allows -- NaN and infinity for floats,
the first integer past a bound, a wrong type, a misspelt enum -- and the error must name the
file, the key, the bad value and the allowed range.  A field added by anyone is covered here
without touching this file.
"""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
import yaml

from neon_hpc import config
from neon_hpc.util import constraints
from neon_hpc.util.constraints import INT_MAX, Range, Rule, above, at_least
from repo_paths import REPO

TINY = REPO / "configs" / "tiny_cpu.yaml"


def _fields(cls, prefix=""):
    """(dotted key, annotation, owning class, field name) of every leaf field (a union of
    sections, such as ``model``, yields each member's fields once, under the member's tag)."""
    hints = constraints.hints(cls)
    seen = set()
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        members = constraints.union_members(tp)
        if dataclasses.is_dataclass(tp):
            yield from _fields(tp, key)
        elif members:
            for member in members.values():
                for leaf in _fields(member, key):
                    if leaf[0] not in seen and leaf[3] != member.TAG_FIELD:
                        seen.add(leaf[0])
                        yield (*leaf, member)
        else:
            yield key, tp, cls, f.name


def _base(tp):
    """The non-None member of ``X | None``."""
    if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _bad_values(tp, rng: Range):
    """Values a field of annotation ``tp`` and range ``rng`` must refuse."""
    tp = _base(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return ["definitely-not-an-option", 3]
    if origin is list:
        (item,) = typing.get_args(tp) or (typing.Any,)
        return ["not a list"] + [[v] for v in _bad_values(item, constraints.DEFAULT)][:1]
    if origin is dict:   # (a bad item value names its own key: offpolicy.correction_params.cap: got nan)
        return ["not a mapping"]
    if tp is bool:
        return ["yes please", 1]
    if tp is str:
        return [12, ["a"]]
    if tp is int:
        out = [1.5, "many", INT_MAX + 1]
        if rng.ge is not None:
            out.append(math.ceil(rng.ge) - 1)
        if rng.gt is not None:
            out.append(math.floor(rng.gt))
        if rng.le is not None and rng.le < INT_MAX:
            out.append(math.floor(rng.le) + 1)
        if rng.lt is not None:
            out.append(math.ceil(rng.lt))
        return out
    if tp is float:
        out = [float("nan"), "nan", float("-inf"), "no"]
        if rng.finite:
            out.append(float("inf"))
        if rng.ge is not None:
            out.append(rng.ge - max(1e-3, abs(rng.ge) * 1e-3))
        if rng.gt is not None:
            out.append(rng.gt)
        if rng.le is not None:
            out.append(rng.le + max(1e-3, abs(rng.le) * 1e-3))
        if rng.lt is not None:
            out.append(rng.lt)
        return out
    return []


TAGS = {"model": "arch"}


def _cases():
    for key, tp, cls, name, *member in _fields(config.ExperimentConfig):
        rng = constraints.range_of(cls, name)
        tag = []
        if member and key.split(".")[0] in TAGS:     # a union member's field: choose that member
            field = TAGS[key.split(".")[0]]
            tag = [f"{key.split('.')[0]}.{field}={typing.get_args(constraints.hints(member[0])[field])[0]}"]
        for v in _bad_values(tp, rng):
            yield pytest.param(key, v, tag, id=f"{key}={v!r}"[:80])


ALL_CASES = list(_cases())


def _dump_override(key: str, value) -> str:
    if isinstance(value, float) and math.isnan(value):
        return f"{key}=.nan"
    if isinstance(value, float) and math.isinf(value):
        return f"{key}={'-' if value < 0 else ''}.inf"
    return f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


def test_every_field_has_cases():
    """Each leaf field of the schema appears in the table: nothing escapes the checker."""
    keys = {k for k, *_ in _fields(config.ExperimentConfig)}
    covered = {p.values[0] for p in ALL_CASES}
    assert keys == covered, f"fields without a refusal case: {sorted(keys - covered)}"


_TINY_DATA = yaml.safe_load(TINY.read_text())


def _load_tiny(*overrides: str):
    """``config.load(TINY, overrides)`` without re-reading the YAML for each of the many cases."""
    import copy
    data = copy.deepcopy(_TINY_DATA)
    for override in overrides:
        keys, value = config._parse_override(override)
        config._apply_override(data, keys, value)
    return config.from_dict(data, f"{TINY} (with --set {' '.join(overrides)})")


@pytest.mark.parametrize("key,value,tag", ALL_CASES)
def test_out_of_range_value_refused(key, value, tag):
    override = _dump_override(key, value)
    with pytest.raises(config.ConfigError) as ei:
        _load_tiny(*tag, override)
    msg = str(ei.value)
    assert "tiny_cpu.yaml" in msg and key in msg, msg
    line = next(ln for ln in msg.split("\n") if key in ln)
    assert ("allowed:" in line or "expected" in line), line   # the allowed range (or type) is named
    shown = constraints.short_repr(value) if not isinstance(value, float) or math.isfinite(value) else \
        ("nan" if math.isnan(value) else repr(value))
    assert shown.strip("'") in line or repr(value) in line or str(value) in line, line


ISSUE_VALUES = ["train.lr=nan", "train.lr=.nan", "train.lr=.inf", "offpolicy.max_staleness=-1", "train.clip_eps=nan",
                "rollout.num_workers=-1", "train.grad_clip=-1", "train.weight_decay=-0.5",
                "train.wait_for_data_s=-10", "train.steps=10^20", "train.steps=100000000000000000000"]


@pytest.mark.parametrize("override", ISSUE_VALUES)
def test_issue_values_refused(override):
    key = override.split("=")[0]
    with pytest.raises(config.ConfigError) as ei:
        config.load(TINY, [override])
    assert key in str(ei.value) and "tiny_cpu.yaml" in str(ei.value)


def test_defaults_and_shipped_configs_pass():
    assert constraints.errors(config.ExperimentConfig()) == []
    for name in ("tiny_cpu.yaml", "tiny_dsv3_cpu.yaml", "kimi_k2_1300xh200.yaml"):
        assert constraints.errors(config.load(REPO / "configs" / name)) == []


def test_message_names_file_key_value_and_range(tmp_path):
    p = tmp_path / "exp.yaml"
    p.write_text("train:\n  lr: .nan\n  clip_eps: 1.5\nrollout:\n  num_workers: -1\n")
    with pytest.raises(config.ConfigError) as ei:
        config.load(p)
    lines = str(ei.value).split("\n")
    assert len(lines) == 3, lines          # every violation reported at once
    assert f"{p}: train.lr: got nan; allowed: a finite number in (0, 1]" in lines
    assert f"{p}: train.clip_eps: got 1.5; allowed: a finite number in (0, 1)" in lines
    assert f"{p}: rollout.num_workers: got -1; allowed: an integer >= 1" in lines


def test_cross_field_rule_reports_field_and_value():
    with pytest.raises(config.ConfigError, match=r"model.moe_router_topk: got 6; allowed: in 1..num_experts \(4\)"):
        config.load(TINY, ["model.num_experts=4", "model.moe_router_topk=6"])


def test_huge_bad_value_is_quoted_bounded():
    with pytest.raises(config.ConfigError) as ei:
        config.load(TINY, ["train.steps=" + "x" * 1_000_000])
    assert len(str(ei.value)) < 2000 and "truncated" in str(ei.value)


# --- the mechanism, for fields that others add -----------------------------------------

@constraints.section
@dataclasses.dataclass
class _NewSection:
    plain_float: float = 1.0
    plain_int: int = 3
    maybe: float | None = None
    choice: typing.Literal["a", "b"] = "a"
    items: list[int] = dataclasses.field(default_factory=list)
    signed: float = -1.0
    CHECKS = {"signed": Range(ge=-5, le=5)}
    RULES = (Rule("plain_int", lambda c: c.plain_int <= 10, "<= 10"),)


@pytest.mark.parametrize("field,value,allowed", [
    ("plain_float", float("nan"), "a finite number >= 0"),
    ("plain_float", float("inf"), "a finite number >= 0"),
    ("plain_float", -0.1, "a finite number >= 0"),
    ("plain_int", -1, "an integer >= 0"),
    ("plain_int", 2**63, "an integer >= 0"),
    ("maybe", float("nan"), "a finite number >= 0"),
    ("choice", "c", "one of 'a', 'b'"),
    ("items", [1, -2], "an integer >= 0"),
    ("signed", 6.0, "a finite number in [-5, 5]"),
    ("plain_int", 11, "<= 10"),
])
def test_undeclared_fields_get_defaults(field, value, allowed):
    sec = _NewSection(**{field: value})
    ((key, msg),) = constraints.errors(sec)
    assert key.startswith(field) and allowed in msg, (key, msg)


def test_undeclared_defaults_accept_valid_values():
    assert constraints.errors(_NewSection(maybe=0.5, items=[0, 7], signed=-5.0)) == []


def test_checks_naming_no_field_is_a_programming_error():
    with pytest.raises(TypeError, match="stpes"):
        @constraints.section
        @dataclasses.dataclass
        class Typo:
            steps: int = 1
            CHECKS = {"stpes": at_least(1)}


def test_range_describe():
    assert above(0, le=1.0).describe("float") == "a finite number in (0, 1]"
    assert at_least(1, "x").describe("int") == "an integer >= 1 (x)"
    assert Range(lt=3, finite=False).describe("float") == "a number < 3"


def test_config_check_runs_role_startup_checks(tmp_path, capsys):
    """What a role would refuse at start-up (here: the trainer's cost model) is refused by
    `neon-hpc config check`, which the schema alone accepts."""
    from neon_hpc.cli import main as cli_main
    missing = tmp_path / "no_such_cost.json"
    config.load(TINY, [f"balance.cost_file={missing}"])          # the schema has nothing against it
    assert cli_main(["config", "check", str(TINY), "--set", f"balance.cost_file={missing}"]) == 2
    err = capsys.readouterr().err
    assert "trainer would refuse it" in err and "balance.cost_file" in err and str(missing) in err
    assert cli_main(["config", "check", str(TINY)]) == 0


def test_episode_budget_must_fit_the_model_context():
    """The engines refuse prompt + generation beyond the context; the config says so first."""
    with pytest.raises(config.ConfigError,
                       match=r"rollout.max_total_tokens: 4096 is over model.max_position_embeddings \(2048\)"):
        config.load(TINY, ["rollout.max_total_tokens=4096"])
    assert config.load(TINY, ["rollout.max_total_tokens=2048"]).rollout.max_total_tokens == 2048


def test_a_moved_key_is_refused_naming_its_new_home(tmp_path):
    """rollout.tools / rollout.prompt_style are the XRD environment's (env.tools, env.prompt_style under kind: xrd):
    an old config or run.yaml that still sets them is told where they went (RolloutConfig.MOVED)."""
    old = yaml.safe_load(TINY.read_text())
    old.setdefault("rollout", {}).update(tools="minimal", prompt_style="full")
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(yaml.safe_dump(old))
    with pytest.raises(config.ConfigError) as ei:
        config.load(run_yaml)
    lines = str(ei.value).splitlines()
    assert f"{run_yaml}: rollout.tools: moved to env.tools (kind: xrd); set it there" in lines
    assert f"{run_yaml}: rollout.prompt_style: moved to env.prompt_style (kind: xrd); set it there" in lines
    with pytest.raises(config.ConfigError, match=r"\(with --set rollout.tools=full\): rollout.tools: moved to "
                                                 r"env.tools \(kind: xrd\); set it there"):
        config.load(TINY, ["rollout.tools=full"])
    cfg = config.load(TINY, ["env.tools=minimal", "env.prompt_style=full"])     # the new home takes them
    assert (cfg.env.tools, cfg.env.prompt_style) == ("minimal", "full")
    assert "tools" not in config.to_dict(cfg)["rollout"] and "tools: minimal" in config.dump(cfg)


def test_balance_planner_is_refused_naming_balance_method(tmp_path):
    """balance.planner became balance.method ("planner" is the capacity planner's, neon_hpc/plan):
    an old config or run.yaml that still sets it is refused with the new key (BalanceConfig.MOVED)."""
    old = yaml.safe_load(TINY.read_text())
    old.setdefault("balance", {})["planner"] = "tokenkk"
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(yaml.safe_dump(old))
    with pytest.raises(config.ConfigError) as ei:
        config.load(run_yaml)
    assert f"{run_yaml}: balance.planner: moved to balance.method; set it there" in str(ei.value).splitlines()
    with pytest.raises(config.ConfigError, match=r"\(with --set balance.planner=cost\): balance.planner: moved to "
                                                 r"balance.method; set it there"):
        config.load(TINY, ["balance.planner=cost"])
    cfg = config.load(TINY, ["balance.method=tokenkk"])                  # the new home takes it
    assert cfg.balance.method == "tokenkk" and not cfg.balance.splits
    assert "planner" not in config.to_dict(cfg)["balance"] and "method: tokenkk" in config.dump(cfg)
    # the capacity planner's own key for how often it runs the balancer
    with pytest.raises(config.ConfigError, match=r"plan.planner_every: moved to plan.balance_every; set it there"):
        config.load(TINY, ["plan.planner_every=5"])
    assert config.load(TINY, ["plan.balance_every=5"]).plan.balance_every == 5


def test_moved_naming_a_field_is_a_programming_error():
    with pytest.raises(TypeError, match="MOVED names steps: still fields of Stays"):
        @constraints.section
        @dataclasses.dataclass
        class Stays:
            steps: int = 1
            MOVED = {"steps": "train.steps"}
