"""tools/bench_soak.py's report arithmetic on known series: slopes, the largest rise per role
(a one-time step is named with its role and time), and the trainer's memory-record summary."""

from __future__ import annotations

import json
import sys

import pytest

from repo_paths import REPO

sys.path.insert(0, str(REPO / "tools"))
import bench_soak  # noqa: E402


def test_slope_and_largest_rise_name_a_one_time_step():
    # trainer: flat 550 MB, one +13 MB step at t=1400 s; engine: +36 MB/h steadily
    samples = [(t, {"trainer": 550.0 + (13.0 if t >= 1400 else 0.0), "engine": 400.0 + t / 100})
               for t in range(10, 1810, 10)]
    slopes = bench_soak.fit_slopes(samples, 450, 1800)
    assert slopes["engine"] == pytest.approx(36.0, rel=1e-6)
    assert slopes["trainer"] > 10                          # the fit sees the step as growth
    rises = bench_soak.largest_rise(samples)
    assert rises["trainer"] == (1400, 550.0, 563.0)
    assert rises["engine"][2] - rises["engine"][1] == pytest.approx(0.1)


def test_memdebug_summary_compares_first_and_last_quarters(tmp_path):
    path = tmp_path / "memdebug_0.jsonl"
    assert bench_soak.memdebug_summary(path) is None
    with open(path, "w") as f:
        for i in range(8):
            f.write(json.dumps({"step": 5 * (i + 1), "rss_kb": 1024 * (500 + 10 * i), "threads": 69, "trimmed": True,
                                "trim_ms": 2.0, "max_seq_seen": 139,
                                "malloc": {"used_kb": 1024 * 150, "free_kb": 0, "heaps": 16}}) + "\n")
    md = bench_soak.memdebug_summary(path)
    assert md["steps"] == (5, 40) and md["records"] == 8
    assert md["rss_mb"] == (505.0, 565.0) and md["in_use_mb"] == (150.0, 150.0)
    assert md["trimmed"] and md["trim_ms_mean"] == 2.0 and md["heaps"] == 16
