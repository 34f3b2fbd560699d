"""The engines one rollout node serves, behind one interface (:class:`EngineGroup`).

:func:`engine_group` chooses once, when the node starts:

- ``NEON_ENGINE_URLS`` set (comma-separated): :class:`ExternalEngines`, engines started
  elsewhere; the node starts none, updates no weights and writes no engine record;
- ``engine.kind: sglang``: :class:`SGLangEngines`, the SGLang processes that
  :class:`~neon_hpc.rollout.engines.fleet.Fleet` places on this node;
- otherwise :class:`EmbeddedEngines`: ``engine.num_engines`` embedded engines, each a child
  process of the node, confined to loading weights from the run's ``weights/``.

The node asks a group only these things: start it (health-checked; False if told to stop
meanwhile, :class:`EngineStartError` naming the fix if it cannot), which URLs it updates
the weights of, which nodes run workers and which URL worker ``w`` uses, the record for
``state/engines/node<r>.json``, whether a process of it has died, and to stop.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


class EngineStartError(RuntimeError):
    """The node's engines cannot be placed, started or reached; the message says what to do."""


class EngineGroup:
    """The engines of one rollout node (see the module docstring)."""

    kind = ""

    def __init__(self, node_count: int):
        self.node_count = node_count
        self.version = -1       # the weight version the engines started on; -1: none

    def start(self, version: int, path: Path, stop: Callable[[], bool]) -> bool:
        """Start on weights ``path`` (version ``version``); wait until they serve."""
        raise NotImplementedError

    def update_urls(self) -> list[str]:
        """The engines whose weights this node updates (none: another node's engine)."""
        return []

    def worker_nodes(self) -> list[int]:
        """The nodes that run rollout workers."""
        return list(range(self.node_count))

    def worker_url(self, worker: int) -> str:
        raise NotImplementedError

    def record(self) -> dict | None:
        """What ``state/engines/node<r>.json`` says about these engines (None: write none)."""
        return None

    def ready_message(self) -> str | None:
        return None

    def dead(self) -> str | None:
        """Why a process of this group is gone, or None."""
        return None

    def stop(self) -> None:
        pass


class ExternalEngines(EngineGroup):
    kind = "external"

    def __init__(self, urls: list[str], node_count: int):
        super().__init__(node_count)
        self.urls = urls

    def start(self, version: int, path: Path, stop: Callable[[], bool]) -> bool:
        return True

    def worker_url(self, worker: int) -> str:
        return self.urls[worker % len(self.urls)]


class EmbeddedEngines(EngineGroup):
    kind = "embedded"

    def __init__(self, cfg, run, node_count: int):
        super().__init__(node_count)
        self.cfg, self.run = cfg, run
        self.handles: list = []     # embedded.ServerHandle

    def start(self, version: int, path: Path, stop: Callable[[], bool]) -> bool:
        # deferred: heavy (neon_hpc.rollout.engines.embedded: torch, numpy)
        from neon_hpc.rollout.engines.embedded import start_server
        e = self.cfg.engine
        for i in range(e.num_engines):
            self.handles.append(start_server(str(path), host=e.host, port=e.port + i if e.port else 0,
                                             max_batch_size=e.max_batch_size, weight_version=str(version),
                                             allowed_root=str(self.run.weights)))  # loads stay inside the run
        self.version = version
        return True

    def update_urls(self) -> list[str]:
        return [h.url for h in self.handles]

    def worker_url(self, worker: int) -> str:
        return self.handles[worker % len(self.handles)].url

    def record(self) -> dict | None:
        return {"urls": self.update_urls(), "kind": self.kind}

    def ready_message(self) -> str | None:
        return f"engines up at {', '.join(self.update_urls())} with weights v_{self.version}"

    def dead(self) -> str | None:
        for i, h in enumerate(self.handles):
            rc = h.process.poll() if h.process is not None else None
            if rc is not None:
                return f"embedded engine {i} at {h.url} exited (exit code {rc})"
        return None

    def stop(self) -> None:
        for h in self.handles:
            h.stop()


class SGLangEngines(EngineGroup):
    kind = "sglang"

    def __init__(self, cfg, run, node: int, node_count: int, log):
        super().__init__(node_count)
        self.cfg, self.run, self.node, self.log = cfg, run, node, log
        self.fleet = None    # fleet.Fleet, made by start (placement errors are start errors)

    def start(self, version: int, path: Path, stop: Callable[[], bool]) -> bool:
        # deferred: heavy (neon_hpc.rollout.engines.fleet: h5py, numpy)
        from neon_hpc.rollout.engines.fleet import Fleet
        self.fleet = Fleet(self.cfg, self.run, self.node, self.node_count, self.log)
        self.fleet.start(version, path)
        if not self.fleet.wait_ready(stop):
            return False
        self.version = self.fleet.version
        return True

    def update_urls(self) -> list[str]:
        return self.fleet.head_urls() if self.fleet else []

    def worker_nodes(self) -> list[int]:
        return self.fleet.worker_nodes()

    def worker_url(self, worker: int) -> str:
        return self.fleet.worker_url(worker)

    def record(self) -> dict | None:
        return {"urls": self.update_urls(), "kind": self.kind,
                "workers_url": self.fleet.load_balancer_url() if self.cfg.engine.pd_disaggregation else None}

    def ready_message(self) -> str | None:
        here = ", ".join(self.update_urls()) or "none serving here (another node's engine)"
        return f"SGLang engines of node {self.node} ready: {here}"

    def dead(self) -> str | None:
        return self.fleet.dead() if self.fleet else None

    def stop(self) -> None:
        if self.fleet:
            self.fleet.stop()


def engine_group(cfg, run, node: int, node_count: int, log) -> EngineGroup:
    """The engine group of rollout node ``node`` (of ``node_count``), chosen once."""
    external = os.environ.get("NEON_ENGINE_URLS")
    if external:
        return ExternalEngines(external.split(","), node_count)
    if cfg.engine.kind == "sglang":
        return SGLangEngines(cfg, run, node, node_count, log)
    return EmbeddedEngines(cfg, run, node_count)
