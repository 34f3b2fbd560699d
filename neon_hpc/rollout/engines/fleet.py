"""SGLang servers started by the rollout node (``engine.kind: sglang``).

Every rollout node runs the same code: :func:`~neon_hpc.rollout.engines.sglang_launch.layout`
says which engine processes belong on it, :class:`Fleet` starts them with the command lines
of ``sglang_launch.render_commands`` (the golden-tested text, with ``${NEON_*}`` resolved
here, not by a shell), health-checks them, and stops them with their whole process tree.

* **Placement**: an engine of ``tp_size * dp_size`` GPUs spans whole nodes (SGLang's
  ``--nnodes``/``--node-rank``, rendezvous at ``--dist-init-addr`` on its first node), or
  several engines share a node, each on its own ``CUDA_VISIBLE_DEVICES`` slice.
* **Addresses**: ``NEON_NODE_ADDRS`` (comma-separated, one per rollout node) when set; under
  Slurm the step's node list mapped to each node's ``NodeAddr``; a single node without Slurm
  is 127.0.0.1. Workers reach an engine at its first node's address, or at 127.0.0.1 when
  ``engine.host`` is a loopback address (then only that node's workers can).
* **Readiness**: a node's engines are ready when every engine it heads answers ``GET
  /health``; under PD disaggregation node 0 waits for *all* engines, then starts
  ``sglang_router`` and waits for it; other nodes wait for the load balancer before their workers
  start. A process that exits first, or ``engine.startup_timeout_s`` passing, is an error
  that names the engine's log.
* **Weights**: engines start on the newest published version (``weights/LATEST``) unless
  ``engine.model_path`` names another start; updates go to every engine directly (the PD
  load balancer does not forward ``/update_weights_from_disk``).
* **Weight updates** (:func:`update_weights`, the node's one sequence for SGLang and the
  embedded engine alike), per ``engine.weight_update``: ``between_requests`` is one
  ``/update_weights_from_disk`` (it waits for running requests); ``in_place`` is SGLang's
  ``/pause_generation {"mode": "in_place"}``, ``/update_weights_from_disk`` with
  ``flush_cache: false`` (the running requests keep their KV cache, and SGLang's flush
  fails while they hold it), then ``/continue_generation``: requests in flight finish on the
  new weights and report both versions in ``meta_info.weight_versions``.  Request shapes
  as checked in SGLang's ``python/sglang/srt/managers/io_struct.py`` (``PauseGenerationReqInput.mode``,
  ``UpdateWeightFromDiskReqInput.{model_path, weight_version, flush_cache}``,
  ``ContinueGenerationReqInput``) at commit 001067fffe33427bee0ed2f007fb7551a1d76b44, and the
  spans in ``python/sglang/srt/utils/weight_versions.py`` at 19f93835d3f8a0b84485592090245d11de783289.
* **Signals**: Slurm's pre-timeout SIGUSR1 reaches every process of the job step; engines
  are started with it ignored (an engine has nothing to save; the node stops it).

Logs: ``RUN/logs/engine/<i>.log`` for engine ``i``'s first node (``<i>.n<k>.log`` for its
node ``k``), ``RUN/logs/engine/load_balancer.log``; each starts with the exact command line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from neon_hpc.config.cross import is_loopback
from neon_hpc.rollout.engines.client import EngineClient
from neon_hpc.rollout.engines.groups import EngineStartError
from neon_hpc.rollout.engines.sglang_launch import engine_port, format_commands, layout, render_commands
from neon_hpc.util.logs import last_lines
from neon_hpc.util.procutil import child_setup, stop_tree


class FleetError(EngineStartError):
    """An engine could not be placed, started or reached; the message says what to do."""


WEIGHT_UPDATE_POLICIES = ("in_place", "between_requests")


def update_weights(client, model_path: str, version: str, policy: str) -> dict:
    """Load ``model_path`` as ``version`` into one engine under ``policy`` (module docstring).

    ``in_place`` always continues generation, also when the load fails (the old weights then
    keep serving and the error propagates)."""
    if policy == "between_requests":
        return client.update_weights_from_disk(model_path, version)
    if policy != "in_place":
        raise ValueError(f"engine.weight_update must be one of {WEIGHT_UPDATE_POLICIES}, got {policy!r}")
    client.pause_generation(mode="in_place")
    try:
        return client.update_weights_from_disk(model_path, version, flush_cache=False)
    finally:
        client.continue_generation()


_VAR = re.compile(r"\$\{([A-Z0-9_]+)\}")


def resolve(cmd: list[str], env: dict[str, str]) -> list[str]:
    """Substitute ``${NAME}`` in every argument; an unknown name is an error, not ''."""
    def one(m: re.Match) -> str:
        if m.group(1) not in env:
            raise FleetError(f"launch line needs ${{{m.group(1)}}}, which the rollout node does not set: "
                             f"{' '.join(cmd)}")
        return env[m.group(1)]
    return [_VAR.sub(one, a) for a in cmd]


def node_addresses(count: int) -> list[str]:
    """One reachable address per rollout node, in node-rank order."""
    given = os.environ.get("NEON_NODE_ADDRS")
    if given:
        addrs = [a.strip() for a in given.split(",") if a.strip()]
        if len(addrs) != count:
            raise FleetError(f"NEON_NODE_ADDRS lists {len(addrs)} address(es) for {count} rollout node(s): "
                             f"give one per node, in node-rank order")
        return addrs
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if nodelist:
        return _slurm_addresses(nodelist, count)
    if count == 1:
        return ["127.0.0.1"]
    raise FleetError(f"{count} rollout nodes outside Slurm: set NEON_NODE_ADDRS to their addresses "
                     f"(comma-separated, in node-rank order)")


def _slurm_addresses(nodelist: str, count: int) -> list[str]:
    try:
        names = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               check=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        raise FleetError(f"cannot expand the Slurm node list {nodelist!r} ({e}); set NEON_NODE_ADDRS") from None
    if len(names) != count:
        raise FleetError(f"the Slurm step has {len(names)} node(s) ({nodelist}) for {count} rollout node "
                         f"task(s): run one rollout-node task per node (launch.rollout.tasks_per_node: 1)")
    addrs = []
    for name in names:
        # the name need not resolve (emulated nodes, a separate fabric name): use NodeAddr
        out = subprocess.run(["scontrol", "show", "node", name, "-o"], capture_output=True, text=True,
                             timeout=60).stdout
        m = re.search(r"\bNodeAddr=(\S+)", out)
        addrs.append(m.group(1) if m else name)
    return addrs


@dataclass
class Proc:
    name: str                  # "engine 3", "engine 3 node 1", "load balancer"
    popen: subprocess.Popen
    log: Path

    def exit_message(self) -> str | None:
        rc = self.popen.poll()
        if rc is None:
            return None
        how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
        try:
            tail = "\n".join("  | " + x for x in last_lines(self.log, 15)) or "  (empty)"
        except OSError:
            tail = "  (no log)"
        return f"{self.name} exited ({how}); its log {self.log} ends with:\n{tail}"


def _healthy(url: str, timeout: float = 5.0) -> bool:
    return EngineClient(url, timeout=timeout).health(timeout=timeout)


class Fleet:
    """The SGLang processes of one rollout node and the URLs its workers use."""

    def __init__(self, cfg, run, node: int, node_count: int, log, addrs: list[str] | None = None):
        self.cfg, self.run, self.node, self.log = cfg, run, node, log
        self.lay = layout(cfg)
        if self.lay.nodes_needed > node_count:
            raise FleetError(f"{cfg.engine.num_engines} SGLang engine(s) of {self.lay.gpus_per_engine} GPUs need "
                             f"{self.lay.nodes_needed} rollout node(s) of {self.lay.gpus_per_node} GPUs, but "
                             f"{node_count} run: raise launch.rollout.nodes (or lower engine.num_engines); "
                             f"`neon-hpc run` starts one rollout node, so larger layouts need `neon-hpc launch`")
        self.addrs = addrs if addrs is not None else node_addresses(node_count)
        self.procs: list[Proc] = []
        self.version = -1
        e = cfg.engine
        self.vars = {"NEON_LB_HOST": self._url_host(self.addrs[0])}
        for i in range(e.num_engines):
            addr = self.addrs[self.lay.first_node(i)]
            # a multi-node engine's rendezvous needs the real address; a one-node engine's URL
            # (which the PD load balancer also uses) must match what it binds
            self.vars[f"NEON_ENGINE{i}_HOST"] = addr if self.lay.nodes_per_engine > 1 else self._url_host(addr)

    # --- addresses ----------------------------------------------------------------------
    def _url_host(self, addr: str) -> str:
        host = self.cfg.engine.host
        if is_loopback(host):
            return "127.0.0.1"
        if host in ("0.0.0.0", "::", ""):
            return addr
        return host

    def engine_url(self, i: int) -> str:
        return f"http://{self._url_host(self.addrs[self.lay.first_node(i)])}:{engine_port(self.cfg, i)}"

    def load_balancer_url(self) -> str:
        return f"http://{self._url_host(self.addrs[0])}:{self.cfg.engine.load_balancer_port}"

    def local_heads(self) -> list[int]:
        """Engines whose HTTP endpoint is on this node (their weights are this node's to update)."""
        return [i for i, k, _ in self.lay.processes_on(self.node) if k == 0]

    def head_urls(self) -> list[str]:
        return [self.engine_url(i) for i in self.local_heads()]

    def _named(self, engines) -> dict[str, str]:
        return {self.engine_url(i): f"engine {i}" for i in engines}

    def worker_nodes(self) -> list[int]:
        """Nodes that run rollout workers: those serving an engine endpoint."""
        return self.lay.head_nodes()

    def worker_url(self, worker: int) -> str:
        if self.cfg.engine.pd_disaggregation:
            return self.load_balancer_url()
        heads = self.local_heads()
        return self.engine_url(heads[(worker // len(self.worker_nodes())) % len(heads)])

    # --- processes ----------------------------------------------------------------------
    def _argv(self, cmd: list[str], node_rank: int, version: int, path: Path) -> list[str]:
        argv = resolve(cmd, dict(self.vars, NEON_NODE_RANK=str(node_rank)))
        if argv[0] == "python":
            argv[0] = self.cfg.engine.python or sys.executable
        if not self.cfg.engine.model_path and "--model-path" in argv:
            # start on the newest published weights (a resumed run is past v_0)
            argv[argv.index("--model-path") + 1] = str(path)
            if "--weight-version" in argv:
                argv[argv.index("--weight-version") + 1] = str(version)
        return argv

    def _spawn(self, name: str, argv: list[str], log_name: str, gpus: str | None, url: str | None) -> None:
        d = self.run.log_dir("engine")
        d.mkdir(parents=True, exist_ok=True)
        path = d / log_name
        out = open(path, "ab")
        out.write(f"# neon-hpc rollout node {self.node}: {format_commands([argv]).strip()}\n".encode())
        out.flush()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        # SIGUSR1 ignored (Slurm's pre-timeout signal is for the trainer); SIGTERM when this node dies
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                             preexec_fn=child_setup(ignore_usr1=True))
        out.close()
        self.procs.append(Proc(name, p, path))
        self.log.info("started %s (pid %d)%s: log %s", name, p.pid, f" at {url}" if url else "", path)

    def start(self, version: int, path: Path) -> None:
        """Start this node's engine processes (not the load balancer: that waits for the engines)."""
        cmds = render_commands(self.cfg)
        self.version = version if not self.cfg.engine.model_path else 0
        for i, k, gpus in self.lay.processes_on(self.node):
            name = f"engine {i}" + (f" node {k}" if self.lay.nodes_per_engine > 1 else "")
            self._spawn(name, self._argv(cmds[i], k, version, path), f"{i}.log" if k == 0 else f"{i}.n{k}.log",
                        gpus, self.engine_url(i) if k == 0 else None)

    def dead(self) -> str | None:
        """The first of this node's processes that has exited, described; None if all run."""
        for p in self.procs:
            msg = p.exit_message()
            if msg:
                return msg
        return None

    def _wait_healthy(self, urls: dict[str, str], stop: Callable[[], bool], deadline: float) -> bool:
        """Poll ``/health`` of ``{url: name}`` until all answer; False if asked to stop."""
        pending = dict(urls)
        t0, said = time.monotonic(), time.monotonic()
        while pending:
            if stop():
                return False
            msg = self.dead()
            if msg:
                raise FleetError(f"{msg}\nFix the cause (engine.* settings, engine.python, the weights) and rerun "
                                 f"to resume")
            for url in list(pending):
                if _healthy(url):
                    self.log.info("%s at %s is healthy after %.0fs", pending.pop(url), url, time.monotonic() - t0)
            if not pending:
                break
            if time.monotonic() > deadline:
                raise FleetError(f"{', '.join(f'{n} ({u})' for u, n in pending.items())} did not answer "
                                 "GET /health within engine.startup_timeout_s="
                                 f"{self.cfg.engine.startup_timeout_s:.0f}s; "
                                 f"see {self.run.log_dir('engine')}/ (raise the timeout for a large model)")
            if time.monotonic() - said > 60:
                self.log.info("waiting for %s to answer /health (%.0fs so far)", ", ".join(pending.values()),
                              time.monotonic() - t0)
                said = time.monotonic()
            time.sleep(1.0)
        return True

    def wait_ready(self, stop: Callable[[], bool]) -> bool:
        """Block until this node's engines (and, under PD, the load balancer) serve; False if stopped."""
        e = self.cfg.engine
        deadline = time.monotonic() + e.startup_timeout_s
        if not e.pd_disaggregation:
            return self._wait_healthy(self._named(self.local_heads()), stop, deadline)
        if self.node == 0:
            if not self._wait_healthy(self._named(range(e.num_engines)), stop, deadline):
                return False
            self._spawn("load balancer", self._argv(render_commands(self.cfg)[-1], 0, self.version, Path()),
                        "load_balancer.log", None, self.load_balancer_url())
            return self._wait_healthy({self.load_balancer_url(): "load balancer"}, stop, deadline)
        if self.node not in self.worker_nodes():
            return True   # a multi-node engine's other node: nothing here serves HTTP
        urls = dict(self._named(self.local_heads()), **{self.load_balancer_url(): "load balancer"})
        return self._wait_healthy(urls, stop, deadline)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM every process and its children (SGLang forks schedulers), SIGKILL what remains."""
        stop_tree([p.popen for p in reversed(self.procs)], timeout, kill_wait_s=5.0,   # the load balancer first
                  on_kill=lambda pid: self.log.warning("engine process %d did not stop within %.0fs; killing it",
                                                       pid, timeout))
