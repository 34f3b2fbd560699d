"""The grader on hand-made cases."""
import pytest

from neon_hpc.envs.xrd.science.grader import grade

TRUTH = [("cur:NiO_bunsenite", "NiO", 0.60), ("cur:ZnO_zincite", "ZnO", 0.36), ("cur:LaOH3", "La(OH)3", 0.04)]


def test_exact_answer_succeeds_with_full_dense_reward():
    g = grade([("cur:NiO_bunsenite", 0.60), ("cur:ZnO_zincite", 0.36), ("cur:LaOH3", 0.04)], TRUTH)
    assert g.success and g.dense == pytest.approx(1.0)


def test_missed_minor_phase_still_succeeds():
    g = grade([("cur:NiO_bunsenite", 0.62), ("cur:ZnO_zincite", 0.38)], TRUTH)
    assert g.success and g.details["missed_major"] == []
    assert 0.9 < g.dense < 1.0


def test_missed_major_phase_fails():
    g = grade([("cur:NiO_bunsenite", 1.0)], TRUTH)
    assert not g.success and g.details["missed_major"] == ["cur:ZnO_zincite"]


def test_spurious_major_phase_fails_but_a_trace_does_not():
    bad = grade([("cur:NiO_bunsenite", 0.55), ("cur:ZnO_zincite", 0.35), ("cur:TiO2_rutile", 0.10)], TRUTH)
    assert not bad.success and bad.details["spurious_major"] == ["cur:TiO2_rutile"]
    ok = grade([("cur:NiO_bunsenite", 0.58), ("cur:ZnO_zincite", 0.38), ("cur:TiO2_rutile", 0.04)], TRUTH)
    assert ok.success


def test_fraction_off_by_11_fails_and_by_9_passes():
    off11 = grade([("cur:NiO_bunsenite", 0.71), ("cur:ZnO_zincite", 0.25), ("cur:LaOH3", 0.04)], TRUTH)
    assert not off11.success and "cur:NiO_bunsenite" in off11.details["fraction_off"]
    off9 = grade([("cur:NiO_bunsenite", 0.69), ("cur:ZnO_zincite", 0.27), ("cur:LaOH3", 0.04)], TRUTH)
    assert off9.success
    assert not grade([("cur:NiO_bunsenite", 0.66), ("cur:ZnO_zincite", 0.30), ("cur:LaOH3", 0.04)], TRUTH,
                     strict=True).success


def test_formula_and_space_group_names_and_percent():
    g = grade([("NiO", 60), ("ZnO P6_3mc", 36), ("La(OH)3:176", 4)], TRUTH)
    assert g.success and g.dense == pytest.approx(1.0)


def test_formula_alone_cannot_pick_a_polymorph_but_formula_truth_takes_any():
    two = [("cur:TiO2_anatase", "TiO2", 0.5), ("cur:TiO2_rutile", "TiO2", 0.5)]
    assert not grade([("TiO2", 1.0)], two).success
    assert grade([("TiO2 I4_1/amd", 0.5), ("TiO2 136", 0.5)], two).success
    real = [("", "TiO2", 0.7), ("cur:NiO_bunsenite", "NiO", 0.3)]
    assert grade([("cur:TiO2_anatase", 0.5), ("cur:TiO2_rutile", 0.2), ("NiO", 0.3)], real).success


def test_isostructural_copies_within_the_strain_window_are_one_phase():
    import dataclasses

    import numpy as np

    from neon_hpc.envs.xrd.science.library import Library, load_library
    base = load_library()
    rutile = base.get("cur:TiO2_rutile")
    scaled = lambda f, pid: dataclasses.replace(rutile, id=pid, lattice=tuple(tuple(np.asarray(r) * f)
                                                                               for r in rutile.lattice))
    lib = Library(base.phases + [scaled(1.02, "test:rutile_strained2"), scaled(1.05, "test:rutile_strained5")])
    truth = [("cur:TiO2_rutile", "TiO2", 1.0)]
    assert grade([("test:rutile_strained2", 1.0)], truth, library=lib).success
    assert not grade([("test:rutile_strained5", 1.0)], truth, library=lib).success
    # SnO2 has the rutile structure but is another compound
    assert not grade([("cur:SnO2_cassiterite", 1.0)], truth).success


def test_unreadable_prediction_is_graded_not_raised():
    g = grade([("not a phase !!", 0.5), ("NiO", "x"), ("cur:ZnO_zincite", 0.5)], TRUTH)
    assert not g.success and len(g.details["unreadable"]) == 2
    assert grade([], TRUTH).dense == 0.0
