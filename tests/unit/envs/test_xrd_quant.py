"""Quantification past Hill-Howard: absorption coefficients, the Brindley correction, standard errors, strict report."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from neon_hpc.envs.xrd.science import absorption as ab, quant
from neon_hpc.envs.xrd.science.library import load_library
from repo_paths import REPO

CU = 1.540598


def test_mass_attenuation_of_nio_is_the_mass_weighted_sum_of_its_elements():
    # hand calculation: NiO = 58.6934 g Ni + 15.999 g O per mole; Elam's mu/rho at Cu K-alpha1
    ni, o = ab.element_mass_attenuation("Ni", CU), ab.element_mass_attenuation("O", CU)
    assert ni == pytest.approx(48.72, abs=0.01) and o == pytest.approx(11.42, abs=0.01)
    hand = (58.6934 * 48.72 + 15.999 * 11.42) / (58.6934 + 15.999)
    assert hand == pytest.approx(40.73, abs=0.01)
    nio = load_library().get("cur:NiO_bunsenite")
    assert ab.mass_attenuation(list(nio.species), CU) == pytest.approx(hand, rel=2e-4)
    assert ab.mass_attenuation({"Ni": 1, "O": 1}, CU) == pytest.approx(hand, rel=2e-4)
    # linear: x the crystallographic density (6.81 g/cm^3)
    assert ab.linear_attenuation(nio, CU) == pytest.approx(hand * nio.density, rel=2e-4)
    # the table against International Tables Vol. C (Table 4.2.4.3, Cu K-alpha): within a few per cent
    for el, itc in (("O", 11.5), ("Ni", 49.2), ("Fe", 308.0), ("Zn", 59.5)):
        assert ab.element_mass_attenuation(el, CU) == pytest.approx(itc, rel=0.06), el
    # below / above the Ni K edge (8.33 keV): Mo K-alpha (17.5 keV) is above it, Cu K-alpha below
    assert ab.element_mass_attenuation("Ni", 0.7093) > 0 and ab.element_mass_attenuation("Fe", CU) > 5 * ni


def test_unknown_wavelength_and_element_are_errors_that_say_what_to_do():
    with pytest.raises(ab.AbsorptionError, match="not a tabulated anode line"):
        ab.element_mass_attenuation("Ni", 1.2)
    with pytest.raises(ab.AbsorptionError, match="Xx"):
        ab.element_mass_attenuation("Xx", CU)


def test_brindley_tau_closed_form_series_and_numerical_integral():
    # tau(s) = <exp(-2 s l)> over the volume-weighted chord density 3 l^2 on l in [0, 1] (l = L / 2R)
    l = np.linspace(0.0, 1.0, 200001)
    for s in (-0.4, -0.1, -0.02, -1e-4, 0.0, 5e-4, 0.024, 0.026, 0.1, 0.3, 1.0):
        num = np.trapezoid(3 * l ** 2 * np.exp(-2 * s * l), l)
        assert float(ab.brindley_tau(s)) == pytest.approx(num, rel=1e-6), s
    # hand value at s = 0.1: 3 / 0.008 (2 - e^-0.2 x 2.44)
    assert float(ab.brindley_tau(0.1)) == pytest.approx(3 / 0.008 * (2 - math.exp(-0.2) * 2.44), rel=1e-9)
    assert float(ab.brindley_tau(0.1)) == pytest.approx(0.8614, abs=1e-4)
    # first order: 1 - 3/2 s (Brindley's mean path 3R/2); continuous across the series / closed form switch
    h = 1e-5
    assert (float(ab.brindley_tau(h)) - float(ab.brindley_tau(-h))) / (2 * h) == pytest.approx(-1.5, rel=1e-4)
    lo, hi = float(ab.brindley_tau(0.025 - 1e-9)), float(ab.brindley_tau(0.025 + 1e-9))
    assert abs(hi - lo) < 1e-8            # the slope alone makes 3e-9; a wrong series term would jump ~1e-7


def test_brindley_correction_raises_the_stronger_absorber_by_the_expected_amount():
    lib = load_library()
    nio, bi = lib.get("cur:NiO_bunsenite"), lib.get("cur:Bi2O3_alpha")
    mu = np.array([ab.linear_attenuation(nio, CU), ab.linear_attenuation(bi, CU)])
    rho = np.array([nio.density, bi.density])
    assert mu[1] > 5 * mu[0]          # Bi2O3 absorbs Cu K-alpha ~7x more than NiO
    w = np.array([0.64, 0.36])        # what Hill-Howard gives on the real 60/40 scans
    none = ab.brindley_correct(w, mu, rho, 0.0)
    assert np.allclose(none.fractions, w) and np.allclose(none.tau, 1.0)
    m = ab.brindley_correct(w, mu, rho, 1.0)
    # direction: the stronger absorber is under-seen (tau < 1) and goes up, the weaker (tau > 1) down
    assert m.tau[1] < 1 < m.tau[0]
    assert m.fractions[1] > w[1] and m.fractions[0] < w[0] and m.fractions.sum() == pytest.approx(1.0)
    # size, by hand: the fixed point x_i ~ w_i / tau_i((mu_i - mu_bar(x)) R), mu_bar volume-weighted
    v = m.fractions / rho
    mu_bar = float(np.sum(v * mu) / np.sum(v))
    tau = ab.brindley_tau((mu - mu_bar) * 1e-4)
    hand = (w / tau) / np.sum(w / tau)
    assert np.allclose(m.fractions, hand, atol=1e-8)
    assert 0.04 < m.fractions[1] - w[1] < 0.08        # ~ +6 wt% at R = 1 um (the real scans: +4 wt% too few Bi2O3)
    # larger particles, larger correction
    assert ab.brindley_correct(w, mu, rho, 2.0).fractions[1] > m.fractions[1]


def test_brindley_correction_barely_moves_a_dominant_phase():
    lib = load_library()
    li, zr = lib.get("cur:Li2CO3_zabuyelite"), lib.get("cur:ZrO2_baddeleyite")
    mu = np.array([ab.linear_attenuation(li, CU), ab.linear_attenuation(zr, CU)])
    rho = np.array([li.density, zr.density])
    m = ab.brindley_correct(np.array([0.95, 0.05]), mu, rho, 1.0)
    # the mixture's mean absorption is the dominant phase's: its tau ~ 1
    assert abs(m.tau[0] - 1) < 0.01 and abs(m.fractions[0] - 0.95) < 0.01
    assert m.fractions[1] > 0.05      # the minor strong absorber still goes up


def _fake_fit(pids, w, cov):
    phases = [SimpleNamespace(phase_id=p, weight_fraction=x, wf_esd=math.sqrt(cov[i][i])) for i, (p, x) in
              enumerate(zip(pids, w))]
    return SimpleNamespace(phases=phases, details={"wf_cov": np.asarray(cov)})


def test_standard_errors_are_propagated_through_the_correction():
    pids = ["cur:NiO_bunsenite", "cur:Bi2O3_alpha"]
    w = [0.64, 0.36]
    cov = [[1e-4, -1e-4], [-1e-4, 1e-4]]           # two fractions: perfectly anti-correlated
    lib = load_library()
    q0 = quant.quantify(_fake_fit(pids, w, cov), lib, CU, quant.QuantModel(radius_um=0.0, se_sys=0.0))
    assert [q.se_stat for q in q0] == pytest.approx([0.01, 0.01], rel=1e-4)
    assert [q.se for q in q0] == pytest.approx([0.01, 0.01], rel=1e-4) and [q.moved for q in q0] == [0.0, 0.0]
    # the model term adds in quadrature, x sqrt(w (1 - w))
    qs = quant.quantify(_fake_fit(pids, w, cov), lib, CU, quant.QuantModel(radius_um=0.0, se_sys=0.05))
    assert qs[0].se == pytest.approx(math.sqrt(0.01 ** 2 + 0.05 ** 2 * 0.64 * 0.36), rel=1e-4)
    # through the Brindley correction: se_stat = |d corrected / d w| x esd, checked by finite differences
    R = 1.0
    q1 = quant.quantify(_fake_fit(pids, w, cov), lib, CU, quant.QuantModel(radius_um=R, se_sys=0.0))
    mu = [ab.linear_attenuation(lib.get(p), CU) for p in pids]
    rho = [lib.get(p).density for p in pids]
    h = 1e-4
    up = ab.brindley_correct([w[0] + h, w[1] - h], mu, rho, R).fractions
    dn = ab.brindley_correct([w[0] - h, w[1] + h], mu, rho, R).fractions
    slope = (up - dn) / (2 * h)
    assert [q.se_stat for q in q1] == pytest.approx(list(np.abs(slope) * 0.01), rel=1e-3)
    assert q1[1].moved == pytest.approx(q1[1].weight_fraction - 0.36) and q1[1].moved > 0


def test_se_calibration_reaches_the_coverage_on_fresh_draws():
    rng = np.random.default_rng(0)

    def draws(n):
        wt = rng.uniform(0.1, 0.9, n)
        wp = wt + rng.normal(0, 0.03 * np.sqrt(wt * (1 - wt)) * 2, n)     # model error 0.06 sqrt(w(1-w))
        return [(float(a), float(b), 0.002) for a, b in zip(wt, wp)]
    fit = quant.calibrate_se(draws(400))
    assert 0.045 <= fit <= 0.075
    assert quant.coverage(draws(4000), fit) == pytest.approx(0.95, abs=0.02)
    assert quant.coverage(draws(4000), 0.0) < 0.2          # the refinement's esd alone is far too small


def test_choose_radius_follows_the_data_and_the_prior():
    truth = {"A": 0.5, "B": 0.5}

    def at(shift):
        return lambda s, R: {"A": 0.5 + shift * R, "B": 0.5 - shift * R}
    # the data say R = 0 (every radius moves the fractions away from the truth)
    assert quant.choose_radius([(None, truth)] * 20, at(0.05)) == 0.0
    # the data are blind to R: the prior's median wins
    assert quant.choose_radius([(None, truth)] * 20, at(0.0)) == quant.RADIUS_PRIOR_UM


def test_strict_report_has_both_tolerances_mae_and_time_per_scan_length():
    from neon_hpc.envs.xrd.science.evaluate import EvalReport, strict_lines
    from neon_hpc.envs.xrd.science.grader import grade
    from neon_hpc.envs.xrd.science.tasks import load_tasks
    t = next(t for t in load_tasks("easy", "test_id", n=12) if len(t.truth) == 2)
    (p1, _, w1), (p2, _, w2) = t.truth
    rep = EvalReport("x")
    off = 0.07 if w1 < 0.9 else -0.07        # 7 wt% off: inside +-10, outside +-5
    cases = [("--2min", [(p1, w1), (p2, w2)], 1.0, 0.5), ("--8min", [(p1, w1 + off), (p2, w2 - off)], 3.0, 2.5)]
    for suffix, pred, sec, cpu in cases:
        t.id = "mix" + suffix
        rep.add(t, pred, grade(pred, t.truth), sec, cpu)
    s = rep.summary()["strict"]
    assert s["success_10"] == 1.0 and s["success_5"] == 0.5
    assert s["by_scan"]["2min"]["success_5"] == 1.0 and s["by_scan"]["8min"]["success_5"] == 0.0
    assert s["by_scan"]["8min"]["wf_mae"] == pytest.approx(0.07, abs=1e-3)
    assert s["by_scan"]["2min"]["seconds_per_pattern"] == 1.0 and s["by_scan"]["8min"]["cpu_seconds_per_pattern"] == 2.5
    assert s["seconds_per_pattern"] == 2.0 and s["wf_mae"] == pytest.approx(0.035, abs=1e-3)
    text = "\n".join(strict_lines(rep.summary()))
    assert "+-10wt%=1.000" in text and "+-5wt%=0.500" in text and "8min" in text and "s CPU" in text
    # a strict grade passed in is recorded as the +-5 figure, the +-10 one computed beside it
    rep2 = EvalReport("y")
    rep2.add(t, cases[1][1], grade(cases[1][1], t.truth, strict=True), 1.0)
    assert rep2.rows[0]["success_5"] is False and rep2.rows[0]["success_10"] is True


def test_bench_result_line_keeps_its_keys_and_adds_the_strict_ones():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_xrd", REPO / "tools" / "bench_xrd.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    block = {"success_5": 0.9, "wf_mae": 0.02, "seconds_per_pattern": 2.0}
    real = ({"success": 1.0, "cpu_per_pattern": 2.0},
            {"success": 1.0, "wf_mae": 0.02, "success_by_scan": {"2min": 1.0},
             "strict": {"success_5": 0.85, "by_scan": {"2min": block, "8min": block}},
             "quant": {"coverage_2se": 0.93}})
    line = bench.result_line({"speedup": 20.0}, {"easy": {"success": 1.0}, "realistic": {"success": 0.95}}, real, 1.5)
    keys = dict(kv.split("=") for kv in line.split()[1:])
    for k in ("xrd_sim_speedup_vs_pymatgen", "xrd_baseline_success_easy", "xrd_baseline_success_realistic",
              "xrd_baseline_success_real", "xrd_baseline_success_real_loo", "xrd_baseline_success_real_loo_2min",
              "xrd_baseline_wf_mae_real_loo", "xrd_fit_seconds", "xrd_refine_seconds"):
        assert k in keys, k
    assert keys["xrd_baseline_success_real_loo_strict"] == "0.850"
    assert keys["xrd_baseline_se_coverage_real_loo"] == "0.930"
    assert line.startswith("RESULT ")
    nan_line = bench.result_line({"speedup": 20.0}, {"easy": {"success": 1.0}, "realistic": {"success": 0.95}},
                                 None, 1.5)
    assert "xrd_baseline_success_real_loo_strict=nan" in nan_line


class _QuantTrace:
    """A trace whose fractions depend on the Brindley radius: right at ``best_R``, off by ``slope`` per um away."""
    def __init__(self, task, best_R, slope=0.2):
        self.task, self.best_R, self.slope = task, best_R, slope

    def final_fit(self, th=None):
        return "fit", 1

    def quant_fit(self, res):
        return res

    def identify(self, th):
        return [(x.phase_id, x.weight_fraction) for x in self.quantify(None, quant.QuantModel())]

    def quantify(self, res, q):
        (p1, _, w1), (p2, _, w2) = self.task.truth
        d = self.slope * (q.radius_um - self.best_R)
        return [quant.PhaseQuant(p1, w1 + d, w1, d, 1.0, 1.0, 0.001, 0.01),
                quant.PhaseQuant(p2, w2 - d, w2, -d, 1.0, 1.0, 0.001, 0.01)]

    def decide(self, th, q=None):
        from neon_hpc.envs.xrd.science.baseline import Solution
        qs = self.quantify(None, q or quant.QuantModel())
        return Solution([(x.phase_id, x.weight_fraction) for x in qs], 0.1, {"fit": {"phases": []}})


def test_loo_never_chooses_the_radius_or_the_se_on_the_held_out_mixture(monkeypatch):
    from neon_hpc.envs.xrd.science import baseline, evaluate as ev
    from neon_hpc.envs.xrd.science.tasks import load_tasks
    tasks = [t for t in load_tasks("easy", "test_id", n=20) if len(t.truth) == 2
             and all(0.2 < w < 0.8 for _, _, w in t.truth)][:4]
    for i, t in enumerate(tasks):
        t.id = f"mix{i}--8min"
    best = {t.id: (1.0 if i == 0 else 0.0) for i, t in enumerate(tasks)}      # only mix0 wants a correction
    monkeypatch.setattr(baseline, "trace", lambda ctx: _QuantTrace(next(t for t in tasks if t.id == ctx.task_id),
                                                                   best[ctx.task_id]))
    rep, folds = ev.evaluate_loo(tasks, grid=[baseline.Thresholds()])
    assert folds["mix0"]["quant"]["radius_um"] == 0.0            # chosen on mix1-3, so mix0 is scored off by 0.2
    assert rep.rows[0]["abs_errors"] == pytest.approx({k: 0.2 for k in rep.rows[0]["abs_errors"]}, abs=1e-6)
    assert all(folds[f"mix{i}"]["quant"]["radius_um"] > 0.0 for i in (1, 2, 3))    # they do see mix0
    # its s.e. were calibrated on mix1-3, whose errors are 0: the held-out 0.2 is far outside +-2 s.e.
    assert folds["mix0"]["quant"]["se_sys"] == 0.0 and rep.rows[0]["within_2se"] == [False, False]


def test_se_sys_is_calibrated_on_errors_at_radii_chosen_without_each_mixture():
    # two mixtures that want 0 and 2 um: on both, R = 1 leaves each 0.02 off; but a radius chosen
    # without a mixture (what the held-out one gets) is the other's, 0.5 or 2 um, and leaves it
    # 0.03-0.04 off.  se_sys must cover those, not the in-sample 0.02.
    from neon_hpc.envs.xrd.science import evaluate as ev
    from neon_hpc.envs.xrd.science.tasks import load_tasks
    tasks = [t for t in load_tasks("easy", "test_id", n=20) if len(t.truth) == 2
             and all(0.2 < w < 0.8 for _, _, w in t.truth)][:2]
    for i, t in enumerate(tasks):
        t.id = f"mix{i}--8min"
    fits = {0: (_QuantTrace(tasks[0], 0.0, 0.02), "fit"), 1: (_QuantTrace(tasks[1], 2.0, 0.02), "fit")}
    model, info = ev.choose_quant(tasks, fits, [0, 1])
    assert info["radius_um"] == 1.0 and info["inner_radii"] == [0.5, 2.0]
    # (true, predicted, se_stat): the first phase of mix0 goes up with R (its best is 0), mix1's down
    in_sample = [(w, w + sgn * 0.02, 0.001) for t, m in zip(tasks, (1, -1)) for (_, _, w), sgn in zip(t.truth, (m, -m))]
    nested = [(w, w + sgn * e, 0.001) for t, e, m in zip(tasks, (0.04, 0.03), (1, -1))
              for (_, _, w), sgn in zip(t.truth, (m, -m))]
    assert model.se_sys > quant.calibrate_se(in_sample)
    assert model.se_sys == quant.calibrate_se(nested) and quant.coverage(nested, model.se_sys) >= 0.95


def test_every_library_element_has_a_mass_attenuation_coefficient_at_every_line():
    table = ab.load_table()
    for el in {e for p in load_library().phases for e in p.elements}:
        assert el in table["molar_mass"], (f"{el}: rebuild data/mass_attenuation.json "
                                           "(python -m neon_hpc.envs.xrd.science.absorption)")
        for line, lam in ab.LINES.items():
            assert table["mu_rho"][el][line] > 0, (el, line)


def test_anomalous_scattering_of_nio_by_hand():
    from neon_hpc.envs.xrd.science.simulate import compute_reflections, form_factors
    p = load_library().get("cur:NiO_bunsenite")
    disp = ab.dispersion(["Ni", "O"], CU)
    # Chantler at Cu K-alpha1, just below the Ni K edge: f'(Ni) ~ -3.05, f''(Ni) ~ 0.51
    assert disp["Ni"].real == pytest.approx(-3.05, abs=0.05) and disp["Ni"].imag == pytest.approx(0.505, abs=0.02)
    plain = compute_reflections(np.asarray(p.lattice), list(p.species), np.asarray(p.frac_coords), 1.2)
    anom = compute_reflections(np.asarray(p.lattice), list(p.species), np.asarray(p.frac_coords), 1.2, dispersion=disp)
    a = p.lattice_params[0]
    for hkl, sign in (((1, 1, 1), -1), ((2, 0, 0), +1)):        # rocksalt: F = 4 (f_Ni -+ f_O)
        k = int(np.nonzero(np.all(anom.hkl == hkl, axis=1))[0][0])
        s2 = (np.linalg.norm(hkl) / a / 2) ** 2
        f0 = form_factors(["Ni", "O"], np.array([s2]))[0]
        F = 4 * ((f0[0] + disp["Ni"]) + sign * (f0[1] + disp["O"]))
        assert anom.f2[k] == pytest.approx(2 * abs(F) ** 2, rel=1e-9)         # f2 holds 2 |F|^2 (Friedel pair)
        assert plain.f2[k] == pytest.approx(2 * (4 * (f0[0] + sign * f0[1])) ** 2, rel=1e-9)
        assert 0.6 < anom.f2[k] / plain.f2[k] < 0.85              # NiO lines 15-35 % weaker (111 most)


def test_measured_patterns_are_fitted_with_anomalous_scattering_and_synthetic_ones_without():
    from neon_hpc.envs.xrd.science.fitting import Fitter
    from neon_hpc.envs.xrd.science.simulate import Instrument, phase_reflections
    from neon_hpc.envs.xrd.science.tasks import load_tasks
    from neon_hpc.envs.xrd.science.tools import TaskContext
    x = np.linspace(20, 80, 3001)
    y = np.ones_like(x)
    plain, real = Fitter(x, y, Instrument()), Fitter(x, y, Instrument(measured=True))
    assert plain.dispersion_wavelength is None and real.dispersion_wavelength == CU
    pid = "cur:NiO_bunsenite"
    allowed = plain.model(pid).f2 > 1e-6 * plain.model(pid).f2.max()        # not the systematic absences
    assert allowed.sum() >= 5 and np.all(real.model(pid).f2[allowed] < plain.model(pid).f2[allowed])
    assert np.allclose(plain.model(pid).f2_unmerged, phase_reflections(pid, round(plain.d_min, 3)).f2)
    synthetic = load_tasks("easy", "test_id", n=1)[0]
    assert TaskContext.for_task(synthetic, None).instrument.measured is False
    from neon_hpc.envs.xrd.science.real import load_real_tasks, real_data_dir
    if real_data_dir() is not None:
        assert TaskContext.for_task(load_real_tasks(scan="2min")[0], None).instrument.measured is False
        assert TaskContext.for_task(load_real_tasks(scan="2min", measured=True)[0], None).instrument.measured is True


def test_default_quantification_corrects_real_measurements_only():
    from neon_hpc.envs.xrd.science.simulate import Instrument
    assert quant.default_model(Instrument()).radius_um == 0.0                    # the simulator has no microabsorption
    assert quant.default_model(Instrument(measured=True)).radius_um == quant.RADIUS_PRIOR_UM


class _TwoStageTrace:
    """Identification fractions off by ``id_err[j]`` at grid entry j; its quantification (decide) the other
    way round."""
    def __init__(self, task, id_err):
        self.task, self.id_err = task, id_err

    def _frac(self, d):
        (p1, _, w1), (p2, _, w2) = self.task.truth
        return [(p1, w1 + d), (p2, w2 - d)]

    def identify(self, th):
        return self._frac(self.id_err[th.z_min])

    def decide(self, th, q=None):
        from neon_hpc.envs.xrd.science.baseline import Solution
        return Solution(self._frac(0.03 - self.id_err[th.z_min]), 0.1, {})


def test_loo_thresholds_are_fitted_on_identification_not_on_the_quantification_model():
    from neon_hpc.envs.xrd.science import baseline, evaluate as ev
    from neon_hpc.envs.xrd.science.tasks import load_tasks
    tasks = [t for t in load_tasks("easy", "test_id", n=20) if len(t.truth) == 2
             and all(0.2 < w < 0.8 for _, _, w in t.truth)][:3]
    for i, t in enumerate(tasks):
        t.id = f"mix{i}--8min"
    grid = [baseline.Thresholds(z_min=3.0), baseline.Thresholds(z_min=5.0)]
    # both entries succeed everywhere (a tie); identification is closer at z 5, the quantified fractions at z 3
    traces = [_TwoStageTrace(t, {3.0: 0.03, 5.0: 0.0}) for t in tasks]
    folds = ev.loo_folds(tasks, traces, grid)
    assert all(f["index"] == 1 for f in folds.values()), folds
