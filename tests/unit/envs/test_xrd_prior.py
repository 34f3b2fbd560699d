"""The precursor prior of the baseline: stated precursors are searched first, other phases need more evidence."""
import dataclasses

import numpy as np

from neon_hpc.envs.xrd.science import baseline
from neon_hpc.envs.xrd.science.fitting import FitResult, PhaseFit
from neon_hpc.envs.xrd.science.tasks import build_record_db, load_tasks, make_context


def _ctx(precursors):
    # SrTiO3 + two SiO2 polymorphs (quartz-like, cristobalite)
    task = load_tasks("realistic", "train", 1, 11)[10]
    task = dataclasses.replace(task, precursors=list(precursors))
    return task, make_context(task, build_record_db([task], ":memory:", include_real=False))


def test_expected_phases_match_stated_formulas_in_any_notation():
    _, ctx = _ctx(["La(OH)3", "TiO2"])
    cands = ["cur:LaOH3", "cur:TiO2_anatase", "cur:TiO2_rutile", "cur:NiO_bunsenite"]
    assert set(baseline.expected_phases(ctx, cands)) == {"cur:LaOH3", "cur:TiO2_anatase", "cur:TiO2_rutile"}
    _, ctx = _ctx([])
    assert set(baseline.expected_phases(ctx, cands)) == set(cands)       # nothing stated: no prior


def test_screening_keeps_more_polymorphs_of_a_stated_precursor():
    task, ctx = _ctx(["SiO2", "SrTiO3", "SiO2"])
    truth = {p for p, _, _ in task.truth}
    cands = baseline.candidate_ids(ctx)
    with_prior = [r[0] for r in baseline.screen(ctx, cands)[0]]
    assert truth <= set(with_prior)
    _, bare = _ctx([])
    without = [r[0] for r in baseline.screen(bare, cands)[0]]
    assert "aflow:A2B_cF24_227_c_a:SiO2" not in without                  # two SiO2 polymorphs at most
    si_o2 = [p for p in with_prior if p.endswith(":SiO2")]
    assert with_prior[:len(si_o2) + 1] == sorted(with_prior[:len(si_o2) + 1], key=lambda p: p not in
                                                  baseline.expected_phases(ctx, with_prior))   # stated ones first


def _step(ids, z, gain, expected):
    phases = [PhaseFit(p, 1.0, 1.0 / len(ids), 0.0, 0.0, significance=z) for p in ids]
    res = FitResult(phases, 0.1, 0.0, np.zeros(3), np.zeros(3), refined=True)
    return baseline.Step(list(ids), res, gain, z, expected)


def test_an_unexpected_phase_needs_the_factor_more_evidence():
    _, ctx = _ctx(["SrTiO3"])
    steps = [_step(["cur:SrTiO3_perovskite"], 80.0, 0.48, True),
             _step(["cur:SrTiO3_perovskite", "ase:Sr"], 26.0, 0.08, False)]     # like K metal beside KClO3
    tr = baseline.Trace(ctx, steps, [], 0.4)
    assert tr.expected == {"cur:SrTiO3_perovskite"}
    sol = tr.decide(baseline.Thresholds())
    assert [p for p, _ in sol.phases] == ["cur:SrTiO3_perovskite"] and sol.details["not_detectable"] == ["ase:Sr"]
    sol = tr.decide(baseline.Thresholds(unexpected=1.0))                      # no prior: the same evidence suffices
    assert [p for p, _ in sol.phases] == ["cur:SrTiO3_perovskite", "ase:Sr"]
    tr.steps[1].expected = True
    assert len(tr.decide(baseline.Thresholds()).phases) == 2
