"""The dated records database: nothing dated on or after the cutoff ever comes back (property tests), on SQLite
and on a real PostgreSQL server (a throwaway cluster from tests/pgcluster.py)."""
import datetime as dt
import sqlite3

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from neon_hpc.envs.xrd.science.library import load_library
from neon_hpc.envs.xrd.science.records import RecordDB, RecordDBError, chemical_system, iso_date

ELEMENTS = ["Ni", "O", "Ti", "Zn", "La", "H", "Li", "C"]
DAY0 = dt.date(2015, 1, 1)


def _records(seed_dates):
    out = []
    for i, (days, els) in enumerate(seed_dates):
        out.append({"sample_id": f"s{i}", "date": (DAY0 + dt.timedelta(days=days)).isoformat(),
                    "elements": els, "precursors": [], "conditions": {"t": i},
                    "phases": [{"phase_id": "x", "formula": "NiO", "weight_fraction": 1.0}], "source": "test"})
    return out


record_st = st.lists(st.tuples(st.integers(0, 4000), st.lists(st.sampled_from(ELEMENTS), min_size=1, max_size=4,
                                                               unique=True)), min_size=1, max_size=40)


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_record_db(request):
    """A function returning an empty record_db on the parametrised backend."""
    if request.param == "sqlite":
        yield lambda: RecordDB.open(":memory:")
        return
    pg = request.getfixturevalue("postgres")
    opened = []

    def fresh():
        s = RecordDB.open(pg.dsn())
        s.execute("DELETE FROM experiments")
        s.execute("DELETE FROM phases")
        opened.append(s)
        return s
    yield fresh
    for s in opened:
        s.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=record_st, cutoff_days=st.integers(-10, 4010),
       query=st.one_of(st.none(), st.lists(st.sampled_from(ELEMENTS), min_size=1, max_size=5, unique=True)),
       mode=st.sampled_from(["subset", "any", "system", "all"]), limit=st.integers(0, 60))
def test_no_record_on_or_after_the_cutoff_is_ever_returned(empty_record_db, records, cutoff_days, query, mode, limit):
    record_db = empty_record_db()
    recs = _records(records)
    record_db.add_experiments(recs)
    cutoff = (DAY0 + dt.timedelta(days=cutoff_days)).isoformat()
    view = record_db.view(cutoff)
    kwargs = {"limit": limit}
    if query is not None and mode == "subset":
        kwargs["elements"] = query
    elif query is not None and mode == "any":
        kwargs["any_element"] = query
    elif query is not None and mode == "system":
        kwargs["chemical_system_"] = "-".join(query)
    rows = view.experiments(**kwargs)
    assert all(r["date"] < cutoff for r in rows)
    # and it is exactly the brute-force answer (nothing visible is lost)
    expect = [r for r in recs if r["date"] < cutoff]
    if "elements" in kwargs:
        expect = [r for r in expect if set(r["elements"]) <= set(query)]
    if "any_element" in kwargs:
        expect = [r for r in expect if set(r["elements"]) & set(query)]
    if "chemical_system_" in kwargs:
        expect = [r for r in expect if chemical_system(r["elements"]) == chemical_system(query)]
    assert len(rows) == min(limit, len(expect))
    assert {r["sample_id"] for r in rows} <= {r["sample_id"] for r in expect}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(year=st.integers(1900, 2030), els=st.lists(st.sampled_from(ELEMENTS), min_size=1, max_size=4, unique=True))
def test_phases_published_on_or_after_the_cutoff_are_hidden(phase_record_db, year, els):
    record_db = phase_record_db
    cutoff = f"{year}-06-01"
    rows = record_db.view(cutoff).phases(elements=els, limit=1000)
    assert all(r["available_from"] < cutoff and r["year"] <= year for r in rows)
    lib = load_library()
    expect = {p.id for p in lib.within(els) if f"{p.year:04d}-01-01" < cutoff}
    assert {r["id"] for r in rows} == expect


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def phase_record_db(request):
    if request.param == "sqlite":
        s = RecordDB.open(":memory:")
    else:
        s = RecordDB.open(request.getfixturevalue("postgres").create_db("phases_only"))
    s.add_phases(load_library().phases)
    yield s
    s.close()


def test_record_db_file_survives_reopen_and_validates_dates(tmp_path):
    path = tmp_path / "db" / "exp.sqlite"
    s = RecordDB.open(path)
    s.add_experiments(_records([(10, ["Ni", "O"])]))
    s.close()
    s2 = RecordDB.open(path)
    assert s2.count("experiments") == 1
    with pytest.raises(ValueError, match="not an ISO date"):
        s2.add_experiments([{"sample_id": "bad", "date": "13/01/2020", "elements": ["O"]}])
    with pytest.raises(ValueError, match="not an ISO date"):
        s2.view("yesterday")
    assert iso_date("2020-02-29") == "2020-02-29"
    assert isinstance(s2.conn, sqlite3.Connection)


def _write_batch(target, worker, n):
    s = RecordDB.open(target)
    s.add_experiments([{"sample_id": f"w{worker}-{i}", "date": "2020-01-01", "elements": ["Ni", "O"],
                        "source": "test"} for i in range(n)])
    # the same record from every writer: an upsert, never a duplicate or an error
    s.add_experiments([{"sample_id": "shared", "date": "2019-01-01", "elements": ["O"], "source": f"w{worker}"}])
    s.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_concurrent_writers_from_separate_processes(backend, tmp_path, request):
    import multiprocessing as mp
    target = (str(tmp_path / "exp.sqlite") if backend == "sqlite"
              else request.getfixturevalue("postgres").create_db("concurrent"))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write_batch, args=(target, w, 200)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    s = RecordDB.open(target)
    assert s.count("experiments") == 4 * 200 + 1
    assert len(s.view("2020-01-02").experiments(limit=10_000)) == 801
    assert s.view("2019-06-01").experiments(limit=10)[0]["source"] in {f"w{w}" for w in range(4)}


def test_postgres_errors_name_the_server_and_the_fix(postgres):
    from neon_hpc.util.netutil import free_port
    dead = f"postgresql://neon:secret@127.0.0.1:{free_port()}/postgres"
    with pytest.raises(RecordDBError, match="cannot connect") as e:
        RecordDB.open(dead)
    assert "secret" not in str(e.value) and "server is running" in str(e.value)
    with pytest.raises(RecordDBError, match="cannot connect"):
        RecordDB.open(postgres.dsn("no_such_database"))


def test_xrd_tasks_cli_builds_a_task_set_into_postgres(postgres, tmp_path):
    import subprocess
    import sys

    from neon_hpc.envs.xrd.science.tasks import open_task_set
    dsn = postgres.create_db("taskset")
    out = tmp_path / "set"
    r = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "xrd", "tasks", "--preset", "tiny", "--split", "train",
                        "--n", "3", "--no-real", "--out", str(out), "--db", dsn],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not (out / "experiments.sqlite").exists() and (out / "record_db.json").exists()
    tasks, record_db = open_task_set(out)
    assert len(tasks) == 3 and record_db.paramstyle == "format"
    assert record_db.count("phases") == len(load_library().phases)
    # the task's own record and its follow-up are in the server, and hidden by the task's date
    t = tasks[0]
    ids = {r[0] for r in record_db.execute("SELECT sample_id FROM experiments")}
    assert {t.id, f"{t.id}-followup"} <= ids
    visible = record_db.view(t.date).experiments(limit=10_000)
    assert visible and all(r["date"] < t.date for r in visible)
    assert not {t.id, f"{t.id}-followup"} & {r["sample_id"] for r in visible}
    record_db.close()
    # a folder written before the pointer was renamed: refused, naming the mv that fixes it
    (out / "record_db.json").rename(out / "store.json")
    with pytest.raises(FileNotFoundError, match=r"old name; rename it `mv .*store\.json .*record_db\.json`"):
        open_task_set(out)
    bad = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "xrd", "tasks", "--preset", "tiny", "--split",
                          "train", "--n", "1", "--no-real", "--out", str(tmp_path / "x"),
                          "--db", postgres.dsn("missing_db")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "cannot connect to the system of record" in bad.stderr
