"""Readers for measured patterns: Malvern Panalytical ``.xrdml`` (XML) and two-column ``xy``.

Both return a :class:`Measured` pattern: 2theta (deg, uniform grid), intensity (counts per
step, as measured), the wavelengths when the file says them, and the file's sample id.
XML is parsed with the standard library (no entity expansion beyond what ElementTree does;
files are local measurements, not untrusted network input).
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from neon_hpc.envs.xrd.science.simulate import CU_KA1, CU_KA2


class PatternFormatError(ValueError):
    """A pattern file cannot be read; the message names the file and what is wrong."""


@dataclass
class Measured:
    two_theta: np.ndarray
    intensity: np.ndarray
    wavelength: float = CU_KA1
    wavelength2: float = CU_KA2
    ka2_ratio: float = 0.5
    sample_id: str = ""
    source: str = ""
    meta: dict = field(default_factory=dict)


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _find_all(root: ET.Element, name: str) -> list[ET.Element]:
    return [el for el in root.iter() if _local(el.tag) == name]


def _text_float(root: ET.Element, name: str, default: float) -> float:
    found = _find_all(root, name)
    if not found or found[0].text is None:
        return default
    try:
        return float(found[0].text)
    except ValueError:
        return default


def read_xrdml(path: str | Path) -> Measured:
    """The first scan's 2theta positions and counts (or intensities) of an ``.xrdml`` file."""
    path = Path(path)
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise PatternFormatError(f"{path}: not valid XML ({e})") from None
    except FileNotFoundError:
        raise PatternFormatError(f"{path}: no such file") from None
    points = _find_all(root, "dataPoints")
    if not points:
        raise PatternFormatError(f"{path}: no <dataPoints> element; is this an xrdml scan?")
    dp = points[0]
    counts_el = next((el for el in dp if _local(el.tag) in ("counts", "intensities")), None)
    if counts_el is None or not (counts_el.text or "").strip():
        raise PatternFormatError(f"{path}: <dataPoints> has no <counts> or <intensities>")
    y = np.array(counts_el.text.split(), dtype=float)
    x = _positions(dp, len(y), path)
    sample = _find_all(root, "id")
    return Measured(
        two_theta=x, intensity=y,
        wavelength=_text_float(root, "kAlpha1", CU_KA1), wavelength2=_text_float(root, "kAlpha2", CU_KA2),
        ka2_ratio=_text_float(root, "ratioKAlpha2KAlpha1", 0.5),
        sample_id=(sample[0].text or "").strip() if sample else path.stem, source=str(path),
        meta={"counting_time_s": _text_float(root, "commonCountingTime", float("nan"))})


def _positions(dp: ET.Element, n: int, path: Path) -> np.ndarray:
    for pos in dp:
        if _local(pos.tag) != "positions" or pos.get("axis") != "2Theta":
            continue
        listed = next((el for el in pos if _local(el.tag) == "listPositions"), None)
        if listed is not None and listed.text:
            x = np.array(listed.text.split(), dtype=float)
        else:
            start = next((el for el in pos if _local(el.tag) == "startPosition"), None)
            end = next((el for el in pos if _local(el.tag) == "endPosition"), None)
            if start is None or end is None:
                raise PatternFormatError(f"{path}: 2Theta <positions> has neither list nor start/end")
            x = np.linspace(float(start.text), float(end.text), n)
        if len(x) != n:
            raise PatternFormatError(f"{path}: {len(x)} 2Theta positions for {n} counts")
        return x
    raise PatternFormatError(f"{path}: no <positions axis=\"2Theta\"> in <dataPoints>")


def read_xy(path: str | Path) -> Measured:
    """Two whitespace- or comma-separated columns (2theta, intensity); '#' starts a comment."""
    path = Path(path)
    xs, ys = [], []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise PatternFormatError(f"{path}: no such file") from None
    for lineno, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.replace(",", " ").split()
        if len(parts) < 2:
            raise PatternFormatError(f"{path}:{lineno}: expected two columns (2theta intensity), got {line!r}")
        try:
            xs.append(float(parts[0]))
            ys.append(float(parts[1]))
        except ValueError:
            if not xs:          # a header line
                continue
            raise PatternFormatError(f"{path}:{lineno}: not numbers: {line!r}") from None
    if len(xs) < 10:
        raise PatternFormatError(f"{path}: only {len(xs)} data points")
    return Measured(two_theta=np.array(xs), intensity=np.array(ys), sample_id=path.stem, source=str(path))


def read_pattern(path: str | Path) -> Measured:
    path = Path(path)
    if path.suffix.lower() == ".xrdml":
        return read_xrdml(path)
    return read_xy(path)


def write_xy(path: str | Path, two_theta: np.ndarray, intensity: np.ndarray) -> None:
    np.savetxt(path, np.column_stack([two_theta, intensity]), fmt="%.5f", header="2theta intensity")


def to_uniform(two_theta: np.ndarray, intensity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Resample onto a uniform grid (same count) when the steps are not uniform (needed by render)."""
    x = np.asarray(two_theta, dtype=float)
    steps = np.diff(x)
    if len(steps) and np.allclose(steps, steps.mean(), rtol=1e-3, atol=1e-6):
        return x, np.asarray(intensity, dtype=float)
    grid = np.linspace(x[0], x[-1], len(x))
    return grid, np.interp(grid, x, intensity)
