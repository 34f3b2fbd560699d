"""Capacity-planning section of the experiment config (owned by ``neon_hpc/plan``).

Every field whose default is ``0`` (or ``""``) means "derive it from the rest of the
experiment config" (see ``neon_hpc/plan/params.py``, which records where each simulator
parameter came from).  Units are SI: seconds, bytes, FLOP/s.
"""
from dataclasses import dataclass, field
from typing import Literal

from neon_hpc.util.constraints import above, at_least, between, section


@section
@dataclass
class PlanConfig:
    total_gpus: int = 0                 # 0 = rollout + train groups of the launch section
    gpus_per_node: int = 0              # 0 = launch.*.gpus_per_node (1 when that is 0)
    decode_tokens_per_s: float = 25.0   # per request, after PD disaggregation (10 before)
    prefill_tokens_per_s: float = 0.0   # per request for tool/prompt tokens; 0 = not modelled
    tool_latency_s: float = 2.0         # mean (exponential) per tool call
    # decode speed vs an engine's batch: k = KV-cache / weight bytes read per decode step at a full
    # batch (params.py SimParams.decode_kv_ratio); -1 = derive it (SGLang engines; 0 for embedded)
    decode_kv_ratio: float = -1.0
    # concurrent episodes; 0 = workers x group_size (worker) or engines x max_batch_size (episode)
    rollout_slots: int = 0
    # episode shape (heavy tail: a lognormal body plus a fraction of max-turn episodes)
    turns_median: float = 0.0           # 0 = max_turns / 8
    turns_sigma: float = 0.7
    gen_tokens_median: float = 0.0      # per turn; 0 = max_new_tokens / 4
    gen_tokens_sigma: float = 0.7
    tail_fraction: float = 0.05         # episodes that run max_turns with long turns (the hour-long ones)
    tail_gen_tokens_median: float = 0.0  # per turn in tail episodes; 0 = max_new_tokens / 2
    prompt_tokens: int = 2048
    tool_tokens_per_turn: int = 512
    # router-data export (replay)
    export_bytes_per_s: float = 2.0e9   # engine-side route serialisation; stalls the whole DP group
    dense_layers: int = -1              # -1 = 1 for deepseek_v3 (first layer dense), 0 otherwise
    # trainer
    gpu_flops: float = 989e12           # dense bf16 peak per GPU (H200)
    mfu: float = 0.3                    # achieved fraction of peak in the training step
    step_overhead_s: float = 10.0       # optimizer, grad all-reduce, data loading per step
    publish_bytes_per_s: float = 0.0    # weight export (reshard); 0 = 1 GB/s per trainer node
    publish_blocks_trainer: bool = True  # the trainer waits for its own weight publish
    # engines loading a published version (in place: their running requests pause meanwhile);
    # 0 = model bytes / (weight_load_bytes_per_s x rollout nodes per engine)
    weight_load_s: float = 0.0
    weight_load_bytes_per_s: float = 5e9   # per rollout node reading the weights (assumed: measure it)
    balance_every: int = 20             # run the balancer every N simulated steps (bound x last ratio between)
    # policy and run
    policy: Literal["async", "one_step_off", "sync"] = "async"
    admission: Literal["steps_ahead", "oldest"] = "steps_ahead"   # see README: staleness admission rule
    slot_mode: Literal["worker", "episode"] = "worker"  # worker: one whole group per worker at a time
    abort_stale: bool = False           # stop in-flight groups once beyond the staleness bound (worker mode)
    simulated_steps: int = 1000
    sweep_steps: int = 300
    sweep_points: int = 9
    # --sweep also searches these staleness bounds and trajectories per step (0 / empty =
    # the config's own and a few around it: see report.search_space)
    sweep_staleness: list[int] = field(default_factory=list)
    sweep_trajectories_per_step: list[int] = field(default_factory=list)
    # ... and the rollout concurrency, in percent: rollout.num_workers x group_size over the engines'
    # request slots (decoding engines x max_batch_size; above 100 the rest wait in the engines' queue).
    # Empty = the config's, 100, 200, 300 and 400 (worker mode; report.concurrency_space)
    sweep_in_flight_pct: list[int] = field(default_factory=list)
    # trainer memory (plan/memory.py): weights + grads + optimizer state + activations must fit this
    # share of a GPU (the rest: NCCL and allocator buffers)
    gpu_memory_bytes: float = 141e9     # H200
    train_memory_fraction: float = 0.8
    # activation bytes per token measured on the trainer's step: a cost file with a memory block
    # (`neon-hpc costfit --out FILE`); "" = plan/memory.py's formula
    activation_file: str = ""
    seed: int = 0

    CHECKS = {
        **{k: above(0) for k in ("decode_tokens_per_s", "tool_latency_s", "turns_sigma", "gen_tokens_sigma",
                                 "export_bytes_per_s", "gpu_flops")},
        **{k: at_least(0, "0 = derive from the rest of the config")
           for k in ("total_gpus", "gpus_per_node", "prefill_tokens_per_s",
                     "rollout_slots", "turns_median", "gen_tokens_median",
                     "tail_gen_tokens_median", "prompt_tokens", "tool_tokens_per_turn",
                     "step_overhead_s", "publish_bytes_per_s", "weight_load_s")},
        "weight_load_bytes_per_s": above(0),
        "decode_kv_ratio": at_least(-1, "-1 = derive from the engine and model"),
        "sweep_in_flight_pct": at_least(1, "percent of the engines' request slots"),
        "mfu": above(0, le=1.0, note="a fraction of peak"),
        "tail_fraction": between(0, 1),
        "train_memory_fraction": above(0, le=1.0, note="a fraction of the GPU's memory"),
        "gpu_memory_bytes": above(0),
        "dense_layers": at_least(-1, "-1 = the architecture's own count of dense first layers"),
        **{k: at_least(1) for k in ("simulated_steps", "sweep_steps", "sweep_points", "balance_every")},
    }
    # "planner" is this package's name, not the balancer's: an old config that still sets it is told where
    MOVED = {"planner_every": "plan.balance_every"}
