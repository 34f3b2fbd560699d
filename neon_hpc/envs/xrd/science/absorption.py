"""X-ray absorption of phases: anomalous scattering, the Brindley microabsorption correction.

Mass attenuation coefficients (cm^2/g, total: photoabsorption + coherent + incoherent) of the
elements at the common anode lines, from the tables of Elam, Ravel & Sieber (Radiat. Phys. Chem.
63, 121 (2002)) as XrayDB ships them (MIT), evaluated once by :func:`build_table` and stored in
``data/mass_attenuation.json`` (loading needs no XrayDB).  A phase's coefficient is the mass-
fraction-weighted sum over its cell's atoms; its linear coefficient mu = (mu/rho) x density.

Anomalous scattering: the same file holds each element's f' and f'' (Chantler 2000) at those
lines; :func:`dispersion` gives them to the structure factors (:mod:`simulate`, ``dispersion_line``)
when a pattern is a real measurement.  Near an absorption edge they matter: at Cu K-alpha, just
below the Ni K edge, Ni has f' = -3.0, which weakens NiO's reflections by ~20 %.

Microabsorption (Brindley 1945): a particle of phase i in a powder of mean linear absorption
mu_bar diffracts as if its amount were multiplied by the particle absorption factor
``tau_i = <exp(-(mu_i - mu_bar) x)>`` over its volume, x the X-rays' path inside the particle.
For spheres of radius R with the path taken as the chord through each point (volume-weighted
chord density 3 L^2 / (8 R^3) on 0..2R, mean path 3R/2: Brindley's first-order term):

    tau(s) = 3 / a^3 (2 - exp(-a) (a^2 + 2a + 2)),   a = 2 s,  s = (mu_i - mu_bar) R

(tau(0.1) = 0.861; tau < 1 for a phase more absorbing than the mixture).  The correction divides
each Hill-Howard fraction by its tau and renormalises; mu_bar is the volume-fraction mean of the
phases' mu, so the corrected fractions are found by fixed-point iteration.  R is the one
parameter (one size for every phase, as Brindley's correction is used); the baseline's value is
chosen on other mixtures (:mod:`neon_hpc.envs.xrd.science.evaluate`).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from neon_hpc.envs.xrd.science.library import load_library

TABLE_PATH = Path(__file__).parent / "data" / "mass_attenuation.json"
# K-alpha1 lines (A) the table holds; a pattern's wavelength must be within LINE_TOL of one of them
LINES = {"CrKa1": 2.289760, "FeKa1": 1.936042, "CoKa1": 1.788965, "CuKa1": 1.540598, "MoKa1": 0.709300,
         "AgKa1": 0.559421}
LINE_TOL = 0.01
HC_EV_A = 12398.4198                 # h c in eV A
FIXED_POINT_ITERATIONS = 50
FIXED_POINT_TOL = 1e-10


class AbsorptionError(ValueError):
    pass


# ----------------------------------------------------------------------------------------------
# the table

def build_table(xraydb_sqlite: str, elements: list[str], out: Path = TABLE_PATH) -> dict:
    """Evaluate Elam's cubic splines (log mu vs log E) at ``LINES`` for ``elements``; write ``out``."""
    con = sqlite3.connect(xraydb_sqlite)

    def spline(xs, ys, y2, t):
        # natural cubic spline with the stored second derivatives; edges are repeated energies and
        # bisect_right puts an energy at or above an edge on its upper branch
        xs, ys, y2 = (np.asarray(json.loads(v), dtype=float) for v in (xs, ys, y2))
        k = int(np.clip(np.searchsorted(xs, t, side="right") - 1, 0, len(xs) - 2))
        h = xs[k + 1] - xs[k]
        a, b = (xs[k + 1] - t) / h, (t - xs[k]) / h
        return a * ys[k] + b * ys[k + 1] + ((a ** 3 - a) * y2[k] + (b ** 3 - b) * y2[k + 1]) * h * h / 6.0

    mu, mass, disp = {}, {}, {}
    for el in elements:
        ph = con.execute("select log_energy, log_photoabsorption, log_photoabsorption_spline from photoabsorption "
                         "where element=?", (el,)).fetchone()
        sc = con.execute("select log_energy, log_coherent_scatter, log_coherent_scatter_spline, "
                         "log_incoherent_scatter, log_incoherent_scatter_spline from scattering where element=?",
                         (el,)).fetchone()
        m = con.execute("select molar_mass from elements where element=?", (el,)).fetchone()
        if ph is None or sc is None or m is None:
            raise AbsorptionError(f"{xraydb_sqlite}: no Elam data for element {el!r}")
        ch = con.execute("select energy, f1, f2 from Chantler where element=?", (el,)).fetchone()
        if ch is None:
            raise AbsorptionError(f"{xraydb_sqlite}: no Chantler data for element {el!r}")
        ce, f1, f2 = (np.asarray(json.loads(v), dtype=float) for v in ch)
        disp[el] = {line: [round(float(np.interp(HC_EV_A / lam, ce, f1)), 4),
                           round(float(np.interp(HC_EV_A / lam, ce, f2)), 4)] for line, lam in LINES.items()}
        mass[el] = float(m[0])
        mu[el] = {}
        for line, lam in LINES.items():
            t = math.log(HC_EV_A / lam)
            tot = math.exp(spline(*ph, t)) + math.exp(spline(sc[0], sc[1], sc[2], t)) + \
                math.exp(spline(sc[0], sc[3], sc[4], t))
            mu[el][line] = round(tot, 4)
    table = {"units": "mu_rho: cm^2/g (total attenuation); molar_mass: g/mol; dispersion: [f', f''] electrons",
             "source": "mu_rho: Elam, Ravel & Sieber, Radiat. Phys. Chem. 63 (2002) 121; dispersion: Chantler, "
                       "J. Phys. Chem. Ref. Data 29 (2000) 597 (linear in energy between its points); both via "
                       "XrayDB (MIT); built by neon_hpc.envs.xrd.science.absorption.build_table",
             "lines": LINES, "molar_mass": mass, "mu_rho": mu, "dispersion": disp}
    tmp = Path(str(out) + ".tmp")
    tmp.write_text(json.dumps(table, indent=0, sort_keys=True))
    tmp.replace(out)
    return table


@functools.lru_cache(maxsize=1)
def load_table(path: str = str(TABLE_PATH)) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise AbsorptionError(f"{path}: mass attenuation table missing; rebuild it with "
                              f"`python -m neon_hpc.envs.xrd.science.absorption --build PATH/xraydb.sqlite`") from None


def line_of(wavelength: float) -> str:
    """The table's anode line for a wavelength (A), within ``LINE_TOL``."""
    best = min(LINES, key=lambda k: abs(LINES[k] - wavelength))
    if abs(LINES[best] - wavelength) > LINE_TOL:
        raise AbsorptionError(f"wavelength {wavelength} A is not a tabulated anode line "
                              f"({', '.join(f'{k} {v}' for k, v in LINES.items())}); add it to "
                              f"absorption.LINES and rebuild data/mass_attenuation.json with "
                              f"python -m neon_hpc.envs.xrd.science.absorption --build")
    return best


def element_mass_attenuation(element: str, wavelength: float) -> float:
    """mu/rho of an element (cm^2/g) at the anode line of ``wavelength``."""
    t = load_table()
    try:
        return float(t["mu_rho"][element][line_of(wavelength)])
    except KeyError:
        raise AbsorptionError(f"element {element!r} is not in {TABLE_PATH.name}; rebuild it with the "
                              "library's elements (`python -m neon_hpc.envs.xrd.science.absorption --build ...`)"
                              ) from None


def dispersion(elements, wavelength: float) -> dict[str, complex]:
    """Anomalous scattering f' + i f'' (electrons) of each element at the anode line of ``wavelength``."""
    t = load_table()
    line = line_of(wavelength)
    out = {}
    for el in elements:
        try:
            f1, f2 = t["dispersion"][el][line]
        except KeyError:
            raise AbsorptionError(f"element {el!r} has no dispersion correction in {TABLE_PATH.name}; rebuild it "
                                  "(`python -m neon_hpc.envs.xrd.science.absorption --build PATH/xraydb.sqlite`)"
                                  ) from None
        out[el] = complex(f1, f2)
    return out


def mass_attenuation(species, wavelength: float) -> float:
    """mu/rho (cm^2/g) of a composition given as a list of atoms (a cell's species) or {element: count}."""
    counts = species if isinstance(species, dict) else {}
    if not isinstance(species, dict):
        for el in species:
            counts[el] = counts.get(el, 0) + 1
    t = load_table()
    masses = {}
    for el, n in counts.items():
        if el not in t["molar_mass"]:
            raise AbsorptionError(f"element {el!r} is not in {TABLE_PATH.name}")
        masses[el] = n * t["molar_mass"][el]
    total = sum(masses.values())
    return sum(m / total * element_mass_attenuation(el, wavelength) for el, m in masses.items())


def linear_attenuation(phase, wavelength: float) -> float:
    """mu (1/cm) of a library phase: its mass attenuation x its crystallographic density."""
    return mass_attenuation(list(phase.species), wavelength) * float(phase.density)


# ----------------------------------------------------------------------------------------------
# Brindley

def brindley_tau(s: float | np.ndarray) -> np.ndarray:
    """Particle absorption factor of spheres at s = (mu_i - mu_bar) R (closed form; series near 0)."""
    a = 2.0 * np.asarray(s, dtype=float)
    small = np.abs(a) < 0.05          # the closed form cancels to ~a^3/3: the series (to a^5, error < 1e-11) there
    aa = np.where(small, 1.0, a)
    closed = 3.0 / aa ** 3 * (2.0 - np.exp(-aa) * (aa * aa + 2.0 * aa + 2.0))
    series = 1.0 - 0.75 * a + 0.3 * a ** 2 - a ** 3 / 12.0 + a ** 4 / 56.0 - a ** 5 / 320.0
    return np.where(small, series, closed)


@dataclass
class Microabsorption:
    fractions: np.ndarray          # corrected weight fractions
    tau: np.ndarray                # each phase's particle absorption factor
    mu: np.ndarray                 # linear attenuation (1/cm)
    mu_mean: float                 # volume-fraction mean of the solids
    jacobian: np.ndarray           # d corrected / d uncorrected (for propagating standard errors)


def _correct(w: np.ndarray, mu: np.ndarray, rho: np.ndarray, radius_cm: float):
    w = np.maximum(np.asarray(w, dtype=float), 0.0)
    if w.sum() <= 0:
        return w, np.ones_like(w), 0.0
    w0 = w / w.sum()
    x = w0.copy()
    tau = np.ones_like(w0)
    mu_bar = 0.0
    for _ in range(FIXED_POINT_ITERATIONS):
        v = x / rho
        mu_bar = float(np.sum(v * mu) / np.sum(v))
        tau = brindley_tau((mu - mu_bar) * radius_cm)
        new = w0 / tau
        new /= new.sum()
        done = float(np.max(np.abs(new - x))) < FIXED_POINT_TOL
        x = new
        if done:
            break
    return x, tau, mu_bar


def brindley_correct(w, mu, rho, radius_um: float) -> Microabsorption:
    """Hill-Howard fractions ``w`` corrected for microabsorption of spheres of radius ``radius_um``.

    ``mu``: each phase's linear attenuation (1/cm), ``rho``: its density (g/cm^3).  ``radius_um``
    0 returns ``w`` (renormalised) unchanged with tau = 1.
    """
    w, mu, rho = (np.asarray(v, dtype=float) for v in (w, mu, rho))
    if radius_um < 0:
        raise AbsorptionError(f"particle radius {radius_um} um: must be >= 0")
    R = radius_um * 1e-4
    x, tau, mu_bar = _correct(w, mu, rho, R)
    k = len(w)
    J = np.zeros((k, k))
    h = 1e-6
    for j in range(k):
        up, dn = w.copy(), w.copy()
        up[j] += h
        dn[j] = max(dn[j] - h, 0.0)
        J[:, j] = (_correct(up, mu, rho, R)[0] - _correct(dn, mu, rho, R)[0]) / (up[j] - dn[j])
    # the corrected fractions depend on w only through w / sum(w): J maps changes of the normalised w
    return Microabsorption(x, tau, mu, mu_bar, J)


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="rebuild data/mass_attenuation.json from an XrayDB sqlite file")
    ap.add_argument("--build", required=True, help="path of xraydb.sqlite (pip download xraydb; it is in the wheel)")
    args = ap.parse_args(argv)
    elements = sorted({e for p in load_library().phases for e in p.elements})
    t = build_table(args.build, elements)
    print(f"wrote {TABLE_PATH}: {len(t['mu_rho'])} elements x {len(LINES)} lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
