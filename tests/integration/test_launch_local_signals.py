"""The local launcher's Ctrl-C (``launch/local.py`` through ``procutil.StopFlag``): the first
signal asks the trainer to checkpoint (SIGTERM) and lets the roles stop by themselves; a
second one kills every process of the run at once. Real child processes stand in for the
roles (the launcher only signals, waits for and kills them), real signals reach the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from neon_hpc import config
from neon_hpc.launch.local import TERM_GRACE_S, LocalRun
from neon_hpc.protocol.records import Finished
from neon_hpc.protocol.rundir import RunDir
from repo_paths import REPO

# a "trainer": says it is ready, then on SIGTERM either records it and exits 0 (it checkpointed)
# or ignores it (stuck in a long save)
ROLE = r"""
import signal, sys, time, pathlib
ready, got, ignore = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3] == "ignore"
def on_term(*_):
    got.write_text("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else on_term)
ready.write_text("up")
time.sleep(600)
"""


def _launcher(tmp_path: Path, how: str) -> tuple[LocalRun, Path, Path]:
    cfg = config.load(str(REPO / "configs" / "tiny_cpu.yaml"))
    run = RunDir(tmp_path / "run").create()
    lr = LocalRun(cfg, run, quiet=True)
    ready, got = tmp_path / "ready", tmp_path / "got"
    lr.trainers.append(subprocess.Popen([sys.executable, "-c", ROLE, str(ready), str(got), how],
                                        start_new_session=True))
    return lr, ready, got


def _interrupted_wait(lr: LocalRun, ready: Path, times: int, gap_s: float = 1.5) -> int:
    """The launcher's wait() while this process gets SIGINT ``times`` times once the role is up
    (from a thread; Python runs the handler in the main thread, inside wait())."""
    def send():
        while not ready.exists():
            time.sleep(0.05)
        for i in range(times):
            if i:
                time.sleep(gap_s)
            os.kill(os.getpid(), signal.SIGINT)
    lr.stop_flag.install()
    try:
        threading.Thread(target=send, daemon=True).start()
        return lr.wait()
    finally:
        lr.stop_flag.restore()


def _log(lr: LocalRun) -> str:
    return (lr.run.log_dir("launcher") / "0.log").read_text()


def test_first_ctrl_c_asks_the_trainer_to_stop_and_waits_for_it(tmp_path):
    lr, ready, got = _launcher(tmp_path, "checkpoint")
    rc = _interrupted_wait(lr, ready, 1)
    assert rc == 130 and lr.interrupted and not lr.stop_flag.escalated
    assert got.read_text() == "SIGTERM" and lr.trainers[0].returncode == 0    # it stopped by itself
    assert not Finished.present(lr.run)                                        # interrupted is not finished
    assert lr.stop_grace() == TERM_GRACE_S
    assert "SIGINT: asking the trainer to checkpoint" in _log(lr) and "again: killing" not in _log(lr)


def test_second_ctrl_c_kills_every_process_at_once(tmp_path):
    lr, ready, got = _launcher(tmp_path, "ignore")
    before = signal.getsignal(signal.SIGINT)   # SIG_IGN when the suite runs in the background (CI)
    rc = _interrupted_wait(lr, ready, 2)
    assert rc == 130 and lr.stop_flag.escalated and lr.stop_flag.count == 2
    assert lr.stop_grace() == 0.0
    assert lr.trainers[0].returncode == -signal.SIGKILL and not got.exists()  # it ignored SIGTERM: killed
    log = _log(lr)
    assert "SIGINT: asking the trainer to checkpoint" in log and "SIGINT again: killing every process" in log
    assert signal.getsignal(signal.SIGINT) is before    # restored


def test_stop_flag_calls_on_again_from_the_second_signal_on():
    from neon_hpc.util.procutil import StopFlag
    first, again = [], []
    flag = StopFlag((signal.SIGUSR1,), on_signal=first.append, on_again=again.append).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert (first, again, flag.count, flag.escalated) == ([signal.SIGUSR1], [], 1, False)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert (first, again, flag.count, flag.escalated) == ([signal.SIGUSR1], [signal.SIGUSR1] * 2, 3, True)
    finally:
        flag.restore()
    plain = []
    flag = StopFlag((signal.SIGUSR1,), on_signal=plain.append).install()   # no on_again: on_signal each time
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert plain == [signal.SIGUSR1] * 2 and flag.escalated
    finally:
        flag.restore()
