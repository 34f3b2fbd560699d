"""TensorBoard and W&B sinks: what a role writes to metrics.jsonl is what the event files and the
W&B offline run hold, read back with TensorBoard's own reader and W&B's own record schema."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from neon_hpc.config.logging import LoggingConfig
from neon_hpc.util import logsinks
from neon_hpc.util.logs import RoleLogger, read_metrics
from repo_paths import REPO


def tb_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_history(run_file: Path, timeout_s: float = 60.0) -> list[dict[str, float]]:
    """History rows of a finished W&B offline run file, waiting for its ``exit`` record
    (W&B's service process writes the file; ``finish()`` can return before it is done)."""
    end = time.monotonic() + timeout_s
    while True:
        rows, finished = _read_wandb(run_file)
        if finished or time.monotonic() > end:
            assert finished, f"{run_file}: no exit record after {timeout_s} s"
            return rows
        time.sleep(0.5)


def _read_wandb(run_file: Path) -> tuple[list[dict[str, float]], bool]:
    """History rows of a W&B offline ``run-*.wandb`` file.

    The file is W&B's record log: a 7-byte header (``:W&B``, magic 0xBEE1, version), then
    32 KiB blocks of records, each with a 7-byte header (CRC-32 of type+data, little-endian
    length, type: 1 full, 2 first, 3 middle, 4 last); a block tail under 7 bytes is padding.
    Each assembled record is a ``wandb.proto.wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2 as pb
    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file}: not a W&B record log"
    block, pos, parts, rows, finished = 32768, 7, b"", [], False
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left          # zero padding up to the block end
            continue
        chunk = data[pos + 7:pos + 7 + length]
        if len(chunk) < length:
            break                # the writer is still appending this record
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"{run_file}: bad record CRC at {pos}"
        pos += 7 + length
        parts += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            parts = b""
            kind_name = rec.WhichOneof("record_type")
            finished |= kind_name == "exit"
            if kind_name == "history":
                rows.append({(it.key or "/".join(it.nested_key)): json.loads(it.value_json)
                             for it in rec.history.item})
    return rows, finished


def _write_records(tmp_path: Path, cfg: LoggingConfig) -> list[dict]:
    logsinks.configure(cfg)
    try:
        log = RoleLogger.open(tmp_path, "trainer", 0, echo=False)
        log.metrics(event="started")                         # before any step: not a scalar
        for step in (1, 2, 3):
            log.set(step=step)
            log.metrics(loss=1.0 / step, reward={"mean": 0.1 * step, "success": step > 1},
                        note="text is not a scalar", bad=float("nan"))
        log.close()
    finally:
        logsinks.configure(None)
    return [r for r in read_metrics(tmp_path, "trainer") if "loss" in r]


def test_tensorboard_event_files_hold_every_numeric_metric(tmp_path):
    recs = _write_records(tmp_path, LoggingConfig(tensorboard=True))
    got = tb_scalars(tmp_path / "logs" / "tb" / "trainer.0")
    assert set(got) == {"trainer/loss", "trainer/reward/mean", "trainer/reward/success"}
    assert got["trainer/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in recs]
    assert [v for _, v in got["trainer/reward/success"]] == [0.0, 1.0, 1.0]


def test_wandb_offline_run_holds_the_same_metrics_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    recs = _write_records(tmp_path, LoggingConfig(wandb="offline"))
    runs = sorted((tmp_path / "logs" / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    rows = [r for r in wandb_history(runs[0]) if "trainer/loss" in r]
    assert [r["_step"] for r in rows] == [r["step"] for r in recs]
    assert [r["trainer/loss"] for r in rows] == pytest.approx([r["loss"] for r in recs])
    assert [r["trainer/reward/mean"] for r in rows] == pytest.approx([0.1, 0.2, 0.3])


def test_wandb_online_without_credentials_is_refused_by_config_check(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    env["NETRC"] = str(tmp_path / "no-netrc")
    r = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "config", "check", str(REPO / "configs/tiny_cpu.yaml"),
                        "--set", "logging.wandb=online"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "logging.wandb" in r.stderr and "WANDB_API_KEY" in r.stderr


@pytest.mark.slow
def test_main_job_writes_trainer_and_rollout_metrics_to_tensorboard_and_wandb(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, WANDB_MODE="offline")
    env.pop("WANDB_API_KEY", None)
    r = subprocess.run([sys.executable, "-m", "neon_hpc.cli", "run", str(REPO / "configs/tiny_cpu.yaml"),
                        "--run-dir", str(run), "--set", "train.steps=2", "--set", "logging.tensorboard=true",
                        "--set", "logging.wandb=offline", "--set", "warm_start.enabled=false",
                        "--set", "eval.num_tasks=0"], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    trainer = tb_scalars(run / "logs" / "tb" / "trainer.0")
    steps = [rec["step"] for rec in read_metrics(run, "trainer") if "loss" in rec]
    assert [s for s, _ in trainer["trainer/loss"]] == steps and steps[-1] == 2
    worker_dirs = sorted((run / "logs" / "tb").glob("rollout.*"))
    assert worker_dirs, "no rollout worker wrote TensorBoard events"
    assert any(tb_scalars(d) for d in worker_dirs)
    runs = sorted((run / "logs" / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    names = {p.parent.name for p in runs}
    assert len(runs) >= 2, names   # the trainer and at least one rollout role
    # the trainer finishes its W&B run; a role the launcher stops may end before W&B writes its
    # exit record (W&B then shows the run as crashed), but what it logged is in the file
    histories = {p: _read_wandb(p) for p in runs}
    trainer = [p for p, (rows, _) in histories.items() if any("trainer/loss" in r for r in rows)]
    assert len(trainer) == 1
    trainer_rows = [row for row in wandb_history(trainer[0]) if "trainer/loss" in row]
    assert [row["_step"] for row in trainer_rows] == steps
    assert any(rows for p, (rows, _) in histories.items() if p != trainer[0])
