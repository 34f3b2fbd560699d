"""The simulator's inputs, in SI units, each with the place it came from.

``SimParams`` is flat and plain (numbers and short strings), so a policy comparison or a
sweep is ``dataclasses.replace(params, ...)``.  ``Sourced`` pairs it with a source per field:
``default`` (a PlanConfig default), ``config <file>: <key>`` (the experiment config),
``derived (<formula>)``, or ``RESULT <file>:<line> <key>`` (a benchmark measurement, see
``measured.py``).  Every table the planner prints carries these sources.

A field the experiment config gives as is declares its key beside it (``Annotated[int,
From("rollout.group_size")]``): :func:`from_experiment` copies every such field in one loop;
the functions below derive the rest.  ``SimParams`` is a config section
(:func:`neon_hpc.util.constraints.section`): pydantic holds the parameters :func:`from_experiment`
builds to their types, enums and ranges (numbers finite and ``>= 0``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import ValidationError

from neon_hpc.arch import get as get_architecture
from neon_hpc.config.plan import PlanConfig
from neon_hpc.plan.memory import FORMULA
from neon_hpc.rollout.engines.sglang_launch import engine_roles
from neon_hpc.util import constraints
from neon_hpc.util.constraints import section

ROUTE_BYTES_PER_ID = 4 * 4 / 3      # int32 expert ids, base64 on the wire (SGLang meta_info)


@dataclass(frozen=True)
class From:
    """Where a :class:`SimParams` field comes from when the experiment config gives it as is:
    the config key (:func:`from_experiment` copies every such field, the source reads
    ``config FILE: key`` or ``default key``).  Fields without it are derived below."""

    key: str


@section
@dataclass
class SimParams:
    # groups of the allocation
    rollout_gpus: int = 8
    train_gpus: int = 8
    gpus_per_node: int = 8
    rollout_slots: int = 64             # concurrent episodes over all engines
    num_engines: int = 1
    engine_slots: int = 0               # engines x max_batch_size (request capacity, for the stall model)
    # worker mode: when the workers' episodes (rollout_slots) exceed engine_slots, the excess waits in
    # the engines' queue (SGLang --max-running-requests, the embedded scheduler's queue): see slots.py
    # decode speed vs an engine's batch (memory-bound decode, a roofline): a request's decode time
    # scales by (1 + k * b/B) / (1 + k), b = requests running on the engine, B = its max_batch_size,
    # k = decode_kv_ratio = KV-cache bytes / weight bytes an engine GPU reads per step at b = B.
    # decode_tokens_per_s is the rate at a full batch. 0 = the rate does not depend on the batch.
    decode_kv_ratio: float = 0.0
    # episodes
    group_size: Annotated[int, From("rollout.group_size")] = 1
    max_turns: Annotated[int, From("rollout.max_turns")] = 8
    max_new_tokens: Annotated[int, From("rollout.max_new_tokens")] = 1024
    max_total_tokens: Annotated[int, From("rollout.max_total_tokens")] = 32768
    turns_median: float = 2.0
    turns_sigma: Annotated[float, From("plan.turns_sigma")] = 0.7
    gen_tokens_median: float = 256.0
    gen_tokens_sigma: Annotated[float, From("plan.gen_tokens_sigma")] = 0.7
    tail_fraction: Annotated[float, From("plan.tail_fraction")] = 0.0
    tail_gen_tokens_median: float = 512.0
    prompt_tokens: Annotated[int, From("plan.prompt_tokens")] = 512
    tool_tokens_per_turn: Annotated[int, From("plan.tool_tokens_per_turn")] = 128
    decode_tokens_per_s: Annotated[float, From("plan.decode_tokens_per_s")] = 25.0
    prefill_tokens_per_s: Annotated[float, From("plan.prefill_tokens_per_s")] = 0.0
    tool_latency_s: Annotated[float, From("plan.tool_latency_s")] = 2.0
    # empirical episode durations (seconds) to resample instead of the parametric shape
    episode_seconds: tuple = ()
    episode_tokens: tuple = ()
    # router-data export
    replay_mode: Annotated[Literal["delta", "full", "off"], From("offpolicy.replay_engine")] = "delta"
    route_bytes_per_token: float = 0.0
    export_bytes_per_s: Annotated[float, From("plan.export_bytes_per_s")] = 2.0e9
    # trainer
    trajectories_per_step: Annotated[int, From("train.trajectories_per_step")] = 16
    consume_per_step: float = 0.0       # > 0: the trainer takes this many on average (measured runs)
    dp: Annotated[int, From("train.data_parallel")] = 1
    pp: Annotated[int, From("train.pipeline_parallel")] = 1
    # virtual pipeline stages (interleaved 1F1B) when pp > 1
    vpp: Annotated[int, From("train.virtual_pipeline_stages")] = 1
    cp: Annotated[int, From("train.context_parallel")] = 1
    token_cap: Annotated[int, From("balance.tokens_per_microbatch")] = 4096
    balance_method: Annotated[Literal["cost", "tokenkk", "flopkk", "sequential"], From("balance.method")] = "cost"
    cost_a: float = 0.0                 # FLOPs per token
    cost_b: float = 0.0                 # FLOPs per token pair
    gpu_flops: Annotated[float, From("plan.gpu_flops")] = 989e12
    mfu: Annotated[float, From("plan.mfu")] = 0.3
    step_overhead_s: Annotated[float, From("plan.step_overhead_s")] = 0.0
    fixed_step_s: float = 0.0           # > 0: every step takes exactly this (measured runs, tests)
    # measured runs: step k computes step_seconds[k] then publishes, then blocks for
    # after_publish_seconds[k] (the checkpoint the real trainer writes after its publish); cycled
    step_seconds: tuple = ()
    after_publish_seconds: tuple = ()
    model_bytes: float = 0.0
    publish_bytes_per_s: float = 1e9
    publish_blocks_trainer: Annotated[bool, From("plan.publish_blocks_trainer")] = True
    balance_every: Annotated[int, From("plan.balance_every")] = 1
    # policy and run
    # trainer memory (plan.memory): config TP/PP/CP/EP, parameters split dense vs routed experts
    tp: Annotated[int, From("train.tensor_parallel")] = 1
    ep: Annotated[int, From("train.expert_parallel")] = 1
    num_experts: Annotated[int, From("model.num_experts")] = 0
    # > 0: the layout search may deepen the pipeline (plan.memory)
    num_layers: Annotated[int, From("model.num_layers")] = 0
    dense_params: float = 0.0
    expert_params: float = 0.0
    gpu_memory_bytes: Annotated[float, From("plan.gpu_memory_bytes")] = 141e9
    train_memory_fraction: Annotated[float, From("plan.train_memory_fraction")] = 0.8
    # activations (plan.memory.ActivationTerm): hidden_size 0 = not counted; the per-unit
    # coefficients are measured (plan.activation_file) or plan.memory.FORMULA
    hidden_size: Annotated[int, From("model.hidden_size")] = 0
    num_attention_heads: Annotated[int, From("model.num_attention_heads")] = 0
    vocab_size: Annotated[int, From("model.vocab_size")] = 0
    recompute: Annotated[Literal["none", "selective", "full"], From("train.recompute")] = "none"
    act_per_hidden: float = 0.0         # bytes per token per layer per hidden unit
    act_per_head: float = 0.0           # bytes per (query, key) pair per layer per attention head
    act_per_vocab: float = 0.0          # bytes per token per vocabulary entry (logits, loss)
    act_element_bytes: int = 2          # bytes of one activation element (what full recompute keeps per layer)
    # staleness and weight updates (offpolicy.stale_policy, engine.weight_update)
    stale_policy: Annotated[Literal["mask", "drop"], From("offpolicy.stale_policy")] = "mask"
    weight_update: Annotated[Literal["in_place", "between_requests"], From("engine.weight_update")] = "in_place"
    policy: Annotated[Literal["async", "one_step_off", "sync"], From("plan.policy")] = "async"
    admission: Annotated[Literal["steps_ahead", "oldest"], From("plan.admission")] = "steps_ahead"
    # steps_ahead admission adds the version gap (neon_hpc.rollout.worker.version_gap): the
    # version the trainer's next claim trains minus the engines' loaded version. False = the
    # worker's rule before it counted the gap (steps of data ahead only), for comparison.
    version_gap: bool = True
    slot_mode: Annotated[Literal["worker", "episode"], From("plan.slot_mode")] = "worker"
    # stop in-flight groups once they are beyond the bound
    abort_stale: Annotated[bool, From("plan.abort_stale")] = False
    max_staleness: Annotated[int, From("offpolicy.max_staleness")] = 2
    backpressure_steps: Annotated[int, From("offpolicy.backpressure_steps")] = 4
    # polling latencies of the real processes (they poll the shared filesystem, no inotify):
    # a refused worker re-checks admission every admission_poll_s, a waiting trainer looks at
    # ready/ every claim_poll_s. Negligible at cluster scale (minute-long steps), not on a laptop.
    admission_poll_s: float = 0.0       # worker mode, async
    claim_poll_s: float = 0.0
    # weight pickup: the rollout node checks weights/LATEST every weight_poll_s and loads a newer
    # version into its engines (weight_load_s); a new group starts on the engines' version, not
    # the trainer's. 0/0 = engines have every version the moment it is published.
    weight_poll_s: float = 0.0
    weight_load_s: float = 0.0
    # in-place updates pause the engines' running requests while they load (weight_load_s per
    # load, each engine; SGLang's pause_generation(in_place) -> update_weights_from_disk -> continue)
    pause_on_load: bool = False
    # the worker's shard writer (neon_hpc.store.ShardWriter + neon_hpc.rollout.worker): a finished
    # group is buffered and published (visible to the trainer and to admission) when the buffer
    # holds flush_trajectories, when its oldest is flush_seconds old (checked when a group is
    # added), after any group while ready/ holds less than one step, or when admission refuses
    # the worker. 0 = every group is published the moment it ends.
    flush_trajectories: Annotated[int, From("store.flush_trajectories")] = 0
    flush_seconds: Annotated[float, From("store.flush_seconds")] = 0.0
    steps: Annotated[int, From("plan.simulated_steps")] = 1000
    seed: Annotated[int, From("plan.seed")] = 0

    @property
    def queued(self) -> bool:
        """Worker mode with more episodes in flight than the engines run at once: the rest queue."""
        return self.slot_mode == "worker" and 0 < self.engine_slots < self.rollout_slots

    @property
    def request_slots(self) -> int:
        """Episodes that can run at once: the engines' slots when workers queue for them, else the
        rollout slots (the capacity rollout idle is measured against)."""
        return self.engine_slots if self.queued else self.rollout_slots

    @property
    def publish_s(self) -> float:
        return self.model_bytes / self.publish_bytes_per_s if self.publish_bytes_per_s > 0 else 0.0

    @property
    def train_flops_per_s(self) -> float:
        return self.train_gpus * self.gpu_flops * self.mfu


@dataclass
class Sourced:
    """Parameters plus where each came from (field name -> source string)."""

    params: SimParams
    sources: dict[str, str] = field(default_factory=dict)

    def set(self, name: str, value: Any, source: str) -> None:
        if not hasattr(self.params, name):
            raise KeyError(f"SimParams has no field {name!r}")
        setattr(self.params, name, value)
        self.sources[name] = source

    def source(self, name: str) -> str:
        return self.sources.get(name, "default")

    def replace(self, **changes: Any) -> "Sourced":
        src = dict(self.sources)
        for k in changes:
            src.setdefault(k, "planner (policy/sweep)")
        return Sourced(dataclasses.replace(self.params, **changes), src)

    def table(self) -> list[tuple[str, str, str]]:
        """(name, value, source) for every simulator parameter, in field order."""
        rows = []
        for f in dataclasses.fields(self.params):
            v = getattr(self.params, f.name)
            if f.name in ("episode_seconds", "episode_tokens", "step_seconds", "after_publish_seconds"):
                v = f"{len(v)} samples" if v else "-"
            elif isinstance(v, float):
                v = f"{v:.4g}"
            rows.append((f.name, str(v), self.source(f.name)))
        return rows


# --------------------------------------------------------------------------------------
# model arithmetic (used when the balancer's CostModel is not present)

def moe_layers(model: Any, dense_layers: int) -> int:
    if dense_layers < 0:
        dense_layers = get_architecture(model.arch).default_dense_layers
    return max(model.num_layers - dense_layers, 0)


def model_param_count(model: Any, dense_layers: int) -> float:
    """Total parameters (all experts), for the bytes a weight publish moves."""
    h = model.hidden_size
    attn = 4 * h * model.num_attention_heads * model.head_dim
    n_moe = moe_layers(model, dense_layers)
    n_dense = model.num_layers - n_moe
    shared = get_architecture(model.arch).default_shared_experts
    expert = 3 * h * model.moe_ffn_hidden_size
    per_moe = attn + (model.num_experts + shared) * expert + h * model.num_experts
    per_dense = attn + 3 * h * model.ffn_hidden_size
    return 2 * model.vocab_size * h + n_moe * per_moe + n_dense * per_dense


def expert_param_count(model: Any, dense_layers: int) -> float:
    """Parameters of the routed experts (sharded by expert parallelism); the rest is dense."""
    return moe_layers(model, dense_layers) * model.num_experts * 3 * model.hidden_size * model.moe_ffn_hidden_size


def local_cost_coefficients(model: Any, dense_layers: int) -> tuple[float, float]:
    """FLOPs of forward+backward: ``a`` per token (6 x active params), ``b`` per token pair
    (causal attention: QK^T and AV, 4*heads*head_dim per pair and layer, x3 for backward,
    over n^2/2 pairs).  The same formula as the balancer's cost model, kept only as a
    fallback while ``neon_hpc.balance`` is absent."""
    h = model.hidden_size
    attn = 4 * h * model.num_attention_heads * model.head_dim
    n_moe = moe_layers(model, dense_layers)
    n_dense = model.num_layers - n_moe
    shared = get_architecture(model.arch).default_shared_experts
    active_moe = attn + (model.moe_router_topk + shared) * 3 * h * model.moe_ffn_hidden_size
    active_dense = attn + 3 * h * model.ffn_hidden_size
    active = n_moe * active_moe + n_dense * active_dense + model.vocab_size * h
    a = 6.0 * active
    b = 6.0 * model.num_layers * model.num_attention_heads * model.head_dim
    return a, b


def cost_coefficients(cfg: Any, dense_layers: int) -> tuple[float, float, str]:
    """(a, b, source): the balancer's CostModel when present, else the local formula."""
    bal = cfg.balance
    if bal.cost_a > 0 and bal.cost_b > 0:
        return bal.cost_a, bal.cost_b, "config balance.cost_a/cost_b"
    try:
        # deferred: heavy (neon_hpc.balance: numpy)
        from neon_hpc.balance import CostModel  # type: ignore[attr-defined]
        cm = CostModel.from_model_config(cfg.model, num_dense_layers=dense_layers if dense_layers >= 0 else None)
        return float(cm.a), float(cm.b), "derived (neon_hpc.balance.CostModel.from_model_config)"
    except (ImportError, AttributeError):
        a, b = local_cost_coefficients(cfg.model, dense_layers)
        return a, b, "derived (plan fallback: 6*active params; 6*L*heads*head_dim)"


RECOMPUTE_FACTOR = 4.0 / 3.0   # forward + backward = 3 forwards; recomputation runs one more forward


def recompute_cost(a: float, b: float, src: str, recompute: str) -> tuple[float, float, str]:
    """The step's FLOPs under ``train.recompute``: ``full`` re-runs every layer's forward in the
    backward (a and b x 4/3; the LM head, not recomputed, is counted in too: an upper bound),
    ``selective`` only core attention's (b x 4/3). Costs the config gives (balance.cost_a/cost_b)
    are taken as measured with the config's recomputation, unchanged."""
    if recompute == "none" or src.startswith("config"):
        return a, b, src
    f = RECOMPUTE_FACTOR
    if recompute == "full":
        return a * f, b * f, f"{src} x 4/3 (train.recompute: full re-runs each layer's forward)"
    return a, b * f, f"{src}; b x 4/3 (train.recompute: selective re-runs core attention's forward)"


# --------------------------------------------------------------------------------------

def _source_namer(cfg: Any, where: str):
    """``key -> "config FILE: key"`` when the config sets it, ``"default key"`` when the
    value is the schema default (so a reader sees which numbers nobody chose)."""
    from neon_hpc.config import ExperimentConfig  # deferred: heavy (neon_hpc.config: h5py, numpy)
    defaults = ExperimentConfig()

    def lookup(obj: Any, key: str) -> Any:
        for part in key.split("."):
            obj = getattr(obj, part, None)
        return obj

    def name(key: str) -> str:
        path = key.split(" ")[0]
        value = lookup(cfg, path)
        if value is not None and value == lookup(defaults, path):
            return f"default {key}"
        return f"config {where}: {key}"
    return name


def _gpus(group: Any, gpn: int) -> int:
    return group.nodes * (group.gpus_per_node or gpn)


def from_experiment(cfg: Any, where: str = "<config>") -> Sourced:
    """Build the simulator's parameters from a resolved ``ExperimentConfig``."""
    s = Sourced(SimParams())
    c = _source_namer(cfg, where)
    for name, key in config_keys().items():      # the fields the config gives as is (From beside each)
        s.set(name, _lookup(cfg, key), c(key))
    _layout(s, cfg, c)
    _rollout(s, cfg, c)
    for name, what in (("admission_poll_s", "the worker's admission poll"), ("claim_poll_s", "the claim's poll"),
                       ("weight_poll_s", "the rollout node's weight check")):
        s.set(name, 0.0, f"planner: 0 ({what} is under a second; python -m neon_hpc.plan.validate sets it)")
    s.set("version_gap", True, "neon_hpc.rollout.worker.version_gap (steps_ahead admission adds the engines' "
                               "lag behind the trainer's next claim)")
    _trainer(s, cfg, c)
    _weight_load(s, cfg, c)
    _decode_kv_ratio(s, cfg, c)
    if cfg.schedule == "sync" and cfg.plan.policy == "async":
        s.set("policy", "sync", c("schedule"))
    try:
        constraints.validate(s.params)
    except ValidationError as e:
        raise ValueError(f"{where}: the simulator's parameters derived from it are out of range: "
                         + "; ".join(constraints.explain(SimParams, e))) from None
    return s


def config_keys() -> dict[str, str]:
    """``{SimParams field: experiment config key}`` of the fields the config gives as is."""
    return {name: m.key for name, tp in constraints.hints(SimParams).items()
            for m in getattr(tp, "__metadata__", ()) if isinstance(m, From)}


def _lookup(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _layout(s: Sourced, cfg: Any, c) -> None:
    """GPUs of the two groups, and how many episodes run at once."""
    pc, L, E = cfg.plan, cfg.launch, cfg.engine
    gpn = pc.gpus_per_node or L.train.gpus_per_node or L.rollout.gpus_per_node or 1
    s.set("gpus_per_node", gpn, c("plan.gpus_per_node") if pc.gpus_per_node else
          c("launch.train.gpus_per_node") if L.train.gpus_per_node else "derived (no GPUs: 1 per node)")
    s.set("rollout_gpus", _gpus(L.rollout, gpn), c("launch.rollout.nodes x gpus_per_node"))
    s.set("train_gpus", _gpus(L.train, gpn), c("launch.train.nodes x gpus_per_node"))
    if pc.total_gpus and pc.total_gpus != s.params.rollout_gpus + s.params.train_gpus:
        share = s.params.rollout_gpus / (s.params.rollout_gpus + s.params.train_gpus)
        r = max(gpn, round(pc.total_gpus * share / gpn) * gpn)
        s.set("rollout_gpus", r, c("plan.total_gpus split like launch"))
        s.set("train_gpus", pc.total_gpus - r, c("plan.total_gpus split like launch"))
    # the engines that decode: under PD disaggregation the prefill engines hold no running request
    decoding = sum(1 for r in engine_roles(cfg) if r != "prefill")
    what = ("engine.num_engines - prefill engines (engine_roles)" if decoding != E.num_engines
            else "engine.num_engines")
    if pc.rollout_slots:
        s.set("rollout_slots", pc.rollout_slots, c("plan.rollout_slots"))
    elif pc.slot_mode == "worker":
        s.set("rollout_slots", cfg.rollout.num_workers * cfg.rollout.group_size,
              c("rollout.num_workers x rollout.group_size"))
    else:
        s.set("rollout_slots", decoding * E.max_batch_size, c(f"{what} x engine.max_batch_size"))
    s.set("engine_slots", decoding * E.max_batch_size, c(f"{what} x engine.max_batch_size"))
    s.set("num_engines", decoding, c(what))


def _rollout(s: Sourced, cfg: Any, c) -> None:
    R, M, pc = cfg.rollout, cfg.model, cfg.plan
    _episode_shape(s, pc, R, c)
    n_moe = moe_layers(M, pc.dense_layers)
    s.set("route_bytes_per_token", n_moe * M.moe_router_topk * ROUTE_BYTES_PER_ID,
          f"derived ({n_moe} MoE layers x top-{M.moe_router_topk} x int32 x base64 4/3)")


def _trainer(s: Sourced, cfg: Any, c) -> None:
    T, pc = cfg.train, cfg.plan
    a, b, src = cost_coefficients(cfg, pc.dense_layers)
    a, b, src = recompute_cost(a, b, src, T.recompute)
    s.set("cost_a", a, src)
    s.set("cost_b", b, src)
    s.set("model_bytes", 2.0 * model_param_count(cfg.model, pc.dense_layers),
          "derived (bf16 x parameter count of model)")
    experts = expert_param_count(cfg.model, pc.dense_layers)
    s.set("expert_params", experts, "derived (MoE layers x experts x 3 x hidden x moe_ffn)")
    s.set("dense_params", model_param_count(cfg.model, pc.dense_layers) - experts,
          "derived (parameter count - routed experts)")
    _activations(s, cfg, c)
    if pc.publish_bytes_per_s:
        s.set("publish_bytes_per_s", pc.publish_bytes_per_s, c("plan.publish_bytes_per_s"))
    else:
        s.set("publish_bytes_per_s", 1e9 * cfg.launch.train.nodes, "derived (1 GB/s per trainer node)")


def _activations(s: Sourced, cfg: Any, c) -> None:
    """The activation term's shape and coefficients (plan/memory.py): measured when
    ``plan.activation_file`` is set (the memory block of a ``neon-hpc costfit`` cost
    file), else the documented formula."""
    pc, recompute = cfg.plan, cfg.train.recompute
    if pc.activation_file:
        from neon_hpc.balance.memory import load_memory  # deferred: heavy (neon_hpc.balance.memory: numpy)
        m = load_memory(pc.activation_file)
        if m.recompute != "none" and m.recompute != recompute or m.recompute == "full":
            raise ValueError(f"plan.activation_file={pc.activation_file}: measured with train.recompute="
                             f"{m.recompute!r}, planned with {recompute!r}; the planner derives selective and full "
                             f"from a measurement without recomputation: re-run `neon-hpc costfit` with "
                             f"--set train.recompute=none")
        src = f"measured ({c('plan.activation_file')}: {m.source})"
        values = {"act_per_hidden": m.per_hidden, "act_per_head": m.per_head, "act_per_vocab": m.per_vocab,
                  "act_element_bytes": m.element_bytes}
    else:
        src = "derived (plan.memory.FORMULA: Korthikanti et al. 2022 in bf16; set plan.activation_file to measure)"
        values = {"act_per_hidden": FORMULA["per_hidden"], "act_per_head": FORMULA["per_head"],
                  "act_per_vocab": FORMULA["per_vocab"], "act_element_bytes": FORMULA["element_bytes"]}
    for name, v in values.items():
        s.set(name, v, src)


def _weight_load(s: Sourced, cfg: Any, c) -> None:
    """How long the engines take to load a published version, and whether running requests
    pause meanwhile (``engine.weight_update: in_place``; between requests, the load waits for
    them instead, which is not modelled)."""
    pc = cfg.plan
    s.set("pause_on_load", cfg.engine.weight_update == "in_place", c("engine.weight_update"))
    if pc.weight_load_s:
        s.set("weight_load_s", pc.weight_load_s, c("plan.weight_load_s"))
        return
    engines = max(cfg.engine.num_engines, 1)
    nodes = max(s.params.rollout_gpus / max(s.params.gpus_per_node, 1) / engines, 1.0)
    s.set("weight_load_s", s.params.model_bytes / (pc.weight_load_bytes_per_s * nodes),
          f"derived (model bytes / ({c('plan.weight_load_bytes_per_s')} x {nodes:.3g} rollout nodes per "
          f"engine); a measured RESULT weight_load_s=... (--calibrate) replaces it)")


def _episode_shape(s: Sourced, pc: PlanConfig, R: Any, c) -> None:
    derived = [("turns_median", pc.turns_median, max(1.0, R.max_turns / 8), "max_turns / 8"),
               ("gen_tokens_median", pc.gen_tokens_median, max(1.0, R.max_new_tokens / 4), "max_new_tokens / 4"),
               ("tail_gen_tokens_median", pc.tail_gen_tokens_median, max(1.0, R.max_new_tokens / 2),
                "max_new_tokens / 2")]
    for name, given, fallback, formula in derived:
        if given:
            s.set(name, float(given), c(f"plan.{name}"))
        else:
            s.set(name, float(fallback), f"derived (rollout.{formula})")


def kv_bytes_per_token_per_gpu(model: Any, attn_tp: int) -> float:
    """bf16 KV cache one GPU holds per token of a request it serves: the architecture's values
    per token and layer (``neon_hpc.arch``: MLA keeps the compressed latent, replicated over the
    attention TP group; GQA K and V of ``num_query_groups`` heads, sharded over it)."""
    return 2.0 * model.num_layers * get_architecture(model.arch).kv_cache_values_per_token_layer(model, attn_tp)


def _decode_kv_ratio(s: Sourced, cfg: Any, c) -> None:
    """``decode_kv_ratio`` k: at a full engine batch, KV-cache bytes / weight bytes one engine GPU
    reads per decode step (memory-bound decode: both are read once a step; compute is far below
    the roofline's knee at these batches). Per GPU of an SGLang engine (``--tp-size tp*dp
    --dp-size dp``, DP attention): weights = routed experts / ep_size + the rest / tp_size (each
    DP rank's attention TP group holds the dense part); KV = max_batch_size / dp_size requests x
    the decode-weighted mean context x :func:`kv_bytes_per_token_per_gpu`."""
    pc, E, M = cfg.plan, cfg.engine, cfg.model
    if pc.decode_kv_ratio >= 0:
        s.set("decode_kv_ratio", pc.decode_kv_ratio, c("plan.decode_kv_ratio"))
        return
    if E.kind != "sglang":
        s.set("decode_kv_ratio", 0.0, f"{c('engine.kind')} = {E.kind} (not a GPU roofline: the rate does not "
                                      f"depend on the batch; set plan.decode_kv_ratio to change it)")
        return
    import numpy as np  # deferred: heavy (numpy)

    from neon_hpc.plan.workload import decode_context_mean  # deferred: heavy (neon_hpc.plan.workload: numpy)
    p = s.params
    ctx = decode_context_mean(p, 20000, np.random.default_rng(p.seed + 5))
    kv = kv_bytes_per_token_per_gpu(M, E.tp_size)
    dp = max(E.dp_size, 1)
    weights = 2.0 * (p.expert_params / max(E.ep_size, 1) + p.dense_params / max(E.tp_size, 1))
    k = E.max_batch_size / dp * ctx * kv / weights
    s.set("decode_kv_ratio", k,
          f"derived ({E.max_batch_size}/{dp} requests per DP rank x {ctx:,.0f} tokens decode-weighted context x "
          f"{kv / 1e3:.1f} kB KV/token/GPU / {weights / 1e9:.1f} GB weights/GPU; engine.* and model.*; "
          f"plan.decode_kv_ratio sets it)")
