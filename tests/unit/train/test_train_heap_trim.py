"""``StepHeap.after_step`` trims at most once every ``TRIM_EVERY_S`` (a clock the test holds)."""

from __future__ import annotations

import json

import pytest

from neon_hpc.train import heap


@pytest.mark.skipif(heap.glibc() is None, reason="malloc_trim is glibc's; this libc has none")
def test_the_trim_runs_on_the_first_step_then_once_the_interval_has_passed(tmp_path, monkeypatch):
    clock = {"now": 100.0}
    monkeypatch.setattr(heap.time, "monotonic", lambda: clock["now"])
    mem = heap.StepHeap(tmp_path / "memdebug_0.jsonl", every=1)
    for step, dt in enumerate((0.0, 0.5, heap.TRIM_EVERY_S - 0.6, 0.2, heap.TRIM_EVERY_S), start=1):
        clock["now"] += dt
        mem.after_step(step, [8])
    recs = [json.loads(x) for x in (tmp_path / "memdebug_0.jsonl").read_text().splitlines()]
    # t = 100, 100.5, 101.9, 102.1 (2.1 s after the first trim), 104.1
    assert [r["trimmed"] for r in recs] == [True, False, False, True, True]
    assert all((r["trim_ms"] is None) != r["trimmed"] for r in recs)
