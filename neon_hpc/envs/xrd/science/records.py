"""The dated system of record: experiments and phases in SQL, read through a date-cutoff layer.

Schema (portable: only TEXT / INTEGER / DOUBLE PRECISION, JSON kept as TEXT, ISO dates as
TEXT 'YYYY-MM-DD' so string order is date order).  SQLite is the embedded default; the same
DDL and the same statements run on PostgreSQL: :meth:`RecordDB.connect` takes a file path or a
``postgresql://`` DSN (psycopg 3; placeholders are rewritten for its ``format`` paramstyle).
Both are tested, including the date cutoff and concurrent writers (``tests/integration/test_xrd_records.py``
against a throwaway PostgreSQL cluster).  Tables:

``experiments``: sample_id (key), date, chemical_system ("La-Ni-O-Ti", sorted), elements
(JSON list), precursors (JSON list), conditions (JSON object), two_theta / intensity (JSON
arrays or NULL), phases (JSON list of {phase_id, formula, weight_fraction} or NULL when not
verified), source ("synthetic:<preset>", "real:precursor_mixture", ...), notes.

``phases``: the phase library's searchable columns; ``available_from`` = the structure's
publication year as 'YYYY-01-01'.

The only way tools read it is :class:`DatedView`: every query carries ``date < cutoff`` in SQL
*and* each returned row is re-checked in Python, so nothing dated on or after the task's date is
ever returned, whatever the arguments (``tests/integration/test_xrd_records.py`` checks this with random
queries).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlsplit, urlunsplit

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS experiments (
        sample_id TEXT PRIMARY KEY,
        date TEXT NOT NULL,
        chemical_system TEXT NOT NULL,
        elements TEXT NOT NULL,
        precursors TEXT NOT NULL,
        conditions TEXT NOT NULL,
        two_theta TEXT,
        intensity TEXT,
        phases TEXT,
        source TEXT NOT NULL,
        notes TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS experiments_by_system ON experiments (chemical_system, date)",
    "CREATE INDEX IF NOT EXISTS experiments_by_date ON experiments (date)",
    """CREATE TABLE IF NOT EXISTS phases (
        id TEXT PRIMARY KEY,
        formula TEXT NOT NULL,
        spacegroup TEXT NOT NULL,
        sg_number INTEGER NOT NULL,
        chemical_system TEXT NOT NULL,
        elements TEXT NOT NULL,
        year INTEGER NOT NULL,
        available_from TEXT NOT NULL,
        source TEXT NOT NULL,
        reference TEXT NOT NULL,
        answer_eligible INTEGER NOT NULL,
        density DOUBLE PRECISION NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS phases_by_date ON phases (available_from)",
]

EXPERIMENT_COLUMNS = ("sample_id", "date", "chemical_system", "elements", "precursors", "conditions",
                      "two_theta", "intensity", "phases", "source", "notes")


def iso_date(value: str, what: str = "date") -> str:
    """Validate an ISO date ('YYYY-MM-DD'); the error names the value and the fix."""
    try:
        return _dt.date.fromisoformat(str(value)[:10]).isoformat()
    except ValueError:
        raise ValueError(f"{what} {value!r} is not an ISO date; write YYYY-MM-DD") from None


def chemical_system(elements: Iterable[str]) -> str:
    return "-".join(sorted(set(elements)))


POSTGRES_SCHEMES = ("postgresql://", "postgres://")
_SCHEMA_LOCK_KEY = 0x6E656F6E  # any constant: the advisory lock that serialises schema creation


class RecordDBError(RuntimeError):
    """The system of record cannot be opened; the message names it and what to do."""


def is_postgres(target: str | Path) -> bool:
    return str(target).startswith(POSTGRES_SCHEMES)


def redact_dsn(dsn: str) -> str:
    """A DSN fit for logs and task folders: the password (if any) removed."""
    parts = urlsplit(dsn)
    if parts.password is None:
        return dsn
    host = parts.hostname or ""
    netloc = (f"{parts.username}@" if parts.username else "") + host + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _upsert(table: str, columns: tuple[str, ...], key: str) -> str:
    """One INSERT that replaces an existing row, in syntax SQLite (>= 3.24) and PostgreSQL share."""
    updates = ",".join(f"{c}=excluded.{c}" for c in columns if c != key)
    return (f"INSERT INTO {table} ({','.join(columns)}) VALUES ({','.join('?' * len(columns))}) "
            f"ON CONFLICT ({key}) DO UPDATE SET {updates}")


PHASE_COLUMNS = ("id", "formula", "spacegroup", "sg_number", "chemical_system", "elements", "year",
                 "available_from", "source", "reference", "answer_eligible", "density")


class RecordDB:
    """A connection plus the schema; writes go here, reads for agents go through :meth:`view`."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.lock = threading.RLock()      # one connection shared by a worker's threads
        self.paramstyle = "qmark" if isinstance(conn, sqlite3.Connection) else "format"
        cur = conn.cursor()
        if self.paramstyle == "format":
            # concurrent CREATE TABLE IF NOT EXISTS races in PostgreSQL's catalog: serialise it
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_KEY,))
        for stmt in SCHEMA:
            cur.execute(stmt)
        conn.commit()

    @classmethod
    def open(cls, path: str | Path = ":memory:") -> "RecordDB":
        """A file path (or ``:memory:``) opens SQLite; a ``postgresql://`` DSN opens PostgreSQL."""
        if is_postgres(path):
            return cls.connect_postgres(str(path))
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # timeout: concurrent writers (several task builders, workers) wait for SQLite's lock
        conn = sqlite3.connect(str(path), check_same_thread=False, timeout=60)
        return cls(conn)

    @classmethod
    def connect_postgres(cls, dsn: str, connect_timeout_s: int = 10) -> "RecordDB":
        try:
            import psycopg  # deferred: optional (psycopg: a PostgreSQL records database only)
        except ImportError as e:  # declared in pyproject; only a broken venv lacks it
            raise RecordDBError(f"{redact_dsn(dsn)}: PostgreSQL needs psycopg ({e}); run `bash env/setup.sh`") from None
        try:
            conn = psycopg.connect(dsn, connect_timeout=connect_timeout_s)
        except psycopg.OperationalError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RecordDBError(f"cannot connect to the system of record {redact_dsn(dsn)}: {first}. Check that the "
                             f"server is running and reachable, and the user, password (PGPASSWORD or ~/.pgpass) "
                             f"and database in the DSN") from None
        except psycopg.ProgrammingError as e:
            raise RecordDBError(f"{redact_dsn(dsn)} is not a valid PostgreSQL DSN ({e}); write "
                             f"postgresql://USER@HOST:PORT/DBNAME") from None
        return cls(conn)

    def _sql(self, sql: str) -> str:
        return sql if self.paramstyle == "qmark" else sql.replace("?", "%s")

    def execute(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self.lock, self._transaction() as cur:
            cur.execute(self._sql(sql), params)
            return cur.fetchall() if cur.description else []

    @contextlib.contextmanager
    def _transaction(self):
        """A cursor whose work is committed on success and rolled back on error (a failed
        statement leaves a PostgreSQL transaction aborted until then)."""
        cur = self.conn.cursor()
        try:
            yield cur
        except BaseException:
            self.conn.rollback()
            raise
        self.conn.commit()

    def add_experiments(self, records: Iterable[dict]) -> int:
        rows = [self._experiment_row(r) for r in records]
        sql = self._sql(_upsert("experiments", EXPERIMENT_COLUMNS, "sample_id"))
        with self.lock, self._transaction() as cur:
            cur.executemany(sql, rows)
        return len(rows)

    @staticmethod
    def _experiment_row(r: dict) -> tuple:
        if not r.get("sample_id"):
            raise ValueError(f"experiment record without sample_id: {sorted(r)}")
        elements = sorted(set(r.get("elements") or []))
        two_theta = r.get("two_theta")
        intensity = r.get("intensity")
        return (str(r["sample_id"]), iso_date(r["date"], f"experiment {r['sample_id']}: date"),
                r.get("chemical_system") or chemical_system(elements), json.dumps(elements),
                json.dumps(list(r.get("precursors") or [])), json.dumps(dict(r.get("conditions") or {})),
                None if two_theta is None else json.dumps([round(float(v), 4) for v in two_theta]),
                None if intensity is None else json.dumps([round(float(v), 3) for v in intensity]),
                None if r.get("phases") is None else json.dumps(r["phases"]),
                str(r.get("source", "unknown")), r.get("notes"))

    def add_phases(self, phases) -> int:
        rows = [(p.id, p.display_formula or p.formula, p.spacegroup, p.sg_number, p.chemsys,
                 json.dumps(list(p.elements)), p.year, f"{p.year:04d}-01-01", p.source, p.reference,
                 int(p.answer_eligible), p.density) for p in phases]
        with self.lock, self._transaction() as cur:
            cur.executemany(self._sql(_upsert("phases", PHASE_COLUMNS, "id")), rows)
        return len(rows)

    def count(self, table: str) -> int:
        if table not in ("experiments", "phases"):
            raise ValueError(f"unknown table {table!r}")
        return int(self.execute(f"SELECT COUNT(*) FROM {table}")[0][0])

    def view(self, cutoff: str) -> "DatedView":
        return DatedView(self, cutoff)

    def close(self) -> None:
        self.conn.close()


def _decode_experiment(row: tuple, with_pattern: bool) -> dict:
    rec = dict(zip(EXPERIMENT_COLUMNS, row))
    for key in ("elements", "precursors", "conditions", "phases"):
        if rec[key] is not None:
            rec[key] = json.loads(rec[key])
    if with_pattern:
        for key in ("two_theta", "intensity"):
            if rec[key] is not None:
                rec[key] = json.loads(rec[key])
    else:
        rec["has_pattern"] = rec.pop("two_theta") is not None
        rec.pop("intensity")
    return rec


class CutoffViolation(RuntimeError):
    """A row dated on or after the cutoff reached the query layer: a bug, never returned."""


class DatedView:
    """Read-only queries that never return anything dated on or after ``cutoff``."""

    def __init__(self, record_db: RecordDB, cutoff: str):
        self.record_db = record_db
        self.cutoff = iso_date(cutoff, "cutoff")

    def _guard(self, rows: list[dict], key: str) -> list[dict]:
        for r in rows:
            if not str(r[key]) < self.cutoff:
                raise CutoffViolation(f"row {r.get('sample_id') or r.get('id')} dated {r[key]} >= {self.cutoff}")
        return rows

    def experiments(self, elements: Iterable[str] | None = None, chemical_system_: str | None = None,
                    any_element: Iterable[str] | None = None, limit: int = 20,
                    with_pattern: bool = False) -> list[dict]:
        """Experiments dated before the cutoff, newest first.

        ``elements``: records whose elements are a subset of these; ``chemical_system_``: exact
        system ("Ni-O-Ti"); ``any_element``: records containing at least one of these.
        """
        sql = f"SELECT {','.join(EXPERIMENT_COLUMNS)} FROM experiments WHERE date < ?"
        params: list[Any] = [self.cutoff]
        if chemical_system_:
            sql += " AND chemical_system = ?"
            params.append(chemical_system(chemical_system_.split("-")))
        sql += " ORDER BY date DESC, sample_id"
        rows = [_decode_experiment(r, with_pattern) for r in self.record_db.execute(sql, tuple(params))]
        if elements is not None:
            allowed = set(elements)
            rows = [r for r in rows if set(r["elements"]) <= allowed]
        if any_element is not None:
            wanted = set(any_element)
            rows = [r for r in rows if set(r["elements"]) & wanted]
        return self._guard(rows[:max(0, int(limit))], "date")

    def phases(self, elements: Iterable[str] | None = None, chemical_system_: str | None = None,
               formula: str | None = None, limit: int = 50) -> list[dict]:
        """Library phases published before the cutoff (subset of ``elements``, or exact system)."""
        sql = f"SELECT {','.join(PHASE_COLUMNS)} FROM phases WHERE available_from < ?"
        params: list[Any] = [self.cutoff]
        if chemical_system_:
            sql += " AND chemical_system = ?"
            params.append(chemical_system(chemical_system_.split("-")))
        sql += " ORDER BY answer_eligible DESC, year, id"
        rows = [dict(zip(PHASE_COLUMNS, r)) for r in self.record_db.execute(sql, tuple(params))]
        for r in rows:
            r["elements"] = json.loads(r["elements"])
            r["answer_eligible"] = bool(r["answer_eligible"])
        if elements is not None:
            allowed = set(elements)
            rows = [r for r in rows if set(r["elements"]) <= allowed]
        if formula is not None:
            # deferred: heavy (neon_hpc.envs.xrd.science.library: numpy)
            from neon_hpc.envs.xrd.science.library import normalize_formula
            want = normalize_formula(formula)
            rows = [r for r in rows if normalize_formula(r["formula"]) == want]
        return self._guard(rows[:max(0, int(limit))], "available_from")

    def phase_visible(self, phase_id: str) -> bool:
        rows = self.record_db.execute("SELECT available_from FROM phases WHERE id = ? AND available_from < ?",
                                  (phase_id, self.cutoff))
        return bool(rows)
