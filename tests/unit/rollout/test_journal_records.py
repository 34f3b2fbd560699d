"""The episode journal (issue 41), in process: the record format refuses what it did not write, an
episode stopped at a turn boundary resumes exactly (same tokens, logprobs, versions and routes as
the journalled prefix; routes asked only from the resume point on), environments snapshot and
restore (digits, XRD), a corrupt record is quarantined naming its file while the others resume,
and records go only once the group's shard is committed."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from neon_hpc.envs.digits.plugin import DigitsEnv, DigitsTask
from neon_hpc.protocol.journal import JournalCorrupt, JournalRecord, read_meta, read_record, write_record
from neon_hpc.protocol.rundir import RunDir
from neon_hpc.rollout import journal as jr
from neon_hpc.rollout.agent.episode import Episode, EpisodeStopped
from test_agent_episode import CFG, TOK, ScriptedClient, ToyEnv


class Log:
    def __init__(self):
        self.errors = []

    def error(self, msg, *args):
        self.errors.append(msg % args)


def _record():
    return JournalRecord({"uid": "w0-1", "turn": 3, "texts": ["a", "b"]},
                         {"tokens": np.arange(10, dtype=np.int32), "routed_experts": np.ones((10, 2, 2), np.int32),
                          "logprobs": np.linspace(-1, 0, 10).astype(np.float32)})


def test_record_round_trips_exactly(tmp_path):
    p = tmp_path / "e0.jrec"
    write_record(p, _record())
    back = read_record(p)
    assert back.meta == _record().meta and read_meta(p) == _record().meta
    for k, a in _record().arrays.items():
        assert back.arrays[k].dtype == a.dtype and np.array_equal(back.arrays[k], a)


@pytest.mark.parametrize("damage,needle", [
    (lambda b: b[: len(b) // 2], "truncated"),
    (lambda b: b[:20], "truncated"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "digest mismatch"),
    (lambda b: b"XXXXXXXX" + b[8:], "bad magic"),
    (lambda b: b + b"\0", "truncated or padded"),
])
def test_a_damaged_record_is_refused_naming_its_file(tmp_path, damage, needle):
    p = tmp_path / "e0.jrec"
    write_record(p, _record())
    p.write_bytes(damage(p.read_bytes()))
    with pytest.raises(JournalCorrupt, match=needle) as e:
        read_record(p)
    assert str(p) in str(e.value)


def test_object_arrays_are_refused():
    with pytest.raises(TypeError, match="dtype object"):
        JournalRecord({}, {"x": np.array([{"a": 1}], dtype=object)}).encode()


# --- one episode, stopped at a turn boundary and resumed ---------------------------------------
SCRIPT = ["hmm", "<tool_call>lookup</tool_call>", "thinking more", "<answer>42</answer>"]
CFG6 = replace(CFG, max_turns=6)


def _stopped_after(turns, env, client, tmp_path):
    """Run an episode until ``turns`` turns are done, stop it at the boundary; its last record."""
    ep = Episode(client, env, TOK, CFG6)
    ev, records = threading.Event(), []

    def boundary(e):
        records.append(jr.episode_record(e, jr.Slot("w0-7", "g1", 0, 1, env.task_id)))
        if e.turn == turns:
            ev.set()
    ep.on_boundary, ep.stop_event = boundary, ev
    with pytest.raises(EpisodeStopped):
        ep.run()
    p = tmp_path / "e0.jrec"
    write_record(p, records[-1])
    return read_record(p)


@pytest.mark.parametrize("turns", [1, 2, 3])
def test_a_resumed_episode_keeps_its_prefix_and_asks_routes_from_the_resume_point(tmp_path, turns):
    whole = Episode(ScriptedClient(SCRIPT), ToyEnv(), TOK, CFG6).run().trajectory()
    rec = _stopped_after(turns, ToyEnv(), ScriptedClient(SCRIPT), tmp_path)
    prefix = len(rec.arrays["tokens"])
    assert rec.meta["turn"] == turns and not rec.meta["done"]
    client = ScriptedClient(SCRIPT[turns:])
    ep = jr.restore_episode(Episode(client, ToyEnv(), TOK, CFG6), rec)
    tr = ep.run().trajectory()
    # the same conversation as one uninterrupted run (a scripted engine: the same outputs)
    assert np.array_equal(tr.tokens, whole.tokens) and np.array_equal(tr.turn_offsets, whole.turn_offsets)
    # the journalled prefix is kept token for token: logprobs, versions, routes
    for k, a in (("tokens", tr.tokens), ("loss_mask", tr.loss_mask), ("logprobs", tr.logprobs),
                 ("versions", tr.versions)):
        assert np.array_equal(a[:prefix], rec.arrays[k]), k
    pinned = len(rec.arrays["cache_tokens"]) - 1
    assert np.array_equal(tr.routed_experts[:pinned], rec.arrays["routed_experts"][:pinned])
    # the first request after the resume re-sends the whole prefix and asks routes from its end on
    ids, _sp, start = client.requests[0]
    assert ids == rec.arrays["tokens"].tolist() and start == pinned
    assert tr.metadata["answer"] == "42" and ep.resumes == 1


def test_a_full_export_after_a_resume_keeps_the_recorded_routes(tmp_path):
    rec = _stopped_after(2, ToyEnv(), ScriptedClient(SCRIPT), tmp_path)
    ep = jr.restore_episode(Episode(ScriptedClient(SCRIPT[2:]), ToyEnv(), TOK, CFG6, replay="full"), rec)
    rec.arrays["routed_experts"][:] = 0        # the recorded rows differ from what a recompute returns
    ep.conv.cache.routed_experts = rec.arrays["routed_experts"].copy()
    tr = ep.run().trajectory()
    pinned = len(rec.arrays["cache_tokens"]) - 1
    assert (tr.routed_experts[:pinned] == 0).all() and (tr.routed_experts[pinned:-1] != 0).any()


def test_digits_snapshot_and_restore():
    task = DigitsTask("digits-train-0-0-3+4", 3, 4, "train")
    env = DigitsEnv(task)
    fresh = DigitsEnv(task)
    fresh.restore(env.snapshot())
    assert fresh.snapshot() == env.snapshot()
    with pytest.raises(ValueError, match="restored into digits task"):
        DigitsEnv(DigitsTask("other", 1, 1, "train")).restore(env.snapshot())


def test_a_resumed_xrd_episode_has_the_state_it_was_saved_with():
    from neon_hpc.envs.xrd.env import XRDEnv
    from neon_hpc.envs.xrd.science.tasks import load_tasks
    from neon_hpc.rollout.agent.parse import ToolCall
    task = load_tasks("tiny", "train", n=1)[0]
    env = XRDEnv(task, style="compact")
    env.task_text()                                          # the candidates the prompt lists
    ids = [env.candidates()[0][0]]
    fit = env.run_tool(ToolCall("fit_phases", {"phases": ids}))
    assert "error" not in fit, fit
    state = env.snapshot()
    back = XRDEnv(task, style="compact")
    back.restore(state)
    assert back.snapshot() == state
    # the tools see the same state: the last fit (what simulate_phase reports from) is the same
    a, b = env.ctx.cache["_last_fit"][1], back.ctx.cache["_last_fit"][1]
    assert a.rwp == pytest.approx(b.rwp, rel=1e-9) and back.task_text() == env.task_text()
    sim = ToolCall("simulate_phase", {"phase": ids[0]})
    assert back.run_tool(sim) == env.run_tool(sim)


def test_an_environment_without_snapshot_gets_its_tool_calls_replayed(tmp_path):
    class Counting(ToyEnv):
        calls = 0

        def run_tool(self, call):
            type(self).calls += 1
            return super().run_tool(call)
    rec = _stopped_after(3, Counting(), ScriptedClient(SCRIPT), tmp_path)
    assert rec.meta["env_state"] is None
    Counting.calls = 0
    jr.restore_episode(Episode(ScriptedClient([]), Counting(), TOK, CFG6), rec)
    assert Counting.calls == 1         # the one recorded tool call, replayed


# --- a worker's journal: quarantine, take-over, removal after the commit -------------------------
def _journalled(run, worker, group, n):
    """A group of ``n`` episodes journalled at their first turn boundary, stopped there."""
    j = jr.Journal(run, worker, fsync=False)
    for i in range(n):
        ep = Episode(ScriptedClient(SCRIPT), ToyEnv(), TOK, CFG6)
        ep.on_boundary = lambda e, s=jr.Slot(f"w{worker}-{group}-{i}", group, i, n, "toy-1"): j.write(e, s)
        ep.stop_event = threading.Event()
        ep.stop_event.set()
        with pytest.raises(EpisodeStopped):
            ep.run()
    assert j.drain() and j.stats.writes == n
    return j


def test_a_corrupt_record_is_quarantined_and_the_others_resume(tmp_path):
    run = RunDir(tmp_path / "run")
    _journalled(run, 0, "gA", 2)
    _journalled(run, 0, "gB", 2)
    bad = run.journal_record("w0", "gA", 1)
    bad.write_bytes(bad.read_bytes()[:-7])
    log = Log()
    groups, quarantined = jr.Journal(run, 0).take_over(2, log)
    assert {g.group_id: sorted(g.records) for g in groups} == {"gA": [0], "gB": [0, 1]}
    assert [q["path"] for q in quarantined] == [str(bad)] and "truncated" in quarantined[0]["reason"]
    assert str(bad) in log.errors[0] and "quarantined" in log.errors[0]
    moved = run.journal_quarantine / "w0.gA.e1.jrec"
    assert moved.exists() and "truncated" in moved.with_name(moved.name + ".reason.txt").read_text()


def test_a_record_of_the_old_schema_is_quarantined_naming_both_schemas(tmp_path):
    """Schema 1 named the arrays ``mask`` and ``routes``; schema 2 uses the shard's words
    (``loss_mask``, ``routed_experts``): an old record is refused, not misread."""
    run = RunDir(tmp_path / "run")
    _journalled(run, 0, "gA", 1)
    p = run.journal_record("w0", "gA", 0)
    rec = read_record(p)
    a = dict(rec.arrays)
    a["mask"] = a.pop("loss_mask")
    write_record(p, JournalRecord({**rec.meta, "schema": 1}, a))
    groups, quarantined = jr.Journal(run, 0).take_over(1, Log())
    assert groups == [] and [q["path"] for q in quarantined] == [str(p)]
    assert f"record schema 1, this neon-hpc writes {jr.SCHEMA}" in quarantined[0]["reason"]


def test_a_missing_worker_index_is_adopted_once(tmp_path):
    run = RunDir(tmp_path / "run")
    _journalled(run, 3, "gC", 1)          # a worker index the restarted run no longer has (2 workers)
    assert jr.Journal(run, 0).take_over(2, Log())[0] == []
    got = jr.Journal(run, 1).take_over(2, Log())[0]       # 3 % 2 == 1
    assert [g.group_id for g in got] == ["gC"] and (run.journal_owner("w1") / "gC").is_dir()
    assert not (run.journal_owner("w3") / "gC").exists()


def test_records_go_only_when_the_shard_is_committed(tmp_path):
    run = RunDir(tmp_path / "run")
    j = _journalled(run, 0, "gD", 2)
    j.added("gD")
    assert run.journal_group("w0", "gD").is_dir()      # in the writer's buffer: still journalled
    assert j.committed() == 1 and not run.journal_group("w0", "gD").exists()


def test_the_writer_thread_coalesces_and_a_failure_reaches_the_episodes(tmp_path):
    run = RunDir(tmp_path / "run")
    j = jr.Journal(run, 0, fsync=True)
    ep = Episode(ScriptedClient(SCRIPT), ToyEnv(), TOK, CFG6)
    slot = jr.Slot("w0-x-0", "gE", 0, 1, "toy-1")
    for _ in range(20):
        j.write(ep, slot)
    assert j.drain() and j.stats.writes + j.stats.coalesced == 20
    assert read_record(run.journal_record("w0", "gE", 0)).meta["uid"] == "w0-x-0"
    (run.journal_owner("w0") / "gF").write_text("a file where the group's directory goes")
    j.write(ep, jr.Slot("w0-x-1", "gF", 0, 1, "toy-1"))
    j.drain()
    with pytest.raises(RuntimeError, match="the episode journal stopped writing"):
        j.write(ep, slot)


def test_a_group_published_before_its_records_went_never_trains_twice(tmp_path):
    """A worker killed between its shard's commit and the removal of the group's records: the
    restarted worker publishes the group again from the journal, under the same uids; the
    store's uid window skips them (counted) and nothing trains twice."""
    from neon_hpc.config.store import StoreConfig
    from neon_hpc.store import ShardWriter, claim_step
    run = RunDir(tmp_path / "run")
    j = jr.Journal(run, 0, fsync=False)
    slots = [jr.Slot(f"w0-dup-{i}", "gG", i, 2, "toy-1") for i in range(2)]
    with ShardWriter(run, "w0-first", StoreConfig(fsync=False)) as w:
        for s in slots:
            ep = Episode(ScriptedClient(SCRIPT), ToyEnv(), TOK, CFG6)
            ep.on_boundary = lambda e, s=s: j.write(e, s)
            tr = ep.run().trajectory(group_id="gG")
            tr.metadata["uid"] = s.uid
            w.add(tr)
    j.drain()
    first = claim_step(run.root, 0, want=2, consumer="trainer-0", timeout_s=0)
    assert sorted(t.metadata["uid"] for t in first.trajectories) == ["w0-dup-0", "w0-dup-1"]
    # ... the worker died before j.committed(): its successor finds the finished group and publishes it
    (r,), _ = jr.Journal(run, 0).take_over(1, Log())
    group = jr.resumed_group(r, lambda: Episode(ScriptedClient([]), ToyEnv(), TOK, CFG6))
    assert all(ep.done for ep, _ in group.episodes)
    with ShardWriter(run, "w0-second", StoreConfig(fsync=False)) as w:
        for ep, s in group.episodes:
            tr = ep.trajectory(group_id=s.group_id)
            tr.metadata["uid"] = s.uid
            w.add(tr)
        for i in range(2):       # the successor's fresh episodes after it
            tr = Episode(ScriptedClient(SCRIPT), ToyEnv(), TOK, CFG6).run().trajectory(group_id="gH")
            tr.metadata["uid"] = f"w0-fresh-{i}"
            w.add(tr)
    again = claim_step(run.root, 1, want=2, consumer="trainer-0", timeout_s=0)
    assert [t.metadata["uid"] for t in again.trajectories] == ["w0-fresh-0", "w0-fresh-1"]
    assert again.duplicates == 2
