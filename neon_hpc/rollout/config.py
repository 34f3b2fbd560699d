"""Rollout and engine sections of the experiment config (owned by ``neon_hpc/rollout``)."""
from dataclasses import dataclass, field
from typing import Literal


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
    router_port: int = 8000           # PD only: the sglang_router in front of prefill/decode
    model_path: str = ""              # weights the engines start on; "" = RUN/weights/v_0
    enable_return_routed_experts: bool = True
    extra_args: list[str] = field(default_factory=list)
    # kind=sglang: the interpreter that has SGLang installed ("" = the one running neon-hpc),
    # and how long an engine (or the PD router) may take to answer /health after its start:
    # a trillion-parameter model loads for many minutes
    python: str = ""
    startup_timeout_s: float = 1800.0

    def validate(self):
        errs = []
        if not 0 <= self.port < 65536:
            errs.append(("port", "must be in 0..65535 (0 picks a free port)"))
        if self.num_engines < 1:
            errs.append(("num_engines", "must be >= 1"))
        if self.max_batch_size < 1:
            errs.append(("max_batch_size", "must be >= 1"))
        for k in ("tp_size", "dp_size", "ep_size"):
            if getattr(self, k) < 1:
                errs.append((k, "must be >= 1"))
        if self.ep_size not in (1, self.tp_size * self.dp_size):
            errs.append(("ep_size", f"must be 1 or tp_size * dp_size ({self.tp_size * self.dp_size}): "
                                    f"SGLang spreads experts over all GPUs of an engine"))
        if self.pd_disaggregation and self.num_engines < 2:
            errs.append(("num_engines", "PD disaggregation needs >= 2 engines (prefill + decode)"))
        if self.prefill_engines < 0 or (self.pd_disaggregation and self.prefill_engines >= self.num_engines):
            errs.append(("prefill_engines", f"must be in 0..num_engines-1 ({self.num_engines - 1}); 0 = a quarter"))
        if not 0 < self.router_port < 65536:
            errs.append(("router_port", "must be in 1..65535"))
        if self.startup_timeout_s <= 0:
            errs.append(("startup_timeout_s", "must be > 0 seconds"))
        return errs


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
    max_staleness: int = 2            # versions a token may lag the trainer
    backpressure_steps: int = 4       # stop when ready/ holds more than this many steps of data
    replay_mode: Literal["delta", "full", "off"] = "delta"
    restart_dead_workers: bool = True
    tools: Literal["full", "minimal"] = "full"
    reward: Literal["success", "dense"] = "dense"   # which grader reward becomes Trajectory.reward
    force_answer: bool = True         # the last turn starts with <answer> (budget forcing)
    answer_max_new_tokens: int = 0    # tokens for that forced answer (0 = max_new_tokens)
    prompt_style: Literal["auto", "compact", "full"] = "auto"  # auto: compact for the tiny preset
    max_tool_chars: int = 2000        # tool results are cut to this many characters
    request_retries: int = 2          # retries of one turn after a dropped response

    def validate(self):
        errs = []
        if self.group_size < 1:
            errs.append(("group_size", "must be >= 1"))
        if self.max_staleness < 0:
            errs.append(("max_staleness", "must be >= 0 (0 = on-policy)"))
        if not 0.0 < self.top_p <= 1.0:
            errs.append(("top_p", "must be in (0, 1]"))
        if self.temperature < 0:
            errs.append(("temperature", "must be >= 0"))
        if self.max_turns < 1:
            errs.append(("max_turns", "must be >= 1"))
        if self.max_new_tokens < 1:
            errs.append(("max_new_tokens", "must be >= 1"))
        if self.max_tool_chars < 16:
            errs.append(("max_tool_chars", "must be >= 16 (tool errors must stay readable)"))
        if self.answer_max_new_tokens < 0:
            errs.append(("answer_max_new_tokens", "must be >= 0 (0 = max_new_tokens)"))
        if self.request_retries < 0:
            errs.append(("request_retries", "must be >= 0"))
        return errs
