#!/usr/bin/env python
"""Config load cost: the pydantic config model with its validator built once vs built per load.

Both sides build the same ExperimentConfig from the same parsed YAML (configs/tiny_cpu.yaml)
through ``config.from_dict`` (conversion, every declared range, cross-field rules,
cross-section rules); the baseline clears ``constraints.adapter`` (the cached pydantic
``TypeAdapter``) before every load, so it pays for building the validator each time.  YAML
parsing is left out (it is the same on both sides).

    python tools/bench_config.py [--loads 200]

Last line: RESULT config_load_ms=<cached> config_load_uncached_ms=<baseline> speedup=<ratio>
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import yaml

from neon_hpc import config
from neon_hpc.util import constraints

REPO = Path(__file__).resolve().parents[1]


def _time(data: dict, loads: int, uncached: bool) -> float:
    out = []
    for _ in range(loads):
        if uncached:
            constraints.adapter.cache_clear()
        t0 = time.perf_counter()
        config.from_dict(data)
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", type=int, default=200)
    a = ap.parse_args()
    data = yaml.safe_load((REPO / "configs" / "tiny_cpu.yaml").read_text())
    config.from_dict(data)   # imports and first-use costs out of both measurements
    cached, uncached = _time(data, a.loads, False), _time(data, a.loads, True)
    print(f"median of {a.loads} loads: cached {cached:.2f} ms, uncached {uncached:.2f} ms")
    print(f"RESULT config_load_ms={cached:.3f} config_load_uncached_ms={uncached:.3f} speedup={uncached / cached:.2f}")


if __name__ == "__main__":
    main()
