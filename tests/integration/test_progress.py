"""Progress bars draw on a terminal and stay out of logs and pipes (neon_hpc/util/progress.py)."""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path


def _tasks_cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "neon_hpc.cli", "xrd", "tasks", "--preset", "tiny", "--split", "train",
            "--n", "3", "--no-real", "--out", str(out)]


def test_task_building_shows_a_bar_on_a_terminal(tmp_path):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))   # a terminal has a size
    env = {k: v for k, v in os.environ.items() if k != "NEON_PROGRESS"}
    p = subprocess.Popen(_tasks_cmd(tmp_path / "a"), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:          # the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    assert p.wait(300) == 0
    os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    assert "tasks tiny/train" in text and "3/3" in text, text[-2000:]


def test_no_bar_when_stderr_is_not_a_terminal(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NEON_PROGRESS"}
    r = subprocess.run(_tasks_cmd(tmp_path / "b"), capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "3/3" not in r.stderr and "\r" not in r.stderr
