"""Starting and stopping an embedded engine (a child process or a thread), and its CLI."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from neon_hpc.rollout.engines.embedded.scheduler import REQUEST_TIME_BUDGET_S
from neon_hpc.rollout.engines.embedded.server import EngineServer, serve
from neon_hpc.util.procutil import StopFlag, child_setup, stop_tree


@dataclass
class ServerHandle:
    """A running engine: ``url``; ``stop()`` ends it (and its process, if it has one)."""

    url: str
    process: subprocess.Popen | None = None
    server: EngineServer | None = None
    thread: threading.Thread | None = None

    def stop(self, timeout: float = 10.0) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.scheduler.close()
            self.server.server_close()
        if self.process is not None:
            stop_tree([self.process], timeout)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(model_path: str | os.PathLike, host: str = "127.0.0.1", port: int = 0,
                 max_batch_size: int = 16, in_process: bool = False, weight_version: str | None = None,
                 allowed_root: str | None = None, startup_timeout: float = 120.0) -> ServerHandle:
    """Start an engine on ``model_path`` and wait until it answers ``/health``.

    By default in a child process (``python -m neon_hpc.rollout.engines.embedded``), so it can
    be killed like a real server; ``in_process=True`` runs it on a thread of this process.
    """
    if in_process:
        srv = serve(str(model_path), host, port, max_batch_size, weight_version, allowed_root)
        t = threading.Thread(target=srv.serve_forever, name="engine-http", daemon=True)
        t.start()
        return ServerHandle(url=srv.url, server=srv, thread=t)
    cmd = [sys.executable, "-m", "neon_hpc.rollout.engines.embedded", "--model", str(model_path),
           "--host", host, "--port", str(port), "--max-batch-size", str(max_batch_size)]
    if weight_version is not None:
        cmd += ["--weight-version", str(weight_version)]
    if allowed_root is not None:
        cmd += ["--allowed-root", str(allowed_root)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=child_setup())  # dies with its owner
    deadline = time.monotonic() + startup_timeout
    url = None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("LISTENING "):
            url = line.split()[1]
            break
    if url is None:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"embedded engine on {model_path} did not start (exit code {proc.returncode}); "
                           f"run `neon-hpc engine serve --model {model_path}` to see why")
    # keep draining stdout so the child never blocks on a full pipe
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return ServerHandle(url=url, process=proc)


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="neon-hpc engine serve",
                                description="Serve an HF MoE on CPU behind SGLang's /generate API subset.")
    p.add_argument("--model", required=True, help="HF weights folder (config.json + model.safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=int, default=0, help="0 = pick a free port (printed on stdout)")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--weight-version", default=None, help="version of the initial weights (default: from v_N, else 0)")
    p.add_argument("--allowed-root", default=None,
                   help="refuse update_weights_from_disk outside this folder (default: the weights directory "
                        "holding --model, e.g. RUN/weights for RUN/weights/v_0)")
    p.add_argument("--max-new-tokens-cap", type=_positive_int, default=None,
                   help="refuse requests asking for more new tokens (default: the model's context)")
    p.add_argument("--request-time-budget-s", type=float, default=REQUEST_TIME_BUDGET_S,
                   help="a request generating longer is ended with finish_reason abort (0 = no budget)")
    a = p.parse_args(argv)
    if not (a.request_time_budget_s >= 0 and a.request_time_budget_s != float("inf")):
        p.error(f"--request-time-budget-s: expected a finite number >= 0, got {a.request_time_budget_s}")
    allowed_root = a.allowed_root if a.allowed_root is not None else str(Path(a.model).resolve().parent)
    if not (Path(a.model) / "config.json").exists():
        print(f"neon-hpc engine serve: {a.model}/config.json not found; point --model at an HF weights "
              f"folder such as RUN/weights/v_0", file=sys.stderr)
        return 2
    srv = serve(a.model, a.host, a.port, a.max_batch_size, a.weight_version, allowed_root,
                a.max_new_tokens_cap, a.request_time_budget_s or None)
    print(f"LISTENING {srv.url} weight_version={srv.scheduler.version}", flush=True)
    StopFlag((signal.SIGTERM,),
             on_signal=lambda _: threading.Thread(target=srv.shutdown, daemon=True).start()).install()
    # Slurm's pre-timeout SIGUSR1 reaches every process of a job step; it asks the trainer to
    # checkpoint and workers to flush. An engine has nothing to save: its owner stops it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.scheduler.close()
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
