"""The client rollout workers use for both engines: SGLang servers and our embedded engine.

It speaks SGLang's native API (see :mod:`.wire` for the exact fields) over HTTP with
``httpx``: one pooled client per process (keep-alive connections shared by every
``EngineClient`` of the process; a forked child builds its own).

Routes need the model's top-k and the rows per token (SGLang: one per decoder layer, the
``num_moe_layers=`` argument) to be reshaped.  Pass them (``num_moe_layers=``, ``top_k=``)
when you can; otherwise the client asks the engine once (ours reports both; a real SGLang
server reports ``model_path``, whose ``config.json`` gives top-k) and derives the row count
from the payload size.  The payload is decoded in ``meta_info.routed_experts_dtype``
(int32 / uint16 / uint8; absent = int32); a payload whose size does not fit is refused.

Errors: :class:`EngineError` with ``.status`` (the HTTP status) for answers that are
errors; connection trouble surfaces as ``ConnectionError``/``TimeoutError`` (``OSError``).
Which of them are worth retrying is the project's one taxonomy, :mod:`neon_hpc.util.httpretry`
(``EngineError.transient``; callers retry with its ``RetryPolicy``, as replay does).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import httpx
import numpy as np

from neon_hpc.rollout.engines import wire
from neon_hpc.util.bounded import MESSAGE_CAP, clip_text
from neon_hpc.util.httpretry import retryable_status

_POOL: tuple[int, httpx.Client] | None = None     # (pid, client): sockets never cross a fork
_POOL_LOCK = threading.Lock()


def _pool() -> httpx.Client:
    """The process's pooled HTTP client (thread-safe), built on first use and after a fork."""
    global _POOL
    pool = _POOL
    if pool is None or pool[0] != os.getpid():
        with _POOL_LOCK:
            if _POOL is None or _POOL[0] != os.getpid():
                _POOL = (os.getpid(), httpx.Client(limits=httpx.Limits(max_connections=512,
                                                                       max_keepalive_connections=128)))
            pool = _POOL
    return pool[1]


class EngineError(RuntimeError):
    """The engine answered with an error; ``status`` is the HTTP status (4xx: fix the request)."""

    def __init__(self, status: int, message: str, url: str = ""):
        super().__init__(f"{url}: HTTP {status}: {message}" if url else f"HTTP {status}: {message}")
        self.status = self.status_code = status
        self.message = message
        self.transient = retryable_status(status)    # 5xx/429/408: retry; 4xx: fix the request


class RoutePayloadError(EngineError, ValueError):
    """``routed_experts`` that do not decode into the rows asked for (a short or misfit payload):
    a ValueError too, so replay resamples the turn with a full export (its ``row_mismatch``)."""


@dataclass
class GenerateResult:
    output_ids: list[int]
    output_logprobs: list[float] | None
    routed_experts: np.ndarray | None        # int32 [rows, layers, top_k], rows = [start, seqlen-1)
    weight_version: str
    finish_reason: dict | None
    prompt_tokens: int
    meta_info: dict = field(repr=False, default_factory=dict)
    # SGLang's per-token version spans [{"version", "start", "end"}] over the output tokens
    # (end exclusive); None when the engine reports only weight_version
    weight_versions: list[dict] | None = None

    @property
    def aborted(self) -> bool:
        return bool(self.finish_reason) and self.finish_reason.get("type") == "abort"

    def token_versions(self, version_of: Callable[[str], int] = int) -> list[int]:
        """The weight version of each output token: from the spans when the engine sent
        them (a weight update inside the response), else ``weight_version`` for all."""
        n = len(self.output_ids)
        if not self.weight_versions:
            return [version_of(self.weight_version)] * n
        out: list[int] = []
        for span in self.weight_versions:
            out += [version_of(span["version"])] * (span["end"] - span["start"])
        return out

    def route_row_versions(self, start: int, version_of: Callable[[str], int] = int) -> list[int]:
        """The weight version of each route row ``[start, seqlen)``, following the spans.

        Row ``p`` holds the experts of the forward that consumed token ``p``: prompt rows come
        from the prefill, which sampled output token 0; output token ``j``'s row from the
        decode step that sampled token ``j + 1``; the last token was never forwarded (its row
        is the cache's placeholder) and takes its own version.
        """
        toks = self.token_versions(version_of)
        prefill = toks[0] if toks else version_of(self.weight_version)
        p, n = self.prompt_tokens, len(toks)
        rows = []
        for pos in range(start, p + n):
            j = pos - p
            rows.append(prefill if j < 0 else toks[min(j + 1, n - 1)])
        return rows


class EngineClient:
    """One engine's HTTP API.  Thread-safe (the process's pooled httpx client)."""

    def __init__(self, base_url: str, timeout: float = 600.0, num_moe_layers: int | None = None,
                 top_k: int | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.num_moe_layers, self.top_k = num_moe_layers, top_k
        self._info_cache: dict | None = None

    # --- transport ----------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None, timeout: float | None = None,
                 parse: bool = True) -> Any:
        data = None if body is None else json.dumps(body).encode()
        url, t = self.base_url + path, self.timeout if timeout is None else timeout
        try:
            resp = _pool().request(method, url, content=data, headers={"Content-Type": "application/json"}, timeout=t)
        except httpx.TimeoutException:
            raise TimeoutError(f"{url}: timed out after {t}s") from None
        except httpx.TransportError as e:    # refused, reset, a response cut short, no such host
            raise ConnectionError(f"{url}: {type(e).__name__}: {e}") from None
        if resp.status_code >= 400:
            raise EngineError(resp.status_code, _error_message(resp.content), url)
        raw = resp.content
        return json.loads(raw) if raw and parse else None

    # --- API ----------------------------------------------------------------------------
    def generate(self, input_ids: Sequence[int], sampling_params: dict, return_logprob: bool = True,
                 return_routed_experts: bool = False, routed_experts_start_len: int | None = None,
                 rid: str | None = None) -> GenerateResult:
        """One completion of ``input_ids``.

        ``sampling_params`` uses SGLang's names; ``seed`` is accepted as an alias of
        SGLang's ``sampling_seed``.  ``routed_experts_start_len`` (None/0 = full) asks only
        for routes from that absolute position on.
        """
        sp = dict(sampling_params)
        if "seed" in sp:
            sp.setdefault("sampling_seed", sp.pop("seed"))
            sp.pop("seed", None)
        body: dict[str, Any] = {"input_ids": [int(t) for t in input_ids], "sampling_params": sp,
                                "return_logprob": bool(return_logprob)}
        if return_routed_experts:
            body["return_routed_experts"] = True
            if routed_experts_start_len:
                body["routed_experts_start_len"] = int(routed_experts_start_len)
        if rid is not None:
            body["rid"] = rid
        out = self._request("POST", "/generate", body)
        return self._result(out, len(body["input_ids"]), int(routed_experts_start_len or 0))

    def _result(self, out: dict, n_prompt: int, start: int) -> GenerateResult:
        if not isinstance(out, dict) or "meta_info" not in out:
            raise EngineError(502, f"/generate answered without meta_info: {str(out)[:200]}", self.base_url)
        meta = out["meta_info"]
        output_ids = [int(t) for t in out.get("output_ids") or []]
        lps = meta.get("output_token_logprobs")
        logprobs = [float(x[0]) for x in lps] if lps is not None else None
        if logprobs is not None and len(logprobs) != len(output_ids):
            raise EngineError(502, f"{len(logprobs)} logprobs for {len(output_ids)} output tokens", self.base_url)
        routed_experts = None
        if meta.get("routed_experts") is not None:
            prompt = int(meta.get("prompt_tokens", n_prompt))
            rows = wire.routed_rows(prompt, len(output_ids), start)
            nbytes = len(wire.base64.b64decode(meta["routed_experts"]))
            try:
                dtype = wire.route_dtype(meta)
                item = np.dtype(wire.ROUTE_DTYPES[dtype]).itemsize
                layers, top_k = self._route_shape(nbytes, rows, item)
                if (meta.get("finish_reason") or {}).get("type") == "abort":
                    rows = nbytes // (item * layers * top_k)  # only what was forwarded before the abort
                routed_experts = wire.decode_routes(meta["routed_experts"], rows, layers, top_k, dtype)
            except ValueError as e:
                raise RoutePayloadError(502, str(e), self.base_url) from None
        version = meta.get("weight_version")
        spans = _spans(meta.get("weight_versions"), len(output_ids), self.base_url)
        return GenerateResult(output_ids=output_ids, output_logprobs=logprobs, routed_experts=routed_experts,
                              weight_version=str(version) if version is not None else "0",
                              finish_reason=meta.get("finish_reason"),
                              prompt_tokens=int(meta.get("prompt_tokens", n_prompt)), meta_info=meta,
                              weight_versions=spans)

    def _route_shape(self, nbytes: int, rows: int, item: int = 4) -> tuple[int, int]:
        """(rows per token, top_k): given, else from the engine, else from the payload itself.

        "Layers" here are the route rows per token: decoder layers in SGLang's layout (our
        engine reports ``routed_experts_rows``), which the trainer maps to its MoE layers.

        Our engine reports both in ``/get_model_info``; a real SGLang server reports
        ``model_path``, whose ``config.json`` (shared filesystem) has ``num_experts_per_tok``.
        The layer count then follows from the payload size, which also absorbs SGLang
        versions that count all layers rather than only MoE layers.
        """
        if self.top_k is None or self.num_moe_layers is None:
            info = self._info_cache or self.model_info()
            self._info_cache = info
            if self.top_k is None:
                self.top_k = info.get("moe_router_topk") or _topk_from_config(info.get("model_path"))
            if self.num_moe_layers is None and (info.get("routed_experts_rows") or info.get("num_moe_layers")):
                self.num_moe_layers = int(info.get("routed_experts_rows") or info["num_moe_layers"])
        if self.top_k is None:
            raise EngineError(0, "cannot tell the router top-k of the served model (not in /get_model_info, "
                                 "no readable config.json at its model_path); construct "
                                 "EngineClient(url, num_moe_layers=..., top_k=...) from the model config",
                                 self.base_url)
        top_k = int(self.top_k)
        if self.num_moe_layers is not None:
            return int(self.num_moe_layers), top_k
        if rows <= 0 or nbytes % (item * rows * top_k):
            raise RoutePayloadError(502, f"routed_experts of {nbytes} bytes do not split into {rows} rows "
                                   f"x top_k {top_k} x {item} bytes; pass num_moe_layers= to EngineClient",
                                   self.base_url)
        return nbytes // (item * rows * top_k), top_k

    def health(self, timeout: float = 5.0) -> bool:
        """True when ``GET /health`` answers 200 within ``timeout``."""
        try:
            # the status is the answer: SGLang's load balancer answers a plain-text body, servers an empty one
            self._request("GET", "/health", timeout=timeout, parse=False)
            return True
        except (EngineError, OSError):
            return False

    def model_info(self) -> dict:
        return self._request("GET", "/get_model_info")

    def update_weights_from_disk(self, model_path: str, weight_version: str | int | None = None,
                                 abort_all_requests: bool = False, flush_cache: bool = True) -> dict:
        """Ask the engine to load new weights; waits until they serve.  Raises on failure.

        ``flush_cache=False`` while requests are paused ``in_place``: SGLang's flush after the
        load fails when requests hold KV cache."""
        body: dict[str, Any] = {"model_path": str(model_path)}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if abort_all_requests:
            body["abort_all_requests"] = True
        if not flush_cache:
            body["flush_cache"] = False
        try:
            out = self._request("POST", "/update_weights_from_disk", body)
        except EngineError as e:
            raise EngineError(e.status, f"update_weights_from_disk({model_path}) failed: {e.message}",
                              self.base_url) from None
        if not out.get("success", False):
            raise EngineError(400, f"update_weights_from_disk({model_path}) failed: {out.get('message')}",
                              self.base_url)
        return out

    def pause_generation(self, mode: str = "abort") -> dict:
        """``abort`` (SGLang's default) ends in-flight requests; ``in_place``/``retract`` hold them."""
        return self._request("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self._request("POST", "/continue_generation", {})


def _spans(raw: Any, n: int, url: str) -> list[dict] | None:
    """``meta_info.weight_versions`` checked: contiguous spans covering output tokens [0, n)."""
    if raw is None:
        return None
    bad = EngineError(502, f"meta_info.weight_versions does not cover the {n} output tokens in order: "
                           f"{str(raw)[:200]}", url)
    if not isinstance(raw, list) or not raw:
        raise bad
    spans, at = [], 0
    for sp in raw:
        if not isinstance(sp, dict) or "version" not in sp:
            raise bad
        try:
            a, b = int(sp["start"]), int(sp["end"])
        except (KeyError, TypeError, ValueError):
            raise bad from None
        if a != at or b < a:
            raise bad
        spans.append({"version": str(sp["version"]), "start": a, "end": b})
        at = b
    if at != n:
        raise bad
    return spans


def _topk_from_config(model_path: str | None) -> int | None:
    if not model_path:
        return None
    try:
        with open(f"{model_path}/config.json") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    cfg = cfg.get("text_config", cfg)
    return cfg.get("num_experts_per_tok")


def _error_message(raw: bytes) -> str:
    return clip_text(_raw_error_message(raw), MESSAGE_CAP)   # a server may echo a huge input


def _raw_error_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw[:500].decode("utf-8", "replace")
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in obj:
            return str(obj["message"])
        if "detail" in obj:
            return str(obj["detail"])
    return str(obj)[:500]
