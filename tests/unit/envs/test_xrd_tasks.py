"""Task sets: deterministic, splits hold out chemical systems and dates, files round-trip."""
import json

import numpy as np
import pytest

from neon_hpc.envs.xrd.science.tasks import (
    PRESETS,
    TRAIN_DATES,
    build_record_db,
    is_held_out,
    load_tasks,
    make_context,
    open_task_set,
    read_tasks,
    write_tasks,
)


def test_tasks_are_deterministic_from_the_seed():
    a = load_tasks("tiny", "train", seed=3, n=4)
    b = load_tasks("tiny", "train", seed=3, n=4)
    c = load_tasks("tiny", "train", seed=4, n=4)
    for x, y in zip(a, b):
        assert x.id == y.id and x.truth == y.truth and x.date == y.date
        np.testing.assert_array_equal(x.pattern.intensity, y.pattern.intensity)
    assert any(not np.array_equal(x.pattern.intensity, z.pattern.intensity) for x, z in zip(a, c))


def test_ood_systems_never_appear_in_train_and_temporal_is_later():
    train = load_tasks("tiny", "train", n=40)
    test_id = load_tasks("tiny", "test_id", n=15)
    ood = load_tasks("tiny", "test_ood", n=15)
    temporal = load_tasks("tiny", "test_temporal", n=15)
    train_systems = {t.chemical_system for t in train}
    assert all(is_held_out(t.chemical_system) for t in ood)
    assert not train_systems & {t.chemical_system for t in ood}
    assert not any(is_held_out(s) for s in train_systems | {t.chemical_system for t in test_id + temporal})
    assert max(t.date for t in train) <= TRAIN_DATES[1] < min(t.date for t in temporal)
    assert not {t.id for t in train} & {t.id for t in test_id}


def test_task_contents_per_preset():
    for name in PRESETS:
        t = load_tasks(name, "test_id", n=1)[0]
        lo, hi, step = PRESETS[name].two_theta
        assert t.pattern.two_theta[0] == pytest.approx(lo) and t.pattern.two_theta[-1] == pytest.approx(hi)
        assert np.all(t.pattern.intensity >= 0) and t.pattern.intensity.max() > 100
        assert abs(sum(w for _, _, w in t.truth) - 1) < 1e-3
        assert PRESETS[name].n_phases[0] <= len(t.truth) <= PRESETS[name].n_phases[1]
        assert set(t.elements) == set(t.chemical_system.split("-"))
        assert all(h["date"] < t.date for h in t.history)
    tiny = load_tasks("tiny", "train", n=1)[0]
    assert len(tiny.pattern.two_theta) == 501
    public = tiny.public_view()
    assert public["n_points"] == 501 and "truth" not in public
    assert not any(pid in json.dumps(public) for pid, _, _ in tiny.truth)


def test_the_answer_is_in_the_store_but_hidden_by_the_cutoff():
    task = next(t for t in load_tasks("easy", "train", n=10) if t.history)
    record_db = build_record_db([task], include_real=False)
    ids = {r[0] for r in record_db.execute("SELECT sample_id FROM experiments")}
    assert task.id in ids and f"{task.id}-followup" in ids
    ctx = make_context(task, record_db)
    seen = {r["sample_id"] for r in ctx.view.experiments(limit=1000)}
    assert seen == {h["sample_id"] for h in task.history}


def test_write_and_read_task_files(tmp_path):
    tasks = load_tasks("tiny", "test_ood", n=3)
    info = write_tasks(tasks, tmp_path / "set", include_real=False)
    assert info["tasks"] == 3 and (tmp_path / "set" / "experiments.sqlite").exists()
    back = read_tasks(tmp_path / "set")
    assert [t.id for t in back] == [t.id for t in tasks]
    np.testing.assert_allclose(back[0].pattern.intensity, tasks[0].pattern.intensity, atol=0.01)
    assert back[0].truth == [(p, f, pytest.approx(w)) for p, f, w in tasks[0].truth]
    again, record_db = open_task_set(tmp_path / "set")
    assert [t.id for t in again] == [t.id for t in tasks]
    assert record_db.count("phases") > 300
    ctx = make_context(again[0], record_db)
    assert ctx.view.experiments(limit=100) == [] or all(r["date"] < again[0].date
                                                        for r in ctx.view.experiments(limit=100))
    with pytest.raises(FileNotFoundError, match="experiments.sqlite"):
        open_task_set(tmp_path)
    (tmp_path / "broken.jsonl").write_text('{"id": 1}\n')
    with pytest.raises(ValueError, match="broken.jsonl:1"):
        read_tasks(tmp_path / "broken.jsonl")
