"""A local HTTP server that answers like an SGLang server and records every POST body (tests only)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from neon_hpc.util.netutil import free_port


class RecordingServer(ThreadingHTTPServer):
    """``GET /health`` answers 200; ``POST /generate`` one output token; other POSTs ``success``.
    ``posts`` holds ``(path, body)`` in arrival order; ``bodies`` only the /generate ones."""

    def __init__(self):
        self.posts: list[tuple[str, dict]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code: int, obj: dict) -> None:
                raw = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/health":
                    return self._send(200, {})
                self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                server.posts.append((self.path, body))
                if self.path != "/generate":
                    return self._send(200, {"success": True, "message": "ok", "num_paused_requests": 0})
                self._send(200, {"output_ids": [7], "meta_info": {
                    "id": body.get("rid", "x"), "finish_reason": {"type": "length", "length": 1},
                    "prompt_tokens": len(body["input_ids"]), "completion_tokens": 1, "cached_tokens": 0,
                    "weight_version": "0", "output_token_logprobs": [[-0.5, 7, None]]}})

        super().__init__(("127.0.0.1", free_port()), Handler)
        self.daemon_threads = True
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    @property
    def bodies(self) -> list[dict]:
        return [b for p, b in self.posts if p == "/generate"]
