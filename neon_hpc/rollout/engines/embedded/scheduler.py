"""The scheduler thread: it owns the model and runs queued requests with continuous batching.

Between two decode steps (the safe point) queued requests join the running batch (their
prefill, then they decode with the others) up to ``max_batch_size``, and a request leaves as
soon as it finishes. Weights are swapped only at the safe point: unpaused, an update waits
for the running rows (and admits none meanwhile), so a response comes from one version;
paused ``in_place``/``retract``, at once, and the held rows go on with their KV cache.

Sampling RNG: a request with ``sampling_params.sampling_seed`` draws from its own
``torch.Generator`` seeded with it, one draw per sampled token, so its tokens do not depend on
which requests share its batch or when it joined (its logits differ from a solo run only by
float rounding of the padded shapes); without a seed it draws from the process's global RNG,
shared with every other unseeded request, as upstream (not reproducible).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from neon_hpc.rollout.engines import wire
from neon_hpc.rollout.engines.embedded.model import LoadedModel
from neon_hpc.rollout.engines.embedded.sampler import Sampler
from neon_hpc.rollout.engines.wire import GenerateRequest

# a request's generation may run this long (from its arrival); then it ends with finish_reason
# abort, naming the budget: a request with a huge max_new_tokens and ignore_eos would otherwise
# hold its batch slot, and an unpaused weight update waiting for the running rows, for ever
REQUEST_TIME_BUDGET_S = 600.0
PAUSE_MODES = ("abort", "retract", "in_place")


# --------------------------------------------------------------------------------------
# responses

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
    sampler: Sampler
    done: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None
    error: str | None = None
    # generation state
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routed_experts: list[np.ndarray] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)    # the weight version of each output token
    finish: dict | None = None
    gen: torch.Generator | None = None
    deadline: float | None = None                        # time.monotonic() after which it is aborted


@dataclass
class _Update:
    model: LoadedModel
    done: threading.Event = field(default_factory=threading.Event)
    paused_requests: int = 0


# --------------------------------------------------------------------------------------
# the running batch: rows of requests over one left-padded KV cache

class _Batch:
    """The requests being decoded together, one row each, over one KV cache.

    Rows are left-padded to a common width ``W``: ``mask[i, w]`` is 1 where row ``i`` holds a
    real token, ``pos[i]`` is the position of row ``i``'s last cached token.  A newcomer's
    prefill runs on its own cache and is then joined in (both sides padded on the left to the
    wider of the two); a finished row leaves (its cache row is dropped, and columns that are
    padding in every remaining row are trimmed).  A padded column is masked out of attention,
    so a row's logits do not depend on its neighbours beyond float rounding of the shapes."""

    def __init__(self) -> None:
        self.jobs: list[_Job] = []
        self.cache = None
        self.mask: torch.Tensor | None = None    # [B, W] long
        self.pos: torch.Tensor | None = None     # [B, 1] long

    def join(self, jobs: list[_Job], cache, mask: torch.Tensor, pos: torch.Tensor) -> None:
        if not jobs:
            return
        _check_cache(cache)
        if not self.jobs:
            self.jobs, self.cache, self.mask, self.pos = list(jobs), cache, mask, pos
            return
        wa, wb = self.mask.shape[1], mask.shape[1]
        w = max(wa, wb)
        for la, lb in zip(self.cache.layers, cache.layers):
            la.keys = torch.cat([_pad_left(la.keys, w - wa), _pad_left(lb.keys, w - wb)], dim=0)
            la.values = torch.cat([_pad_left(la.values, w - wa), _pad_left(lb.values, w - wb)], dim=0)
        self.mask = torch.cat([torch.nn.functional.pad(self.mask, (w - wa, 0)),
                               torch.nn.functional.pad(mask, (w - wb, 0))], dim=0)
        self.pos = torch.cat([self.pos, pos], dim=0)
        self.jobs += jobs

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in order); trim the columns that are padding in all of them."""
        if len(rows) == len(self.jobs):
            return
        if not rows:
            self.__init__()
            return
        idx = torch.tensor(rows, dtype=torch.long)
        mask = self.mask[idx]
        first = int(torch.nonzero(mask.sum(0))[0])   # columns before it are padding in every row
        self.mask, self.pos = mask[:, first:], self.pos[idx]
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, first:]
            layer.values = layer.values[idx, :, first:]
        self.jobs = [self.jobs[i] for i in rows]


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0, n, 0)) if n else t   # [B, H, S, D]: pad S on the left


def _check_cache(cache) -> None:
    """Rows can be joined and dropped only in a plain per-layer KV cache ``[B, heads, S, dim]``."""
    from transformers.cache_utils import DynamicLayer  # deferred: heavy (transformers)
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer or layer.keys is None or layer.keys.dim() != 4:
            raise RuntimeError(f"continuous batching needs a full-attention KV cache of [batch, heads, seq, dim] "
                               f"tensors; cache layer {i} is a {type(layer).__name__}")


class Scheduler:
    """Owns the model; runs queued requests in a continuous batch; swaps weights only between steps.

    ``stats``: ``batches`` prefill forwards (admission rounds), ``forwards`` all forwards,
    ``requests`` admitted, ``max_batch`` the most rows decoded together, ``updates`` swaps,
    ``row_errors`` rows evicted because sampling their token failed (each answered with its own
    error; the batch went on)."""

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
            if self.route_dtype not in wire.ROUTE_DTYPES:
                raise ValueError(f"SGLANG_ROUTED_EXPERTS_DTYPE={self.route_dtype!r}: one of "
                                 f"{', '.join(wire.ROUTE_DTYPES)}")
            if np.iinfo(wire.ROUTE_DTYPES[self.route_dtype]).max < model.num_experts - 1:
                raise ValueError(f"SGLANG_ROUTED_EXPERTS_DTYPE={self.route_dtype}: cannot hold expert ids up to "
                                 f"{model.num_experts - 1}")
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._update: _Update | None = None
        self._paused: str | None = None
        self._abort = False
        self._abort_message = ""
        self._running: list[_Job] = []
        self._stepping = False      # the scheduler thread is running a step (outside the lock)
        self._stop = False
        self.stats = {"batches": 0, "forwards": 0, "requests": 0, "max_batch": 0, "updates": 0, "row_errors": 0}
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    # --- called from handler threads -------------------------------------------------
    def submit(self, reqs: list[GenerateRequest]) -> list[_Job]:
        budget = self.request_time_budget_s
        deadline = time.monotonic() + budget if budget else None
        vocab = self.loaded.vocab_size   # a swap keeps the shapes (same_shape_as)
        jobs = [_Job(r, Sampler.from_params(r.sampling, vocab), deadline=deadline) for r in reqs]
        with self._cv:
            self._queue.extend(jobs)
            self._cv.notify_all()
        return jobs

    def swap(self, new: LoadedModel, abort_all: bool = False) -> int:
        """Install ``new`` at the next safe point (once the running rows finish, or at once while
        paused ``in_place``/``retract``)."""
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
        """Returns once no forward runs: the step in flight (if any) has ended; ``abort``: once
        every running request has been answered."""
        with self._cv:
            self._paused = mode
            if mode == "abort":
                self._abort_all_locked("Abort: pause_generation(mode=abort)")
            self._cv.notify_all()
            while self._stepping or (mode == "abort" and self._running):
                self._cv.wait()

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
        batch = _Batch()
        while True:
            with self._cv:
                newcomers = self._next_step_locked(batch)
            if newcomers is None:
                return
            try:
                loaded = self.loaded   # replaced only by this thread, under the lock, between steps
                if newcomers:
                    self._prefill(batch, newcomers, loaded)
                if batch.jobs:
                    self._decode(batch, loaded)
            except Exception as e:  # a bug, not a bad request: fail these requests, keep serving
                for job in batch.jobs + newcomers:
                    if not job.done.is_set():
                        job.error = f"engine error: {type(e).__name__}: {e}"
                        job.done.set()
                batch = _Batch()
            finally:
                with self._cv:
                    self._running = list(batch.jobs)
                    self._stepping = False
                    self._cv.notify_all()

    def _next_step_locked(self, batch: _Batch) -> list[_Job] | None:
        """The safe point between two steps: honours stop/abort/pause/update, then returns the
        queued requests that join the batch now (maybe none; None = stop)."""
        while True:
            if self._stop or self._abort:
                for job in batch.jobs:
                    job.finish = {"type": "abort", "message": self._abort_message or "Abort: server stopping"}
                    self._answer(job, self.loaded)
                batch.keep([])
                self._running, self._abort = [], False
                self._cv.notify_all()
                if self._stop:
                    return None
                continue
            if self._paused in ("in_place", "retract") and batch.jobs:
                self._apply_update_locked()   # at once: the held rows go on with the new weights and their cache
                self._cv.wait()
                continue
            if not batch.jobs:
                self._apply_update_locked()
            newcomers: list[_Job] = []
            # an update waiting (unpaused: SGLang's writer lock) lets the running rows finish, admits none
            if self._queue and not self._paused and self._update is None:
                n = min(self.max_batch_size - len(batch.jobs), len(self._queue))
                newcomers = [self._queue.popleft() for _ in range(n)]
            if newcomers or (batch.jobs and not self._paused):
                self._running = batch.jobs + newcomers
                self._stepping = True
                return newcomers
            self._cv.wait()

    def _prefill(self, batch: _Batch, jobs: list[_Job], loaded: LoadedModel) -> None:
        """One left-padded forward over the newcomers' prompts on a fresh cache, their first
        token sampled; those not finished by it join ``batch``."""
        from transformers import DynamicCache  # deferred: heavy (transformers)

        self.stats["batches"] += 1
        self.stats["requests"] += len(jobs)
        for job in jobs:
            seed = job.req.sampling.sampling_seed
            job.gen = torch.Generator().manual_seed(seed) if seed is not None else None
        lens = [len(j.req.input_ids) for j in jobs]
        width = max(lens)
        ids = torch.zeros(len(jobs), width, dtype=torch.long)
        mask = torch.zeros(len(jobs), width, dtype=torch.long)
        for i, job in enumerate(jobs):  # left padding: every row's last token is at the end
            ids[i, width - lens[i]:] = torch.tensor(job.req.input_ids)
            mask[i, width - lens[i]:] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=loaded.model.config)
        logits, routed_experts = loaded.forward(ids, mask, pos, cache)
        self.stats["forwards"] += 1
        for i, job in enumerate(jobs):
            job.routed_experts.append(routed_experts[i, width - lens[i]:].numpy().astype(np.int32))
            if job.req.sampling.max_new_tokens == 0:
                job.finish = {"type": "length", "length": 0}
            else:
                self._sample_row(job, logits[i], loaded)
            if job.finish is not None:
                self._answer(job, loaded)
        rows = [i for i, j in enumerate(jobs) if j.finish is None and j.error is None]
        if rows:
            new = _Batch()
            new.join(jobs, cache, mask, pos[:, -1:])
            new.keep(rows)
            batch.join(new.jobs, new.cache, new.mask, new.pos)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(batch.jobs))

    def _decode(self, batch: _Batch, loaded: LoadedModel) -> None:
        """One decode forward over every row's last token; finished rows are answered and leave."""
        step = torch.tensor([[job.out[-1]] for job in batch.jobs], dtype=torch.long)
        batch.mask = torch.cat([batch.mask, torch.ones(len(batch.jobs), 1, dtype=torch.long)], dim=1)
        batch.pos = batch.pos + 1
        logits, routed_experts = loaded.forward(step, batch.mask, batch.pos, batch.cache)
        self.stats["forwards"] += 1
        for i, job in enumerate(batch.jobs):
            # the token forwarded needed a successor
            job.routed_experts.append(routed_experts[i].numpy().astype(np.int32))
            self._sample_row(job, logits[i], loaded)
            if job.finish is not None:   # answered now: a long neighbour in the batch never holds it
                self._answer(job, loaded)
        batch.keep([i for i, j in enumerate(batch.jobs) if j.finish is None and j.error is None])

    def _sample_row(self, job: _Job, logits: torch.Tensor, loaded: LoadedModel) -> None:
        """Sample ``job``'s next token; if that fails (its sampler was built to make this
        impossible on sane logits), this row alone is answered with its own error and leaves
        the batch: its neighbours, which shared the forward but not the sampling, go on."""
        try:
            self._sample(job, logits, loaded)
        except Exception as e:  # noqa: BLE001 - one row's failure, reported to its own request
            job.error = (f"engine error in request {job.req.rid or f'req-{id(job):x}'} after "
                         f"{len(job.out)} output tokens: {type(e).__name__}: {e}")
            self.stats["row_errors"] += 1
            job.done.set()

    def _sample(self, job: _Job, logits: torch.Tensor, loaded: LoadedModel) -> None:
        s = job.req.sampling
        stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(loaded.eos_ids))
        if len(job.out) < s.min_new_tokens and stops:
            logits = logits.clone()
            logits[list(stops)] = float("-inf")
        tok, lp = job.sampler.choose(logits, job.gen, self.original_logprob)
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
            rows = wire.routed_rows(prompt, completion, 0)
            allr = (np.concatenate(job.routed_experts, axis=0) if job.routed_experts
                    else np.zeros((0, loaded.route_rows, loaded.top_k), np.int32))
            if allr.shape[0] < rows:  # an aborted request: only what was forwarded exists
                rows = allr.shape[0]
            meta["routed_experts"] = wire.encode_routes(allr[req.routed_experts_start_len:rows],
                                                            self.route_dtype or "int32")
            if self.route_dtype is not None:
                meta["routed_experts_dtype"] = self.route_dtype
        job.result = {"output_ids": list(job.out), "meta_info": meta}
        job.done.set()
