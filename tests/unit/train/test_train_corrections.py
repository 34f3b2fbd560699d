"""The off-policy correction registry (``neon_hpc/train/corrections.py``): the built-ins, a user's correction
by import path (``tests/correction_fixture.py``), the start-up check ``neon-hpc config check`` runs, and two
real trainer steps with the user's correction."""

from __future__ import annotations

import pytest
import torch

from neon_hpc import config as C, config_cli
from neon_hpc.train import corrections
from neon_hpc.train.corrections import CorrectionError, bind
from repo_paths import REPO

TINY = REPO / "configs" / "tiny_cpu.yaml"
USER = "correction_fixture:truncated"


def test_builtins_are_registered_with_their_metrics_and_defaults():
    assert {"tis", "none"} <= set(corrections.REGISTRY)
    tis = bind("tis")
    assert tis.params == {"cap": 2.0} and tis.metrics == ("tis_weight_mean", "tis_clip_frac")
    w, terms = bind("tis", {"cap": 3.0})(torch.tensor([0.5, 2.5, 4.0]))
    assert w.tolist() == [0.5, 2.5, 3.0] and terms["tis_clip_frac"].tolist() == [0, 0, 1]
    w, terms = bind("none")(torch.tensor([0.5, 4.0]))
    assert w.tolist() == [1.0, 1.0] and terms["tis_clip_frac"].tolist() == [0, 0]


def test_a_user_correction_resolves_by_import_path():
    b = bind(USER, {"limit": 1.5})
    assert b.name == "fixture_truncated" and b.params == {"limit": 1.5}
    assert b.metrics == ("fixture_weight_mean", "fixture_over_frac")


@pytest.mark.parametrize("name, params, words", [
    ("nosuch", {}, ["offpolicy.correction", "'nosuch' is not a registered correction", "tis", "pkg.mod:fn"]),
    ("no_such_module_xyz:fn", {}, ["offpolicy.correction", "cannot import module 'no_such_module_xyz'"]),
    ("correction_fixture:missing", {}, ["offpolicy.correction", "has no 'missing'"]),
    ("correction_fixture:not_registered", {},
     ["offpolicy.correction", "not registered", "@neon_hpc.train.corrections"]),
    ("tis", {"cpa": 2.0}, ["offpolicy.correction_params.cpa", "not a parameter of correction 'tis'", "cap"]),
])
def test_unusable_corrections_are_refused_by_name(name, params, words):
    with pytest.raises(CorrectionError) as ei:
        bind(name, params)
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


def test_a_registration_without_the_ratio_or_numeric_defaults_is_refused():
    with pytest.raises(CorrectionError, match="first parameter must be the per-token ratio"):
        corrections.correction("bad_first")(lambda: None)
    with pytest.raises(CorrectionError, match="parameter 'cap' needs a numeric default"):
        corrections.correction("bad_param")(lambda ratio, cap: ratio)


@pytest.mark.parametrize("overrides, words", [
    ([f"offpolicy.correction={USER}"], None),
    (["offpolicy.correction=correction_fixture:not_registered"], ["offpolicy.correction", "not registered"]),
    (["offpolicy.correction=correction_fixture:wrong_metrics"],
     ["returned metrics ['undeclared']", "declared ['declared']"]),
    (["offpolicy.correction_params={cap: 0.5}"], ["offpolicy.correction_params.cap", ">= 1"]),
    (["offpolicy.correction=no_such_module_xyz:fn"], ["cannot import module 'no_such_module_xyz'"]),
])
def test_config_check_imports_and_validates_the_correction(overrides, words):
    """``neon-hpc config check`` runs the trainer's start-up check, which resolves and tries the correction."""
    cfg = C.load(TINY, overrides)
    problems = config_cli.role_problems(cfg)
    mine = [msg for _role, msg in problems if "correction" in msg]
    if words is None:
        assert not mine, mine
    else:
        assert mine, problems
        for w in words:
            assert w in mine[0], (w, mine[0])


def test_trains_with_a_user_correction_exactly_as_with_the_same_builtin():
    """Two real trainer steps with the fixture's correction give the losses of ``tis`` with the same cap,
    and the step's metrics carry the fixture's declared names."""
    from neon_hpc.train import backend as B
    from neon_hpc.train.loop import prepare_step, train_step
    from neon_hpc.train.loss import loss_settings
    from neon_hpc.train.sections import TrainerSections
    from test_train_precision import trajectories

    def run(overrides):
        cfg = C.load(TINY, overrides)
        sec = TrainerSections.of(cfg)
        be = B.setup(cfg.model, lr=3e-3, seed=3)
        try:
            return [train_step(be, prepare_step(trajectories(cfg, s), 1, sec), loss_settings(sec)) for s in range(2)]
        finally:
            B.teardown()

    mine = run([f"offpolicy.correction={USER}", "offpolicy.correction_params={limit: 1.1}"])
    tis = run(["offpolicy.correction_params={cap: 1.1}"])
    assert [m["loss"] for m in mine] == [m["loss"] for m in tis]
    for m, t in zip(mine, tis):
        assert "tis_clip_frac" not in m and m["fixture_over_frac"] == t["tis_clip_frac"]
        assert m["fixture_weight_mean"] == t["tis_weight_mean"]
