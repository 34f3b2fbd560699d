"""The dated store: nothing dated on or after the cutoff ever comes back (property tests)."""
import datetime as dt
import sqlite3

import pytest
from hypothesis import given, settings, strategies as st

from neon_hpc.xrd.library import load_library
from neon_hpc.xrd.store import Store, chemical_system, iso_date

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


@settings(max_examples=40, deadline=None)
@given(records=record_st, cutoff_days=st.integers(-10, 4010),
       query=st.one_of(st.none(), st.lists(st.sampled_from(ELEMENTS), min_size=1, max_size=5, unique=True)),
       mode=st.sampled_from(["subset", "any", "system", "all"]), limit=st.integers(0, 60))
def test_no_record_on_or_after_the_cutoff_is_ever_returned(records, cutoff_days, query, mode, limit):
    store = Store.open(":memory:")
    recs = _records(records)
    store.add_experiments(recs)
    cutoff = (DAY0 + dt.timedelta(days=cutoff_days)).isoformat()
    view = store.view(cutoff)
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


@settings(max_examples=25, deadline=None)
@given(year=st.integers(1900, 2030), els=st.lists(st.sampled_from(ELEMENTS), min_size=1, max_size=4, unique=True))
def test_phases_published_on_or_after_the_cutoff_are_hidden(year, els):
    store = _phase_store()
    cutoff = f"{year}-06-01"
    rows = store.view(cutoff).phases(elements=els, limit=1000)
    assert all(r["available_from"] < cutoff and r["year"] <= year for r in rows)
    lib = load_library()
    expect = {p.id for p in lib.within(els) if f"{p.year:04d}-01-01" < cutoff}
    assert {r["id"] for r in rows} == expect


_STORE = {}


def _phase_store():
    if "s" not in _STORE:
        s = Store.open(":memory:")
        s.add_phases(load_library().phases)
        _STORE["s"] = s
    return _STORE["s"]


def test_store_file_survives_reopen_and_validates_dates(tmp_path):
    path = tmp_path / "db" / "exp.sqlite"
    s = Store.open(path)
    s.add_experiments(_records([(10, ["Ni", "O"])]))
    s.close()
    s2 = Store.open(path)
    assert s2.count("experiments") == 1
    with pytest.raises(ValueError, match="not an ISO date"):
        s2.add_experiments([{"sample_id": "bad", "date": "13/01/2020", "elements": ["O"]}])
    with pytest.raises(ValueError, match="not an ISO date"):
        s2.view("yesterday")
    assert iso_date("2020-02-29") == "2020-02-29"
    assert isinstance(s2.conn, sqlite3.Connection)
