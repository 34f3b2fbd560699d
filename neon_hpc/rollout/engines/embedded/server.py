"""The HTTP side: SGLang's endpoints, request framing and admission, in front of a scheduler."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from neon_hpc.rollout.engines import wire
from neon_hpc.rollout.engines.embedded.model import LoadedModel
from neon_hpc.rollout.engines.embedded.scheduler import PAUSE_MODES, REQUEST_TIME_BUDGET_S, Scheduler
from neon_hpc.rollout.engines.wire import BadRequest, GenerateRequest
from neon_hpc.util.bounded import MESSAGE_CAP, clip_text, short_repr

MAX_BODY_BYTES = 64 << 20


class EngineServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog is 5: a burst of rollout workers would see resets.
    request_queue_size = 1024

    def __init__(self, addr, scheduler: Scheduler, allowed_root: str | None = None,
                 max_new_tokens_cap: int | None = None):
        super().__init__(addr, _Handler)
        self.scheduler = scheduler
        self.allowed_root = allowed_root
        self.max_new_tokens_cap = max_new_tokens_cap   # None = the model's context
        self.swap_lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: EngineServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: one line per request is noise at RL rates
        pass

    # --- plumbing ---------------------------------------------------------------------
    def _send(self, status: int, obj: Any) -> None:
        body = b"" if obj is None else json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": clip_text(message, MESSAGE_CAP)}})

    def _body(self) -> Any:
        """The JSON body, framed by a valid ``Content-Length`` within :data:`MAX_BODY_BYTES`.

        A body whose length cannot be trusted (chunked, negative, not a number, two values)
        or is over the limit is refused without reading it, and the connection is closed:
        its remaining bytes cannot be told apart from a next request."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self.close_connection = True
            raise HTTPRefusal(411, "Transfer-Encoding: chunked is not supported; send a Content-Length")
        values = self.headers.get_all("Content-Length") or []
        if len(set(v.strip() for v in values)) > 1:
            self.close_connection = True
            raise HTTPRefusal(400, f"Content-Length given {len(values)} times with different values")
        raw_n = values[0].strip() if values else "0"
        if not (raw_n.isascii() and raw_n.isdigit()):
            self.close_connection = True
            raise HTTPRefusal(400, f"Content-Length: expected a non-negative integer, got {short_repr(raw_n)}")
        n = int(raw_n)
        if n > MAX_BODY_BYTES:
            self.close_connection = True
            raise HTTPRefusal(413, f"body of {n} bytes exceeds the {MAX_BODY_BYTES}-byte limit")
        raw = self.rfile.read(n) if n else b""
        if len(raw) < n:
            self.close_connection = True
            raise HTTPRefusal(400, f"body ended after {len(raw)} of the {n} bytes of its Content-Length")
        if not raw:
            return {}
        try:
            return json.loads(raw, parse_constant=_no_constants)
        except (ValueError, RecursionError) as e:   # JSONDecodeError, bad UTF-8, NaN, nesting
            raise BadRequest(f"body is not valid JSON: {clip_text(str(e), 300)}") from None

    def do_GET(self):
        sched = self.server.scheduler
        path = self.path.split("?")[0]
        if path in ("/health", "/health_generate"):
            return self._send(200, None)
        if path == "/get_model_info":
            m = sched.loaded
            return self._send(200, {
                "model_path": m.path, "tokenizer_path": None, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": m.version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": m.model.config.model_type,
                "architectures": list(m.model.config.architectures or []),
                # ours (SGLang does not report these): what a client needs to decode routes
                "num_moe_layers": m.num_moe_layers, "moe_router_topk": m.top_k, "vocab_size": m.vocab_size,
                "routed_experts_rows": m.route_rows,   # rows per token: decoder layers (SGLang's layout)
            })
        if path == "/get_server_info":
            return self._send(200, {"version": "neon-hpc-embedded", "max_batch_size": sched.max_batch_size,
                                    "enable_return_routed_experts": True, "weight_version": sched.version,
                                    "paused": sched._paused, "stats": dict(sched.stats)})
        if path == "/get_weight_version":
            return self._send(200, {"weight_version": sched.version})
        return self._error(404, f"no such endpoint: GET {path}")

    def do_POST(self):
        path = self.path.split("?")[0]
        routes = {"/generate": self._generate, "/update_weights_from_disk": self._update_weights,
                  "/pause_generation": self._pause, "/continue_generation": self._continue}
        handler = routes.get(path)
        try:
            body = self._body()
            if handler is None:
                return self._error(404, f"no such endpoint: POST {clip_text(path, 200)}")
            handler(body)
        except BadRequest as e:   # the client's fault: 4xx, never 500
            self._error(getattr(e, "status", 400), str(e))
        except Exception as e:  # noqa: BLE001 - a server bug; the server keeps serving
            self._error(500, f"{type(e).__name__}: {e}")

    # --- endpoints --------------------------------------------------------------------
    def _generate(self, body: Any) -> None:
        sched = self.server.scheduler
        reqs = wire.parse_generate(body, sched.loaded.vocab_size)
        for req in reqs:   # every request fits before any joins a batch: a bad one fails alone
            admit(req, sched.loaded, self.server.max_new_tokens_cap)
        jobs = sched.submit(reqs)
        for job in jobs:
            job.done.wait()
        errors = [j.error for j in jobs if j.error]
        if errors:
            return self._error(500, errors[0])
        results = [j.result for j in jobs]
        batch = isinstance(body.get("input_ids", [None])[0], list)
        self._send(200, results if batch else results[0])

    def _update_weights(self, body: Any) -> None:
        wire.parse_object(body, "update_weights_from_disk", {
            "weight_version": (str, int, type(None)), "abort_all_requests": (bool,), "flush_cache": (bool,)})
        if not isinstance(body.get("model_path"), str):
            raise BadRequest("model_path: expected the path of an HF weights folder")
        version = body.get("weight_version")
        abort_all = body.get("abort_all_requests", False)
        flush = body.get("flush_cache", True)   # SGLang's default
        path = body["model_path"]
        sched = self.server.scheduler
        if flush and sched.holds_requests_in_place():
            # SGLang flushes its prefix cache after the load; with requests held in place
            # that flush fails (its scheduler asserts). Refuse as loudly, before loading.
            return self._send(400, {"success": False, "num_paused_requests": 0, "message":
                                    "Failed to update weights: flush_cache=true while paused in_place with "
                                    "running requests (their KV cache cannot be flushed); send flush_cache=false"})
        try:
            if self.server.allowed_root is not None:
                from neon_hpc.protocol.rundir import inside  # deferred: heavy (neon_hpc.protocol.rundir: pydantic)
                root = Path(self.server.allowed_root).resolve()
                path = str(inside(root, os.path.relpath(Path(path).resolve(), root)))
            with self.server.swap_lock:  # loads are serialised; generation keeps running meanwhile
                new = LoadedModel.load(path, str(version) if version is not None else sched.version)
                mismatch = new.same_shape_as(sched.loaded)
                if mismatch:
                    raise ValueError(f"{path} does not fit the served model: {mismatch}")
                paused = sched.swap(new, abort_all=abort_all)
        except Exception as e:  # noqa: BLE001 - reported, old weights keep serving
            return self._send(400, {"success": False, "message": f"Failed to update weights: {e}",
                                    "num_paused_requests": 0})
        msg = "Succeeded to update model weights."
        if version is not None:
            msg += f" Weight version updated to {version}."
        self._send(200, {"success": True, "message": msg, "num_paused_requests": paused})

    def _pause(self, body: Any) -> None:
        mode = wire.parse_object(body, "pause_generation", {"mode": (str,)}).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode: expected one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self.server.scheduler.pause(mode)
        self._send(200, {"message": "Generation paused successfully.", "status": "ok"})

    def _continue(self, body: Any) -> None:
        wire.parse_object(body, "continue_generation", {})
        self.server.scheduler.resume()
        self._send(200, {"message": "Generation continued successfully.", "status": "ok"})


class HTTPRefusal(BadRequest):
    """A client error with its own 4xx status (413 too large, 411 no length, ...)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _no_constants(name: str):
    raise ValueError(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def context_length(loaded: LoadedModel) -> int | None:
    """Tokens the served model can attend over (prompt + generation), from its HF config."""
    n = getattr(loaded.model.config, "max_position_embeddings", None)
    return int(n) if n else None


def admit(req: GenerateRequest, loaded: LoadedModel, max_new_tokens_cap: int | None = None) -> None:
    """Refuse (400) a request that cannot run within this engine's limits, before it is queued:
    ``min_new_tokens`` with every token a stop token, ``max_new_tokens`` over the cap, a prompt that leaves no
    room in the context, or prompt plus generation beyond it (generation past the context would index positions
    the model never learnt)."""
    s = req.sampling
    if s.min_new_tokens > 0:
        stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(loaded.eos_ids))
        if len(stops) >= loaded.vocab_size:   # every logit masked until min_new_tokens: nothing to sample
            raise BadRequest(f"sampling_params.min_new_tokens={s.min_new_tokens}: stop_token_ids (with the model's "
                             f"EOS ids unless ignore_eos) cover all {loaded.vocab_size} tokens, so none may be "
                             f"sampled before min_new_tokens; leave some tokens out of stop_token_ids")
    ctx = context_length(loaded)
    prompt, new = len(req.input_ids), req.sampling.max_new_tokens
    cap = max_new_tokens_cap if max_new_tokens_cap is not None else ctx
    if cap is not None and new > cap:
        raise BadRequest(f"sampling_params.max_new_tokens={new} exceeds this engine's cap of {cap} "
                         f"(--max-new-tokens-cap, default the model's context)")
    if ctx is None:
        return
    if prompt >= ctx:
        raise BadRequest(f"input_ids: the prompt has {prompt} tokens; the model's context is {ctx} "
                         f"(max_position_embeddings), which leaves no room to generate: shorten the prompt")
    if prompt + new > ctx:
        raise BadRequest(f"prompt_tokens {prompt} + max_new_tokens {new} = {prompt + new} exceeds the model's "
                         f"context of {ctx} tokens: lower max_new_tokens to at most {ctx - prompt}")


def serve(model_path: str, host: str = "127.0.0.1", port: int = 0, max_batch_size: int = 16,
          weight_version: str | None = None, allowed_root: str | None = None,
          max_new_tokens_cap: int | None = None,
          request_time_budget_s: float | None = REQUEST_TIME_BUDGET_S) -> EngineServer:
    """Load the model and return a bound (not yet serving) server; call ``serve_forever``.

    ``allowed_root`` None lets ``update_weights_from_disk`` load from any path (library use);
    the CLI defaults it to the weights directory holding ``--model``."""
    loaded = LoadedModel.load(model_path, weight_version)
    return EngineServer((host, port), Scheduler(loaded, max_batch_size, request_time_budget_s), allowed_root,
                        max_new_tokens_cap)
