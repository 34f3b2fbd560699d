"""One error taxonomy and one retry policy for the project's HTTP clients.

Used by the engine client (``rollout/engines/client.py``: which of its errors are transient),
replay (``replay/client.py``: the delay between resampled turns) and the chat client
(``rollout/agent/chat.py``: its whole retry loop).  This module imports nothing of neon_hpc.

Transient, so retried: connection trouble and timeouts (``OSError``, ``ConnectionError``,
``TimeoutError`` and the errors of httpx / the openai client, by name), and the HTTP statuses of
:func:`retryable_status` (408, 429, and 5xx except 501/505, which no retry fixes).  Anything else,
a 4xx in particular, is a bug in the request and is raised at once.  The delay before retry
``n`` (1-based) is ``backoff_s * 2**(n-1)``, capped at ``max_backoff_s``, or what the server's
``Retry-After`` asks when it asks for no more than that cap.  No jitter: the callers are a
few workers per engine, not a crowd.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_TRANSIENT_NAMES = ("Connect", "Timeout", "RemoteDisconnected", "ChunkedEncoding", "ProtocolError", "ReadError",
                    "WriteError", "NetworkError")


def retryable_status(status: int) -> bool:
    """An HTTP status worth retrying: 408, 429, 5xx except 501 (not implemented) and 505."""
    return status in (408, 429) or (500 <= status <= 599 and status not in (501, 505))


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an error carries (``.status``/``.status_code``, or its ``.response``'s)."""
    status = getattr(exc, "status", None) or getattr(exc, "status_code", None)
    resp = getattr(exc, "response", None)
    if status is None and resp is not None:
        status = getattr(resp, "status_code", None) or getattr(resp, "status", None)
    return status if isinstance(status, int) and not isinstance(status, bool) else None


def is_transient(exc: BaseException) -> bool:
    """A failure worth retrying (see the module docstring); a 4xx other than 408/429 is not."""
    status = status_of(exc)
    if status is not None:
        return retryable_status(status)
    if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
        return True
    return any(k in type(exc).__name__ for k in _TRANSIENT_NAMES)


def retry_after_s(exc: BaseException) -> float | None:
    """Seconds a server asked to wait (``Retry-After: <seconds>`` on the error's response)."""
    headers = getattr(getattr(exc, "response", None), "headers", None)
    try:
        value = headers.get("retry-after") if headers is not None else None
        return max(0.0, float(value)) if value is not None else None
    except (TypeError, ValueError, AttributeError):     # an HTTP date or garbage: our own backoff
        return None


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` retries after the first attempt, exponential backoff from ``backoff_s``."""
    retries: int = 2
    backoff_s: float = 0.2
    max_backoff_s: float = 8.0

    def __post_init__(self):
        if self.retries < 0 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"retry policy needs retries, backoff_s, max_backoff_s >= 0, got {self}")

    @property
    def attempts(self) -> int:
        return self.retries + 1

    def delay(self, attempt: int, exc: BaseException | None = None) -> float:
        """Seconds to wait before retry ``attempt`` (1-based) after ``exc``."""
        asked = retry_after_s(exc) if exc is not None else None
        if asked is not None and asked <= self.max_backoff_s:
            return asked
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, attempt - 1))

    def call(self, fn: Callable[[], T], transient: Callable[[BaseException], bool] = is_transient,
             sleep: Callable[[float], Any] = time.sleep) -> T:
        """``fn()``, retried on transient errors; the last error is raised as it came."""
        for attempt in range(self.attempts):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified by ``transient``
                if attempt == self.retries or not transient(e):
                    raise
                sleep(self.delay(attempt + 1, e))
        raise AssertionError("unreachable")
