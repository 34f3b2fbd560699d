"""Stand-in for ``python -m sglang_router.launch_router --pd-disaggregation`` (see ../README.md)."""

from __future__ import annotations

import argparse
import itertools
import json
import random
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sglang_router.launch_router (neon-hpc test stand-in)")
    p.add_argument("--pd-disaggregation", action="store_true")
    p.add_argument("--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"))
    p.add_argument("--decode", nargs=1, action="append", default=[], metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--worker-startup-timeout-secs", type=int, default=600)
    a = p.parse_args(argv)
    if not a.pd_disaggregation:
        p.error("this stand-in only covers --pd-disaggregation")
    if not a.prefill or not a.decode:
        p.error("--pd-disaggregation needs at least one --prefill and one --decode")
    for spec in a.prefill:
        if len(spec) > 2 or (len(spec) == 2 and not spec[1].isdigit()):
            p.error(f"--prefill takes URL [BOOTSTRAP_PORT], got {spec}")
    for spec in a.prefill + a.decode:
        if "${" in spec[0] or not spec[0].startswith("http://"):
            p.error(f"bad worker URL {spec[0]!r}")
    return a


def _call(url: str, body: bytes | None, timeout: float = 600) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    prefill = [(s[0].rstrip("/"), int(s[1]) if len(s) > 1 else None) for s in a.prefill]
    decode = [s[0].rstrip("/") for s in a.decode]
    deadline = time.monotonic() + a.worker_startup_timeout_secs
    for url in [u for u, _ in prefill] + decode:
        while True:
            try:
                if _call(url + "/health", None, timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                print(f"worker {url} not healthy within {a.worker_startup_timeout_secs}s", flush=True)
                return 1
            time.sleep(0.5)
    print(f"stand-in router: prefill {prefill} decode {decode}", flush=True)
    rr_p, rr_d = itertools.cycle(prefill), itertools.cycle(decode)
    lock = threading.Lock()
    pool = ThreadPoolExecutor(64)
    counts = {"requests": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path in ("/health", "/readiness", "/liveness"):
                return self._send(200, b"")
            if self.path == "/stats":
                return self._send(200, json.dumps(counts).encode())
            return self._send(404, json.dumps({"error": {"message": f"no route GET {self.path}"}}).encode())

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b"{}"
            if self.path != "/generate":
                return self._send(404, json.dumps({"error": {"message": f"no route POST {self.path}"}}).encode())
            body = json.loads(raw)
            with lock:
                (p_url, p_boot), d_url = next(rr_p), next(rr_d)
                counts["requests"] += 1
            batch = isinstance(body.get("input_ids", [None])[0], list)
            n_req = len(body["input_ids"]) if batch else 1
            rooms = [random.getrandbits(63) for _ in range(n_req)]
            body["bootstrap_host"] = [urllib.parse.urlparse(p_url).hostname] * n_req if batch else \
                urllib.parse.urlparse(p_url).hostname
            body["bootstrap_port"] = [p_boot] * n_req if batch else p_boot
            body["bootstrap_room"] = rooms if batch else rooms[0]
            data = json.dumps(body).encode()
            fp = pool.submit(_call, p_url + "/generate", data)
            fd = pool.submit(_call, d_url + "/generate", data)
            (ps, pb), (ds, db) = fp.result(), fd.result()
            if ps != 200:
                return self._send(ps, pb)
            return self._send(ds, db)

    srv = ThreadingHTTPServer((a.host, a.port), Handler)
    srv.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=srv.shutdown, daemon=True).start())
    print(f"stand-in router listening on http://{a.host}:{a.port}", flush=True)
    srv.serve_forever()
    print(f"stand-in router: served {counts['requests']} /generate requests", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
