"""The embedded inference engine: a tiny HF MoE on CPU behind SGLang's HTTP API subset.

Wire format: :mod:`neon_hpc.rollout.engines.wire`.  Inside, three parts:

- HTTP handler threads (``ThreadingHTTPServer``) parse and validate requests, then wait;
- one **scheduler thread** owns the model and batches continuously: between two decode
  steps, queued requests join the running batch up to ``max_batch_size`` rows (their
  left-padded prefill, joined into the batch's KV cache), and each request is answered and
  leaves as soon as it finishes;
- weight updates are loaded by the handler thread (off the critical path) and swapped in by
  the scheduler, never during a forward.  Unpaused, like SGLang's writer lock, a pending
  update admits no newcomer and waits for the running rows, so a response comes from one
  version.  Paused ``in_place`` (or ``retract``), the swap happens at once, as
  upstream: a running batch is held between two decode steps and, on
  ``/continue_generation``, goes on with the new weights **and its KV cache** (the cache
  of the tokens so far is not recomputed).  Every generated token records the version that
  sampled it; a response reports them as SGLang does: ``meta_info.weight_versions``
  ``[{"version", "start", "end"}]`` over the output tokens (end exclusive) and
  ``weight_version`` = the last span's version.

Rows are isolated by construction: a request's sampling parameters become its own
``Sampler`` at admission, which cannot fail at sampling time (greedy, or a finite positive
temperature, top-k in [2, vocab], a nucleus that always keeps the most likely token); a row
whose sampling still raises is answered with its own error and leaves the batch, which goes
on (``stats.row_errors``).  Every malformed body of every endpoint is a 400 naming the field.

Modules: ``model`` (the model and the router hooks that capture routes in SGLang's
layout), ``sampler`` (a request's sampling parameters, normalised at admission),
``scheduler`` (batching, weight swaps), ``server`` (HTTP endpoints, framing, admission),
``launcher`` (start/stop, the CLI; ``python -m neon_hpc.rollout.engines.embedded``).
"""

from neon_hpc.rollout.engines.embedded.launcher import ServerHandle, main, start_server
from neon_hpc.rollout.engines.embedded.model import LoadedModel, version_from_path
from neon_hpc.rollout.engines.embedded.scheduler import (
    PAUSE_MODES,
    REQUEST_TIME_BUDGET_S,
    Scheduler,
    weight_version_meta,
)
from neon_hpc.rollout.engines.embedded.server import (
    MAX_BODY_BYTES,
    EngineServer,
    HTTPRefusal,
    admit,
    context_length,
    serve,
)

__all__ = ["LoadedModel", "version_from_path", "PAUSE_MODES", "REQUEST_TIME_BUDGET_S", "Scheduler",
           "weight_version_meta", "MAX_BODY_BYTES", "EngineServer", "HTTPRefusal", "admit", "context_length",
           "serve", "ServerHandle", "main", "start_server"]
