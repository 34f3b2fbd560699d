"""The scheduler thread: it owns the model, batches queued requests, samples, and swaps
weights only between forwards (or at once while paused ``in_place``/``retract``)."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from neon_hpc.rollout.engines import protocol
from neon_hpc.rollout.engines.embedded.model import LoadedModel
from neon_hpc.rollout.engines.protocol import GenerateRequest

# a request's generation may run this long (a batch runs until all its members finish, so one
# request with a huge max_new_tokens and ignore_eos would otherwise hold every request queued
# behind it); then it ends with finish_reason abort, naming the budget
REQUEST_TIME_BUDGET_S = 600.0
PAUSE_MODES = ("abort", "retract", "in_place")


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
