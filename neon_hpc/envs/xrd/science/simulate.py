"""Powder pattern simulation: vectorized Bragg sticks, then peak profiles.

Sticks (per phase, cached, wavelength-independent): every reciprocal-lattice point with
d >= d_min at once (one integer grid, one matrix product), structure factor
F(hkl) = sum_j f_j(s) exp(2 pi i h.r_j) with s = 1/(2d) and the Cromer-Mann-type form factors
f = Z - 41.78214 s^2 sum_i a_i exp(-b_i s^2) (coefficients read from the installed pymatgen's
``atomic_scattering_params.json``, the table its XRDCalculator uses), optional isotropic
Debye-Waller exp(-B s^2) on f.  Equivalent reflections are kept as separate points, so the
multiplicity is exact by construction; Friedel pairs are folded (x2).

Pattern at a wavelength: 2theta = 2 asin(lambda / 2d), Lorentz-polarisation
(1 + cos^2 2theta) / (sin^2 theta cos theta) -- the same unpolarised-beam factor pymatgen
uses, so :func:`stick_pattern` matches ``XRDCalculator.get_pattern`` peak for peak.

Profiles (:func:`phase_pattern`): pseudo-Voigt peaks of unit area, FWHM from Caglioti
(instrument) combined with Scherrer size (K lambda / (L cos theta)) and microstrain
(4 e tan theta); K-alpha2 doublet at its own wavelength; zero shift; lattice strain
(d -> d (1 + strain)); March-Dollase texture along a reciprocal direction; intensities per
unit *volume fraction* (|F|^2 LP / V_cell^2), so that summing phases with volume fractions
gives a physical mixture (no absorption contrast).  Background and noise: :func:`background`,
:func:`poisson_counts`.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from neon_hpc.envs.xrd.science.absorption import dispersion
from neon_hpc.envs.xrd.science.library import load_library

CU_KA1 = 1.540598
CU_KA2 = 1.544426
CU_KA_AVG = 1.54184          # pymatgen's "CuKa"
SCHERRER_K = 0.9
PYMATGEN_TWO_THETA_TOL = 1e-5
PYMATGEN_SCALED_TOL = 1e-3
ELEMENT_Z = {s: i + 1 for i, s in enumerate(
    "H He Li Be B C N O F Ne Na Mg Al Si P S Cl Ar K Ca Sc Ti V Cr Mn Fe Co Ni Cu Zn Ga Ge As Se Br Kr "
    "Rb Sr Y Zr Nb Mo Tc Ru Rh Pd Ag Cd In Sn Sb Te I Xe Cs Ba La Ce Pr Nd Pm Sm Eu Gd Tb Dy Ho Er Tm Yb "
    "Lu Hf Ta W Re Os Ir Pt Au Hg Tl Pb Bi Po At Rn Fr Ra Ac Th Pa U Np Pu Am Cm Bk Cf Es Fm Md No Lr".split())}


@functools.lru_cache(maxsize=1)
def form_factor_table() -> dict[str, np.ndarray]:
    """Element -> (n, 2) array of (a_i, b_i), from the installed pymatgen (found without importing it)."""
    spec = importlib.util.find_spec("pymatgen")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("pymatgen is needed for its X-ray form-factor table; pip install pymatgen")
    path = Path(list(spec.submodule_search_locations)[0]) / "analysis" / "diffraction" / "atomic_scattering_params.json"
    raw = json.loads(path.read_text())
    return {el: np.asarray(c, dtype=float) for el, c in raw.items()}


def form_factors(elements: list[str], s2: np.ndarray) -> np.ndarray:
    """(n_refl, n_el) atomic form factors at s^2 = (1/2d)^2."""
    table = form_factor_table()
    out = np.empty((len(s2), len(elements)))
    for k, el in enumerate(elements):
        try:
            c = table[el]
        except KeyError:
            raise ValueError(f"no X-ray form factor for element {el!r}") from None
        out[:, k] = ELEMENT_Z[el] - 41.78214 * s2 * (np.exp(-np.outer(s2, c[:, 1])) @ c[:, 0])
    return out


@dataclass(frozen=True)
class Reflections:
    """Half-sphere reflections of one cell (Friedel mates folded into ``f2``)."""
    d: np.ndarray            # (n,) d-spacing, Angstrom
    f2: np.ndarray           # (n,) 2 |F|^2  (electrons^2)
    hkl: np.ndarray          # (n, 3) int
    g_unit: np.ndarray       # (n, 3) unit reciprocal vectors (cartesian), for texture
    volume: float            # cell volume, A^3
    recip: np.ndarray        # (3, 3) reciprocal basis rows (no 2 pi)

    def merged(self) -> tuple[np.ndarray, np.ndarray]:
        """(d, f2) with equal d-spacings summed: what a powder sees without texture."""
        key = np.round(self.d, 7)
        uniq, inv = np.unique(key, return_inverse=True)
        f2 = np.bincount(inv, weights=self.f2, minlength=len(uniq))
        d = np.bincount(inv, weights=self.d, minlength=len(uniq)) / np.bincount(inv, minlength=len(uniq))
        return d, f2


def compute_reflections(lattice: np.ndarray, species: list[str], frac_coords: np.ndarray,
                        d_min: float, b_iso: float = 0.0, dispersion: dict | None = None) -> Reflections:
    """All hkl with d >= d_min at once (vectorized; no per-reflection Python loop).

    ``dispersion``: {element: f' + i f''} added to the form factors (anomalous scattering at one
    wavelength); None = none, as pymatgen's XRDCalculator and the synthetic tasks.
    """
    A = np.asarray(lattice, dtype=float)
    B = np.linalg.inv(A).T                     # rows: a*, b*, c* (crystallographic, no 2 pi)
    g_max = 1.0 / d_min
    hmax = [int(math.floor(g_max * np.linalg.norm(A[i]))) for i in range(3)]
    h, k, l = np.meshgrid(*(np.arange(-m, m + 1) for m in hmax), indexing="ij")
    hkl = np.stack([h.ravel(), k.ravel(), l.ravel()], axis=1)
    half = (hkl[:, 0] > 0) | ((hkl[:, 0] == 0) & (hkl[:, 1] > 0)) | \
           ((hkl[:, 0] == 0) & (hkl[:, 1] == 0) & (hkl[:, 2] > 0))
    hkl = hkl[half]
    g = hkl @ B
    gn = np.linalg.norm(g, axis=1)
    keep = gn <= g_max * (1 + 1e-12)
    hkl, g, gn = hkl[keep], g[keep], gn[keep]
    s2 = (gn / 2.0) ** 2
    elements = sorted(set(species))
    ff = form_factors(elements, s2)
    if dispersion:
        ff = ff + np.array([dispersion[el] for el in elements], dtype=complex)[None, :]
    if b_iso:
        ff = ff * np.exp(-b_iso * s2)[:, None]
    index = np.array([elements.index(sp) for sp in species])
    onehot = np.zeros((len(species), len(elements)))
    onehot[np.arange(len(species)), index] = 1.0
    # exp(2 pi i (hx + ky + lz)) = ex[h] ey[k] ez[l]: three small tables and two complex products
    # per entry instead of one complex exponential per (reflection, atom)
    fc = np.asarray(frac_coords, dtype=float)
    tables = [np.exp(2j * np.pi * np.outer(np.arange(-m, m + 1), fc[:, axis])) for axis, m in enumerate(hmax)]
    phase = tables[0][hkl[:, 0] + hmax[0]] * tables[1][hkl[:, 1] + hmax[1]] * tables[2][hkl[:, 2] + hmax[2]]
    F = ((phase @ onehot) * ff).sum(axis=1)
    f2 = 2.0 * (F.real ** 2 + F.imag ** 2)
    return Reflections(d=1.0 / gn, f2=f2, hkl=hkl, g_unit=g / gn[:, None],
                       volume=float(abs(np.linalg.det(A))), recip=B)


@functools.lru_cache(maxsize=4096)
def phase_reflections(phase_id: str, d_min: float = 0.95, b_iso: float = 0.0, library_path: str | None = None,
                      dispersion_wavelength: float | None = None):
    """A library phase's reflections (cached); ``dispersion_wavelength``: with f', f'' at that anode line."""
    p = load_library(library_path).get(phase_id)
    disp = None
    if dispersion_wavelength is not None:
        disp = dispersion(sorted(set(p.species)), dispersion_wavelength)
    return compute_reflections(np.asarray(p.lattice), list(p.species), np.asarray(p.frac_coords), d_min, b_iso, disp)


def lorentz_polarization(two_theta_deg: np.ndarray) -> np.ndarray:
    t = np.radians(two_theta_deg) / 2.0
    return (1 + np.cos(2 * t) ** 2) / (np.sin(t) ** 2 * np.cos(t))


def two_theta_of(d: np.ndarray, wavelength: float) -> np.ndarray:
    """2theta (deg) of d-spacings; NaN where the reflection is beyond the limiting sphere."""
    x = wavelength / (2.0 * np.asarray(d))
    with np.errstate(invalid="ignore"):
        return np.degrees(2.0 * np.arcsin(np.where(x <= 1.0, x, np.nan)))


def stick_pattern(refl: Reflections, wavelength: float = CU_KA_AVG, two_theta_range=(0.0, 90.0),
                  scaled: bool = True, pymatgen_merge: bool = True):
    """(two_theta, intensity, hkl) sticks, merged and scaled like pymatgen's XRDCalculator."""
    tt = two_theta_of(refl.d, wavelength)
    ok = np.isfinite(tt) & (tt >= two_theta_range[0]) & (tt <= two_theta_range[1])
    tt, f2, hkl = tt[ok], refl.f2[ok], refl.hkl[ok]
    inten = f2 * lorentz_polarization(tt)
    order = np.argsort(tt, kind="stable")
    tt, inten, hkl = tt[order], inten[order], hkl[order]
    tol = PYMATGEN_TWO_THETA_TOL if pymatgen_merge else 1e-4
    keys = np.round(tt / tol).astype(np.int64)
    uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    summed = np.bincount(inv, weights=inten, minlength=len(uniq))
    x, y, h = tt[first], summed, hkl[first]
    keep = y / y.max() * 100 > PYMATGEN_SCALED_TOL
    x, y, h = x[keep], y[keep], h[keep]
    if scaled:
        y = y / y.max() * 100.0
    return x, y, h


# ----------------------------------------------------------------------------------------------
# profiles

@dataclass(frozen=True)
class Instrument:
    """Beam and instrument: wavelengths, Caglioti width (deg^2), profile shape, zero shift."""
    wavelength: float = CU_KA1
    wavelength2: float = CU_KA2
    ka2_ratio: float = 0.5            # 0 = monochromatic
    U: float = 0.004
    V: float = -0.002
    W: float = 0.0025
    eta: float = 0.5                  # pseudo-Voigt Lorentzian fraction
    zero_shift: float = 0.0           # deg, added to every peak position
    window_fwhm: float = 12.0         # peaks are rendered over +- this many FWHM
    measured: bool = False            # a real measurement (real.py sets it): its sample scatters with f', f'' at
                                      # the anode line and has microabsorption; this module's synthetic
                                      # patterns have neither, so their fits model neither

    def with_(self, **kw) -> "Instrument":
        return replace(self, **kw)


@dataclass(frozen=True)
class Microstructure:
    """Per-phase sample effects."""
    strain: float = 0.0               # lattice strain: d -> d (1 + strain)
    size_nm: float = 0.0              # crystallite size, 0 = no size broadening
    microstrain: float = 0.0          # e in 4 e tan(theta)
    texture_r: float = 1.0            # March-Dollase r (1 = random powder)
    texture_hkl: tuple[int, int, int] = (0, 0, 1)


def fwhm_deg(two_theta: np.ndarray, inst: Instrument, micro: Microstructure, wavelength: float) -> np.ndarray:
    th = np.radians(two_theta) / 2.0
    tan = np.tan(th)
    h_inst2 = np.maximum(inst.U * tan ** 2 + inst.V * tan + inst.W, 1e-6)
    h_sample = np.zeros_like(th)
    if micro.size_nm > 0:
        h_sample += np.degrees(SCHERRER_K * wavelength / (micro.size_nm * 10.0 * np.cos(th)))
    if micro.microstrain > 0:
        h_sample += np.degrees(4.0 * micro.microstrain * tan)
    return np.sqrt(h_inst2 + h_sample ** 2)


def march_dollase(refl: Reflections, r: float, hkl_pref) -> np.ndarray:
    """Texture weight of each (unmerged) reflection; averages to 1 over a random powder."""
    axis = np.asarray(hkl_pref, dtype=float) @ refl.recip
    axis /= np.linalg.norm(axis)
    cos2 = np.clip((refl.g_unit @ axis) ** 2, 0.0, 1.0)
    return (r * r * cos2 + (1.0 - cos2) / r) ** -1.5


def render_peaks(x: np.ndarray, centers: np.ndarray, areas: np.ndarray, fwhm: np.ndarray, eta: float,
                 window_fwhm: float = 12.0) -> np.ndarray:
    """Sum of unit-area pseudo-Voigt peaks on a uniform grid ``x`` (one bincount, no Python loop)."""
    y = np.zeros_like(x, dtype=float)
    if len(centers) == 0:
        return y
    step = (x[-1] - x[0]) / (len(x) - 1)
    half_w = int(math.ceil(window_fwhm * float(fwhm.max()) / step)) + 1
    offsets = np.arange(-half_w, half_w + 1)
    start = np.rint((centers - x[0]) / step).astype(np.int64)
    idx = start[:, None] + offsets[None, :]
    dx = x[0] + idx * step - centers[:, None]
    u = (dx / fwhm[:, None]) ** 2
    gauss = (2.0 / fwhm[:, None]) * math.sqrt(math.log(2) / math.pi) * np.exp(-4.0 * math.log(2) * u)
    lor = (2.0 / (math.pi * fwhm[:, None])) / (1.0 + 4.0 * u)
    val = (eta * lor + (1.0 - eta) * gauss) * areas[:, None]
    inside = (idx >= 0) & (idx < len(x))
    y += np.bincount(idx[inside], weights=val[inside], minlength=len(x))
    return y


def peak_list(refl: Reflections, inst: Instrument, micro: Microstructure, two_theta_range):
    """(centers, areas, fwhm) of every rendered line, K-alpha2 included; areas per unit volume fraction."""
    if micro.texture_r != 1.0:
        d, f2 = refl.d, refl.f2 * march_dollase(refl, micro.texture_r, micro.texture_hkl)
    else:
        d, f2 = refl.merged()
    d = d * (1.0 + micro.strain)
    lines = [(inst.wavelength, 1.0)]
    if inst.ka2_ratio > 0:
        lines.append((inst.wavelength2, inst.ka2_ratio))
    lo, hi = two_theta_range
    cs, ars, ws = [], [], []
    for lam, weight in lines:
        tt = two_theta_of(d, lam)
        ok = np.isfinite(tt)
        tt_ok = tt[ok] + inst.zero_shift
        sel = (tt_ok > lo - 2.0) & (tt_ok < hi + 2.0)
        tt_sel = tt_ok[sel]
        area = f2[ok][sel] * lorentz_polarization(tt_sel) * weight / refl.volume ** 2
        cs.append(tt_sel)
        ars.append(area)
        ws.append(fwhm_deg(tt_sel, inst, micro, lam))
    return np.concatenate(cs), np.concatenate(ars), np.concatenate(ws)


def phase_pattern(refl: Reflections, x: np.ndarray, inst: Instrument = Instrument(),
                  micro: Microstructure = Microstructure()) -> np.ndarray:
    """Profile of one phase on grid ``x`` (deg), per unit volume fraction."""
    c, a, w = peak_list(refl, inst, micro, (float(x[0]), float(x[-1])))
    return render_peaks(np.asarray(x, dtype=float), c, a, w, inst.eta, inst.window_fwhm)


def background(x: np.ndarray, coeffs=(1.0, -0.3, 0.1), hump_height: float = 0.0, hump_center: float = 25.0,
               hump_fwhm: float = 12.0) -> np.ndarray:
    """Chebyshev polynomial over the range plus an amorphous hump (Gaussian)."""
    t = 2.0 * (x - x[0]) / (x[-1] - x[0]) - 1.0
    bg = np.polynomial.chebyshev.chebval(t, coeffs)
    if hump_height:
        bg = bg + hump_height * np.exp(-4 * math.log(2) * ((x - hump_center) / hump_fwhm) ** 2)
    return bg


def poisson_counts(y: np.ndarray, peak_counts: float, rng: np.random.Generator) -> np.ndarray:
    """Scale so the maximum is ``peak_counts``, then draw Poisson counts."""
    scale = peak_counts / max(float(np.max(y)), 1e-30)
    return rng.poisson(np.clip(y * scale, 0, None)).astype(float)
