"""The run-directory protocol (neon_hpc/protocol): every record round-trips through its own
file, a reader meeting a torn or foreign file says so (file, field, fix), a missing file reads
as None; the shell helper the sbatch body uses; and no module outside the package spells a
run-directory file name or a trainer phase."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from neon_hpc.protocol import admission as rule
from neon_hpc.protocol.records import (
    ClaimOwner,
    ClaimRecord,
    DroppedRecord,
    EngineRecord,
    Finished,
    JobRecord,
    LeaseRecord,
    NodeBeat,
    Preempted,
    TrainerBeat,
    TrainerPhase,
    WorkerBeat,
    iter_records,
    mark_finished,
)
from neon_hpc.protocol.rundir import FILE_NAMES, LATEST, RUN_YAML, RunDir, RunDirError
from pyscan import docstring_ids
from repo_paths import REPO


@pytest.fixture
def run(tmp_path):
    return RunDir(tmp_path / "run").create()


# one sample of every record type, its writer, its reader, and the file it lives in
def _claim_dir(run):
    d = run.claimed_step(3)
    d.mkdir(parents=True, exist_ok=True)
    return d


CASES = {
    TrainerBeat: (lambda: TrainerBeat(rank=0, step=4, phase=TrainerPhase.WAITING_FOR_DATA, version=3, waited_s=2.5),
                  lambda r, x: x.write(r), lambda r: TrainerBeat.read(r, 0), lambda r: r.heartbeat_file("trainer", 0)),
    WorkerBeat: (lambda: WorkerBeat(rank=7, in_flight=12, groups=3, episodes=12, tokens=900, task="t-1"),
                 lambda r, x: x.write(r), lambda r: WorkerBeat.read(r, 7), lambda r: r.heartbeat_file("rollout", 7)),
    NodeBeat: (lambda: NodeBeat(rank=1, workers=4, restarts=1, version=2),
               lambda r, x: x.write(r), lambda r: NodeBeat.read(r, 1), lambda r: r.heartbeat_file("rollout-node", 1)),
    EngineRecord: (lambda: EngineRecord(urls=["http://127.0.0.1:1"], version=5, kind="sglang", workers_url="http://r"),
                   lambda r, x: x.write(r, 2), lambda r: EngineRecord.read(r, 2), lambda r: r.engine_file(2)),
    JobRecord: (lambda: JobRecord(job_id="42", backend="slurm", host="h", started=2.0, first_started=1.0, starts=2),
                lambda r, x: x.write(r), JobRecord.read, lambda r: r.job_file),
    LeaseRecord: (lambda: LeaseRecord(token="h-1-local-0-9", gen=2, host="h", pid=11, pid_start="123", renewed=5.0,
                                      renewed_by="trainer.0@h:12", took_over={"token": "old", "why": "gone"}),
                  lambda r, x: x.write(r), LeaseRecord.read, lambda r: r.lease_file),
    Finished: (lambda: Finished(by="trainer"), lambda r, x: x.write(r), Finished.read, lambda r: r.finished_file),
    Preempted: (lambda: Preempted(step=6, signal=10, checkpoint="/x/step_6"), lambda r, x: x.write(r),
                Preempted.read, lambda r: r.preempted_file),
    ClaimOwner: (lambda: ClaimOwner.mine("trainer", 3), lambda r, x: x.write_in(_claim_dir(r)),
                 lambda r: ClaimOwner.read_in(r.claimed_step(3)), lambda r: r.owner_file(3)),
    DroppedRecord: (lambda: DroppedRecord(step=3, trainer_version=2, max_staleness=1, stale_policy="mask",
                                          dropped=[{"shard": "s.h5", "index": 0, "tokens": 9}]),
                    lambda r, x: x.write_in(_claim_dir(r)), lambda r: DroppedRecord.load(r.dropped_file(3)),
                    lambda r: r.dropped_file(3)),
    ClaimRecord: (lambda: ClaimRecord(step=3, shards=[{"name": "s.h5", "kept": [0, 2]}], consumer="trainer",
                                      trajectories=2, tokens=40, generated_tokens=30, masked_stale_tokens=4),
                  lambda r, x: x.write_in(_claim_dir(r)), lambda r: ClaimRecord.read(r, 3), lambda r: r.claim_file(3)),
}


def test_every_record_type_has_a_case():
    assert set(CASES) == set(iter_records())


@pytest.mark.parametrize("kind", list(CASES), ids=lambda k: k.__name__)
def test_round_trip(run, kind):
    make, write, read, path = CASES[kind]
    rec = make()
    rec.extra["from_a_newer_writer"] = [1, 2]           # kept, and written back unchanged
    write(run, rec)
    assert path(run).is_file()
    back = read(run)
    assert back == rec and type(back) is kind
    back.save(path(run))
    assert json.loads(path(run).read_text()) == rec.to_json()


@pytest.mark.parametrize("kind", list(CASES), ids=lambda k: k.__name__)
def test_missing_file_reads_as_none(run, kind):
    _make, _write, read, path = CASES[kind]
    assert not path(run).exists()
    assert read(run) is None


@pytest.mark.parametrize("kind", list(CASES), ids=lambda k: k.__name__)
def test_torn_file_is_refused_naming_it(run, kind):
    make, write, read, path = CASES[kind]
    write(run, make())
    text = path(run).read_text()
    path(run).write_text(text[: len(text) // 2])        # what a non-atomic writer killed mid-write leaves
    with pytest.raises(RunDirError, match="not valid JSON") as e:
        read(run)
    assert str(path(run)) in str(e.value) and "Move it aside" in str(e.value)


@pytest.mark.parametrize("kind", list(CASES), ids=lambda k: k.__name__)
def test_foreign_file_is_refused_naming_the_field(run, kind):
    make, write, read, path = CASES[kind]
    write(run, make())
    path(run).write_text(json.dumps(["some", "other", "program"]))
    with pytest.raises(RunDirError, match="not a .* record") as e:
        read(run)
    assert str(path(run)) in str(e.value)
    # an object whose fields have the wrong types: the first typed field is named
    obj = make().to_json()
    field = next(k for k, v in obj.items() if isinstance(v, (int, float, list)) and not isinstance(v, bool))
    obj[field] = {"not": "this"}
    path(run).write_text(json.dumps(obj))
    with pytest.raises(RunDirError, match=f"field {field!r}"):
        read(run)


def test_a_phase_no_trainer_writes_is_refused(run):
    TrainerBeat(rank=0, step=1, phase=TrainerPhase.CLAIMING).write(run)
    obj = json.loads(run.heartbeat_file("trainer", 0).read_text())
    run.heartbeat_file("trainer", 0).write_text(json.dumps(dict(obj, phase="thinking")))
    with pytest.raises(RunDirError, match="'thinking'.*one of 'starting'"):
        TrainerBeat.read(run, 0)


def test_markers_and_what_they_mean(run):
    assert not Finished.present(run)
    Preempted(step=2).write(run)
    assert mark_finished(run, by="trainer") is False and not Finished.present(run)   # preempted is not finished
    Preempted.clear(run)
    assert mark_finished(run, by="trainer") and Finished.read(run).by == "trainer"
    j1 = JobRecord.start(run, "1", "slurm")
    j2 = JobRecord.start(run, "2", "slurm")
    assert (j2.starts, j2.first_started, j2.job_id) == (2, j1.first_started, "2")


def test_a_lease_is_created_only_where_there_is_none(run):
    first, second = LeaseRecord(token="a", renewed=1.0), LeaseRecord(token="b", renewed=2.0)
    assert first.create(run) and not second.create(run)          # link(2): the second launch is refused
    assert LeaseRecord.read(run).token == "a"
    assert not [p for p in run.state.iterdir() if p.name.startswith(".")]     # no temporary left behind
    second.write(run)                                              # a won takeover publishes over it
    assert LeaseRecord.read(run).token == "b" and LeaseRecord.read(run).age_s(now=12.0) == 10.0
    LeaseRecord.clear(run)
    assert LeaseRecord.read(run) is None and second.create(run)


def test_the_admission_rule():
    # 12 in flight, 0 ready, a group of 4, 8 per step: consumed one step after the next claim
    assert rule.admit(0, 12, 4, 8, 4, 2) == (rule.OK, 1.0)
    assert rule.admit(0, 12, 4, 8, 4, 2, lag=2) == (rule.ADMISSION_WAIT, 3.0)
    assert rule.admit(33, 0, 4, 8, 4, 9) == (rule.BACKPRESSURE, 33 / 8)
    beat = TrainerBeat(step=6, phase=TrainerPhase.CLAIMING)
    assert rule.next_claim_version(beat, 5) == 5
    assert rule.next_claim_version(TrainerBeat(step=6, phase=TrainerPhase.TRAINING), 5) == 6
    assert rule.next_claim_version(None, 5) == 5
    assert rule.version_gap(6, 3, 5) == 3 and rule.version_gap(6, None, 5) == 1 and rule.version_gap(2, 9, 9) == 0
    beats = [WorkerBeat(in_flight=4, time=100.0), WorkerBeat(in_flight=8, time=30.0)]
    assert rule.in_flight(beats, now=100.5, expiry_s=60.0) == 4


def test_worker_and_simulator_call_the_one_rule(run, monkeypatch):
    from neon_hpc import config
    from neon_hpc.plan.params import SimParams
    from neon_hpc.plan.sim import simulate
    from neon_hpc.rollout import worker
    from neon_hpc.rollout.sections import WorkerSections
    calls = []
    real = rule.admit
    monkeypatch.setattr(rule, "admit", lambda *a, **k: calls.append(a) or real(*a, **k))
    cfg = config.load(str(REPO / "configs" / "tiny_cpu.yaml"))
    assert worker.admission(run, WorkerSections.of(cfg), cfg.rollout.group_size)[0] == rule.OK
    assert len(calls) == 1
    simulate(SimParams(steps=3, policy="async", admission="steps_ahead", slot_mode="worker", rollout_slots=8,
                       group_size=4, trajectories_per_step=8, seed=0))
    assert len(calls) > 1


def test_shell_helper(run):
    def proto(*args):
        return subprocess.run([sys.executable, "-m", "neon_hpc.protocol", *args, str(run.root)],
                              capture_output=True, text=True, timeout=60)
    assert proto("path", "run-yaml").stdout.strip() == str(run.run_yaml)
    assert proto("preempted").returncode == 1
    Preempted(step=1).write(run)
    assert proto("preempted").returncode == 0
    out = proto("finish")
    assert out.returncode == 0 and "preempted" in out.stderr and not Finished.present(run)
    assert proto("clear-preempted").returncode == 0 and not Preempted.present(run)
    assert proto("finish").returncode == 0 and Finished.read(run).by == "launcher"


# --------------------------------------------------------------------------------------
# no run-directory file name or phase literal outside the protocol package

# the others are common words
DISTINCT_PHASES = {p.value for p in TrainerPhase} - {"starting", "training", "preempted", "done"}


# named in messages as a concept ("the run's run.yaml"), so only a path made of them counts
NAMED_IN_PROSE = (RUN_YAML, LATEST)


def _spells(s: str) -> bool:
    """``s`` builds a run-directory path: it is a file name, ends with one, or holds a state file's."""
    names = FILE_NAMES + (LATEST,)
    return any(s == n or s.endswith("/" + n) for n in names) or \
        any(n in s for n in FILE_NAMES if n not in NAMED_IN_PROSE)


def _label(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def _python_offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    docs = docstring_ids(tree)
    out = []
    for node in ast.walk(tree):
        where = f"{_label(path)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            s = node.value
            if _spells(s) or s in DISTINCT_PHASES:
                out.append(f"{where}: {s[:60]!r}")
        elif isinstance(node, ast.keyword) and node.arg == "phase" and isinstance(node.value, ast.Constant):
            out.append(f"{where}: phase={node.value.value!r}")
        elif isinstance(node, ast.JoinedStr):   # f"node{r}.json": the engine record's name
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if "node" in text and text.endswith(".json"):
                out.append(f"{where}: f-string {text!r}")
    return out


def _shell_offences(path: Path) -> list[str]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#SBATCH") else ""
        if any(n in code for n in FILE_NAMES + ("state/", "/" + LATEST)):
            out.append(f"{_label(path)}:{i}: {line.strip()[:80]}")
    return out


def test_no_run_directory_name_or_phase_outside_the_protocol():
    offences = []
    for top in ("neon_hpc", "tools", "sbatch"):
        for path in sorted((REPO / top).rglob("*")):
            if "protocol" in path.relative_to(REPO).parts or not path.is_file():
                continue
            if path.suffix == ".py":
                offences += _python_offences(path)
            elif path.suffix in (".sh", ".sbatch"):
                offences += _shell_offences(path)
    assert not offences, ("spelled outside neon_hpc/protocol (use its records and RunDir paths):\n"
                          + "\n".join(offences))


def test_the_scan_finds_what_it_looks_for(tmp_path):
    """The check above could pass by finding nothing: it must catch each kind of offence."""
    bad = tmp_path / "probe.py"
    bad.write_text('"""Mentions state/finished.json in prose: fine."""\n'
                   'a = run.state / "finished.json"\nb = hb.get("phase") == "claiming"\n'
                   'c = beat(phase="training")\nd = f"node{r}.json"\ne = "Run config: run.yaml here"\n')
    got = _python_offences(bad)
    assert len(got) == 4, got    # not the docstring, nor run.yaml named in a message
    sh = tmp_path / "probe.sbatch"
    sh.write_text('# a comment about state/finished.json\nrm -f "$RUN_DIR/state/trainer_preempted.json"\n')
    assert len(_shell_offences(sh)) == 1
