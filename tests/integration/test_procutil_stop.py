"""procutil.stop_tree (the one terminate -> wait -> kill) and StopFlag (the one signal handler),
on real processes: a child, and a grandchild that ignores SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from neon_hpc.util.procutil import StopFlag, stop_tree
from repo_paths import REPO

# the child starts a grandchild that ignores SIGTERM (and says so in a file if it gets one),
# prints the grandchild's pid, then waits; on SIGTERM the child exits 0 (or ignores it too)
CHILD = r"""
import signal, subprocess, sys, time
mark, child_mode = sys.argv[1], sys.argv[2]
grand = subprocess.Popen([sys.executable, "-c",
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1], 'w').write('TERM'))\n"
    "print('ready', flush=True)\n"
    "time.sleep(300)\n", mark], stdout=subprocess.PIPE, text=True)
grand.stdout.readline()
if child_mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print(grand.pid, flush=True)
time.sleep(300)
"""


def _start(tmp_path, child_mode: str) -> tuple[subprocess.Popen, psutil.Process, Path]:
    mark = tmp_path / f"grandchild-got-sigterm-{child_mode}"
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(mark), child_mode], stdout=subprocess.PIPE, text=True,
                         cwd=REPO)
    return p, psutil.Process(int(p.stdout.readline())), mark


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def cleanup():
    procs: list = []
    yield procs
    for p in procs:
        try:
            p.kill()
        except (psutil.Error, ProcessLookupError):
            pass


def test_a_grandchild_that_ignores_sigterm_is_killed_and_the_childs_exit_code_kept(tmp_path, cleanup):
    child, grand, mark = _start(tmp_path, "exit")
    cleanup += [child, grand]
    killed = []
    done = stop_tree([child], grace_s=2.0, on_kill=killed.append)
    assert child.returncode == 0                 # its SIGTERM handler's exit code, reaped through Popen
    assert mark.read_text() == "TERM"            # signal_children: the grandchild was asked first
    assert done.killed == [grand.pid] and killed == [grand.pid] and done.stuck == []
    assert _gone(grand)


def test_a_child_that_ignores_sigterm_is_killed_with_its_tree(tmp_path, cleanup):
    child, grand, mark = _start(tmp_path, "ignore")
    cleanup += [child, grand]
    killed = []
    done = stop_tree([child], grace_s=1.0, on_kill=killed.append)
    assert child.returncode == -signal.SIGKILL
    assert set(done.killed) == {child.pid, grand.pid} and set(killed) == {child.pid, grand.pid}
    assert _gone(grand)


def test_roots_only_leaves_the_children_to_their_parent_then_kills_what_is_left(tmp_path, cleanup):
    """signal_children=False (the launcher's roles): SIGTERM reaches only the root; a descendant
    still there once the root is done is SIGKILLed, never sent SIGTERM."""
    child, grand, mark = _start(tmp_path, "exit")
    cleanup += [child, grand]
    done = stop_tree([child], grace_s=2.0, signal_children=False)
    assert child.returncode == 0
    assert not mark.exists()
    assert done.killed == [grand.pid] and _gone(grand)


def test_an_ended_process_is_only_reaped(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    p.wait()
    done = stop_tree([p], grace_s=0.0)
    assert p.returncode == 3 and done.killed == [] and done.stuck == []


def test_process_groups_catch_a_descendant_orphaned_before_the_stop(tmp_path, cleanup):
    """A grandchild whose parent exited earlier is re-parented away from the tree; the root's
    process group (start_new_session) still holds it."""
    code = ("import subprocess, sys, time\n"
            "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)'])\n"
            "print(g.pid, flush=True)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    orphan = psutil.Process(int(p.stdout.readline()))
    cleanup.append(orphan)
    p.wait()
    stop_tree([p], grace_s=0.0, process_groups=True)
    orphan_gone = False
    try:
        orphan.wait(timeout=10)
        orphan_gone = True
    except psutil.TimeoutExpired:
        pass
    assert orphan_gone or _gone(orphan)


def test_stop_flag_records_the_latest_signal_calls_back_and_restores():
    seen = []
    before = signal.getsignal(signal.SIGUSR1)
    flag = StopFlag((signal.SIGUSR1, signal.SIGUSR2), on_signal=seen.append).install()
    try:
        assert not flag.requested and flag.name is None
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.requested and flag.name == "SIGUSR1" and flag.signum == signal.SIGUSR1
        assert seen == [signal.SIGUSR2, signal.SIGUSR1]
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGUSR1) == before
