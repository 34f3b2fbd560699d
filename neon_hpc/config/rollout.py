"""Rollout and engine sections of the experiment config (owned by ``neon_hpc/rollout``)."""
import math
from dataclasses import dataclass, field
from typing import Literal

from neon_hpc.util.constraints import Rule, above, at_least, between, section


@section
@dataclass
class EngineConfig:
    kind: Literal["embedded", "sglang"] = "embedded"
    host: str = "127.0.0.1"          # servers bind to localhost unless configured otherwise
    port: int = 0                    # 0 = pick a free port (SGLang: 30000 + engine index)
    num_engines: int = 1
    max_batch_size: int = 16
    # SGLang production flags (rendered by rollout.engines.sglang_launch).  One engine uses
    # tp_size * dp_size GPUs (DP attention when dp_size > 1); ep_size is 1 or that product.
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    pd_disaggregation: bool = False
    prefill_engines: int = 0          # PD only: how many of num_engines prefill; 0 = a quarter (>= 1)
    transfer_backend: Literal["mooncake", "nixl"] = "mooncake"   # PD KV transfer
    load_balancer_port: int = 8000    # PD only: the sglang_router load balancer in front of prefill/decode
    # PD only: which of sglang_router's two load balancers. "mini_lb" (its Python one,
    # --mini-lb) forwards each /generate body as sent; "rust" (its default) re-serialises
    # the body through a typed request that, in sglang-router 0.3.2, has no
    # return_routed_experts / routed_experts_start_len, so routes would silently go missing.
    load_balancer: Literal["mini_lb", "rust"] = "mini_lb"
    model_path: str = ""              # weights the engines start on; "" = RUN/weights/v_0
    enable_return_routed_experts: bool = True
    extra_args: list[str] = field(default_factory=list)
    # kind=sglang: the interpreter that has SGLang installed ("" = the one running neon-hpc),
    # and how long an engine (or the PD load balancer) may take to answer /health after its start:
    # a trillion-parameter model loads for many minutes
    python: str = ""
    startup_timeout_s: float = 1800.0
    # How a new weight version reaches running engines: "in_place" pauses generation with
    # SGLang's in_place mode (requests keep their KV cache), loads, continues; a response in
    # flight then carries tokens of both versions (meta_info.weight_versions spans).
    # "between_requests": the load waits for running requests; every response is one version.
    weight_update: Literal["in_place", "between_requests"] = "in_place"

    CHECKS = {
        "port": between(0, 65535, "0 picks a free port"),
        **{k: at_least(1) for k in ("num_engines", "max_batch_size", "tp_size", "dp_size", "ep_size")},
        "prefill_engines": at_least(0, "0 = a quarter of num_engines"),
        "load_balancer_port": between(1, 65535),
        "startup_timeout_s": above(0, note="seconds"),
    }
    RULES = (
        Rule("ep_size", lambda c: c.ep_size in (1, c.tp_size * c.dp_size),
             lambda c: f"1 or tp_size * dp_size ({c.tp_size * c.dp_size}): SGLang spreads experts over "
                       f"all GPUs of an engine"),
        Rule("num_engines", lambda c: not c.pd_disaggregation or c.num_engines >= 2,
             ">= 2 with pd_disaggregation (prefill + decode)"),
        Rule("prefill_engines", lambda c: not c.pd_disaggregation or c.prefill_engines < c.num_engines,
             lambda c: f"in 0..num_engines-1 ({c.num_engines - 1}); 0 = a quarter"),
        Rule("load_balancer",
             lambda c: not (c.pd_disaggregation and c.load_balancer == "rust" and c.enable_return_routed_experts),
             "mini_lb while enable_return_routed_experts is on: sglang-router 0.3.2's Rust load balancer drops "
             "return_routed_experts and routed_experts_start_len from /generate, so router replay would get "
             "no routes"),
    )
    # "router" alone is the MoE router; the HTTP one in front of PD servers is the load balancer
    MOVED = {"router": "engine.load_balancer", "router_port": "engine.load_balancer_port"}


@section
@dataclass
class RolloutConfig:
    num_workers: int = 2
    group_size: int = 4               # G samples per task (GRPO groups)
    max_turns: int = 4
    max_new_tokens: int = 16
    max_total_tokens: int = 1024
    episode_timeout_s: float = 120.0
    temperature: float = 1.0
    top_p: float = 1.0
    restart_dead_workers: bool = True
    reward: Literal["success", "dense"] = "dense"   # which grader reward becomes Trajectory.reward
    force_answer: bool = True         # the last turn starts with <answer> (budget forcing)
    answer_max_new_tokens: int = 0    # tokens for that forced answer (0 = max_new_tokens)
    max_tool_chars: int = 2000        # tool results are cut to this many characters
    request_retries: int = 2          # retries of one turn after a dropped response
    wait_for_weights_s: float = 600.0  # a rollout node waits this long for the trainer's first weights
    journal: bool = True              # save unfinished episodes at every turn boundary; resume them on start
    journal_fsync: bool = True        # fsync each record (False: atomic against a killed worker, not a lost node)

    CHECKS = {
        **{k: at_least(1) for k in ("num_workers", "group_size", "max_turns", "max_new_tokens",
                                    "max_total_tokens")},
        "episode_timeout_s": above(0, note="seconds"),
        "temperature": at_least(0, "0 = greedy"),
        "top_p": above(0, le=1.0),
        "max_tool_chars": at_least(16, "tool errors must stay readable"),
        "answer_max_new_tokens": at_least(0, "0 = max_new_tokens"),
        "request_retries": at_least(0),
        "wait_for_weights_s": above(0, note="seconds"),
    }
    # the XRD environment's settings, once here: an old config or run.yaml that sets one is told where
    # and the off-policy settings (config/offpolicy.py)
    MOVED = {"tools": "env.tools (kind: xrd)", "prompt_style": "env.prompt_style (kind: xrd)",
             "max_staleness": "offpolicy.max_staleness", "stale_policy": "offpolicy.stale_policy",
             "backpressure_steps": "offpolicy.backpressure_steps", "replay_mode": "offpolicy.replay_engine"}


@section
@dataclass
class EvalConfig:
    """A fixed eval set of held-out tasks, run greedily on published weights (``rollout/agent/evalset.py``).

    ``neon-hpc run`` evaluates the weights RL starts from and the last published ones on the
    same ``num_tasks`` tasks (the environment's task set, e.g. XRD's ``env.preset``; this
    ``split`` and ``seed``), temperature 0, with the rollout section's turns and limits; 0 tasks =
    no eval.  ``split`` is one of the chosen environment's held-out splits (its registry line,
    ``neon_hpc/envs/__init__.py``; checked by ``neon_hpc.config.env.eval_split_errors``).
    """

    num_tasks: int = 0
    split: str = "test_id"
    seed: int = 0

    CHECKS = {"num_tasks": at_least(0, "0 = no eval")}


# --------------------------------------------------------------------------------------
# where SGLang engines go on the rollout group's nodes: a function of the config alone, so
# ``config check`` and the rollout node's fleet (``engines.fleet``) place them the same way

DEFAULT_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class EngineLayout:
    """Where the engines of a run go on the nodes of the rollout group.

    An engine of ``gpus_per_engine`` GPUs either spans ``nodes_per_engine`` whole nodes
    (SGLang's ``--nnodes``/``--node-rank``), or shares a node with ``engines_per_node - 1``
    others, each on its own slice of the node's GPUs (``CUDA_VISIBLE_DEVICES``).
    """

    num_engines: int
    gpus_per_engine: int
    gpus_per_node: int
    nodes_per_engine: int
    engines_per_node: int

    @property
    def nodes_needed(self) -> int:
        return math.ceil(self.num_engines / self.engines_per_node) * self.nodes_per_engine

    def first_node(self, engine: int) -> int:
        """The node whose engine process serves HTTP (SGLang's node rank 0 of the engine)."""
        return (engine // self.engines_per_node) * self.nodes_per_engine

    def processes_on(self, node: int) -> list[tuple[int, int, str | None]]:
        """``(engine, node rank inside the engine, CUDA_VISIBLE_DEVICES or None)`` on ``node``."""
        out = []
        for i in range(self.num_engines):
            first = self.first_node(i)
            if not first <= node < first + self.nodes_per_engine:
                continue
            gpus = None
            if self.engines_per_node > 1:
                slot = i % self.engines_per_node
                gpus = ",".join(str(g) for g in range(slot * self.gpus_per_engine, (slot + 1) * self.gpus_per_engine))
            out.append((i, node - first, gpus))
        return out

    def head_nodes(self) -> list[int]:
        """Nodes that serve at least one engine's HTTP endpoint, in order."""
        return sorted({self.first_node(i) for i in range(self.num_engines)})


def layout(cfg) -> EngineLayout:
    e = cfg.engine
    gpus = e.tp_size * e.dp_size
    per_node = getattr(getattr(cfg.launch, "rollout", None), "gpus_per_node", 0) or DEFAULT_GPUS_PER_NODE
    if gpus <= per_node:
        return EngineLayout(e.num_engines, gpus, per_node, 1, per_node // gpus)
    return EngineLayout(e.num_engines, gpus, per_node, math.ceil(gpus / per_node), 1)
