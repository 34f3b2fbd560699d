"""Production launch lines for real SGLang servers, rendered from the experiment config.

:func:`render_commands` returns one argv per process to start *on the first node of each
engine* (multi-node engines repeat it on every node with its own ``--node-rank``), plus the
``sglang_router`` in front of a PD-disaggregated fleet.  Values only known at run time are
shell variables that the operator's batch script sets before it runs the line under
``bash -c``:

- ``${NEON_ENGINE<i>_HOST}``  address of engine ``i``'s first node;
- ``${NEON_NODE_RANK}``       the node's rank inside its engine.

The rollout node (``neon_hpc.rollout.node`` with ``engine.kind: sglang``) sets them itself:
:func:`layout` places the engines on the nodes of the rollout group and ``fleet.py`` runs
the lines. ``neon-hpc engine sglang-cmd`` prints them for an operator's own script.

What the config means for SGLang (checked by ``EngineConfig.validate``):

- one engine = ``tp_size * dp_size`` GPUs: ``--tp-size tp*dp``; ``dp_size > 1`` adds
  ``--dp-size dp --enable-dp-attention`` (attention data-parallel, ``tp_size`` GPUs each);
- ``ep_size > 1`` (= all GPUs of the engine) is WideEP: ``--ep-size``, ``--moe-a2a-backend
  deepep --deepep-mode auto`` and ``--enable-dp-lm-head`` when DP attention is on;
- PD disaggregation: the first ``prefill_engines`` engines run ``--disaggregation-mode
  prefill``, the rest ``decode``, both with ``--disaggregation-transfer-backend``; the load balancer
  runs ``python -m sglang_router.launch_router --pd-disaggregation --prefill URL BOOTSTRAP
  ... --decode URL ...``;
- always ``--skip-tokenizer-init`` (workers send token ids), ``--weight-version 0`` (v_0),
  ``--enable-return-routed-experts`` when asked, then ``extra_args`` verbatim.

The rendered text is golden-tested (``tests/golden/sglang_*.txt``): what reaches the cluster
is reviewed like code.
"""

from __future__ import annotations

import shlex

from neon_hpc.config.rollout import layout  # placement is a function of the config (config check uses it)

BOOTSTRAP_PORT = 8998
DIST_INIT_PORT = 20000
DEFAULT_PORT = 30000


def engine_roles(cfg) -> list[str]:
    """``serve`` for every engine, or ``prefill``/``decode`` under PD disaggregation."""
    e = cfg.engine
    if not e.pd_disaggregation:
        return ["serve"] * e.num_engines
    n_prefill = e.prefill_engines or max(1, e.num_engines // 4)
    return ["prefill"] * n_prefill + ["decode"] * (e.num_engines - n_prefill)


def engine_port(cfg, i: int) -> int:
    return (cfg.engine.port or DEFAULT_PORT) + i


def engine_url(i: int, cfg) -> str:
    return f"http://${{NEON_ENGINE{i}_HOST}}:{engine_port(cfg, i)}"


def _engine_command(cfg, i: int, role: str) -> list[str]:
    e = cfg.engine
    gpus = e.tp_size * e.dp_size
    model_path = e.model_path or f"{cfg.run_dir.rstrip('/')}/weights/v_0"
    cmd = ["python", "-m", "sglang.launch_server",
           "--model-path", model_path,
           "--host", e.host, "--port", str(engine_port(cfg, i)),
           "--tp-size", str(gpus)]
    if e.dp_size > 1:
        cmd += ["--dp-size", str(e.dp_size), "--enable-dp-attention"]
    if e.ep_size > 1:
        cmd += ["--ep-size", str(e.ep_size), "--moe-a2a-backend", "deepep", "--deepep-mode", "auto"]
        if e.dp_size > 1:
            cmd += ["--enable-dp-lm-head"]
    nodes = layout(cfg).nodes_per_engine
    if nodes > 1:
        cmd += ["--nnodes", str(nodes), "--node-rank", "${NEON_NODE_RANK}",
                "--dist-init-addr", f"${{NEON_ENGINE{i}_HOST}}:{DIST_INIT_PORT + i}"]
    if role != "serve":
        cmd += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", e.transfer_backend]
        if role == "prefill":
            cmd += ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT)]
    cmd += ["--max-running-requests", str(e.max_batch_size),
            "--trust-remote-code", "--skip-tokenizer-init", "--weight-version", "0"]
    if e.enable_return_routed_experts:
        cmd += ["--enable-return-routed-experts"]
    return cmd + list(e.extra_args)


def _load_balancer_command(cfg, roles: list[str]) -> list[str]:
    cmd = ["python", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    if cfg.engine.load_balancer == "mini_lb":
        cmd += ["--mini-lb"]   # forwards the body as sent (engine.load_balancer in config/rollout.py says why)
    for i, role in enumerate(roles):
        if role == "prefill":
            cmd += ["--prefill", engine_url(i, cfg), str(BOOTSTRAP_PORT)]
    for i, role in enumerate(roles):
        if role == "decode":
            cmd += ["--decode", engine_url(i, cfg)]
    return cmd + ["--host", cfg.engine.host, "--port", str(cfg.engine.load_balancer_port)]


def render_commands(cfg) -> list[list[str]]:
    """One argv per engine (in engine order), then the PD load balancer if any."""
    roles = engine_roles(cfg)
    cmds = [_engine_command(cfg, i, role) for i, role in enumerate(roles)]
    if cfg.engine.pd_disaggregation:
        cmds.append(_load_balancer_command(cfg, roles))
    return cmds


def endpoint_urls(cfg) -> list[str]:
    """The URLs rollout workers talk to: the load balancer under PD, else every engine."""
    if cfg.engine.pd_disaggregation:
        return [f"http://${{NEON_LB_HOST}}:{cfg.engine.load_balancer_port}"]
    return [engine_url(i, cfg) for i in range(cfg.engine.num_engines)]


def _quote(arg: str) -> str:
    # ${VARS} must survive for the shell that runs the line; everything else is quoted safely.
    if "${" in arg:
        return '"' + arg.replace('"', '\\"') + '"'
    return shlex.quote(arg)


def format_commands(cmds: list[list[str]]) -> str:
    """Shell text, one command per line (``bash -c`` expands the ``${NEON_*}`` variables)."""
    return "".join(" ".join(_quote(a) for a in cmd) + "\n" for cmd in cmds)
