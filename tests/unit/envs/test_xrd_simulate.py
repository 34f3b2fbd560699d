"""The simulator equals pymatgen's XRDCalculator peak for peak; profiles behave physically."""
import warnings

import numpy as np
import pytest

from neon_hpc.envs.xrd.science.library import load_library
from neon_hpc.envs.xrd.science.simulate import (
    CU_KA1,
    CU_KA2,
    CU_KA_AVG,
    Instrument,
    Microstructure,
    compute_reflections,
    phase_pattern,
    phase_reflections,
    render_peaks,
    stick_pattern,
    two_theta_of,
)

# every real-data phase, plus AFLOW structures of other lattice systems / heavy and light atoms
VALIDATION_IDS = [
    "cur:TiO2_anatase", "cur:TiO2_rutile", "cur:In2O3_bixbyite", "cur:Li2CO3_zabuyelite", "cur:Bi2O3_alpha",
    "cur:V2O5_shcherbinaite", "cur:LaOH3", "cur:ZrO2_baddeleyite", "cur:MnCO3_rhodochrosite", "cur:ZnO_zincite",
    "cur:NiO_bunsenite", "cur:Fe3O4_magnetite",
]


def _aflow_extra(lib):
    picks = []
    for p in lib.phases:
        if p.source == "aflow" and p.sg_number in (2, 62, 148, 166, 194, 221) and len(p.species) <= 24:
            if p.sg_number not in {lib.get(i).sg_number for i in picks}:
                picks.append(p.id)
    return picks


def _ours(p, lo=10.0, hi=90.0, wavelength=CU_KA_AVG, b_iso=0.0):
    d_min = wavelength / (2 * np.sin(np.radians(hi / 2))) * 0.999
    refl = compute_reflections(np.asarray(p.lattice), list(p.species), np.asarray(p.frac_coords), d_min, b_iso)
    return stick_pattern(refl, wavelength, (lo, hi))


@pytest.fixture(scope="module")
def calc():
    warnings.filterwarnings("ignore")
    from pymatgen.analysis.diffraction.xrd import XRDCalculator
    return XRDCalculator()


def test_simulator_matches_pymatgen_peak_for_peak(calc):
    lib = load_library()
    ids = VALIDATION_IDS + _aflow_extra(lib)
    assert len(ids) >= 16
    for pid in ids:
        p = lib.get(pid)
        ref = calc.get_pattern(p.structure(), two_theta_range=(10, 90))
        x, y, _ = _ours(p)
        assert len(x) == len(ref.x), pid
        np.testing.assert_allclose(x, ref.x, atol=1e-3, err_msg=pid)
        # relative intensities (max = 100) within 1 % of each peak (0.01 absolute floor for tiny ones)
        assert np.all(np.abs(y - np.asarray(ref.y)) <= 0.01 * np.maximum(ref.y, 1.0)), pid


def test_debye_waller_matches_pymatgen():
    warnings.filterwarnings("ignore")
    from pymatgen.analysis.diffraction.xrd import XRDCalculator
    p = load_library().get("cur:ZrO2_baddeleyite")
    ref = XRDCalculator(debye_waller_factors={"Zr": 0.8, "O": 0.8}).get_pattern(p.structure(), two_theta_range=(10, 90))
    x, y, _ = _ours(p, b_iso=0.8)
    np.testing.assert_allclose(x, ref.x, atol=1e-3)
    assert np.all(np.abs(y - np.asarray(ref.y)) <= 0.01 * np.maximum(ref.y, 1.0))


def test_other_wavelength_moves_peaks_by_bragg():
    p = load_library().get("cur:NiO_bunsenite")
    x_cu, _, hkl = _ours(p)
    x_mo, _, _ = _ours(p, lo=5, hi=60, wavelength=0.7093)
    d = 1.54184 / (2 * np.sin(np.radians(x_cu[0] / 2)))
    assert x_mo[0] == pytest.approx(np.degrees(2 * np.arcsin(0.7093 / (2 * d))), abs=1e-6)


def test_rendered_peaks_have_unit_area():
    x = np.arange(20, 60, 0.01)
    y = render_peaks(x, np.array([30.0, 45.0]), np.array([2.0, 5.0]), np.array([0.1, 0.3]), eta=0.5,
                     window_fwhm=60)
    assert y.sum() * 0.01 == pytest.approx(7.0, rel=0.01)
    upper = x > 40
    assert x[upper][np.argmax(y[upper])] == pytest.approx(45.0, abs=0.01)
    assert x[np.argmax(y)] == pytest.approx(30.0, abs=0.01)   # taller: 2 / 0.1 > 5 / 0.3


def test_kalpha2_zero_shift_and_strain_move_peaks():
    refl = phase_reflections("cur:NiO_bunsenite", 1.0)
    x = np.arange(40, 46, 0.002)
    plain = phase_pattern(refl, x, Instrument(ka2_ratio=0.0, W=0.0005, U=0, V=0))
    peak = x[np.argmax(plain)]
    d200 = 4.1771 / 2
    assert peak == pytest.approx(two_theta_of(np.array([d200]), CU_KA1)[0], abs=0.003)
    shifted = phase_pattern(refl, x, Instrument(ka2_ratio=0.0, W=0.0005, U=0, V=0, zero_shift=0.2))
    assert x[np.argmax(shifted)] == pytest.approx(peak + 0.2, abs=0.003)
    strained = phase_pattern(refl, x, Instrument(ka2_ratio=0.0, W=0.0005, U=0, V=0), Microstructure(strain=0.01))
    assert x[np.argmax(strained)] == pytest.approx(two_theta_of(np.array([d200 * 1.01]), CU_KA1)[0], abs=0.003)
    doublet = phase_pattern(refl, x, Instrument(ka2_ratio=0.5, W=0.0005, U=0, V=0))
    ka2_pos = two_theta_of(np.array([d200]), CU_KA2)[0]
    i2 = np.argmin(np.abs(x - ka2_pos))
    assert doublet[i2] == pytest.approx(0.5 * plain.max(), rel=0.1)


def test_size_broadening_widens_and_keeps_area():
    refl = phase_reflections("cur:NiO_bunsenite", 1.0)
    x = np.arange(35, 50, 0.005)
    sharp = phase_pattern(refl, x, Instrument(ka2_ratio=0.0), Microstructure())
    broad = phase_pattern(refl, x, Instrument(ka2_ratio=0.0, window_fwhm=40), Microstructure(size_nm=10))
    assert broad.max() < 0.5 * sharp.max()
    assert broad.sum() == pytest.approx(sharp.sum(), rel=0.05)


def test_texture_changes_relative_intensities_of_aligned_planes():
    refl = phase_reflections("cur:ZnO_zincite", 1.0)
    x = np.arange(30, 38, 0.005)
    inst = Instrument(ka2_ratio=0.0)
    random_ = phase_pattern(refl, x, inst)
    textured = phase_pattern(refl, x, inst, Microstructure(texture_r=0.6, texture_hkl=(0, 0, 1)))
    i002 = np.argmin(np.abs(x - 34.42))
    i100 = np.argmin(np.abs(x - 31.77))
    assert textured[i002] / textured[i100] > 1.5 * random_[i002] / random_[i100]
    same = phase_pattern(refl, x, inst, Microstructure(texture_r=1.0))
    np.testing.assert_allclose(same, random_)
