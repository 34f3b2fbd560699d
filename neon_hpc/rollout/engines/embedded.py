"""The embedded inference engine: a tiny HF MoE on CPU behind SGLang's HTTP API subset.

Wire format: :mod:`.protocol`.  Inside, three parts:

- HTTP handler threads (``ThreadingHTTPServer``) parse and validate requests, then wait;
- one **scheduler thread** owns the model: it takes up to ``max_batch_size`` queued
  requests, runs them as one batch (left-padded prefill, then one decode forward per step
  with a KV cache) until every member has finished, answers them, and only then looks at
  the queue again;
- weight updates are loaded by the handler thread (off the critical path) and swapped in by
  the scheduler, never during a forward.  Unpaused, like SGLang's writer lock, an update
  waits for the running batch and queued requests wait for the update, so a response comes
  from one version.  Paused ``in_place`` (or ``retract``), the swap happens at once, as
  upstream: a running batch is held between two decode steps and, on
  ``/continue_generation``, goes on with the new weights **and its KV cache** (the cache
  of the tokens so far is not recomputed).  Every generated token records the version that
  sampled it; a response reports them as SGLang does: ``meta_info.weight_versions``
  ``[{"version", "start", "end"}]`` over the output tokens (end exclusive) and
  ``weight_version`` = the last span's version.

Routes are captured from the model's own routers (a forward hook on each router the
architecture adapter names) during prefill and decode, never recomputed afterwards.  Their
layout is SGLang's: one row per decoder layer, zeros for layers that do not route (dense
first layers); a shared expert is not a routed choice and has no column.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neon_hpc.bounded import MESSAGE_CAP, clip_text, short_repr
from neon_hpc.rollout.engines import protocol
from neon_hpc.rollout.engines.protocol import BadRequest, GenerateRequest

MAX_BODY_BYTES = 64 << 20
# a request's generation may run this long (a batch runs until all its members finish, so one
# request with a huge max_new_tokens and ignore_eos would otherwise hold every request queued
# behind it); then it ends with finish_reason abort, naming the budget
REQUEST_TIME_BUDGET_S = 600.0
PAUSE_MODES = ("abort", "retract", "in_place")


def version_from_path(path: str | os.PathLike) -> str:
    """``.../weights/v_7`` -> ``"7"``; anything else -> ``"0"`` (v_0 = initial weights)."""
    m = re.match(r"^v_(\d+)$", Path(path).name)
    return m.group(1) if m else "0"


# --------------------------------------------------------------------------------------
# the model with its routers observed

class LoadedModel:
    """An HF MoE model plus hooks that record every router's top-k indices per forward."""

    def __init__(self, model: torch.nn.Module, path: str, version: str):
        from neon_hpc.models.adapters import adapter_for_hf_config
        self.model, self.path, self.version = model, str(path), str(version)
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.top_k = int(cfg.num_experts_per_tok)
        self.eos_ids = _as_list(getattr(cfg, "eos_token_id", None))
        adapter = adapter_for_hf_config({"model_type": cfg.model_type})
        # SGLang's route layout: one row per decoder layer, zeros where a layer does not route
        mcfg = adapter.model_config_from_hf(cfg)
        self.route_layout = adapter.route_layout(mcfg)
        self.num_experts = int(mcfg.num_experts)
        hooked = adapter.hf_routers(model)
        if [layer for layer, _ in hooked] != list(self.route_layout.moe_rows):
            raise RuntimeError(f"{path}: routers found at decoder layers {[l for l, _ in hooked]}, but the "
                               f"{adapter.name} layout routes at {list(self.route_layout.moe_rows)}")
        self.routers = [r for _, r in hooked]
        self.num_moe_layers = len(self.routers)
        self._buf: list[torch.Tensor] = []
        import inspect
        # transformers >= 5.2x renamed past_key_values -> cache (the old name warns)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        for r in self.routers:
            r.register_forward_hook(self._record)

    @classmethod
    def load(cls, path: str | os.PathLike, version: str | None = None) -> "LoadedModel":
        from neon_hpc.models.hf import load_hf
        return cls(load_hf(path), str(path), version if version is not None else version_from_path(path))

    def _record(self, module, inputs, output) -> None:
        self._buf.append(output[2])  # (tokens, top_k) indices of this forward, in layer order

    @property
    def route_rows(self) -> int:
        """Rows per token in ``routed_experts`` (decoder layers, as SGLang sends them)."""
        return self.route_layout.rows

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the last position ``[B, V]`` and routes ``[B, S, decoder layers, top_k]``
        (zeros in the rows of layers that do not route)."""
        self._buf = []
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         **{self._cache_kw: cache})
        b, s = ids.shape
        routes = torch.zeros((b, s, self.route_layout.rows, self.top_k), dtype=torch.int64)
        for row, r in zip(self.route_layout.moe_rows, self._buf):
            routes[:, :, row] = r.reshape(b, s, self.top_k)
        return out.logits[:, -1, :].float(), routes

    def same_shape_as(self, other: "LoadedModel") -> str | None:
        a, b = self.model.state_dict(), other.model.state_dict()
        if set(a) != set(b):
            return f"parameter names differ ({len(set(a) ^ set(b))} keys)"
        for k in a:
            if a[k].shape != b[k].shape:
                return f"{k}: shape {tuple(b[k].shape)} != served {tuple(a[k].shape)}"
        return None


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in (x if isinstance(x, (list, tuple)) else [x])]


# --------------------------------------------------------------------------------------
# sampling

def _choose(logits: torch.Tensor, s: protocol.Sampling, gen: torch.Generator | None,
            original_logprob: bool) -> tuple[int, float]:
    """Sample one token from ``[V]`` logits; returns (token, logprob as SGLang reports it)."""
    greedy = s.temperature < 1e-6 or s.top_k == 1
    temp = 1.0 if greedy else float(s.temperature)
    logprobs = torch.log_softmax(logits / temp, dim=-1)  # SGLang: after temperature
    if greedy:
        tok = int(torch.argmax(logits))
    else:
        probs = logprobs.exp()
        if s.top_k > 1:
            kth = torch.topk(probs, min(s.top_k, probs.numel())).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if s.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = (sorted_p.cumsum(0) - sorted_p) < s.top_p * sorted_p.sum()
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            probs = torch.where(mask, probs, torch.zeros_like(probs))
        tok = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
    lp = torch.log_softmax(logits, dim=-1)[tok] if original_logprob else logprobs[tok]
    return tok, float(lp)


def weight_version_meta(versions: list[str], current: str) -> dict:
    """``weight_versions`` spans (SGLang's format) and ``weight_version`` for a response whose
    output tokens were sampled by ``versions``; no output token: one empty span of ``current``."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    if not spans:
        spans = [{"version": current, "start": 0, "end": 0}]
    return {"weight_versions": spans, "weight_version": spans[-1]["version"]}


# --------------------------------------------------------------------------------------
# scheduler

@dataclass
class _Job:
    req: GenerateRequest
    done: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None
    error: str | None = None
    # generation state
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)    # the weight version of each output token
    finish: dict | None = None
    gen: torch.Generator | None = None
    deadline: float | None = None                        # time.monotonic() after which it is aborted


@dataclass
class _Update:
    model: LoadedModel
    done: threading.Event = field(default_factory=threading.Event)
    paused_requests: int = 0


class Scheduler:
    """Owns the model; batches queued requests; swaps weights only between forwards."""

    def __init__(self, model: LoadedModel, max_batch_size: int = 16,
                 request_time_budget_s: float | None = REQUEST_TIME_BUDGET_S):
        self.loaded = model
        self.max_batch_size = max_batch_size
        self.request_time_budget_s = request_time_budget_s
        self.original_logprob = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true")
        # SGLang's SGLANG_ROUTED_EXPERTS_DTYPE: routes on the wire in a narrower dtype, advertised
        # in meta_info.routed_experts_dtype (unset: int32, not advertised)
        self.route_dtype = os.environ.get("SGLANG_ROUTED_EXPERTS_DTYPE") or None
        if self.route_dtype is not None:
            if self.route_dtype not in protocol.ROUTE_DTYPES:
                raise ValueError(f"SGLANG_ROUTED_EXPERTS_DTYPE={self.route_dtype!r}: one of "
                                 f"{', '.join(protocol.ROUTE_DTYPES)}")
            if np.iinfo(protocol.ROUTE_DTYPES[self.route_dtype]).max < model.num_experts - 1:
                raise ValueError(f"SGLANG_ROUTED_EXPERTS_DTYPE={self.route_dtype}: cannot hold expert ids up to "
                                 f"{model.num_experts - 1}")
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._update: _Update | None = None
        self._paused: str | None = None
        self._abort = False
        self._abort_message = ""
        self._running: list[_Job] = []
        self._stop = False
        self.stats = {"batches": 0, "forwards": 0, "requests": 0, "max_batch": 0, "updates": 0}
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    # --- called from handler threads -------------------------------------------------
    def submit(self, reqs: list[GenerateRequest]) -> list[_Job]:
        budget = self.request_time_budget_s
        deadline = time.monotonic() + budget if budget else None
        jobs = [_Job(r, deadline=deadline) for r in reqs]
        with self._cv:
            self._queue.extend(jobs)
            self._cv.notify_all()
        return jobs

    def swap(self, new: LoadedModel, abort_all: bool = False) -> int:
        """Install ``new`` at the next safe point (between batches, or at once while paused)."""
        upd = _Update(new)
        with self._cv:
            while self._update is not None:  # one swap at a time, in arrival order
                self._cv.wait()
            if abort_all:
                self._abort_all_locked("Abort: update_weights_from_disk(abort_all_requests=true)")
            upd.paused_requests = len(self._running) if self._paused else 0
            self._update = upd
            self._cv.notify_all()
        upd.done.wait()
        return upd.paused_requests

    def pause(self, mode: str) -> None:
        with self._cv:
            self._paused = mode
            if mode == "abort":
                self._abort_all_locked("Abort: pause_generation(mode=abort)")
                while self._running:
                    self._cv.wait()
            self._cv.notify_all()

    def holds_requests_in_place(self) -> bool:
        """Paused ``in_place`` with requests running or queued (a cache flush would fail)."""
        with self._cv:
            return self._paused == "in_place" and bool(self._running or self._queue)

    def resume(self) -> None:
        with self._cv:
            self._paused = None
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._abort_all_locked("Abort: server shutting down")
            self._cv.notify_all()

    @property
    def version(self) -> str:
        return self.loaded.version

    # --- scheduler thread -------------------------------------------------------------
    def _abort_all_locked(self, message: str) -> None:
        self._abort = bool(self._running)
        self._abort_message = message
        while self._queue:
            job = self._queue.popleft()
            job.finish = {"type": "abort", "message": message}
            self._answer(job, self.loaded)

    def _apply_update_locked(self) -> None:
        if self._update is not None:
            self.loaded = self._update.model
            self.stats["updates"] += 1
            self._update.done.set()
            self._update = None
            self._cv.notify_all()

    def _loop(self) -> None:
        torch.set_num_threads(int(os.environ.get("NEON_ENGINE_THREADS", "1")))
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        return
                    self._apply_update_locked()
                    if self._queue and not self._paused:
                        break
                    self._cv.wait()
                n = min(self.max_batch_size, len(self._queue))
                batch = [self._queue.popleft() for _ in range(n)]
                self._running = batch
                self._abort = False
            try:
                self._run_batch(batch)
            except Exception as e:  # a bug, not a bad request: fail these requests, keep serving
                for job in batch:
                    if not job.done.is_set():
                        job.error = f"engine error: {type(e).__name__}: {e}"
                        job.done.set()
            finally:
                with self._cv:
                    self._running = []
                    self._cv.notify_all()

    def _between_forwards(self) -> bool:
        """Safe point inside a batch: honours pause/abort/update; False = abort the batch."""
        with self._cv:
            while self._paused in ("in_place", "retract") and not self._abort and not self._stop:
                self._apply_update_locked()
                self._cv.wait()
            return not (self._abort or self._stop)

    def _run_batch(self, batch: list[_Job]) -> None:
        from transformers import DynamicCache

        self.stats["batches"] += 1
        self.stats["requests"] += len(batch)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(batch))
        for job in batch:
            seed = job.req.sampling.sampling_seed
            job.gen = torch.Generator().manual_seed(seed) if seed is not None else None
        lens = [len(j.req.input_ids) for j in batch]
        width = max(lens)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, job in enumerate(batch):  # left padding: every row's last token is at the end
            ids[i, width - lens[i]:] = torch.tensor(job.req.input_ids)
            mask[i, width - lens[i]:] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        loaded = self.loaded
        cache = DynamicCache(config=loaded.model.config)
        logits, routes = loaded.forward(ids, mask, pos, cache)
        self.stats["forwards"] += 1
        for i, job in enumerate(batch):
            job.routes.append(routes[i, width - lens[i]:].numpy().astype(np.int32))
            if job.req.sampling.max_new_tokens == 0:
                job.finish = {"type": "length", "length": 0}
        while True:
            step = torch.zeros(len(batch), 1, dtype=torch.long)
            for i, job in enumerate(batch):
                if job.finish is None:
                    self._sample(job, logits[i], loaded)
                    if job.finish is not None:   # answered now: a long neighbour in the batch never holds it
                        self._answer(job, loaded)
                step[i, 0] = job.out[-1] if job.out else 0
            if all(j.finish is not None for j in batch):
                break
            if not self._between_forwards():
                for job in batch:
                    if job.finish is None:
                        job.finish = {"type": "abort", "message": self._abort_message or "Abort: server stopping"}
                break
            if self.loaded is not loaded:  # swapped while paused in place: continue on the new weights
                loaded = self.loaded
            mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=torch.long)], dim=1)
            pos = pos[:, -1:] + 1
            logits, routes = loaded.forward(step, mask, pos, cache)
            self.stats["forwards"] += 1
            for i, job in enumerate(batch):
                if job.finish is None:  # only tokens that still need a successor were forwarded
                    job.routes.append(routes[i].numpy().astype(np.int32))
        for job in batch:
            if not job.done.is_set():
                self._answer(job, self.loaded)

    def _sample(self, job: _Job, logits: torch.Tensor, loaded: LoadedModel) -> None:
        s = job.req.sampling
        stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(loaded.eos_ids))
        if len(job.out) < s.min_new_tokens and stops:
            logits = logits.clone()
            logits[list(stops)] = float("-inf")
        tok, lp = _choose(logits, s, job.gen, self.original_logprob)
        job.out.append(tok)
        job.logprobs.append(lp)
        job.versions.append(loaded.version)
        if tok in stops:
            job.finish = {"type": "stop", "matched": tok}
        elif len(job.out) >= s.max_new_tokens:
            job.finish = {"type": "length", "length": s.max_new_tokens}
        elif job.deadline is not None and time.monotonic() > job.deadline:
            job.finish = {"type": "abort", "message": f"Abort: the request ran past this engine's per-request "
                                                      f"time budget ({self.request_time_budget_s:g} s)"}

    def _answer(self, job: _Job, loaded: LoadedModel) -> None:
        req = job.req
        prompt, completion = len(req.input_ids), len(job.out)
        meta: dict[str, Any] = {
            "id": req.rid or f"req-{id(job):x}",
            "finish_reason": job.finish,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "cached_tokens": 0,
        }
        meta.update(weight_version_meta(job.versions, loaded.version))
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(job.logprobs, job.out)]
        if req.return_routed_experts:
            rows = protocol.routed_rows(prompt, completion, 0)
            allr = (np.concatenate(job.routes, axis=0) if job.routes
                    else np.zeros((0, loaded.route_rows, loaded.top_k), np.int32))
            if allr.shape[0] < rows:  # an aborted request: only what was forwarded exists
                rows = allr.shape[0]
            meta["routed_experts"] = protocol.encode_routes(allr[req.routed_experts_start_len:rows],
                                                            self.route_dtype or "int32")
            if self.route_dtype is not None:
                meta["routed_experts_dtype"] = self.route_dtype
        job.result = {"output_ids": list(job.out), "meta_info": meta}
        job.done.set()


# --------------------------------------------------------------------------------------
# HTTP

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
        reqs = protocol.parse_generate(body, sched.loaded.vocab_size)
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
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise BadRequest("model_path: expected the path of an HF weights folder")
        version = body.get("weight_version")
        if version is not None and not isinstance(version, (str, int)):
            raise BadRequest(f"weight_version: expected a string, got {version!r}")
        abort_all = body.get("abort_all_requests", False)
        if not isinstance(abort_all, bool):
            raise BadRequest(f"abort_all_requests: expected true or false, got {abort_all!r}")
        flush = body.get("flush_cache", True)   # SGLang's default
        if not isinstance(flush, bool):
            raise BadRequest(f"flush_cache: expected true or false, got {flush!r}")
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
                from neon_hpc.rundir import inside
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
        mode = (body or {}).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode: expected one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self.server.scheduler.pause(mode)
        self._send(200, {"message": "Generation paused successfully.", "status": "ok"})

    def _continue(self, body: Any) -> None:
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
    ``max_new_tokens`` over the cap, a prompt that leaves no room in the context, or prompt
    plus generation beyond it (generation past the context would index positions the model
    never learnt)."""
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


# --------------------------------------------------------------------------------------
# starting and stopping

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
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

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
    from neon_hpc.procutil import child_setup
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
    import signal
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=srv.shutdown, daemon=True).start())
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
