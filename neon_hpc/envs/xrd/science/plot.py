"""Rietveld-style plot of a fit: observed points, calculated curve, difference below, tick marks per phase."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np


def plot_fit(x: np.ndarray, y: np.ndarray, res, path: str | Path, title: str = "") -> Path:
    """Write a PNG (published by rename) of ``res`` (a :class:`~neon_hpc.envs.xrd.science.fitting.FitResult`)
    against (x, y)."""
    import matplotlib  # deferred: heavy (matplotlib)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: heavy (matplotlib)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax, axd) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot(x, y, ".", ms=2, color="tab:blue", label="observed")
    ax.plot(x, res.calc, "-", lw=0.8, color="tab:red", label="calculated")
    ax.plot(x, res.background, "-", lw=0.6, color="0.5", label="background")
    comps = res.details.get("components") or []
    for p, comp in zip(res.phases, comps):
        ax.plot(x, comp + res.background, "-", lw=0.5, alpha=0.7,
                label=f"{p.phase_id} {p.weight_fraction:.3f} +- {p.wf_esd:.3f}")
    ax.set_ylabel("counts")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title((title + "\n" if title else "") +
                 f"Rwp {res.rwp:.4f}  Rexp {res.rexp:.4f}  GoF {res.gof:.2f}", fontsize=9)
    axd.plot(x, y - res.calc, "-", lw=0.6, color="tab:green")
    axd.axhline(0, color="0.5", lw=0.5)
    axd.set_ylabel("obs - calc")
    axd.set_xlabel("2theta (deg)")
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".plot-", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
